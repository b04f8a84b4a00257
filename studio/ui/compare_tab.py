"""Compare tab: overlaid curves aligned by step, the config keys that differ, final metrics, A/B chat."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from studio.services import compare as compare_svc
from studio.services import deployments as deployments_svc
from studio.services import runs as runs_svc
from studio.ui import charts
from studio.ui.chat_messages import chat_messages, message_text
from studio.ui.context import UIContext, parse_id, refusal
from studio.ui.deploy_tab import deployment_choices
from studio.ui.evaluate_tab import EvaluateHandlers, build_compare_evals
from studio.ui.i18n import Texts, current_language, text
from studio.ui.run_views import run_choices
from studio.ui.sampling import sampling_controls, sampling_params

SERIES_COLORS = [
    ("#f97316", "🟧"),
    ("#3b82f6", "🟦"),
    ("#22c55e", "🟩"),
    ("#a855f7", "🟪"),
    ("#ef4444", "🟥"),
    ("#eab308", "🟨"),
]
# Keeps ?runs=1,2 in the address bar in step with the runs picked, so a reload compares them again.
URL_JS = """(chosen) => {
  const url = new URL(window.location.href);
  const ids = (chosen || []).map(String).filter((s) => s !== "");
  if (ids.length) { url.searchParams.set("runs", ids.join(",")); } else { url.searchParams.delete("runs"); }
  window.history.replaceState(null, "", url.toString());
  return chosen;
}"""
FINAL_KEYS_FIRST = ("loss", "eval_loss", "rewards/accuracy", "tokens_per_second", "elapsed_s", "step")


@dataclass
class CompareTab:
    tab: gr.Tab
    runs: gr.Dropdown


def aligned_frames(result: dict[str, Any], metric: str) -> pd.DataFrame:
    """``compare_runs`` output -> one line per run for ``metric`` (steps a run did not log are skipped)."""
    labels = {str(r["id"]): f"#{r['id']} {r['name']}" for r in result["runs"]}
    per_run = {}
    for run_id, values in (result["metrics"].get(metric) or {}).items():
        per_run[labels.get(run_id, run_id)] = [
            {"step": s, metric: v} for s, v in zip(result["steps"], values, strict=True) if v is not None
        ]
    return charts.compare_frame(per_run, metric)


def diff_frame(result: dict[str, Any]) -> pd.DataFrame:
    """Config keys that differ: one row per key, one column per run."""
    cols = [f"#{r['id']} {r['name']}" for r in result["runs"]]
    ids = [str(r["id"]) for r in result["runs"]]
    rows = [[key, *(_cell(values.get(i)) for i in ids)] for key, values in result["config_diff"].items()]
    return pd.DataFrame(rows, columns=["key", *cols])


def final_frame(runs: list[Any], result: dict[str, Any]) -> pd.DataFrame:
    """Final metrics side by side: the run summary's, else (still running) each metric's last logged value."""
    metrics: dict[str, dict[str, Any]] = {}
    for run in runs:
        final = dict(run.final_metrics or {})
        if not final:
            for name, per_run in result["metrics"].items():
                logged = [v for v in per_run.get(str(run.id), []) if v is not None]
                if logged:
                    final[name] = logged[-1]
        metrics[f"#{run.id} {run.name}"] = final
    keys = [k for k in FINAL_KEYS_FIRST if any(k in m for m in metrics.values())]
    keys += sorted({k for m in metrics.values() for k in m} - set(keys))
    rows = [[k, *(_cell(m.get(k)) for m in metrics.values())] for k in keys]
    return pd.DataFrame(rows, columns=["metric", *metrics])


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def metric_names(result: dict[str, Any]) -> list[str]:
    """Metrics ``compare_runs`` found, the ones every stage logs first; step and time are axes, not curves."""
    names = sorted(result["metrics"], key=lambda k: (k not in charts.CORE_METRICS, k))
    return [n for n in names if n not in ("step", "elapsed_s")]


def pick_metric(names: list[str], wanted: str) -> str:
    """``wanted`` when the runs logged it, else loss, else the first metric they have."""
    if wanted in names:
        return wanted
    return "loss" if "loss" in names else (names or ["loss"])[0]


def series_legend(labels: list[str]) -> tuple[dict[str, str], str]:
    """A fixed colour per run and a legend line naming them (Gradio's own legend is clipped at this size)."""
    colors = {label: SERIES_COLORS[i % len(SERIES_COLORS)][0] for i, label in enumerate(labels)}
    legend = "  ".join(
        f"{SERIES_COLORS[i % len(SERIES_COLORS)][1]} {label}" for i, label in enumerate(labels)
    )
    return colors, legend


def _ab_histories(text: str, hist_a: list | None, hist_b: list | None) -> list[list[dict[str, str]]]:
    """Both chats as plain messages, each ending in the new prompt and an empty reply to stream into."""
    histories = [
        [{"role": m["role"], "content": message_text(m.get("content"))} for m in h or []]
        for h in (hist_a, hist_b)
    ]
    for h in histories:
        h.append({"role": "user", "content": text})
        h.append({"role": "assistant", "content": ""})
    return histories


class CompareHandlers:
    """The Compare tab's event handlers: component values in, plain values out."""

    def __init__(self, ctx: UIContext):
        self.ctx = ctx

    def refresh(self) -> tuple[Any, Any, Any]:
        """Fresh run and deployment choices."""
        # Choices only: the values are the person's, and this may land after they picked something.
        lang = current_language()
        items = self.ctx.read(runs_svc.list_runs, default=[])
        deps = self.ctx.read(deployments_svc.list_deployments, default=[])
        return (
            gr.update(choices=run_choices(items, lang)),
            gr.update(choices=deployment_choices(deps, lang)),
            gr.update(choices=deployment_choices(deps, lang)),
        )

    def restore(self, request: gr.Request) -> tuple[Any, Any, Any]:
        """On page load: fresh choices, and the runs named in ?runs=1,2 picked again (those that exist)."""
        runs_u, dep_a, dep_b = self.refresh()
        wanted = request.query_params.get("runs", "") if request else ""
        known = {value for _, value in runs_u["choices"]}
        picked = [i for i in (parse_id(w) for w in wanted.split(",")) if i in known]
        if picked:
            runs_u["value"] = picked
        return runs_u, dep_a, dep_b

    def compare_restored(self, chosen: list[Any] | None, metric: str) -> tuple[Any, ...]:
        """:meth:`compare` for runs restored from the URL; fewer than two change nothing."""
        if len([c for c in chosen or [] if parse_id(c) is not None]) < 2:
            return tuple(gr.skip() for _ in range(5))
        return self.compare(chosen, metric)

    def compare(self, chosen: list[Any] | None, metric: str) -> tuple[Any, ...]:
        """(curves, legend, metric dropdown, config diff, final metrics) of two or more runs."""
        ids = [i for i in (parse_id(c) for c in chosen or []) if i is not None]
        if len(ids) < 2:
            raise refusal(text("cmp.err.two_runs", current_language()))
        result = self.ctx.call(compare_svc.compare_runs, ids)
        names = metric_names(result)
        metric = pick_metric(names, metric)
        full_runs = [self.ctx.call(runs_svc.get_run, i) for i in ids]
        colors, legend = series_legend([f"#{r['id']} {r['name']}" for r in result["runs"]])
        return (
            gr.update(value=aligned_frames(result, metric), color_map=colors),
            legend,
            gr.update(choices=names or ["loss"], value=metric),
            diff_frame(result),
            final_frame(full_runs, result),
        )

    def ab_chat(
        self, prompt: str, a: Any, b: Any, temperature: float, ignore_eos: bool, hist_a: list, hist_b: list
    ) -> Iterator[tuple[Any, ...]]:
        """Send one prompt to deployments A and B; both replies stream side by side."""
        da, db = parse_id(a), parse_id(b)
        if not prompt or da is None or db is None:
            raise refusal(text("cmp.err.ab", current_language()))
        histories = _ab_histories(prompt, hist_a, hist_b)
        params = sampling_params({"temperature": temperature, "ignore_eos": ignore_eos})
        # Both deployments stream at once; deltas arrive on one queue tagged with their side.
        events: queue.Queue[tuple[int, str | None, str | None]] = queue.Queue()
        for side, dep_id in ((0, da), (1, db)):
            body = {"messages": chat_messages("", histories[side][:-1]), **params}
            threading.Thread(target=self._pump, args=(side, dep_id, body, events), daemon=True).start()
        yield "", histories[0], histories[1]
        done = 0
        while done < 2:
            side, delta, error = events.get()
            if delta is not None:
                histories[side][-1]["content"] += delta
            elif error:
                histories[side][-1]["content"] += f"\n\n⚠️ {error}"
            else:
                done += 1
                continue
            yield "", histories[0], histories[1]

    def _pump(self, side: int, dep_id: int, body: dict[str, Any], events: queue.Queue) -> None:
        """Put one deployment's deltas on ``events``, then its error if any, then the end (None, None)."""
        try:
            for delta in self.ctx.stream(deployments_svc.chat_stream, dep_id, body):
                events.put((side, delta, None))
        except Exception as e:  # shown in that side's bubble; the other side keeps streaming
            events.put((side, None, str(e)))
        events.put((side, None, None))


# ---- layout ----------------------------------------------------------------------------------------------


def _runs_panel(t: Texts) -> dict[str, Any]:
    """Run picker, metric, curves, legend, config diff and final metrics."""
    with gr.Row(equal_height=True):
        runs = t.make(gr.Dropdown, "cmp.runs", choices=[], multiselect=True, elem_id="cmp-runs", scale=4)
        metric = t.make(
            gr.Dropdown, "cmp.metric", choices=["loss"], value="loss", elem_id="cmp-metric", scale=1
        )
        compare_btn = t.make(
            gr.Button, "cmp.btn", prop="value", variant="primary", elem_id="cmp-btn", scale=1
        )
    curves = t.make(
        gr.LinePlot,
        "cmp.curves",
        x="step",
        y="value",
        color="series",
        height=340,
        elem_id="cmp-curves",
        also={"x_title": "plot.step", "y_title": "plot.value", "color_title": "plot.series"},
    )
    legend = gr.Markdown("", elem_id="cmp-legend")
    with gr.Row():
        diff = t.make(
            gr.Dataframe,
            "cmp.diff",
            headers=["key"],
            interactive=False,
            wrap=True,
            elem_id="cmp-diff",
            max_height=300,
        )
        final = t.make(
            gr.Dataframe,
            "cmp.final",
            headers=["metric"],
            interactive=False,
            elem_id="cmp-final",
            wrap=True,
            max_height=300,
        )
    return {
        "runs": runs,
        "metric": metric,
        "compare_btn": compare_btn,
        "curves": curves,
        "legend": legend,
        "diff": diff,
        "final": final,
    }


def _ab_panel(t: Texts) -> dict[str, Any]:
    """Two deployments, one prompt with its sampling controls, two chats."""
    with t.make(gr.Accordion, "cmp.ab", open=True):
        with gr.Row():
            dep_a = t.make(gr.Dropdown, "cmp.deploy_a", choices=[], elem_id="cmp-dep-a")
            dep_b = t.make(gr.Dropdown, "cmp.deploy_b", choices=[], elem_id="cmp-dep-b")
        with gr.Row(equal_height=True):
            prompt = t.make(gr.Textbox, "cmp.prompt", elem_id="cmp-prompt", scale=4)
            sampling = sampling_controls(
                t, "cmp", ("temperature", "ignore_eos"), scales={"temperature": 2, "ignore_eos": 1}
            )
            send = t.make(gr.Button, "cmp.send", prop="value", variant="primary", elem_id="cmp-send", scale=1)
        with gr.Row():
            chat_a = t.make(gr.Chatbot, "cmp.chat_a", height=260, elem_id="cmp-chat-a")
            chat_b = t.make(gr.Chatbot, "cmp.chat_b", height=260, elem_id="cmp-chat-b")
    return {
        "dep_a": dep_a,
        "dep_b": dep_b,
        "prompt": prompt,
        "sampling": sampling,
        "send": send,
        "chat_a": chat_a,
        "chat_b": chat_b,
    }


def build_compare_tab(ctx: UIContext) -> CompareTab:
    """Lay out the Compare tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.compare", id="compare") as tab:
        r = _runs_panel(t)
        evals = build_compare_evals(ctx)  # eval metrics of the compared runs, next to their curves
        ab = _ab_panel(t)
    h = CompareHandlers(ctx)
    compared = [r["curves"], r["legend"], r["metric"], r["diff"], r["final"]]
    r["compare_btn"].click(h.compare, [r["runs"], r["metric"]], compared).then(
        EvaluateHandlers(ctx).runs_evals, r["runs"], evals
    )
    r["metric"].input(h.compare, [r["runs"], r["metric"]], compared)
    ab_inputs = [ab["prompt"], ab["dep_a"], ab["dep_b"], *ab["sampling"].values(), ab["chat_a"], ab["chat_b"]]
    ab_outputs = [ab["prompt"], ab["chat_a"], ab["chat_b"]]
    ab["send"].click(h.ab_chat, ab_inputs, ab_outputs)
    ab["prompt"].submit(h.ab_chat, ab_inputs, ab_outputs)
    pickers = [r["runs"], ab["dep_a"], ab["dep_b"]]
    tab.select(h.refresh, None, pickers, show_progress="hidden")
    # However the runs got picked, the URL follows; a reload picks them again and compares them.
    r["runs"].change(None, r["runs"], None, js=URL_JS)
    ctx.demo.load(h.restore, None, pickers, show_progress="hidden").then(
        h.compare_restored, [r["runs"], r["metric"]], compared, show_progress="hidden"
    )
    # The language restored on load rewrites the tables it saw, which may be before the compare above.
    ctx.on_language(h.compare_restored, [r["runs"], r["metric"]], compared, needs_selection=False)
    return CompareTab(tab=tab, runs=r["runs"])
