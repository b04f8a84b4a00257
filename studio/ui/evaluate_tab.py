"""Evaluate tab: evaluate models on datasets, the results of several evals side by side, the pairwise
judge's win rate, and a per-sample browser (prediction vs reference, and two models' predictions with
their differences, the samples where they differ first). Also the "evaluate after training" fields of the
Train tab and the eval table of the Compare tab.

Handlers call the service functions the REST API calls (`studio.services.evals`); the plain functions
below turn their results into tables and HTML and are tested without a browser.
"""

from __future__ import annotations

import dataclasses
import difflib
import html
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from engine.eval.config import JUDGE_MODES, METRICS, EvalConfig
from engine.train.options import field_info
from studio.models import DeploymentStatus, RunStatus
from studio.services import datasets as datasets_svc
from studio.services import deployments as deployments_svc
from studio.services import eval_reads
from studio.services import evals as evals_svc
from studio.services import models as models_svc
from studio.services.runs import EvaluateAfter
from studio.ui.context import UIContext, fmt_time, model_choices, parse_id, refusal
from studio.ui.datasets_tab import dataset_choices
from studio.ui.i18n import Texts, current_language, text

EVAL_COLUMNS = ["id", "name", "model", "status", "progress", "created"]
SAMPLE_COLUMNS = ["sample", "reference", "prediction A", "prediction B", "differ"]
SAMPLES_SHOWN = 200
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
# The metrics a person picks in the form, starting from the engine's; judge is added when a judge is picked.
FORM_METRICS = [m for m in METRICS if m != "judge"]
DEFAULT_METRICS = [m for m in EvalConfig().metrics if m in FORM_METRICS]


@dataclass
class EvaluateTab:
    tab: gr.Tab


# ---- plain functions ---------------------------------------------------------------------------------------


def eval_label(ev: Any) -> str:
    return f"#{ev.id} {ev.name}"  # evals after training are named "<run> · base|result"


def eval_choices(evals: list[Any]) -> list[tuple[str, int]]:
    return [(f"{eval_label(e)} · {e.status}", e.id) for e in evals]


def eval_rows(evals: list[Any], done: dict[int, int]) -> pd.DataFrame:
    rows = [
        [e.id, e.name, e.model, e.status, f"{done.get(e.id, 0)}/{e.samples_total}", fmt_time(e.created_at)]
        for e in evals
    ]
    return pd.DataFrame(rows, columns=EVAL_COLUMNS)


def results_frame(compare: dict[str, Any]) -> pd.DataFrame:
    """``compare_evals`` -> one row per headline metric, one column per eval, with its bootstrap interval."""
    labels = {str(e["id"]): f"#{e['id']} {e['name']}" for e in compare["evals"]}
    rows = []
    for metric, per_eval in compare["metrics"].items():
        ci = compare["intervals"].get(metric, {})
        rows.append([metric, *(_number(per_eval.get(i), ci.get(i)) for i in labels)])
    return pd.DataFrame(rows, columns=["metric", *labels.values()])


def _number(value: Any, interval: list[float] | None) -> str:
    if value is None:
        return "—"
    text = f"{value:.4g}"
    return f"{text} ({interval[0]:.3g}–{interval[1]:.3g})" if interval else text


def summary_markdown(compare: dict[str, Any]) -> str:
    """How many samples the first two evals answer differently, and each pairwise judge's win rate."""
    lines = []
    differ = compare.get("differ")
    if differ:
        a, b = differ["evals"]
        lines.append(
            f"#{a} and #{b} answer **{differ['samples']}** of {differ['of']} shared samples differently."
        )
    names = {str(e["id"]): e["name"] for e in compare["evals"]}
    for eval_id, pw in compare.get("pairwise", {}).items():
        rate = "—" if pw["win_rate"] is None else f"{100 * pw['win_rate']:.1f}%"
        lines.append(
            f"#{eval_id} {names.get(eval_id, '')} vs its baseline: win rate **{rate}** "
            f"({pw['wins']} wins, {pw['ties']} ties, {pw['losses']} losses, {pw['unparsed']} unparsed)"
        )
    return "  \n".join(lines)


