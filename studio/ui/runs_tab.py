"""Runs tab: the run table and a live run view (curves, log tail, checkpoints, actions, export, deploy).

Everything shown is read back from the store on every tick, so a refresh or a reconnect shows the same
live state; the selected run survives in the URL (``?run=N``) and in browser storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from studio.services import deployments as deployments_svc
from studio.services import exports as exports_svc
from studio.services import progress as progress_svc
from studio.services import runs as runs_svc
from studio.ui import charts
from studio.ui.context import UIContext, fmt_time, parse_id

RUN_COLUMNS = ["id", "name", "stage", "tuning", "status", "progress", "loss", "ETA", "created"]
CHECKPOINT_COLUMNS = ["step", "path", "saved"]
EXPORT_OPTIONS: dict[str, dict[str, Any]] = {
    "merge LoRA (paddle layout)": {"layout": "paddle"},
    "merge LoRA (hf layout)": {"layout": "hf"},
    "PTQ wint8": {"layout": "paddle", "ptq": "wint8"},
    "PTQ wint4": {"layout": "paddle", "ptq": "wint4"},
}
EXPORT_KINDS = list(EXPORT_OPTIONS)
EXPORT_COLUMNS = ["id", "layout", "ptq", "status", "perplexity", "model dir"]
LOG_TAIL_BYTES = 16384
LOG_TAIL_LINES = 20
POLL_SECONDS = 2.0
STATUS_ICONS = {"queued": "⏳", "running": "🏃", "succeeded": "✅", "failed": "❌", "cancelled": "⏹️"}

# Keeps ?run=N in the address bar in step with the selection, so a refresh reopens the same run.
URL_JS = """(runId) => {
  const url = new URL(window.location.href);
  if (runId === null || runId === undefined || runId === "") { url.searchParams.delete("run"); }
  else { url.searchParams.set("run", String(runId)); }
  window.history.replaceState(null, "", url.toString());
  return runId;
}"""


@dataclass
class RunsTab:
    tab: gr.Tab
    selected: gr.Dropdown
    clone_btn: gr.Button
    deploy_btn: gr.Button
    deployed: gr.State
    timer: gr.Timer
    show_run: Any  # (run_id) -> updates of [selected, table] followed by the run view
    show_outputs: list[Any]


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = round(seconds)
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def run_rows(runs: list[Any], progress: dict[int, dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in runs:
        p = progress.get(r.id, {})
        step, total = p.get("step"), p.get("max_steps")
        frac = (
            f"{step}/{total} ({100 * step / total:.0f}%)" if step is not None and total else (str(step or ""))
        )
        loss = p.get("loss")
        rows.append(
            [
                r.id,
                r.name,
                r.stage,
                r.fine_tuning,
                f"{STATUS_ICONS.get(r.status, '')} {r.status}",
                frac,
                f"{loss:.4f}" if loss is not None else "",
                _eta(p.get("eta_s")) if r.status == "running" else "",
                fmt_time(r.created_at),
            ]
        )
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def export_rows(items: list[Any]) -> pd.DataFrame:
    """Exports of a run; PTQ ones carry perplexity before and after quantization."""
    rows = []
    for e in items:
        ppl = e.perplexity or {}
        shown = ", ".join(
            f"{k} {v:+.2%}" if k == "relative_change" else f"{k} {v:.3f}" for k, v in ppl.items()
        )
        status = f"{STATUS_ICONS.get(e.status, '')} {e.status}" + (
            f": {e.error.splitlines()[-1][:120]}" if e.error else ""
        )
        rows.append([e.id, e.layout, e.quantization or "—", status, shown, e.export_dir])
    return pd.DataFrame(rows, columns=EXPORT_COLUMNS)


def run_choices(runs: list[Any]) -> list[tuple[str, int]]:
    return [(f"#{r.id} {r.name} · {r.status}", r.id) for r in runs]


def status_markdown(run: Any, p: dict[str, Any], position: int | None) -> str:
    icon = STATUS_ICONS.get(run.status, "")
    parts = [f"### {icon} #{run.id} {run.name} — {run.status}"]
    line = [f"stage **{run.stage}** · {run.fine_tuning}", f"base `{run.base_model}`"]
    if p.get("step") is not None:
        total = p.get("max_steps")
        line.append(f"step **{p['step']}**" + (f" / {total}" if total else ""))
    if run.status == "running" and p.get("eta_s") is not None:
        line.append(f"ETA {_eta(p['eta_s'])}")
    if run.status == "queued" and position:
        line.append(f"queue position **{position}**")
    if run.attempt and run.attempt > 1:
        line.append(f"attempt {run.attempt}")
    parts.append(" · ".join(line))
    if run.error:
        parts.append(f"\n❌ `{run.error.strip().splitlines()[-1][:400]}`")
    if run.model_dir:
        parts.append(f"\nmodel: `{run.model_dir}`")
    return "\n".join(parts)


def _pick(current: Any, saved: Any, request: gr.Request | None) -> int | None:
    """The run to show: the dropdown's, else the one in browser storage, else ?run=N."""
    url_run = request.query_params.get("run") if request else None
    return parse_id(current) or parse_id(saved) or parse_id(url_run)


