"""The Train tab's Sweep mode: the form above is the base run, this box says which keys Optuna searches and
how (a few fixed rows), the objective, the sampler and pruner, the budget; the planner's estimate before
launch, and launch. Its choices are built once from the engine's schema (``engine.sweep``), so opening the
tab costs no event of its own; only its two buttons send anything. A refusal is shown in the box, naming
the key, and queues nothing (the same ``studio.services.sweeps`` checks POST /api/v1/sweeps runs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr
from pydantic import ValidationError

from engine.sweep import DIRECTIONS, PRUNERS, SAMPLERS, SweepSettings, eval_metrics, searchable_keys
from engine.train.stages import STAGES
from studio.services import runs as runs_svc
from studio.services import sweeps as sweeps_svc
from studio.services.errors import ServiceError
from studio.ui.context import UIContext
from studio.ui.i18n import Texts, current_language, localize_message, text

ROWS = 3
# What a row's kind means in the engine's space ({type, log} or choices).
KINDS = ("log-uniform", "uniform", "int", "choice")
# The keys people search most often first, then every other searchable key of the schema.
FIRST_KEYS = (
    "learning_rate", "lora_rank", "lora_alpha", "num_train_epochs", "max_steps", "warmup_steps",
    "weight_decay", "lr_scheduler_type", "per_device_train_batch_size", "gradient_accumulation_steps",
)  # fmt: skip
_DEFAULTS = SweepSettings()
# The metrics any stage's evaluation reports (the service checks the one picked against the stage).
OBJECTIVES = tuple(dict.fromkeys(m for stage in STAGES for m in eval_metrics(stage)))
STARTING_ROW = {"key": "learning_rate", "kind": "log-uniform", "low": 1e-5, "high": 1e-3}


def key_choices() -> list[str]:
    keys = searchable_keys()
    return [k for k in FIRST_KEYS if k in keys] + sorted(k for k in keys if k not in FIRST_KEYS)


@dataclass
class SweepBox:
    rows: list[dict[str, gr.components.Component]]
    settings: dict[str, gr.components.Component]
    estimate_btn: gr.Button
    launch: gr.Button
    status: gr.Markdown
    launched: gr.State

    @property
    def inputs(self) -> list[Any]:
        """The box's values in ``SweepHandlers`` order: each row's key, kind, low, high, choices; then the
        settings in ``SETTING_KEYS`` order."""
        return [*(row[p] for row in self.rows for p in ROW_PARTS), *self.settings.values()]


ROW_PARTS = ("key", "kind", "low", "high", "choices")
SETTING_KEYS = (
    "n_trials", "parallelism", "objective", "direction", "sampler", "pruner", "max_wall_s", "max_total_steps",
)  # fmt: skip


# ---- plain functions of the box's values -------------------------------------------------------------------


def choice_value(item: str) -> Any:
    """One item of a choices box as YAML would read it: true / false, an integer, a number, else text."""
    item = item.strip()
    if item.lower() in ("true", "false"):
        return item.lower() == "true"
    for kind in (int, float):
        try:
            return kind(item)
        except ValueError:
            pass
    return item


def space_of(rows: list[tuple[Any, ...]]) -> dict[str, dict[str, Any]]:
    """The rows (key, kind, low, high, choices) with a key -> the engine's search space; the engine checks
    it and names the key of each problem (an empty range, a choice the key does not allow, ...)."""
    space: dict[str, dict[str, Any]] = {}
    for key, kind, low, high, choices in rows:
        if not key:
            continue
        if kind == "choice":
            items = [c for c in str(choices or "").split(",") if c.strip()]
            space[str(key)] = {"type": "categorical", "choices": [choice_value(c) for c in items]}
        else:
            spec = {"type": "int" if kind == "int" else "float", "low": low, "high": high}
            space[str(key)] = spec | ({"log": True} if kind == "log-uniform" else {})
    return space


def sweep_body(spec: runs_svc.RunSpec, box: tuple[Any, ...]) -> sweeps_svc.SweepIn:
    """The base run and the box's values (``SweepBox.inputs`` order) as POST /api/v1/sweeps' body; a value
    pydantic refuses becomes a ``ServiceError`` naming its field."""
    n = len(ROW_PARTS) * ROWS
    rows = [tuple(box[i : i + len(ROW_PARTS)]) for i in range(0, n, len(ROW_PARTS))]
    values = dict(zip(SETTING_KEYS, box[n:], strict=True))
    try:
        return sweeps_svc.SweepIn(
            name=f"{spec.name}-sweep" if spec.name else None,
            run=spec,
            parameters=space_of(rows),
            **{k: v for k, v in values.items() if v is not None},
        )
    except ValidationError as e:
        first = e.errors()[0]
        raise ServiceError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


def problems_markdown(error: ServiceError, lang: str) -> str:
    """A refusal as the box shows it: each problem on its own line, its key first."""
    problems = error.details.get("problems") if isinstance(error.details, dict) else None
    lines = (
        [localize_message(p, lang) for p in problems] if problems else [localize_message(error.message, lang)]
    )
    return text("sw.refused", lang) + "\n" + "\n".join(f"- {line}" for line in lines)


def estimate_markdown(est: dict[str, Any], lang: str) -> str:
    """The sweep's cost from the planner's single-run estimate (an upper bound: pruned trials end early)."""
    one = est.get("run") or {}
    peak = (one.get("memory_gib") or {}).get("peak")
    shown = text(
        "sw.estimate",
        lang,
        trials=est["n_trials"],
        parallel=est["parallelism"],
        steps=est["steps"],
        run_steps=one.get("steps") or 0,
        total=_duration(est["total_s"]),
    )
    return shown + (text("sw.estimate.peak", lang, peak=peak) if peak is not None else "")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


# ---- event handlers ----------------------------------------------------------------------------------------


class SweepHandlers:
    """The box's two buttons: the Train form's values (``form`` of them) and then the box's."""

    def __init__(self, ctx: UIContext, spec: Callable[[tuple[Any, ...]], runs_svc.RunSpec], form: int):
        self.ctx, self.spec, self.form = ctx, spec, form

    def _body(self, values: tuple[Any, ...]) -> sweeps_svc.SweepIn:
        try:
            spec = self.spec(values[: self.form])
        except gr.Error as e:
            raise ServiceError(str(e.message)) from None
        return sweep_body(spec, values[self.form :])

    def estimate(self, *values: Any) -> str:
        lang = current_language()
        try:
            body = self._body(values)
        except ServiceError as e:
            return problems_markdown(e, lang)
        est, err = self.ctx.attempt(sweeps_svc.estimate_sweep, self.ctx.settings, body)
        return problems_markdown(err, lang) if err is not None else estimate_markdown(est, lang)

    def launch(self, *values: Any) -> tuple[str, Any]:
        """Queue the sweep: (message, its id); a refusal leaves the id as it was."""
        lang = current_language()
        try:
            body = self._body(values)
        except ServiceError as e:
            return problems_markdown(e, lang), gr.skip()
        sweep, err = self.ctx.attempt(sweeps_svc.create_sweep, self.ctx.settings, body)
        if err is not None:
            return problems_markdown(err, lang), gr.skip()
        gr.Info(text("sw.queued", lang, id=sweep.id))
        shown = text("sw.launched", lang, id=sweep.id, name=sweep.name, trials=sweep.settings["n_trials"])
        if sweep.estimate:
            shown += "  \n" + estimate_markdown(sweep.estimate, lang)
        return shown, sweep.id