def sample_rows(page: dict[str, Any]) -> pd.DataFrame:
    rows = [
        [
            f"{i['dataset']}:{i['line']}",
            i["reference"],
            i["prediction"],
            (i.get("other") or {}).get("prediction", "—") if page.get("compare_to") else "—",
            "≠" if i.get("differ") else ("=" if page.get("compare_to") else ""),
        ]
        for i in page["items"]
    ]
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def diff_html(a: str, b: str) -> str:
    """B against A, character by character: what B drops struck through, what B adds marked."""
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out.append(html.escape(a[i1:i2]))
            continue
        if i2 > i1:
            out.append(f"<del style='background:#fecaca'>{html.escape(a[i1:i2])}</del>")
        if j2 > j1:
            out.append(f"<ins style='background:#bbf7d0'>{html.escape(b[j1:j2])}</ins>")
    return "".join(out)


def sample_html(item: dict[str, Any] | None, label_a: str, label_b: str | None) -> str:
    """One sample: its prompt, the reference, A's prediction and scores, and B's with the diff A -> B."""
    if not item:
        return "<p>No sample selected.</p>"
    esc = html.escape
    parts = [
        f"<div id='ev-sample-id'><b>{esc(item['dataset'])}:{item['line']}</b>"
        + (" · <b>the predictions differ</b>" if item.get("differ") else "")
        + "</div>",
        f"<details><summary>prompt</summary><pre style='white-space:pre-wrap'>{esc(item['prompt'])}</pre></details>",
        f"<p><b>reference</b><br><span class='ev-reference'>{esc(item['reference'])}</span></p>",
        f"<p><b>{esc(label_a)}</b> {esc(_scores(item['scores']))}<br>"
        f"<span class='ev-prediction-a'>{esc(item['prediction'])}</span></p>",
    ]
    other = item.get("other")
    if label_b and other is not None:
        parts.append(
            f"<p><b>{esc(label_b)}</b> {esc(_scores(other['scores']))}<br>"
            f"<span class='ev-prediction-b'>{esc(other['prediction'])}</span></p>"
            f"<p><b>A → B</b><br><span class='ev-diff'>{diff_html(item['prediction'], other['prediction'])}</span></p>"
        )
    return "\n".join(parts)


def _scores(scores: dict[str, Any]) -> str:
    shown = {k: v for k, v in scores.items() if isinstance(v, int | float)}
    return "(" + ", ".join(f"{k} {v:.3g}" for k, v in shown.items()) + ")" if shown else ""


def evaluate_after_spec(
    on: bool, holdout: Any, dataset_ids: list[Any] | None, max_new_tokens: Any
) -> EvaluateAfter | None:
    """The Train tab's "evaluate after training" fields -> the RunSpec part (None when unticked)."""
    if not on:
        return None
    ids = [i for i in (parse_id(d) for d in dataset_ids or []) if i is not None]
    options = {}
    if max_new_tokens not in (None, "") and int(max_new_tokens) != _DEFAULTS["max_new_tokens"]:
        options["max_new_tokens"] = int(max_new_tokens)
    return EvaluateAfter(holdout=int(holdout or 0), dataset_ids=ids or None, options=options)


@dataclass
class JudgeFields:
    """The form's judge box: a running deployment or an external URL (with model name and key), the mode, and
    the eval whose predictions a pairwise judge compares with."""

    deployment: Any = None
    url: str = ""
    model: str = ""
    api_key: str = ""
    mode: str = _DEFAULTS["judge_mode"]
    baseline: Any = None


