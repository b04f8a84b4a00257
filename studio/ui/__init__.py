"""The Gradio studio: ``build_ui(settings)`` returns the Blocks that ``studio.app.create_app()`` mounts at "/".

One small builder per tab (``*_tab.py``); every callback calls the service functions the REST API calls.
What the person was looking at (tab, run, dataset, deployment, language) is kept in the URL and in
browser storage, and everything on screen is read back from the store, so a refresh shows the same state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import gradio as gr
from gradio.blocks import BlockContext

from studio.config import Settings
from studio.ui.compare_tab import CompareTab, build_compare_tab
from studio.ui.context import UIContext, echo
from studio.ui.datasets_tab import DatasetsTab, build_datasets_tab
from studio.ui.deploy_tab import DeployTab, build_deploy_tab
from studio.ui.evaluate_tab import EvaluateTab, build_evaluate_tab
from studio.ui.i18n import DEFAULT_LANGUAGE, LANGUAGES, Texts, remember_language, text
from studio.ui.nodes_tab import NodesTab, build_nodes_tab
from studio.ui.runs_tab import RunsTab, build_runs_tab
from studio.ui.sweeps_tab import SweepsTab, build_sweeps_tab
from studio.ui.train_tab import TrainTab, build_train_tab

TAB_IDS = ("datasets", "train", "runs", "sweeps", "compare", "evaluate", "deploy", "nodes")

# A few layout touches. Gradio 6 takes css at mount time (gr.mount_gradio_app), which studio.app owns, so
# the rules travel inside the Blocks as a <style> element instead.
CSS = """
#studio-header h1 { margin-bottom: 0; }
#studio-header p { margin-top: 0; color: var(--body-text-color-subdued); }
#studio-tabs .row > button { align-self: center; }
#studio-style { display: none; }
/* Tables show every column: cells wrap (each table's wrap=True), and one wider than its box scrolls. */
#studio-tabs .table-wrap { overflow-x: auto; }
/* A failed event's outputs would carry Gradio's bare "Error" badge; the failure's toast (which stays until
   closed) says what happened, so the badge and its overlay are hidden. */
