"""Sweeps tab: every sweep, and one sweep's leaderboard (each trial's keys, objective and state), its
objective over the trials, Optuna's parameter importances, cancel, and "promote best", which deploys the best
trial's run and opens Deploy & Chat on it. Read back from the store by a timer that runs only while this tab
shows, sending only what changed; the sweep shown is the one picked, else ``?sweep=N``, else the newest."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from studio.services import deployments as deployments_svc
from studio.services import sweeps as sweeps_svc
from studio.ui import charts
from studio.ui.context import SentValues, UIContext, fmt_time, parse_id, refusal
from studio.ui.i18n import DEFAULT_LANGUAGE, current_language, status_text, text
from studio.ui.run_views import shown_status
from studio.ui.runs_tab import POLL_SECONDS

SWEEP_COLUMNS = ["id", "name", "status", "trials", "objective", "created"]
TRIAL_COLUMNS = ["trial", "params", "objective", "trial state", "step", "run"]
# Keeps ?sweep=N in the address bar in step with the pick, so a refresh or a shared link shows the same sweep.
URL_JS = """(sweepId) => {
  const url = new URL(window.location.href);
  if (sweepId === null || sweepId === undefined || sweepId === "") { url.searchParams.delete("sweep"); }
  else { url.searchParams.set("sweep", String(sweepId)); }
  window.history.replaceState(null, "", url.toString());
  return sweepId;
}"""
TRIAL_ICONS = {"running": "🏃", "complete": "✅", "pruned": "✂️", "fail": "❌", "waiting": "⏳"}


@dataclass
class SweepsTab:
    tab: gr.Tab
    selected: gr.Dropdown
    deployed: gr.State
    timer: gr.Timer
    show_sweep: Any  # (sweep_id) -> updates of [selected, table, *view]
    show_outputs: list[Any]


# ---- plain functions -------------------------------------------------------------------------------------


def trial_state(state: str, lang: str = DEFAULT_LANGUAGE) -> str:
    return f"{TRIAL_ICONS.get(state, '')} {status_text(state, lang)}"


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_number(v)}" for k, v in params.items())


def ordered_trials(trials: list[dict[str, Any]], direction: str) -> list[dict[str, Any]]:
    """The leaderboard: completed trials best first, then running ones, then the rest by number."""
    done = sorted(
        (t for t in trials if t["state"] == "complete" and t["value"] is not None),
        key=lambda t: t["value"],
        reverse=direction == "maximize",
    )
    running = [t for t in trials if t["state"] == "running"]
    rest = [t for t in trials if t not in done and t not in running]
    return [*done, *running, *rest]


def trial_rows(trials: list[dict[str, Any]], direction: str, lang: str = DEFAULT_LANGUAGE) -> pd.DataFrame:
    rows = []
    for t in ordered_trials(trials, direction):
        value = t["value"] if t["value"] is not None else t["last_value"]
        rows.append(
            [
                t["number"],
                params_text(t["params"]),
                _number(value) if value is not None else "",
                trial_state(t["state"], lang),
                t["last_step"] if t["last_step"] is not None else "",
                f"#{t['run_id']} {status_text(t['run_status'], lang)}" if t["run_id"] else "",
            ]
        )
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


def sweep_rows(sweeps: list[Any], lang: str = DEFAULT_LANGUAGE) -> pd.DataFrame:
    rows = [
        [
            s.id,
            s.name,
            shown_status(s.status, lang),
            s.settings.get("n_trials", ""),
            s.settings.get("objective", ""),
            fmt_time(s.created_at),
        ]
        for s in sweeps
    ]
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)


def sweep_choices(sweeps: list[Any], lang: str = DEFAULT_LANGUAGE) -> list[tuple[str, int]]:
    return [(f"#{s.id} {s.name} ({status_text(s.status, lang)})", s.id) for s in sweeps]


def summary_markdown(sweep: Any, trials: list[dict[str, Any]], lang: str = DEFAULT_LANGUAGE) -> str:
    """The sweep's state, what it optimises, its trials so far and its best, why it stopped."""
    s = sweep.settings
    counts = {state: sum(t["state"] == state for t in trials) for state in TRIAL_ICONS}
    board = ordered_trials(trials, s["direction"])
    best = board[0] if board and board[0]["state"] == "complete" else None
    lines = [
        text(
            "swp.summary",
            lang,
            id=sweep.id,
            name=sweep.name,
            status=shown_status(sweep.status, lang),
            objective=s["objective"],
            direction=s["direction"],
            n=len(trials),
            total=s["n_trials"],
            complete=counts["complete"],
            pruned=counts["pruned"],
            running=counts["running"],
            sampler=s["sampler"],
            pruner=s["pruner"],
        )
    ]
    if best is not None:
        lines.append(
            text(
                "swp.best",
                lang,
                trial=best["number"],
                value=_number(best["value"]),
                params=params_text(best["params"]),
            )
        )
    if sweep.stop_reason:
        lines.append(text("swp.stopped", lang, reason=sweep.stop_reason))
    if sweep.error:
        lines.append(f"❌ {sweep.error}")
    return "  \n".join(lines)