# ---- layout ------------------------------------------------------------------------------------------------


def _space_rows(t: Texts) -> list[dict[str, gr.components.Component]]:
    keys = key_choices()
    rows = []
    for i in range(ROWS):
        start = STARTING_ROW if i == 0 else {"key": None, "kind": "log-uniform", "low": None, "high": None}
        with gr.Row(equal_height=True):
            rows.append(
                {
                    "key": t.make(
                        gr.Dropdown, "sw.key", choices=[("—", ""), *((k, k) for k in keys)],
                        value=start["key"] or "", elem_id=f"sw-key-{i}", scale=3, show_label=i == 0,
                    ),
                    "kind": t.make(
                        gr.Dropdown, "sw.kind", choices=list(KINDS), value=start["kind"],
                        elem_id=f"sw-kind-{i}", scale=2, show_label=i == 0,
                    ),
                    "low": t.make(
                        gr.Number, "sw.low", value=start["low"], elem_id=f"sw-low-{i}", scale=2,
                        show_label=i == 0,
                    ),
                    "high": t.make(
                        gr.Number, "sw.high", value=start["high"], elem_id=f"sw-high-{i}", scale=2,
                        show_label=i == 0,
                    ),
                    "choices": t.make(
                        gr.Textbox, "sw.choices", max_lines=1, elem_id=f"sw-choices-{i}", scale=3,
                        show_label=i == 0,
                    ),
                }
            )  # fmt: skip
    return rows


