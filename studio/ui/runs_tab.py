"""Runs tab: the run table and a live run view (curves, log tail, checkpoints, actions, export, deploy).

Everything shown is read back from the store on every tick, so a refresh or a reconnect shows the same
live state; the selected run survives in the URL (``?run=N``) and in browser storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from engine.train.export_config import ExportConfig
from engine.train.options import field_info
from studio.services import deployments as deployments_svc
from studio.services import exports as exports_svc
from studio.services import progress as progress_svc
from studio.services import runs as runs_svc
from studio.services.exports import export_default
from studio.services.run_parts import placement_of
from studio.ui.context import SentValues, UIContext, echo, parse_id, refusal
from studio.ui.i18n import current_language, text
from studio.ui.run_views import (
    CHECKPOINT_COLUMNS,
    EXPORT_COLUMNS,
    FAMILY_COLUMNS,
    RUN_COLUMNS,
    blank_view,
    family_points,
    gguf_choices,
    member_of_row,
    run_choices,
    run_rows,
    view_of,
)

EXPORT_OPTIONS: dict[str, dict[str, Any]] = {
    "merge LoRA (paddle layout)": {"layout": "paddle"},
    "merge LoRA (hf layout)": {"layout": "hf"},
    "PTQ wint8": {"layout": "paddle", "ptq": "wint8"},
    "PTQ wint4": {"layout": "paddle", "ptq": "wint4"},
    "GGUF f16 + q8_0 (llama.cpp / Ollama)": {"export_format": "gguf", "gguf_types": ["f16", "q8_0"]},
    "GGUF f16 + q8_0 + q4_K_M (llama.cpp / Ollama)": {
        "export_format": "gguf",
        "gguf_types": ["f16", "q8_0", "q4_K_M"],
    },
}
EXPORT_KINDS = list(EXPORT_OPTIONS)
# The export box offers the engine's own choices and default (ExportConfig).
EXPORT_DTYPES = list(field_info(ExportConfig, "dtype")["choices"])
LOG_TAIL_BYTES = 16384
LOG_TAIL_LINES = 20
POLL_SECONDS = 2.0

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


class RunsHandlers:
    """The Runs tab's event handlers: dropdown values and browser state in, plain values out."""

    def __init__(self, ctx: UIContext):
        self.ctx = ctx
        self._sent = SentValues()

    def refresh_table(self, current: Any) -> tuple[Any, pd.DataFrame]:
        """Run choices (keeping ``current`` when it still exists) and the table rows."""
        ctx = self.ctx
        runs = ctx.read(runs_svc.list_runs, default=[])
        progress = ctx.read(progress_svc.runs_progress, [r.id for r in runs], default={})
        keep = parse_id(current)
        value = keep if keep in {r.id for r in runs} else None
        lang = current_language()
        return gr.update(choices=run_choices(runs, lang), value=value), run_rows(runs, progress, lang)

    def relabel_table(self, current: Any) -> tuple[Any, pd.DataFrame]:
        """As :meth:`refresh_table` without touching the dropdown's value (after a language switch)."""
        update, rows = self.refresh_table(current)
        update.pop("value", None)
        return update, rows

    def tick_table(
        self, current: Any, saved: Any, shown: list | None, request: gr.Request
    ) -> tuple[Any, ...]:
        """The timer's refresh: (dropdown, table, choices now shown, run to show)."""
        # A tick reads the dropdown as it was when the tick started, so it never sets the value of a
        # dropdown that has one (a click or a launch may have changed it since); it fills an empty one from
        # browser storage or ?run=N, and it only sends choices that changed (an update closes an open list).
        update, rows = self.refresh_table(_pick(current, saved, request))
        sig = [list(c) for c in update["choices"]]
        if parse_id(current) is not None:
            update.pop("value", None)
            out = gr.skip() if sig == shown else update
        else:
            out = update
        return out, rows, sig, update.get("value", parse_id(current))

    def tick(self, current: Any, saved: Any, shown: list | None, request: gr.Request) -> tuple[Any, ...]:
        """The timer's refresh in one event: (dropdown, table, choices now shown, *run view), each value only
        when it differs from what this session's last tick sent."""
        selected, rows, sig, run = self.tick_table(current, saved, shown, request)
        return self._sent.changed(request, (selected, rows, sig, *self._view(run)))

    def restore(self, saved: Any, request: gr.Request) -> tuple[Any, pd.DataFrame]:
        """On page load: the run in ?run=N, else the one in browser storage."""
        self._sent.forget(request)
        wanted = request.query_params.get("run") if request else None
        return self.refresh_table(parse_id(wanted) or parse_id(saved))

    def on_select(self, current: Any, saved: Any, request: gr.Request) -> tuple[Any, pd.DataFrame]:
        """Selecting the tab (also done programmatically on load, racing the restore) keeps any known run. As
        a tick, it never sets the value of a dropdown that has one: it read the dropdown when the click came,
        and a launch's own selection of its run may land first (the Runs tab, opened right after Launch,
        showed the previous run for good); a run that is gone is cleared."""
        self._sent.forget(request)
        update, rows = self.refresh_table(_pick(current, saved, request))
        if parse_id(current) is not None and update["value"] == parse_id(current):
            update.pop("value")
        return update, rows

    def run_view(self, run_id: Any, request: gr.Request | None = None) -> tuple[Any, ...]:
        """Everything the run view shows for ``run_id``, in ``VIEW_PARTS`` order."""
        self._sent.forget(request)
        return self._view(run_id)

    def _view(self, run_id: Any) -> tuple[Any, ...]:
        rid = parse_id(run_id)
        if rid is None:
            return blank_view()
        ctx = self.ctx
        run = ctx.read(runs_svc.get_run, rid, default=None)
        if run is None:
            return blank_view(text("runs.msg.gone", current_language(), id=rid))
        position = ctx.read(_queue_position, rid, default=None) if run.status == "queued" else None
        return view_of(
            run,
            [m.values for m in ctx.read(runs_svc.get_metrics, rid, default=[])],
            ctx.read(progress_svc.runs_progress, [rid], default={}).get(rid, {}),
            position,
            ctx.read(_log_tail, ctx.settings, rid, default=""),
            ctx.read(runs_svc.list_checkpoints, rid, default=[]),
            ctx.read(exports_svc.list_exports, rid, default=[]),
            ctx.read(exports_svc.family_of, rid, default=None),
            current_language(),
            ctx.read(placement_of, rid, default=[]),
        )

    def show_run(self, run_id: Any, request: gr.Request | None = None) -> tuple[Any, ...]:
        """Select ``run_id`` and show it: (dropdown, table, *run view)."""
        return (*self.refresh_table(run_id), *self.run_view(run_id, request))

    def cancel(self, run_id: Any) -> str:
        rid = self._call_on_run(runs_svc.cancel_run, run_id)
        return text("runs.msg.cancelling", current_language(), id=rid)

    def resume(self, run_id: Any) -> str:
        rid = self._call_on_run(runs_svc.resume_run, run_id)
        return text("runs.msg.resumed", current_language(), id=rid)

    def delete(self, run_id: Any, request: gr.Request | None = None) -> tuple[str, Any, pd.DataFrame]:
        rid = self._call_on_run(runs_svc.delete_run, run_id)
        self._sent.forget(request)
        update, rows = self.refresh_table(None)
        return text("runs.msg.deleted", current_language(), id=rid), update, rows

    def export(
        self,
        run_id: Any,
        kind: str,
        dtype: str | None = None,
        max_shard_size: str | None = None,
        member: str | None = None,
    ) -> str:
        """Queue an export; dtype and shard size apply to unquantized exports (PTQ writes its own);
        ``member`` cuts that member of an elastic run's family out."""
        rid = _required(run_id, "runs.err.no_run")
        options = dict(EXPORT_OPTIONS[kind])
        if not options.get("ptq") and not options.get("export_format"):
            options.update(dtype=dtype or None, max_shard_size=(max_shard_size or "").strip() or None)
        member = (member or "").strip()
        job = self.ctx.call(runs_svc.create_export, self.ctx.settings, rid, elastic_member=member, **options)
        lang = current_language()
        what = text("runs.msg.member", lang, kind=kind, member=member) if member else kind
        key = (
            "runs.msg.gguf_export_queued"
            if options.get("export_format") == "gguf"
            else "runs.msg.export_queued"
        )
        return text(key, lang, id=job.id, kind=what)

    def deploy_member(self, run_id: Any, member: str | None) -> str:
        """One click: export the picked member of the family and deploy it once written (the worker chains
        the two; the family table shows exporting -> deploying -> running)."""
        rid = _required(run_id, "runs.err.no_run")
        member = (member or "").strip()
        if not member:
            raise refusal(text("runs.err.no_member", current_language()))
        job = self.ctx.call(exports_svc.deploy_member, self.ctx.settings, rid, member)
        return text("runs.msg.member_deploy_queued", current_language(), id=job.id, member=member)

    def pick_member(self, family: pd.DataFrame, evt: gr.SelectData) -> str:
        """A click on the family table names that row's member for the export."""
        return member_of_row(family, evt.index[0] if isinstance(evt.index, list | tuple) else evt.index)

    def deploy(self, run_id: Any) -> tuple[str, int]:
        """Start serving a finished run; returns the message and the new deployment's id."""
        rid = _required(run_id, "runs.err.no_finished_run")
        spec = deployments_svc.DeploymentSpec(run_id=rid)
        dep = self.ctx.call(deployments_svc.create_deployment, self.ctx.settings, spec)
        return text("runs.msg.deploying", current_language(), id=dep.id), dep.id

    def deploy_gguf(self, run_id: Any, picked: str | None) -> tuple[str, int]:
        """Serve a GGUF file of the run's exports with llama.cpp (the newest export's q8_0 when none is
        picked); returns the message and the new deployment's id."""
        rid = _required(run_id, "runs.err.no_run")
        if not picked:
            choices = gguf_choices(self.ctx.read(exports_svc.list_exports, rid, default=[]))
            if not choices:
                raise refusal(text("runs.err.no_gguf", current_language()))
            served = [v for _, v in choices if v.endswith(":q8_0")]
            picked = (served or [choices[0][1]])[0]
        export_id, _, gguf_type = picked.partition(":")
        spec = deployments_svc.DeploymentSpec(
            export_id=int(export_id), gguf_type=gguf_type, backend="llamacpp"
        )
        dep = self.ctx.call(deployments_svc.create_deployment, self.ctx.settings, spec)
        return text("runs.msg.deploying_gguf", current_language(), id=dep.id, type=gguf_type), dep.id

    def _call_on_run(self, fn: Any, run_id: Any) -> int:
        rid = _required(run_id, "runs.err.no_run")
        self.ctx.call(fn, self.ctx.settings, rid)
        return rid