def objective_plot(trials: list[dict[str, Any]]) -> Any:
    """The objective over the trials, with room around the points (Vega puts the extremes on the frame, where
    two trials of one value were not seen at all)."""
    points = charts.trial_points(trials)
    if points.empty:
        return points
    lo, hi = float(points["objective"].min()), float(points["objective"].max())
    pad = max(hi - lo, abs(hi) * 0.02, 1e-3) * 0.15
    last = int(points["trial"].max())
    return gr.update(value=points, x_lim=[-0.5, last + 0.5], y_lim=[lo - pad, hi + pad])


def blank_view(message: str = "") -> tuple[Any, ...]:
    off = gr.update(interactive=False)
    return (
        message,
        pd.DataFrame(columns=TRIAL_COLUMNS),
        charts.trial_points([]),
        charts.importance_frame({}),
        "",
        off,
        off,
    )


# ---- event handlers --------------------------------------------------------------------------------------


class SweepsHandlers:
    """The Sweeps tab's handlers: the picked sweep in, plain values out (``VIEW`` order after the table)."""

    def __init__(self, ctx: UIContext):
        self.ctx = ctx
        self._sent = SentValues()
        # (sweep id, completed trials) -> importances: Optuna's evaluator fits on every call
        self._importances: dict[tuple[int, int], dict[str, float]] = {}

    def table(self, current: Any, request: gr.Request | None = None) -> tuple[Any, pd.DataFrame, int | None]:
        """(dropdown, table, sweep to show): choices always; a value only when none is picked (then
        ``?sweep=N`` or the newest), so a tick never undoes a pick made since it started."""
        sweeps = self.ctx.read(sweeps_svc.list_sweeps, default=[])
        lang = current_language()
        update = gr.update(choices=sweep_choices(sweeps, lang))
        picked = parse_id(current)
        if picked is None:
            wanted = parse_id(request.query_params.get("sweep")) if request else None
            ids = [s.id for s in sweeps]
            picked = wanted if wanted in ids else (ids[0] if ids else None)
            update["value"] = picked
        return update, sweep_rows(sweeps, lang), picked

    def view(self, sweep_id: Any) -> tuple[Any, ...]:
        sid = parse_id(sweep_id)
        if sid is None:
            return blank_view(text("swp.none", current_language()))
        ctx, lang = self.ctx, current_language()
        sweep = ctx.read(sweeps_svc.get_sweep, sid, default=None)
        if sweep is None:
            return blank_view(text("swp.gone", lang, id=sid))
        trials = ctx.read(sweeps_svc.trials, ctx.settings, sweep, default=[])
        complete = sum(t["state"] == "complete" for t in trials)
        key = (sid, complete)
        if key not in self._importances:
            self._importances = {key: ctx.read(sweeps_svc.param_importances, ctx.settings, sid, default={})}
        active = sweep.status in ("queued", "running")
        return (
            summary_markdown(sweep, trials, lang),
            trial_rows(trials, sweep.settings["direction"], lang),
            objective_plot(trials),
            charts.importance_frame(self._importances[key]),
            json.dumps({"parameters": sweep.parameters, **sweep.settings}, indent=2),
            gr.update(interactive=active),
            gr.update(interactive=complete > 0),
        )

    def tick(self, current: Any, request: gr.Request) -> tuple[Any, ...]:
        """The timer's refresh: (dropdown, table, *view), each only when it changed for this session."""
        update, rows, picked = self.table(current, request)
        return self._sent.changed(request, (update, rows, *self.view(picked)))

    def show(self, sweep_id: Any, request: gr.Request | None = None) -> tuple[Any, ...]:
        """Pick ``sweep_id`` (a pick, a launch from the Train tab): (dropdown, table, *view)."""
        self._sent.forget(request)
        update, rows, _ = self.table(None, None)
        update["value"] = parse_id(sweep_id)
        return (update, rows, *self.view(sweep_id))

    def opened(self, current: Any, request: gr.Request) -> tuple[Any, ...]:
        self._sent.forget(request)
        update, rows, picked = self.table(current, request)
        return (update, rows, *self.view(picked))

    def relabel(self, current: Any) -> tuple[Any, ...]:
        """After a language switch: choices, table and view in the new language (the pick kept)."""
        update, rows, picked = self.table(current)
        update.pop("value", None)
        return (update, rows, *self.view(picked))

    def cancel(self, sweep_id: Any) -> str:
        sid = _required(sweep_id)
        self.ctx.call(sweeps_svc.cancel_sweep, self.ctx.settings, sid)
        return text("swp.cancelling", current_language(), id=sid)

    def promote(self, sweep_id: Any) -> tuple[str, int]:
        """Deploy the best completed trial's run: (message, the deployment's id), which opens Deploy & Chat."""
        sid = _required(sweep_id)
        best = self.ctx.call(sweeps_svc.best_trial, self.ctx.settings, sid)
        spec = deployments_svc.DeploymentSpec(run_id=best["run_id"])
        dep = self.ctx.call(deployments_svc.create_deployment, self.ctx.settings, spec)
        lang = current_language()
        return text("swp.promoted", lang, trial=best["number"], run=best["run_id"], id=dep.id), dep.id