def _settings(t: Texts) -> dict[str, gr.components.Component]:
    s: dict[str, gr.components.Component] = {}
    with gr.Row():
        s["n_trials"] = t.make(
            gr.Number, "sw.n_trials", value=_DEFAULTS.n_trials, minimum=1, maximum=sweeps_svc.MAX_TRIALS,
            precision=0, elem_id="sw-n-trials",
        )  # fmt: skip
        s["parallelism"] = t.make(
            gr.Number, "sw.parallelism", value=1, minimum=1, maximum=sweeps_svc.MAX_PARALLELISM, precision=0,
            elem_id="sw-parallelism",
        )  # fmt: skip
        s["objective"] = t.make(
            gr.Dropdown, "sw.objective", choices=list(OBJECTIVES), value=_DEFAULTS.objective,
            elem_id="sw-objective",
        )  # fmt: skip
        s["direction"] = t.make(
            gr.Radio,
            "sw.direction",
            choices=list(DIRECTIONS),
            value=_DEFAULTS.direction,
            elem_id="sw-direction",
        )
    with gr.Row():
        s["sampler"] = t.make(
            gr.Dropdown, "sw.sampler", choices=list(SAMPLERS), value=_DEFAULTS.sampler, elem_id="sw-sampler"
        )
        s["pruner"] = t.make(
            gr.Dropdown, "sw.pruner", choices=list(PRUNERS), value=_DEFAULTS.pruner, elem_id="sw-pruner"
        )
        s["max_wall_s"] = t.make(gr.Number, "sw.max_wall_s", value=0, minimum=0, elem_id="sw-max-wall-s")
        s["max_total_steps"] = t.make(
            gr.Number, "sw.max_total_steps", value=0, minimum=0, precision=0, elem_id="sw-max-total-steps"
        )
    return s


def build_sweep_box(t: Texts) -> SweepBox:
    """The folded Sweep box (laid out only: ``wire_sweep_box`` wires its buttons)."""
    with t.make(gr.Accordion, "sw.box", open=False, elem_id="sw-box"):
        t.make(gr.Markdown, "sw.help", prop="value")
        rows = _space_rows(t)
        settings = _settings(t)
        with gr.Row():
            estimate_btn = t.make(
                gr.Button, "sw.estimate_btn", prop="value", size="sm", elem_id="sw-estimate-btn"
            )
            launch = t.make(gr.Button, "sw.launch", prop="value", variant="primary", elem_id="sw-launch")
        status = gr.Markdown("", elem_id="sw-status")
        launched = gr.State(None)
    return SweepBox(rows, settings, estimate_btn, launch, status, launched)


def wire_sweep_box(box: SweepBox, handlers: SweepHandlers, form_inputs: list[Any]) -> None:
    inputs = [*form_inputs, *box.inputs]
    box.estimate_btn.click(handlers.estimate, inputs, box.status)
    box.launch.click(handlers.launch, inputs, [box.status, box.launched], concurrency_limit=1)