def _required(run_id: Any, message_key: str) -> int:
    rid = parse_id(run_id)
    if rid is None:
        raise refusal(text(message_key, current_language()))
    return rid


# ---- layout ----------------------------------------------------------------------------------------------


@dataclass
class _RunView:
    """The components ``run_view`` fills, plus the buttons and export controls beside them."""

    status: gr.Markdown
    loss: gr.LinePlot
    lr: gr.LinePlot
    tps: gr.LinePlot
    extra: gr.LinePlot
    logs: gr.Textbox
    checkpoints: gr.Dataframe
    config: gr.Code
    cancel: gr.Button
    resume: gr.Button
    deploy: gr.Button
    exports: gr.Dataframe
    export_kind: gr.Dropdown
    export_dtype: gr.Dropdown
    export_shard: gr.Textbox
    export_btn: gr.Button
    export_member: gr.Textbox
    member_deploy: gr.Button
    family: gr.Dataframe
    family_plot: gr.ScatterPlot
    gguf_pick: gr.Dropdown
    gguf_deploy: gr.Button
    action: gr.Markdown

    @property
    def outputs(self) -> list[Any]:
        """In the order ``run_view`` returns its values."""
        return [getattr(self, name) for name in VIEW_PARTS]


VIEW_PARTS = (
    "status",
    "loss",
    "lr",
    "tps",
    "extra",
    "logs",
    "checkpoints",
    "config",
    "cancel",
    "resume",
    "deploy",
    "exports",
    "family",
    "family_plot",
    "gguf_pick",
)


