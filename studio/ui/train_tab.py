"""Train tab: base model, stage, fine-tuning, compute type, hyperparameters, YAML, estimate, launch."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import yaml
from pydantic import ValidationError

from engine.train.config import COMPUTE_TYPES, DPO_LOSSES, FINE_TUNING, SCHEDULERS, STAGES
from studio.services import datasets as datasets_svc
from studio.services import models as models_svc
from studio.services import runs as runs_svc
from studio.ui.context import UIContext, model_choices, parse_id
from studio.ui.datasets_tab import dataset_choices

# build_config needs an output dir; the real one (runs/<id>/output) exists once the run is created.
PREVIEW_OUTPUT_DIR = Path("<run dir>/output")
# Per-stage starting values (ERNIEKit's example configs, scaled for a first run); LoRA gets a larger LR.
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "SFT": {"learning_rate": 1e-5, "max_seq_len": 2048, "warmup_steps": 10, "packing": False},
    "DPO": {"learning_rate": 5e-7, "max_seq_len": 2048, "warmup_steps": 10, "packing": False},
    "PT": {"learning_rate": 3e-5, "max_seq_len": 2048, "warmup_steps": 20, "packing": True},
    "VL-SFT": {"learning_rate": 1e-5, "max_seq_len": 2048, "warmup_steps": 10, "packing": False},
}
LORA_LR = {"SFT": 3e-4, "DPO": 1e-5, "PT": 3e-4, "VL-SFT": 3e-4}

# Hyperparameter fields in form order: (config key, component kind, extra kwargs).
HPARAMS: list[tuple[str, str, dict[str, Any]]] = [
    ("learning_rate", "number", {"value": 1e-5}),
    ("max_steps", "int", {"value": -1, "minimum": -1}),
    ("num_train_epochs", "number", {"value": 1.0, "minimum": 0}),
    ("per_device_train_batch_size", "int", {"value": 1, "minimum": 1}),
    ("gradient_accumulation_steps", "int", {"value": 1, "minimum": 1}),
    ("max_seq_len", "int", {"value": 2048, "minimum": 8}),
    ("warmup_steps", "int", {"value": 10, "minimum": 0}),
    ("lr_scheduler_type", "choice", {"choices": list(SCHEDULERS), "value": "cosine"}),
    ("weight_decay", "number", {"value": 0.0, "minimum": 0}),
    ("logging_steps", "int", {"value": 1, "minimum": 1}),
    ("save_steps", "int", {"value": 500, "minimum": 1}),
    ("packing", "bool", {"value": False}),
    ("seed", "int", {"value": 42}),
]
LORA_PARAMS: list[tuple[str, str, dict[str, Any]]] = [
    ("lora_rank", "int", {"value": 8, "minimum": 1}),
    ("lora_alpha", "number", {"value": -1}),
]
DPO_PARAMS: list[tuple[str, str, dict[str, Any]]] = [
    ("beta", "number", {"value": 0.1, "minimum": 0}),
    ("loss_type", "choice", {"choices": list(DPO_LOSSES), "value": "sigmoid"}),
]


@dataclass
class TrainTab:
    tab: gr.Tab
    fields: dict[str, gr.components.Component]
    launched_run: gr.State


def _field(ctx: UIContext, key: str, kind: str, kwargs: dict[str, Any]) -> gr.components.Component:
    t = ctx.texts
    elem = {"elem_id": f"tr-{key.replace('_', '-')}"}
    if kind == "int":
        return t.make(gr.Number, f"tr.{key}", precision=0, **elem, **kwargs)
    if kind == "number":
        return t.make(gr.Number, f"tr.{key}", **elem, **kwargs)
    if kind == "bool":
        return t.make(gr.Checkbox, f"tr.{key}", **elem, **kwargs)
    return t.make(gr.Dropdown, f"tr.{key}", **elem, **kwargs)


SPEC_FIELDS = ("name", "base_model", "dataset_ids", "stage", "fine_tuning")


def run_spec(values: dict[str, Any]) -> runs_svc.RunSpec:
    """Form values -> the RunSpec the REST API takes too (compute_type and the rest are hyperparameters)."""
    hyper: dict[str, Any] = {}
    for key, value in values.items():
        if key in SPEC_FIELDS or value is None or value == "":
            continue
        if isinstance(value, float) and value.is_integer() and key != "learning_rate":
            value = int(value)
        hyper[key] = value
    if values.get("fine_tuning") != "LoRA" and hyper.get("compute_type") not in ("wint8", "wint4/8"):
        hyper.pop("lora_rank", None)
        hyper.pop("lora_alpha", None)
    if values.get("stage") != "DPO":
        hyper.pop("beta", None)
        hyper.pop("loss_type", None)
    ids = [parse_id(d) for d in values.get("dataset_ids") or []]
    try:
        return runs_svc.RunSpec(
            name=values.get("name") or None,
            base_model=values.get("base_model") or "",
            dataset_ids=[i for i in ids if i is not None],
            stage=values.get("stage") or "SFT",
            fine_tuning=values.get("fine_tuning") or "LoRA",
            hyperparameters=hyper,
        )
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        hint = "pick at least one dataset" if field == "dataset_ids" else first["msg"]
        raise gr.Error(f"{field}: {hint}", print_exception=False) from None


def form_values(spec: runs_svc.RunSpec, keys: list[str]) -> list[Any]:
    """A run's spec -> one value per form field (the clone button fills the form with these)."""
    values = {**spec.hyperparameters, **spec.model_dump(include=set(SPEC_FIELDS))}
    values["name"] = f"{spec.name}-clone" if spec.name else ""
    return [values.get(k, gr.update()) for k in keys]