def _queue_position(session: Any, run_id: int) -> int | None:
    return runs_svc.queue_position(session, runs_svc.get_run(session, run_id))


def _log_tail(session: Any, settings: Any, run_id: int) -> str:
    """The last LOG_TAIL_BYTES of the run's log, starting at a line boundary."""
    size = runs_svc.read_logs(session, settings, run_id, offset=0, limit=1)["size"]
    start = max(size - LOG_TAIL_BYTES, 0)
    text = runs_svc.read_logs(session, settings, run_id, offset=start, limit=LOG_TAIL_BYTES)["text"]
    lines = text.splitlines()[1:] if start else text.splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def build_runs_tab(ctx: UIContext, selected_state: gr.BrowserState) -> RunsTab:
    t = ctx.texts
    with t.make(gr.Tab, "tab.runs", id="runs") as tab:
        deployed = gr.State(None)  # inside the tab: see train_tab
        shown_choices = gr.State(None)
        current_run = gr.State(None)  # the run the last tick resolved (the dropdown may be skipped)
        timer = gr.Timer(POLL_SECONDS, active=True)
        table = t.make(
            gr.Dataframe,
            "runs.table",
            headers=RUN_COLUMNS,
            interactive=False,
            elem_id="runs-table",
            max_height=240,
        )
        with gr.Row():
            selected = t.make(gr.Dropdown, "runs.select", choices=[], elem_id="runs-select", scale=3)
            cancel = t.make(
                gr.Button, "runs.cancel", prop="value", size="sm", variant="stop", elem_id="runs-cancel"
            )
            resume = t.make(gr.Button, "runs.resume", prop="value", size="sm", elem_id="runs-resume")
            clone = t.make(gr.Button, "runs.clone", prop="value", size="sm", elem_id="runs-clone")
            delete = t.make(gr.Button, "runs.delete", prop="value", size="sm", elem_id="runs-delete")
        status = gr.Markdown("", elem_id="runs-status")
        with gr.Row():
            loss_plot = t.make(gr.LinePlot, "runs.loss", x="step", y="value", height=260, elem_id="runs-loss")
            lr_plot = t.make(gr.LinePlot, "runs.lr", x="step", y="value", height=260, elem_id="runs-lr")
        with gr.Row():
            tps_plot = t.make(
                gr.LinePlot,
                "runs.throughput",
                x="step",
                y="value",
                height=260,
                elem_id="runs-tps",
            )
            extra_plot = t.make(
                gr.LinePlot,
                "runs.extra",
                x="step",
                y="value",
                color="series",
                height=260,
                elem_id="runs-extra",
            )
        with gr.Row():
            with gr.Column(scale=3):
                # A Textbox (not Code) because it keeps the newest line in view as the tail grows.
                logs = t.make(
                    gr.Textbox,
                    "runs.logs",
                    interactive=False,
                    lines=LOG_TAIL_LINES,
                    max_lines=LOG_TAIL_LINES,
                    autoscroll=True,
                    elem_id="runs-logs",
                )
            with gr.Column(scale=2):
                checkpoints = t.make(
                    gr.Dataframe,
                    "runs.checkpoints",
                    headers=CHECKPOINT_COLUMNS,
                    interactive=False,
                    elem_id="runs-checkpoints",
                    max_height=200,
                )
                with t.make(gr.Accordion, "runs.export", open=False):
                    export_kind = t.make(
                        gr.Dropdown,
                        "runs.export_kind",
                        choices=EXPORT_KINDS,
                        value=EXPORT_KINDS[0],
                        elem_id="runs-export-kind",
                    )
                    export_btn = t.make(
                        gr.Button, "runs.export_btn", prop="value", size="sm", elem_id="runs-export-btn"
                    )
                    exports = t.make(
                        gr.Dataframe,
                        "runs.exports",
                        headers=EXPORT_COLUMNS,
                        interactive=False,
                        wrap=True,
                        elem_id="runs-exports",
                        max_height=200,
                    )
                deploy = t.make(
                    gr.Button, "runs.deploy_btn", prop="value", variant="primary", elem_id="runs-deploy"
                )
                action = gr.Markdown("", elem_id="runs-action")
        with t.make(gr.Accordion, "runs.config", open=False):
            config_view = gr.Code(language="json", show_label=False, elem_id="runs-config")

    def refresh_table(current: Any) -> tuple[Any, pd.DataFrame]:
        runs = ctx.read(runs_svc.list_runs, default=[])
        progress = ctx.read(progress_svc.runs_progress, [r.id for r in runs], default={})
        ids = {r.id for r in runs}
        keep = parse_id(current)
        value = keep if keep in ids else None
        return gr.update(choices=run_choices(runs), value=value), run_rows(runs, progress)

    def tick_table(current: Any, saved: Any, shown: list | None, request: gr.Request) -> tuple[Any, ...]:
        # A tick reads the dropdown as it was when the tick started, so it never sets the value of a
        # dropdown that has one (a click or a launch may have changed it since); it fills an empty one from
        # browser storage or ?run=N, and it only sends choices that changed (an update closes an open list).
        update, rows = refresh_table(_pick(current, saved, request))
        sig = [list(c) for c in update["choices"]]
        if parse_id(current) is not None:
            update.pop("value", None)
            out = gr.skip() if sig == shown else update
        else:
            out = update
        return out, rows, sig, update.get("value", parse_id(current))

    empty = charts.empty_frame()

    def blank_view(message: str = "") -> tuple[Any, ...]:
        no_points = gr.update(value=empty, visible=False)
        off = gr.update(interactive=False)
        return (
            message,
            empty,
            empty,
            empty,
            no_points,
            "",
            pd.DataFrame(columns=CHECKPOINT_COLUMNS),
            "",
            off,
            off,
            off,
            pd.DataFrame(columns=EXPORT_COLUMNS),
        )

    def run_view(run_id: Any) -> tuple[Any, ...]:
        rid = parse_id(run_id)
        if rid is None:
            return blank_view()
        run = ctx.read(runs_svc.get_run, rid, default=None)
        if run is None:
            return blank_view(f"run #{rid} no longer exists")
        rows = [m.values for m in ctx.read(runs_svc.get_metrics, rid, default=[])]
        p = ctx.read(progress_svc.runs_progress, [rid], default={}).get(rid, {})
        position = ctx.read(_queue_position, rid, default=None) if run.status == "queued" else None
        extras = charts.extra_metric_names(rows)
        tail = ctx.read(_log_tail, ctx.settings, rid, default="")
        ckpts = pd.DataFrame(
            [
                [c.step, c.path, fmt_time(c.created_at)]
                for c in ctx.read(runs_svc.list_checkpoints, rid, default=[])
            ],
            columns=CHECKPOINT_COLUMNS,
        )
        active = run.status in ("queued", "running")
        # The step axis spans the whole run, so a live curve shows how far along it is.
        x_lim = [0, p["max_steps"]] if p.get("max_steps") else None
        return (
            status_markdown(run, p, position),
            gr.update(value=charts.metric_frame(rows, ["loss"]), x_lim=x_lim),
            gr.update(value=charts.metric_frame(rows, ["learning_rate"]), x_lim=x_lim),
            gr.update(value=charts.metric_frame(rows, ["tokens_per_second"]), x_lim=x_lim),
            gr.update(value=charts.metric_frame(rows, extras), visible=bool(extras), x_lim=x_lim),
            tail,
            ckpts,
            json.dumps(run.config, indent=2, ensure_ascii=False),
            gr.update(interactive=active),
            gr.update(interactive=run.status in ("failed", "cancelled")),
            gr.update(interactive=run.status == "succeeded"),
            export_rows(ctx.read(exports_svc.list_exports, rid, default=[])),
        )

    view_outputs = [
        status,
        loss_plot,
        lr_plot,
        tps_plot,
        extra_plot,
        logs,
        checkpoints,
        config_view,
        cancel,
        resume,
        deploy,
        exports,
    ]

    def act(fn: Any, verb: str) -> Any:
        def handler(run_id: Any) -> str:
            rid = parse_id(run_id)
            if rid is None:
                raise gr.Error("Pick a run first.")
            ctx.call(fn, ctx.settings, rid)
            return f"{verb} run #{rid}."

        return handler

    def delete_run(run_id: Any) -> tuple[str, Any, pd.DataFrame]:
        rid = parse_id(run_id)
        if rid is None:
            raise gr.Error("Pick a run first.")
        ctx.call(runs_svc.delete_run, ctx.settings, rid)
        update, rows = refresh_table(None)
        return f"Deleted run #{rid}.", update, rows

    def export(run_id: Any, kind: str) -> str:
        rid = parse_id(run_id)
        if rid is None:
            raise gr.Error("Pick a run first.")
        job = ctx.call(runs_svc.create_export, ctx.settings, rid, **EXPORT_OPTIONS[kind])
        return f"Export #{job.id} ({kind}) queued; its model appears under base models when it is done."

    def deploy_run(run_id: Any) -> tuple[str, Any]:
        rid = parse_id(run_id)
        if rid is None:
            raise gr.Error("Pick a finished run first.")
        dep = ctx.call(
            deployments_svc.create_deployment, ctx.settings, deployments_svc.DeploymentSpec(run_id=rid)
        )
        return f"Deployment #{dep.id} starting; chat with it in Deploy & Chat.", dep.id

    timer.tick(
        tick_table,
        [selected, selected_state, shown_choices],
        [selected, table, shown_choices, current_run],
        show_progress="hidden",
    ).then(run_view, current_run, view_outputs, show_progress="hidden")
    selected.input(run_view, selected, view_outputs)
    # However the run got selected (a click, a launch, a restore), the URL and browser storage follow it.
    selected.change(lambda r: r, selected, selected_state, show_progress="hidden").then(
        None, selected, None, js=URL_JS
    )
    cancel.click(act(runs_svc.cancel_run, "Cancelling"), selected, action)
    resume.click(act(runs_svc.resume_run, "Resumed"), selected, action)
    delete.click(delete_run, selected, [action, selected, table])
    export_btn.click(export, [selected, export_kind], action)
    deploy.click(deploy_run, selected, [action, deployed])

    def restore(saved: Any, request: gr.Request) -> tuple[Any, pd.DataFrame]:
        wanted = request.query_params.get("run") if request else None
        return refresh_table(parse_id(wanted) or parse_id(saved))

    quiet = {"show_progress": "hidden"}
    ctx.demo.load(restore, selected_state, [selected, table], **quiet).then(
        run_view, selected, view_outputs, **quiet
    )

    # Selecting the tab (also done programmatically on load, racing the restore) keeps any known run.
    def on_select(current: Any, saved: Any, request: gr.Request) -> tuple[Any, pd.DataFrame]:
        return refresh_table(_pick(current, saved, request))

    tab.select(
        on_select,
        [selected, selected_state],
        [selected, table],
        **quiet,
    ).then(run_view, selected, view_outputs, **quiet)

    def show_run(run_id: Any) -> tuple[Any, ...]:
        return (*refresh_table(run_id), *run_view(run_id))

    return RunsTab(
        tab=tab,
        selected=selected,
        clone_btn=clone,
        deploy_btn=deploy,
        deployed=deployed,
        timer=timer,
        show_run=show_run,
        show_outputs=[selected, table, *view_outputs],
    )