def judge_spec(judge: JudgeFields, options: dict[str, Any]) -> dict[str, Any]:
    """The judge's part of an ``EvalSpec`` (its fields; the engine keys go into ``options``); the service
    checks the rest (a running deployment, a finished baseline on the same datasets, a key with a URL)."""
    dep, baseline = parse_id(judge.deployment), parse_id(judge.baseline)
    url, key = (judge.url or "").strip(), (judge.api_key or "").strip()
    model = (judge.model or "").strip() or _DEFAULTS["judge_model"]
    if dep is None and not url:
        if (
            baseline is not None
            or key
            or judge.mode != _DEFAULTS["judge_mode"]
            or model != _DEFAULTS["judge_model"]
        ):
            raise refusal(text("ev.err.no_judge", current_language()))
        return {}
    options["metrics"] = [*options["metrics"], "judge"]
    options["judge_mode"] = judge.mode
    if url:
        options["judge_url"] = url
    if model != _DEFAULTS["judge_model"]:
        options["judge_model"] = model
    spec: dict[str, Any] = {"judge_deployment_id": dep, "judge_baseline_eval_id": baseline}
    if key:
        spec["judge_api_key"] = key
    return spec


def deployment_choices(deployments: list[Any]) -> list[tuple[str, int]]:
    """Running deployments (the ones that can judge)."""
    running = [d for d in deployments if d.status == DeploymentStatus.RUNNING and d.url]
    return [(f"#{d.id} {d.name} · {d.url}", d.id) for d in running]


# ---- event handlers --------------------------------------------------------------------------------------


class EvaluateHandlers:
    def __init__(self, ctx: UIContext):
        self.ctx = ctx

    def launch(
        self,
        models: list[str] | None,
        datasets: list[Any] | None,
        metrics: list[str] | None,
        max_new_tokens: Any,
        *judge: Any,
    ) -> str:
        """One eval per picked model on the picked datasets (judged when a judge is picked)."""
        if not models:
            raise gr.Error("Pick at least one model to evaluate.")
        ids = [i for i in (parse_id(d) for d in datasets or []) if i is not None]
        if not ids:
            raise gr.Error("Pick at least one eval dataset.")
        options: dict[str, Any] = {"metrics": list(metrics or DEFAULT_METRICS)}
        if max_new_tokens not in (None, ""):
            options["max_new_tokens"] = int(max_new_tokens)
        judged = judge_spec(JudgeFields(*judge), options)
        made = []
        for ref in models:
            spec = evals_svc.EvalSpec(model=ref, dataset_ids=ids, options=dict(options), **judged)
            made.append(self.ctx.call(evals_svc.create_eval, self.ctx.settings, spec))
        return "✅ queued " + ", ".join(f"**#{e.id} {e.name}**" for e in made)

    def refresh(self) -> tuple[Any, ...]:
        """Pickers, the evals table, and (first look) the newest evaluate-after-training pair selected."""
        evals = self.ctx.read(eval_reads.list_evals, default=[])
        done = self.ctx.read(eval_reads.samples_done, [e.id for e in evals], default={})
        models = model_choices(self.ctx.read(models_svc.list_models, self.ctx.settings, default=[]))
        datasets = dataset_choices(self.ctx.read(datasets_svc.list_datasets, default=[]))
        deployments = self.ctx.read(deployments_svc.list_deployments, active_only=True, default=[])
        choices = eval_choices(evals)
        pair = _newest_pair(evals)
        picked = gr.update(choices=choices, value=pair) if pair else gr.update(choices=choices)
        a = gr.update(choices=choices, value=pair[0]) if pair else gr.update(choices=choices)
        b = gr.update(choices=choices, value=pair[1]) if pair else gr.update(choices=choices)
        finished = eval_choices([e for e in evals if e.status == RunStatus.SUCCEEDED])
        return (
            gr.update(choices=models), gr.update(choices=datasets), eval_rows(evals, done), picked, a, b,
            gr.update(choices=deployment_choices(deployments)), gr.update(choices=finished),
        )  # fmt: skip

    def results(self, picked: list[Any] | None) -> tuple[pd.DataFrame, str]:
        ids = [i for i in (parse_id(p) for p in picked or []) if i is not None]
        if not ids:
            return pd.DataFrame(columns=["metric"]), ""
        compare = self.ctx.call(eval_reads.compare_evals, ids)
        return results_frame(compare), summary_markdown(compare)

    def samples(self, a: Any, b: Any, only_differ: bool) -> tuple[pd.DataFrame, list[dict], str]:
        """A's samples (with B's predictions, the differing ones first), and the first one opened."""
        a_id, b_id = parse_id(a), parse_id(b)
        if a_id is None:
            return pd.DataFrame(columns=SAMPLE_COLUMNS), [], sample_html(None, "", None)
        b_id = b_id if b_id != a_id else None
        page = self.ctx.call(
            eval_reads.list_samples,
            a_id,
            limit=SAMPLES_SHOWN,
            compare_to=b_id,
            only_differ=bool(only_differ and b_id),
        )
        items = page["items"]
        labels = self._labels(a_id, b_id)
        return sample_rows(page), items, sample_html(items[0] if items else None, *labels)

    def open_sample(self, items: list[dict], a: Any, b: Any, evt: gr.SelectData) -> str:
        row = evt.index[0] if isinstance(evt.index, list | tuple) else evt.index
        item = items[row] if items and 0 <= row < len(items) else None
        a_id, b_id = parse_id(a), parse_id(b)
        return sample_html(item, *self._labels(a_id, b_id if b_id != a_id else None))

    def _labels(self, a_id: int | None, b_id: int | None) -> tuple[str, str | None]:
        def label(i: int | None) -> str | None:
            return (
                None
                if i is None
                else self.ctx.read(lambda s: eval_label(evals_svc.get_eval(s, i)), default=f"#{i}")
            )

        return f"A: {label(a_id)}", (f"B: {label(b_id)}" if b_id is not None else None)

    def runs_evals(self, run_ids: list[Any] | None) -> pd.DataFrame:
        """For Compare: the headline metrics of every eval of the compared runs, side by side."""
        ids = [i for i in (parse_id(r) for r in run_ids or []) if i is not None]
        evals = [e for rid in ids for e in self.ctx.read(eval_reads.list_evals, run_id=rid, default=[])]
        evals = [e for e in dict((e.id, e) for e in evals).values() if e.status == "succeeded"]
        if not evals:
            return pd.DataFrame(columns=["metric"])
        return results_frame(self.ctx.call(eval_reads.compare_evals, [e.id for e in evals][:20]))