def _required(sweep_id: Any) -> int:
    sid = parse_id(sweep_id)
    if sid is None:
        raise refusal(text("swp.err.none", current_language()))
    return sid


# ---- layout ----------------------------------------------------------------------------------------------


def _view_parts(t: Any) -> dict[str, Any]:
    summary = gr.Markdown("", elem_id="swp-summary")
    board = t.make(
        gr.Dataframe, "swp.leaderboard", headers=TRIAL_COLUMNS, interactive=False, wrap=True,
        elem_id="swp-leaderboard", max_height=320,
    )  # fmt: skip
    with gr.Row():
        objective = t.make(
            gr.ScatterPlot, "swp.objective_plot", value=charts.trial_points([]), x="trial", y="objective",
            color="state", height=280, elem_id="swp-objective-plot",
        )  # fmt: skip
        importance = t.make(
            gr.BarPlot, "swp.importance", value=charts.importance_frame({}), x="parameter", y="importance",
            height=280, elem_id="swp-importance", sort="-y", y_lim=[0, 1],
        )  # fmt: skip
    with t.make(gr.Accordion, "swp.config", open=False):
        config = gr.Code(language="json", show_label=False, elem_id="swp-config")
    return {
        "summary": summary,
        "board": board,
        "objective": objective,
        "importance": importance,
        "config": config,
    }


def build_sweeps_tab(ctx: UIContext) -> SweepsTab:
    """Lay out the Sweeps tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.sweeps", id="sweeps") as tab:
        deployed = gr.State(None)  # inside the tab: see train_tab
        timer = gr.Timer(POLL_SECONDS, active=False)
        table = t.make(
            gr.Dataframe, "swp.table", headers=SWEEP_COLUMNS, interactive=False, wrap=True,
            elem_id="swp-table", max_height=200,
        )  # fmt: skip
        with gr.Row(equal_height=True):
            selected = t.make(gr.Dropdown, "swp.select", choices=[], elem_id="swp-select", scale=3)
            cancel = t.make(
                gr.Button, "swp.cancel", prop="value", size="sm", variant="stop", elem_id="swp-cancel"
            )
            promote = t.make(
                gr.Button, "swp.promote", prop="value", size="sm", variant="primary", elem_id="swp-promote"
            )
        action = gr.Markdown("", elem_id="swp-action")
        parts = _view_parts(t)
    view = [
        parts["summary"],
        parts["board"],
        parts["objective"],
        parts["importance"],
        parts["config"],
        cancel,
        promote,
    ]
    h = SweepsHandlers(ctx)
    quiet: dict[str, Any] = {"show_progress": "hidden"}
    timer.tick(h.tick, selected, [selected, table, *view], show_progress_on=table, **quiet)
    tab.select(h.opened, selected, [selected, table, *view], **quiet)
    selected.input(h.view, selected, view)
    selected.change(None, selected, None, js=URL_JS)
    cancel.click(h.cancel, selected, action)
    promote.click(h.promote, selected, [action, deployed])
    ctx.on_language(h.relabel, selected, [selected, table, *view], needs_selection=False)
    return SweepsTab(
        tab=tab,
        selected=selected,
        deployed=deployed,
        timer=timer,
        show_sweep=h.show,
        show_outputs=[selected, table, *view],
    )
