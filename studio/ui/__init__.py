"""The Gradio studio: ``build_ui(settings)`` returns the Blocks that ``studio.app.create_app()`` mounts at "/".

One small builder per tab (``*_tab.py``); every callback calls the service functions the REST API calls.
What the person was looking at (tab, run, dataset, deployment, language) is kept in the URL and in
browser storage, and everything on screen is read back from the store, so a refresh shows the same state.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from studio.config import Settings
from studio.ui.compare_tab import build_compare_tab
from studio.ui.context import UIContext
from studio.ui.datasets_tab import build_datasets_tab
from studio.ui.deploy_tab import build_deploy_tab
from studio.ui.i18n import DEFAULT_LANGUAGE, LANGUAGES, Texts, remember_language
from studio.ui.runs_tab import build_runs_tab
from studio.ui.train_tab import build_train_tab, form_values

TAB_IDS = ("datasets", "train", "runs", "compare", "deploy")

# A few layout touches. Gradio 6 takes css at mount time (gr.mount_gradio_app), which studio.app owns, so
# the rules travel inside the Blocks as a <style> element instead.
CSS = """
#studio-header h1 { margin-bottom: 0; }
#studio-header p { margin-top: 0; color: var(--body-text-color-subdued); }
#studio-tabs .row > button { align-self: center; }
#studio-style { display: none; }
"""

# Keeps ?tab=...&run=... in the address bar so a refresh reopens the same view.
SET_TAB_JS = """(tabId) => {
  const url = new URL(window.location.href);
  url.searchParams.set("tab", tabId);
  window.history.replaceState(null, "", url.toString());
  return tabId;
}"""


def build_ui(settings: Settings) -> gr.Blocks:
    """The whole studio UI for ``settings`` (one SQL store, one artifact home)."""
    texts = Texts(DEFAULT_LANGUAGE)
    with gr.Blocks(title="ERNIE Studio", analytics_enabled=False) as demo:
        ctx = UIContext(settings=settings, texts=texts, demo=demo)
        lang_state = gr.BrowserState(DEFAULT_LANGUAGE, storage_key="ernie-studio-lang")
        dataset_state = gr.BrowserState(None, storage_key="ernie-studio-dataset")
        run_state = gr.BrowserState(None, storage_key="ernie-studio-run")
        deployment_state = gr.BrowserState(None, storage_key="ernie-studio-deployment")
        tab_state = gr.BrowserState("datasets", storage_key="ernie-studio-tab")
        with gr.Row(equal_height=True):
            with gr.Column(scale=4, elem_id="studio-header"):
                header = gr.Markdown(_header(DEFAULT_LANGUAGE))
                gr.HTML(f"<style>{CSS}</style>", elem_id="studio-style", padding=False)
            language = texts.make(
                gr.Radio,
                "app.language",
                choices=[(v, k) for k, v in LANGUAGES.items()],
                value=DEFAULT_LANGUAGE,
                elem_id="lang-switch",
                scale=1,
            )
        with gr.Tabs(selected="datasets", elem_id="studio-tabs") as tabs:
            datasets = build_datasets_tab(ctx, dataset_state)
            train = build_train_tab(ctx)
            runs = build_runs_tab(ctx, run_state)
            compare = build_compare_tab(ctx)
            deploy = build_deploy_tab(ctx, deployment_state)

        # Tab changes: remember the tab, and poll only on the tab that shows live state.
        tab_objects = {
            "datasets": datasets.tab,
            "train": train.tab,
            "runs": runs.tab,
            "compare": compare.tab,
            "deploy": deploy.tab,
        }
        for tab_id, tab in tab_objects.items():
            tab.select(lambda tid=tab_id: _timers(tid), None, [runs.timer, deploy.timer, tab_state]).then(
                None, tab_state, None, js=SET_TAB_JS
            )

        def restore_tab(saved: Any, request: gr.Request) -> tuple[Any, ...]:
            wanted = request.query_params.get("tab") if request else None
            if wanted not in TAB_IDS:
                wanted = saved if saved in TAB_IDS else "datasets"
            # A ?run=N link opens the Runs tab.
            if request and request.query_params.get("run") and not request.query_params.get("tab"):
                wanted = "runs"
            return (gr.Tabs(selected=wanted), *_timers(wanted)[:2])

        demo.load(restore_tab, tab_state, [tabs, runs.timer, deploy.timer])

        # Language: relabel every registered component; remembered in browser storage.
        # Tables take their current values in so their headers can be translated in place.
        def set_language(lang: str, *frames: Any) -> list[Any]:
            remember_language(lang)
            return [*texts.updates(lang, list(frames)), _header(lang), lang]

        relabel = [*texts.components, header, lang_state]
        language.input(set_language, [language, *texts.tables], relabel)
        demo.load(lambda lang: lang if lang in LANGUAGES else DEFAULT_LANGUAGE, lang_state, language).then(
            set_language, [language, *texts.tables], relabel
        )

        # Runs -> Train: "clone" fills the form with the run's choices and opens the Train tab.
        def clone(run_id: Any) -> list[Any]:
            from studio.services import runs as runs_svc
            from studio.ui.context import parse_id

            rid = parse_id(run_id)
            if rid is None:
                raise gr.Error("Pick a run to clone.")
            spec = ctx.call(lambda s, i: runs_svc.spec_of(runs_svc.get_run(s, i)), rid)
            return [*form_values(spec, list(train.fields)), gr.Tabs(selected="train"), "train"]

        runs.clone_btn.click(clone, runs.selected, [*train.fields.values(), tabs, tab_state]).then(
            None, tab_state, None, js=SET_TAB_JS
        )
        # Runs -> Deploy: after "deploy this run", open Deploy & Chat on the new deployment.
        runs.deployed.change(
            lambda dep: (gr.Tabs(selected="deploy"), dep, "deploy", *_timers("deploy")[:2]),
            runs.deployed,
            [tabs, deployment_state, tab_state, runs.timer, deploy.timer],
        ).then(deploy.refresh_fn, [deploy.run, deployment_state], deploy.refresh_outputs)
        # Train -> Runs: a launched run is selected in the Runs tab.
        train.launched_run.change(lambda rid: rid, train.launched_run, run_state).then(
            runs.show_run, train.launched_run, runs.show_outputs
        )
    # Table headers follow the session's language wherever a callback fills a table.
    texts.localize_tables(demo)
    return demo


def _timers(tab_id: str) -> tuple[Any, Any, str]:
    return gr.Timer(active=tab_id == "runs"), gr.Timer(active=tab_id == "deploy"), tab_id


def _header(lang: str) -> str:
    from studio.ui.i18n import text

    return f"# {text('app.title', lang)}\n{text('app.subtitle', lang)}"


__all__ = ["CSS", "build_ui"]