def build_train_tab(ctx: UIContext) -> TrainTab:
    t = ctx.texts
    fields: dict[str, gr.components.Component] = {}
    with t.make(gr.Tab, "tab.train", id="train") as tab, gr.Row():
        # Inside the tab: a bare State between two Tabs shifts Gradio's tab indices in the browser.
        launched_run = gr.State(None)
        with gr.Column(scale=3):
            fields["base_model"] = t.make(
                gr.Dropdown, "tr.base_model", choices=[], allow_custom_value=True, elem_id="tr-base-model"
            )
            with gr.Row():
                fields["stage"] = t.make(
                    gr.Radio, "tr.stage", choices=list(STAGES), value="SFT", elem_id="tr-stage"
                )
                fields["fine_tuning"] = t.make(
                    gr.Radio,
                    "tr.fine_tuning",
                    choices=list(FINE_TUNING),
                    value="LoRA",
                    elem_id="tr-fine-tuning",
                )
                fields["compute_type"] = t.make(
                    gr.Dropdown,
                    "tr.compute_type",
                    choices=list(COMPUTE_TYPES),
                    value="fp32",
                    elem_id="tr-compute-type",
                )
            with gr.Row():
                fields["dataset_ids"] = t.make(
                    gr.Dropdown,
                    "tr.datasets",
                    choices=[],
                    multiselect=True,
                    elem_id="tr-datasets",
                    scale=3,
                )
                fields["name"] = t.make(gr.Textbox, "tr.run_name", elem_id="tr-run-name", scale=2)
            with t.make(gr.Accordion, "tr.hparams", open=True):
                for start in range(0, len(HPARAMS), 4):
                    with gr.Row(equal_height=True):
                        for key, kind, kwargs in HPARAMS[start : start + 4]:
                            fields[key] = _field(ctx, key, kind, dict(kwargs))
            with gr.Row():
                with t.make(gr.Accordion, "tr.lora", open=True) as lora_box, gr.Row():
                    for key, kind, kwargs in LORA_PARAMS:
                        fields[key] = _field(ctx, key, kind, dict(kwargs))
                with t.make(gr.Accordion, "tr.dpo", open=True, visible=False) as dpo_box, gr.Row():
                    for key, kind, kwargs in DPO_PARAMS:
                        fields[key] = _field(ctx, key, kind, dict(kwargs))
        with gr.Column(scale=2):
            estimate_btn = t.make(
                gr.Button, "tr.estimate_btn", prop="value", size="sm", elem_id="tr-estimate-btn"
            )
            estimate = gr.Markdown("", elem_id="tr-estimate")
            launch = t.make(gr.Button, "tr.launch", prop="value", variant="primary", elem_id="tr-launch")
            launch_status = gr.Markdown("", elem_id="tr-launch-status")
            yaml_view = t.make(
                gr.Code, "tr.yaml", language="yaml", interactive=False, lines=18, elem_id="tr-yaml"
            )
            yaml_file = t.make(
                gr.DownloadButton, "tr.yaml_download", prop="label", size="sm", elem_id="tr-yaml-download"
            )

    keys = list(fields)
    inputs = [fields[k] for k in keys]

    def as_spec(values: tuple[Any, ...]) -> runs_svc.RunSpec:
        return run_spec(dict(zip(keys, values, strict=True)))

    def show_yaml(*values: Any) -> tuple[str, Any]:
        form = dict(zip(keys, values, strict=True))
        if not form.get("base_model") or not form.get("dataset_ids"):
            return "# pick a base model and a dataset to see the config", gr.update(value=None)
        config, err = ctx.attempt(runs_svc.build_config, ctx.settings, as_spec(values), PREVIEW_OUTPUT_DIR)
        if err is not None:
            return f"# not valid yet: {err.message}", gr.update(value=None)
        text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
        path = Path(tempfile.mkdtemp(prefix="ernie-studio-yaml-")) / "train.yaml"
        path.write_text(text, encoding="utf-8")
        return text, gr.update(value=str(path))

    def show_estimate(*values: Any) -> str:
        return format_estimate(ctx.call(runs_svc.estimate_resources, ctx.settings, as_spec(values)))

    def start(*values: Any) -> tuple[str, Any]:
        run = ctx.call(runs_svc.create_run, ctx.settings, as_spec(values))
        position = ctx.read(
            lambda s, rid: runs_svc.queue_position(s, runs_svc.get_run(s, rid)), run.id, default=None
        )
        where = f"position **{position}** in the queue" if position else "starting"
        gr.Info(f"Run #{run.id} queued.")
        return f"✅ run **#{run.id} {run.name}** queued — {where}. Follow it in the Runs tab.", run.id

    def stage_changed(stage: str, fine_tuning: str) -> tuple[Any, ...]:
        d = STAGE_DEFAULTS.get(stage, STAGE_DEFAULTS["SFT"])
        lr = LORA_LR.get(stage, 3e-4) if fine_tuning == "LoRA" else d["learning_rate"]
        return (
            gr.update(value=lr),
            gr.update(value=d["max_seq_len"]),
            gr.update(value=d["warmup_steps"]),
            gr.update(value=d["packing"]),
            gr.update(visible=stage == "DPO"),
        )

    def fine_tuning_changed(stage: str, fine_tuning: str, compute_type: str) -> tuple[Any, ...]:
        lora = fine_tuning == "LoRA" or compute_type in ("wint8", "wint4/8")
        d = STAGE_DEFAULTS.get(stage, STAGE_DEFAULTS["SFT"])
        lr = LORA_LR.get(stage, 3e-4) if fine_tuning == "LoRA" else d["learning_rate"]
        return gr.update(value=lr), gr.update(visible=lora)

    def refresh_choices(base_model: str | None, chosen: list[Any] | None) -> tuple[Any, Any]:
        choices = model_choices(ctx.read(models_svc.list_models, ctx.settings, default=[]))
        items = ctx.read(datasets_svc.list_datasets, default=[])
        # Values are only filled in when empty: this may land after the person picked something.
        model_update = gr.update(choices=choices)
        if not base_model and choices:
            model_update["value"] = choices[0][1]
        return model_update, gr.update(choices=dataset_choices(items))

    fields["stage"].change(
        stage_changed,
        [fields["stage"], fields["fine_tuning"]],
        [fields["learning_rate"], fields["max_seq_len"], fields["warmup_steps"], fields["packing"], dpo_box],
    )
    fields["fine_tuning"].input(
        fine_tuning_changed,
        [fields["stage"], fields["fine_tuning"], fields["compute_type"]],
        [fields["learning_rate"], lora_box],
    )
    fields["compute_type"].input(
        fine_tuning_changed,
        [fields["stage"], fields["fine_tuning"], fields["compute_type"]],
        [fields["learning_rate"], lora_box],
    )
    for comp in inputs:
        comp.change(
            show_yaml, inputs, [yaml_view, yaml_file], show_progress="hidden", trigger_mode="always_last"
        )
    estimate_btn.click(show_estimate, inputs, estimate)
    launch.click(start, inputs, [launch_status, launched_run], concurrency_limit=1)
    tab.select(
        refresh_choices,
        [fields["base_model"], fields["dataset_ids"]],
        [fields["base_model"], fields["dataset_ids"]],
    )
    ctx.demo.load(
        refresh_choices,
        [fields["base_model"], fields["dataset_ids"]],
        [fields["base_model"], fields["dataset_ids"]],
    )
    return TrainTab(tab=tab, fields=fields, launched_run=launched_run)


def format_estimate(est: dict[str, Any]) -> str:
    """``estimate_resources`` as a short table: memory by part, parameters, and time on GPU and CPU."""
    mem = est.get("memory_gib") or {}
    lines = ["| memory | GiB |", "|---|---:|"]
    for part in ("weights", "gradients", "optimizer", "activations"):
        if part in mem:
            lines.append(f"| {part} | {mem[part]:.3f} |")
    if "total" in mem:
        lines.append(f"| **total** | **{mem['total']:.3f}** |")
    n, trainable = est.get("num_parameters"), est.get("trainable_parameters")
    if n:
        lines.append(f"\ntrainable parameters **{trainable:,}** of {n:,} ({100 * trainable / n:.2f}%)")
    secs = est.get("seconds") or {}
    if secs:
        times = " · ".join(f"{where.replace('_', ' ')} ≈ **{_duration(v)}**" for where, v in secs.items())
        lines.append(f"  \n{est.get('tokens', 0):,} tokens: {times}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2g}s"
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")