def _plot(t: Any, key: str, elem_id: str, color_title: str | None = None, **kwargs: Any) -> gr.LinePlot:
    titles = {"x_title": "plot.step", "y_title": "plot.value"}
    if color_title:
        titles["color_title"] = color_title
    return t.make(gr.LinePlot, key, x="step", y="value", height=260, elem_id=elem_id, also=titles, **kwargs)


def _action_row(t: Any) -> tuple[gr.Dropdown, dict[str, gr.Button]]:
    with gr.Row():
        selected = t.make(gr.Dropdown, "runs.select", choices=[], elem_id="runs-select", scale=3)
        buttons = {
            "cancel": t.make(
                gr.Button, "runs.cancel", prop="value", size="sm", variant="stop", elem_id="runs-cancel"
            ),
            "resume": t.make(gr.Button, "runs.resume", prop="value", size="sm", elem_id="runs-resume"),
            "clone": t.make(gr.Button, "runs.clone", prop="value", size="sm", elem_id="runs-clone"),
            "delete": t.make(gr.Button, "runs.delete", prop="value", size="sm", elem_id="runs-delete"),
        }
    return selected, buttons


def _plots(t: Any) -> dict[str, gr.LinePlot]:
    with gr.Row():
        loss = _plot(t, "runs.loss", "runs-loss")
        lr = _plot(t, "runs.lr", "runs-lr")
    with gr.Row():
        tps = _plot(t, "runs.throughput", "runs-tps")
        extra = _plot(t, "runs.extra", "runs-extra", color="series", color_title="plot.series")
    return {"loss": loss, "lr": lr, "tps": tps, "extra": extra}