def _newest_pair(evals: list[Any]) -> list[int] | None:
    """[result, base] of the newest run evaluated after training (both queued together)."""
    for e in evals:
        if e.role == "result":
            base = next((x for x in evals if x.after_run_id == e.after_run_id and x.role == "base"), None)
            if base is not None:
                return [e.id, base.id]
    return None


# ---- layout ----------------------------------------------------------------------------------------------


def _max_new_tokens(t: Texts, key: str, elem_id: str) -> gr.Number:
    info = field_info(EvalConfig, "max_new_tokens")
    return t.make(
        gr.Number, key, value=_DEFAULTS["max_new_tokens"], precision=0, minimum=info["minimum"],
        maximum=info["maximum"], elem_id=elem_id,
    )  # fmt: skip


def build_evaluate_after_fields(ctx: UIContext, tab: gr.Tab) -> dict[str, gr.components.Component]:
    """The Train tab's "evaluate after training" box: its form fields (``evaluate_after_spec``'s inputs)."""
    t = ctx.texts
    with t.make(gr.Accordion, "ev.after", open=False, elem_id="tr-eval-after-box"), gr.Row():
        fields = {
            "eval_after": t.make(gr.Checkbox, "ev.after_on", value=False, elem_id="tr-eval-after"),
            "eval_holdout": t.make(gr.Number, "ev.holdout", value=0, minimum=0, precision=0, elem_id="tr-eval-holdout"),
            "eval_datasets": t.make(gr.Dropdown, "ev.after_datasets", choices=[], multiselect=True, elem_id="tr-eval-datasets"),
            "eval_max_new_tokens": _max_new_tokens(t, "ev.max_new_tokens", "tr-eval-max-new-tokens"),
        }  # fmt: skip
    return fields  # its dataset choices are refreshed with the tab's pickers (train_tab.PICKER_KEYS)


def build_compare_evals(ctx: UIContext) -> gr.Dataframe:
    """The Compare tab's eval table (filled by ``EvaluateHandlers.runs_evals`` after a compare)."""
    return ctx.texts.make(gr.Dataframe, "ev.compare", interactive=False, wrap=True, elem_id="cmp-evals")