#studio-tabs [data-testid=status-tracker]:has(> .error) { display: none !important; }
"""

# Gradio 6.31's StatusTracker (statustracker-*.js, `ze`) advances its elapsed-time counter by re-arming
# requestAnimationFrame while a status is pending, and stops only when its own effect sees the status end.
# The page-level "Loading..." tracker is removed with the {#if} that holds it the moment the app has
# loaded, before that effect runs, so its loop never stops: an idle page asked for 60 frames a second and
# Chromium drew them (17-18% of a core on a tab with no event, on session 18's host; docs/benchmarks.md,
# "a page nobody touches"). The trackers' frames become 10-a-second timeouts instead: the counter shows
# tenths of a second, and a timeout draws nothing when nothing changed. Every other caller keeps its frames.
# Gradio's modules keep the requestAnimationFrame they find when they load, and Gradio's `head` option adds
# its tags only after that: studio.api.page_script.HeadScript puts this first in the served page instead.
STATUS_TIMER_JS = """(() => {
  const frame = window.requestAnimationFrame.bind(window);
  const cancel = window.cancelAnimationFrame.bind(window);
  // A timeout's handle is returned negated: frames' handles are positive, so the two never meet in a cancel.
  window.requestAnimationFrame = (callback) => {
    if (!(new Error().stack || "").includes("/statustracker-")) return frame(callback);
    return -setTimeout(() => callback(performance.now()), 100);
  };
  window.cancelAnimationFrame = (handle) => (handle < 0 ? clearTimeout(-handle) : cancel(handle));
})();"""

# Keeps ?tab=...&run=... in the address bar so a refresh reopens the same view.
SET_TAB_JS = """(tabId) => {
  const url = new URL(window.location.href);
  url.searchParams.set("tab", tabId);
  window.history.replaceState(null, "", url.toString());
  return tabId;
}"""

# The tab the page shows, whatever tab an event names (see _wire_tab_changes).
SHOWN_TAB_JS = """async (saved) => {
  await new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)));  // the click drawn
  const shown = document.querySelector("#studio-tabs button[role=tab][aria-selected=true]");
  return shown ? shown.dataset.tabId : saved;
}"""

# On page load: the tab in ?tab=..., else the remembered one; a ?run=N link opens the Runs tab. Restored by a
# click on its button in the page, so the tab's own select event runs (its timers, its refresh) as if the
# person had clicked, and a person who clicked a tab before the restore keeps it (a server-side restore
# landed after the load's other events and could pull such a page back to Datasets).
# The language the browser stored, or English when it stored none or an unknown one.
RESTORE_LANGUAGE_JS = "(saved) => (LANGUAGE_CODES.includes(saved) ? saved : DEFAULT_CODE)".replace(
    "LANGUAGE_CODES", json.dumps(list(LANGUAGES))
).replace("DEFAULT_CODE", json.dumps(DEFAULT_LANGUAGE))
RESTORE_TAB_JS = """(saved) => {
  const ids = TAB_IDS_JSON;
  const query = new URLSearchParams(window.location.search);
  let wanted = query.get("tab");
  if (!ids.includes(wanted)) wanted = ids.includes(saved) ? saved : "datasets";
  if (query.get("run") && !query.get("tab")) wanted = "runs";
  const pick = (tries) => {
    const buttons = [...document.querySelectorAll("#studio-tabs button[role=tab]")];
    const button = buttons.find((b) => b.dataset.tabId === wanted);
    if (!button) {
      if (tries > 0) setTimeout(() => pick(tries - 1), 50);
      return;
    }
    const shown = buttons.find((b) => b.getAttribute("aria-selected") === "true");
    if (shown && shown.dataset.tabId !== "datasets") return;
    if (wanted !== "datasets") button.click();
  };
  pick(100);
  return saved;
}""".replace("TAB_IDS_JSON", json.dumps(list(TAB_IDS)))

# Gradio's own component texts ("Drop File Here", "Click to Upload", ...) come from its front end's i18n,
# whose locale it takes from the browser (navigator.language) at start and which only its settings panel
# changes, through `changeLocale` of its core module. That module is imported by URL (its name carries a
# build hash), so it is found among the modules the page loaded; importing it again returns the same
# instance. A component reads the locale when it is drawn, so the ones showing such texts are hidden and
# shown again after the switch. Without the module (another Gradio build) they stay in the browser's language.
GRADIO_LOCALE_JS = """async (lang) => {
  const locale = lang === "zh" ? "zh-CN" : "en";
  const urls = [
    ...[...document.querySelectorAll("link[rel=modulepreload]")].map((l) => l.href),
    ...performance.getEntriesByType("resource").map((e) => e.name),
  ];
  const core = urls.find((u) => /\\/assets\\/core-[\\w-]+\\.js$/.test(u));
  if (core) {
    try {
      const gradio = await import(core);
      if (typeof gradio.changeLocale === "function") gradio.changeLocale(locale);
    } catch (e) {
      console.warn("could not set Gradio's locale", e);
    }
  }
  return lang;
}"""


@dataclass
class _BrowserStates:
    """What a refresh brings back, kept in the browser's storage."""

    lang: gr.BrowserState
    dataset: gr.BrowserState
    run: gr.BrowserState
    deployment: gr.BrowserState
    tab: gr.BrowserState


@dataclass
class _Tabs:
    tabs: gr.Tabs
    datasets: DatasetsTab
    train: TrainTab
    runs: RunsTab
    sweeps: SweepsTab
    compare: CompareTab
    evaluate: EvaluateTab
    deploy: DeployTab
    nodes: NodesTab

    def by_id(self) -> dict[str, gr.Tab]:
        return {tab_id: getattr(self, tab_id).tab for tab_id in TAB_IDS}


def build_ui(settings: Settings) -> gr.Blocks:
    """The whole studio UI for ``settings`` (one SQL store, one artifact home)."""
    texts = Texts(DEFAULT_LANGUAGE)
    with gr.Blocks(title="ERNIE Studio", analytics_enabled=False) as demo:
        ctx = UIContext(settings=settings, texts=texts, demo=demo)
        states = _browser_states()
        # the first load event the page dispatches: the other ones queue behind each other on a busy box
        demo.load(None, states.tab, None, js=RESTORE_TAB_JS)
        header, language = _header_row(texts)
        with gr.Tabs(selected="datasets", elem_id="studio-tabs") as tabs:
            built = _Tabs(
                tabs=tabs,
                datasets=build_datasets_tab(ctx, states.dataset),
                train=build_train_tab(ctx),
                runs=build_runs_tab(ctx, states.run),
                sweeps=build_sweeps_tab(ctx),
                compare=build_compare_tab(ctx),
                evaluate=build_evaluate_tab(ctx),
                deploy=build_deploy_tab(ctx, states.deployment),
                nodes=build_nodes_tab(ctx),
            )
        _wire_tab_changes(demo, built, states)
        _wire_language(ctx, texts, language, header, states)
        _wire_across_tabs(built, states)
        narrow_progress(demo, gr.Markdown("", visible=False, elem_id="studio-progress"))
    # Table headers follow the session's language wherever a callback fills a table.
    texts.localize_tables(demo)
    undocument_events(demo)
    return demo