def _export_box(t: Any) -> dict[str, Any]:
    with t.make(gr.Accordion, "runs.export", open=False):
        kind = t.make(
            gr.Dropdown,
            "runs.export_kind",
            choices=EXPORT_KINDS,
            value=EXPORT_KINDS[0],
            elem_id="runs-export-kind",
        )
        with gr.Row():
            dtype = t.make(
                gr.Dropdown, "runs.export_dtype", choices=EXPORT_DTYPES, value=export_default("dtype"),
                elem_id="runs-export-dtype",
            )  # fmt: skip
            shard = t.make(
                gr.Textbox, "runs.export_shard", value=export_default("max_shard_size"), max_lines=1,
                elem_id="runs-export-shard",
            )  # fmt: skip
        # An elastic run's family (engine.train.elastic): a click on a row names its member for the export.
        family = t.make(
            gr.Dataframe,
            "runs.family",
            headers=FAMILY_COLUMNS,
            interactive=False,
            visible=False,
            elem_id="runs-family",
            max_height=240,
        )
        family_plot = t.make(
            gr.ScatterPlot,
            "runs.family_plot",
            value=family_points(None),
            x="active weights (M)",
            y="eval loss",
            color="member",
            height=280,
            visible=False,
            elem_id="runs-family-plot",
        )
        with gr.Row(equal_height=True):
            member = t.make(
                gr.Textbox, "runs.export_member", value="", max_lines=1, elem_id="runs-export-member", scale=3
            )
            member_deploy = t.make(
                gr.Button,
                "runs.member_deploy",
                prop="value",
                size="sm",
                elem_id="runs-member-deploy",
                scale=1,
            )
        button = t.make(gr.Button, "runs.export_btn", prop="value", size="sm", elem_id="runs-export-btn")
        table = t.make(
            gr.Dataframe,
            "runs.exports",
            headers=EXPORT_COLUMNS,
            interactive=False,
            wrap=True,
            elem_id="runs-exports",
            max_height=200,
        )
        with gr.Row(equal_height=True):
            pick = t.make(gr.Dropdown, "runs.gguf_pick", choices=[], elem_id="runs-gguf-pick", scale=3)
            gguf_deploy = t.make(
                gr.Button, "runs.gguf_deploy", prop="value", size="sm", elem_id="runs-gguf-deploy", scale=1
            )
    return {
        "gguf_pick": pick,
        "gguf_deploy": gguf_deploy,
        "export_kind": kind,
        "export_dtype": dtype,
        "export_shard": shard,
        "export_btn": button,
        "export_member": member,
        "member_deploy": member_deploy,
        "family": family,
        "family_plot": family_plot,
        "exports": table,
    }