def _judge_box(t: Texts) -> list[gr.components.Component]:
    """The judge's fields, in ``JudgeFields`` order."""
    with t.make(gr.Accordion, "ev.judge", open=False, elem_id="ev-judge-box"):
        with gr.Row():
            deployment = t.make(gr.Dropdown, "ev.judge_deployment", choices=[], elem_id="ev-judge-deployment")
            url = t.make(gr.Textbox, "ev.judge_url", elem_id="ev-judge-url")
            model = t.make(
                gr.Textbox, "ev.judge_model", value=_DEFAULTS["judge_model"], elem_id="ev-judge-model"
            )
            key = t.make(gr.Textbox, "ev.judge_key", type="password", elem_id="ev-judge-key")
        with gr.Row():
            mode = t.make(
                gr.Radio, "ev.judge_mode", choices=list(JUDGE_MODES), value=_DEFAULTS["judge_mode"],
                elem_id="ev-judge-mode",
            )  # fmt: skip
            baseline = t.make(gr.Dropdown, "ev.judge_baseline", choices=[], elem_id="ev-judge-baseline")
    return [deployment, url, model, key, mode, baseline]


def build_evaluate_tab(ctx: UIContext) -> EvaluateTab:
    """Lay out the Evaluate tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.evaluate", id="evaluate") as tab:
        items = gr.State([])
        with t.make(gr.Accordion, "ev.new", open=True), gr.Row():
            models = t.make(
                gr.Dropdown, "ev.models", choices=[], multiselect=True, elem_id="ev-models", scale=3
            )
            datasets = t.make(
                gr.Dropdown, "ev.datasets", choices=[], multiselect=True, elem_id="ev-datasets", scale=3
            )
            metrics = t.make(
                gr.Dropdown, "ev.metrics", choices=FORM_METRICS, value=DEFAULT_METRICS, multiselect=True,
                elem_id="ev-metrics", scale=2,
            )  # fmt: skip
            max_new = _max_new_tokens(t, "ev.max_new_tokens", "ev-max-new-tokens")
            launch = t.make(gr.Button, "ev.launch", prop="value", variant="primary", elem_id="ev-launch")
        judge = _judge_box(t)
        status = gr.Markdown("", elem_id="ev-launch-status")
        refresh = t.make(gr.Button, "ev.refresh", prop="value", size="sm", elem_id="ev-refresh")
        table = t.make(gr.Dataframe, "ev.list", headers=EVAL_COLUMNS, interactive=False, elem_id="ev-list")
        picked = t.make(gr.Dropdown, "ev.pick", choices=[], multiselect=True, elem_id="ev-pick")
        results = t.make(gr.Dataframe, "ev.results", interactive=False, wrap=True, elem_id="ev-results")
        summary = gr.Markdown("", elem_id="ev-summary")
        with gr.Row():
            a = t.make(gr.Dropdown, "ev.a", choices=[], elem_id="ev-a")
            b = t.make(gr.Dropdown, "ev.b", choices=[], elem_id="ev-b")
            only = t.make(gr.Checkbox, "ev.only_differ", value=False, elem_id="ev-only-differ")
        with gr.Row():
            samples = t.make(
                gr.Dataframe, "ev.samples", headers=SAMPLE_COLUMNS, interactive=False, wrap=True,
                elem_id="ev-samples", scale=3,
            )  # fmt: skip
            sample = gr.HTML(sample_html(None, "", None), elem_id="ev-sample")
    h = EvaluateHandlers(ctx)
    launch.click(h.launch, [models, datasets, metrics, max_new, *judge], status, concurrency_limit=1)
    refreshed = [models, datasets, table, picked, a, b, judge[0], judge[5]]
    for event in (refresh.click, tab.select):
        event(h.refresh, None, refreshed).then(h.results, picked, [results, summary]).then(
            h.samples, [a, b, only], [samples, items, sample]
        )
    picked.input(h.results, picked, [results, summary])
    for comp in (a, b, only):
        comp.input(h.samples, [a, b, only], [samples, items, sample])
    samples.select(h.open_sample, [items, a, b], sample)
    return EvaluateTab(tab=tab)