def undocument_events(demo: gr.Blocks) -> None:
    """Keep the page's events out of Gradio's API description (``api_visibility="undocumented"``).

    Gradio writes the description of every public event (its parameters' JSON schemas) into each page it
    serves, as ``window.gradio_api_info``: 1.38 MB of the studio's 1.89 MB page, downloaded at every load, for a
    "use via API" view the studio does not offer (its API is the REST one under /api/v1). The events stay
    callable as before, by name too (the security tests call the upload by its name)."""
    for fn in demo.fns.values():
        if fn.api_visibility == "public":
            fn.api_visibility = "undocumented"


def narrow_progress(demo: gr.Blocks, sink: gr.Component, many: int = 20) -> None:
    """Show no event's progress on a container (the tabs, a tab, a group of the Train form), and none on many
    components where the progress shows nothing a person needs.

    Gradio's page keeps a loading status for every component any event has ever targeted and, at each status
    change of any event (two or more per event, timer ticks included), looks each of them up by a walk of the
    page's whole tree (``update_loading_stati_state``; ``Z`` in its ``core`` script). With the tabs (~400
    blocks) among the targets of the page load, the language switch and the clone, each 2-second tick of the
    Runs tab cost the browser about a second. An event keeps its other outputs as targets: while it runs they
    show it, and a value typed into one of them is not overwritten when it lands (the recipe, template, YAML
    and clone loaders write the form's values, so they keep theirs). One whose outputs are all containers
    points at ``sink`` (one hidden component), and so does one with more than ``many`` targets that either
    hides its progress (the form's check, the option search) or writes no value anyone types
    (``relabels_only``: the language switch, ~250 labels, which had put them among the statuses for good; a
    profile of the browser during test_studio's flow found three quarters of the page's script in the walks).
    """
    for fn in demo.fns.values():
        if not fn.outputs:
            continue
        targets = fn.show_progress_on if fn.show_progress_on is not None else fn.outputs
        leaves = [o for o in targets if not _container(o)]
        quiet = fn.show_progress == "hidden" or getattr(fn.fn, "relabels_only", False)
        if not leaves or (len(leaves) > many and quiet):
            fn.show_progress_on = [sink]
        elif len(leaves) < len(targets):
            fn.show_progress_on = leaves


def relabels_only(handler: Any) -> Any:
    """Mark an event handler whose outputs change labels, never a value a person types (``narrow_progress``)."""
    handler.relabels_only = True
    return handler


def _container(block: Any) -> bool:
    """A block with blocks inside (gr.HTML is a BlockContext that may have none)."""
    return isinstance(block, BlockContext) and bool(block.children)


def _browser_states() -> _BrowserStates:
    return _BrowserStates(
        lang=gr.BrowserState(DEFAULT_LANGUAGE, storage_key="ernie-studio-lang"),
        dataset=gr.BrowserState(None, storage_key="ernie-studio-dataset"),
        run=gr.BrowserState(None, storage_key="ernie-studio-run"),
        deployment=gr.BrowserState(None, storage_key="ernie-studio-deployment"),
        tab=gr.BrowserState("datasets", storage_key="ernie-studio-tab"),
    )


def _header_row(texts: Texts) -> tuple[gr.Markdown, gr.Radio]:
    """Title and subtitle (with the page's style rules) beside the language switch."""
    with gr.Row(equal_height=True):
        with gr.Column(scale=4, elem_id="studio-header"):
            header = gr.Markdown(header_markdown(DEFAULT_LANGUAGE))
            gr.HTML(f"<style>{CSS}</style>", elem_id="studio-style", padding=False)
        language = texts.make(
            gr.Radio,
            "app.language",
            choices=[(v, k) for k, v in LANGUAGES.items()],
            value=DEFAULT_LANGUAGE,
            elem_id="lang-switch",
            scale=1,
        )
    return header, language


def _wire_tab_changes(demo: gr.Blocks, built: _Tabs, states: _BrowserStates) -> None:
    """Tab changes: remember the tab, and poll only on the tab that shows live state.

    One handler for every tab's select, fed the tab the page shows (``SHOWN_TAB_JS``), not the tab of the
    event: the page also fires selects for tabs it does not show (Datasets' when it mounts, and again when
    a language switch relabels the tabs), which landed after the restore's or the person's click and
    stopped the shown tab's timer and put tab=datasets in the address. One handler runs its events in order.
    """
    timers = [built.runs.timer, built.deploy.timer, built.sweeps.timer]
    gr.on(
        [tab.select for tab in built.by_id().values()],
        shown_tab,
        states.tab,
        [*timers, states.tab],
        js=SHOWN_TAB_JS,
        show_progress="hidden",
    ).then(None, states.tab, None, js=SET_TAB_JS)