def _logs_and_artifacts(t: Any) -> dict[str, Any]:
    """Log tail on the left; checkpoints, exports and the deploy button on the right."""
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
                wrap=True,
                max_height=200,
            )
            export = _export_box(t)
            deploy = t.make(
                gr.Button, "runs.deploy_btn", prop="value", variant="primary", elem_id="runs-deploy"
            )
            action = gr.Markdown("", elem_id="runs-action")
    return {"logs": logs, "checkpoints": checkpoints, **export, "deploy": deploy, "action": action}


def build_runs_tab(ctx: UIContext, selected_state: gr.BrowserState) -> RunsTab:
    """Lay out the Runs tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.runs", id="runs") as tab:
        deployed = gr.State(None)  # inside the tab: see train_tab
        shown_choices = gr.State(None)
        timer = gr.Timer(POLL_SECONDS, active=True)
        table = t.make(
            gr.Dataframe,
            "runs.table",
            headers=RUN_COLUMNS,
            interactive=False,
            elem_id="runs-table",
            wrap=True,
            max_height=240,
        )
        selected, buttons = _action_row(t)
        status = gr.Markdown("", elem_id="runs-status")
        plots = _plots(t)
        parts = _logs_and_artifacts(t)
        with t.make(gr.Accordion, "runs.config", open=False):
            config = gr.Code(language="json", show_label=False, elem_id="runs-config")
    view = _RunView(
        status=status, config=config, cancel=buttons["cancel"], resume=buttons["resume"], **plots, **parts
    )
    h = RunsHandlers(ctx)
    quiet: dict[str, Any] = {"show_progress": "hidden"}
    # A tick every 2 s: its status is kept on the table alone (each target costs the page a lookup at every
    # status change of every event; see studio.ui.narrow_progress).
    timer.tick(
        h.tick,
        [selected, selected_state, shown_choices],
        [selected, table, shown_choices, *view.outputs],
        show_progress_on=table,
        **quiet,
    )
    selected.input(h.run_view, selected, view.outputs)
    # However the run got selected (a click, a launch, a restore), the URL and browser storage follow it.
    selected.change(echo, selected, selected_state, **quiet).then(None, selected, None, js=URL_JS)
    buttons["cancel"].click(h.cancel, selected, view.action)
    buttons["resume"].click(h.resume, selected, view.action)
    buttons["delete"].click(h.delete, selected, [view.action, selected, table])
    export_inputs = [selected, view.export_kind, view.export_dtype, view.export_shard, view.export_member]
    view.export_btn.click(h.export, export_inputs, view.action)
    view.family.select(h.pick_member, view.family, view.export_member)
    view.member_deploy.click(h.deploy_member, [selected, view.export_member], view.action)
    view.deploy.click(h.deploy, selected, [view.action, deployed])
    view.gguf_deploy.click(h.deploy_gguf, [selected, view.gguf_pick], [view.action, deployed])
    ctx.demo.load(h.restore, selected_state, [selected, table], **quiet).then(
        h.run_view, selected, view.outputs, **quiet
    )
    tab.select(h.on_select, [selected, selected_state], [selected, table], **quiet).then(
        h.run_view, selected, view.outputs, **quiet
    )
    # After a language switch the statuses and messages are made again in the new language.
    ctx.on_language(h.relabel_table, selected, [selected, table])
    ctx.on_language(h.run_view, selected, view.outputs)
    return RunsTab(
        tab=tab,
        selected=selected,
        clone_btn=buttons["clone"],
        deploy_btn=view.deploy,
        deployed=deployed,
        timer=timer,
        show_run=h.show_run,
        show_outputs=[selected, table, *view.outputs],
    )