def _wire_language(
    ctx: UIContext, texts: Texts, language: gr.Radio, header: gr.Markdown, states: _BrowserStates
) -> None:
    """Relabel every registered component; the choice is remembered in browser storage."""
    # Tables take their current values in so their headers can be translated in place.
    demo = ctx.demo
    relabel = [*texts.components, header, states.lang]
    h = LanguageHandlers(texts)
    # One chain for a switch and for the restore on load: the radio's change event fires only when the
    # language differs from the page's, so an English page (the default) loads with none of it (each event
    # costs the page a pass over every component that any event has touched: hundreds, after the form's).
    # The stored language is put in the radio by the browser as the page loads: a server round trip there
    # could land after the person's own first click and switch the page back (an e2e test lost its click so).
    demo.load(None, states.lang, language, js=RESTORE_LANGUAGE_JS)
    chained = language.change(h.set_language, [language, *texts.tables], relabel)
    # Gradio's own texts (e.g. "Drop File Here") follow its front end's locale, which it takes from the
    # browser; the switch sets that locale too.
    chained = chained.then(None, language, None, js=GRADIO_LOCALE_JS)
    if texts.uploads:
        for shown in (False, True):
            redraw = partial(visibility, shown, len(texts.uploads))
            chained = chained.then(redraw, language, texts.uploads, show_progress="hidden")
    for follower in ctx.language_followers:
        chained = chained.then(
            follower.fn, follower.inputs, follower.outputs, show_progress="hidden", **follower.options
        )


def _wire_across_tabs(built: _Tabs, states: _BrowserStates) -> None:
    train, runs, deploy, sweeps = built.train, built.runs, built.deploy, built.sweeps
    timers = [runs.timer, deploy.timer, sweeps.timer]
    # Runs -> Train: "clone" fills the form with the run's choices and opens the Train tab.
    runs.clone_btn.click(
        train.handlers.clone_into_form,
        runs.selected,
        [*train.fields.values(), built.tabs, states.tab],
    ).then(None, states.tab, None, js=SET_TAB_JS).then(**train.handlers.review_wiring)
    # Runs -> Deploy, Sweeps -> Deploy: after "deploy this run" or "promote best", open Deploy & Chat on the
    # new deployment.
    for deployed in (runs.deployed, sweeps.deployed):
        deployed.change(open_deployment, deployed, [built.tabs, states.deployment, states.tab, *timers]).then(
            deploy.refresh_fn, [deploy.run, states.deployment], deploy.refresh_outputs
        )
    # Train -> Runs: a launched run is selected in the Runs tab.
    train.launched_run.change(echo, train.launched_run, states.run).then(
        runs.show_run, train.launched_run, runs.show_outputs
    )
    # Train -> Sweeps: a launched sweep is the one the Sweeps tab shows.
    train.launched_sweep.change(sweeps.show_sweep, train.launched_sweep, sweeps.show_outputs)


# ---- event handlers --------------------------------------------------------------------------------------


TIMED_TABS = ("runs", "deploy", "sweeps")


def shown_tab(tab_id: Any) -> tuple[Any, ...]:
    """The tab the page shows (``SHOWN_TAB_JS``) was selected: its timers and its id (``tab_timers``)."""
    return tab_timers(tab_id if tab_id in TAB_IDS else "datasets")


def tab_timers(tab_id: str) -> tuple[Any, ...]:
    """(Runs timer, Deploy timer, Sweeps timer, tab id): only the shown tab's timer runs."""
    return (*(gr.Timer(active=tab_id == timed) for timed in TIMED_TABS), tab_id)


def visibility(shown: bool, count: int, lang: str) -> Any:
    """``count`` components shown or hidden (one update, or a list of them): redrawn in ``lang``'s locale."""
    update = gr.update(visible=shown)
    return update if count == 1 else [update] * count


class LanguageHandlers:
    """The language switch's handler, bound to the registry of translated components."""

    def __init__(self, texts: Texts):
        self.texts = texts

    @relabels_only
    def set_language(self, lang: str, *frames: Any) -> list[Any]:
        """Relabel every registered component (tables keep their rows), the header, the stored language."""
        remember_language(lang)
        return [*self.texts.updates(lang, list(frames)), header_markdown(lang), lang]


def open_deployment(dep: Any) -> tuple[Any, ...]:
    """Deploy & Chat opened on a new deployment, its timer running."""
    return (gr.Tabs(selected="deploy"), dep, "deploy", *tab_timers("deploy")[:-1])


def header_markdown(lang: str) -> str:
    return f"# {text('app.title', lang)}\n{text('app.subtitle', lang)}"


__all__ = ["CSS", "STATUS_TIMER_JS", "build_ui"]
