"""Train tab: base model, stage, fine-tuning, compute type, every training option, YAML, estimate, launch.

The option fields are built from the engine's config schema (``studio.ui.train_form``): their starting values,
choices, bounds, groups and when they apply, so the form starts where ``ernie-studio train`` with a minimal
YAML starts and reaches every key it reads. Each change is checked by the same service functions that
``POST /api/v1/runs`` calls; a field shows the engine's message for its value, and Launch waits until none is
left.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import yaml
from pydantic import ValidationError

from engine.models.config import ErnieConfig
from engine.train.config import TrainConfig
from engine.train.options import MAX_DEVICES, field_info
from engine.train.run_checks import defaults_for
from engine.train.stages import STAGE_DEFAULTS
from studio.config import Settings
from studio.services import datasets as datasets_svc
from studio.services import models as models_svc
from studio.services import runs as runs_svc
from studio.ui.context import UIContext, model_choices, parse_id, refusal
from studio.ui.datasets_tab import dataset_choices
from studio.ui.estimate_text import format_estimate, launch_warning
from studio.ui.evaluate_tab import build_evaluate_after_fields, evaluate_after_spec
from studio.ui.i18n import DEFAULT_LANGUAGE, STRINGS, Texts, current_language, localize_message, text
from studio.ui.model_download import build_download_row
from studio.ui.sweep_box import SweepBox, SweepHandlers, build_sweep_box, wire_sweep_box
from studio.ui.train_form import (
    OPTION_KEYS,
    TOP_KEYS,
    OptionGroups,
    build_option_groups,
    changed_updates,
    config_value,
    fold_updates,
    folded_groups,
    form_defaults,
    form_value,
    grouped_options,
    help_text,
    option_mark,
    option_update,
    problems_by_field,
    problems_markdown,
    probs_text,
    search_updates,
    starting_marks,
    unmet,
)
from studio.ui.train_import import ImportBox, ImportHandlers, build_import_box
from studio.ui.train_templates import StartBox, StartHandlers, build_start_box, wire_start_box

# The radios start on the schema's own defaults (stage SFT, fine_tuning LoRA).
_SCHEMA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
DEFAULT_STAGE: str = _SCHEMA_DEFAULTS["stage"]
DEFAULT_FINE_TUNING: str = _SCHEMA_DEFAULTS["fine_tuning"]
# Keys whose starting value depends on stage and fine-tuning (the engine's per-stage defaults).
STAGE_DEPENDENT_KEYS = tuple(dict.fromkeys(key for d in STAGE_DEFAULTS.values() for key in d))

# Config keys in form order: the choice rows' keys, then every option of the schema (studio.ui.train_form).
CHOICE_KEYS = TOP_KEYS
# The pickers whose choices are the studio's models and datasets, refreshed when the tab opens.
PICKER_KEYS = ("base_model", "dataset_ids", "eval_dataset_ids", "eval_datasets")
CONFIG_KEYS = (*CHOICE_KEYS, *OPTION_KEYS)
SPEC_FIELDS = (
    "name",
    "base_model",
    "dataset_ids",
    "dataset_probs",
    "eval_dataset_ids",
    "stage",
    "fine_tuning",
    "num_devices",
    "num_nodes",
)
# "Evaluate after training" (studio/ui/evaluate_tab.py): RunSpec.evaluate, not hyperparameters.
EVALUATE_FIELDS = ("eval_after", "eval_holdout", "eval_datasets", "eval_max_new_tokens")


@dataclass
class TrainTab:
    tab: gr.Tab
    fields: dict[str, gr.components.Component]
    launched_run: gr.State
    handlers: TrainHandlers
    options: OptionGroups
    launched_sweep: gr.State


@dataclass
class _SidePanel:
    estimate_btn: gr.Button
    estimate: gr.Markdown
    launch: gr.Button
    problems: gr.Markdown
    launch_status: gr.Markdown
    sweep: SweepBox
    yaml_view: gr.Code
    yaml_file: gr.DownloadButton
    importer: ImportBox


# ---- plain functions of form values ----------------------------------------------------------------------


def choice_changed(stage: str, fine_tuning: str, compute_type: str) -> tuple[Any, ...]:
    """Stage, fine-tuning or compute type changed: the stage-dependent fields restart from the engine's
    defaults (in ``STAGE_DEPENDENT_KEYS`` order); which options apply follows in ``TrainHandlers.review``."""
    defaults = defaults_for(stage, fine_tuning)
    return tuple(form_value(key, defaults[key]) for key in STAGE_DEPENDENT_KEYS)


def choice_changed_js() -> str:
    """``choice_changed`` as a browser function, the defaults of every stage and fine-tuning inlined.

    It runs in the page at the click: a server round trip could answer after the person had typed into a field
    it sets (a learning rate typed right after clicking Full was overwritten by Full's default, CI seed 703238).
    Its inputs are the choice fields, then the dependent fields, whose values it keeps for a pair the table
    lacks."""
    table = {f"{stage}|{ft}": list(choice_changed(stage, ft, "")) for stage, ft in STAGE_DEFAULTS}
    n = len(CHOICE_KEYS)
    return f"(...v) => {{ const t = {json.dumps(table)}; return t[v[0] + '|' + v[1]] ?? v.slice({n}); }}"


def hyperparameters(values: dict[str, Any]) -> dict[str, Any]:
    """The form's training keys as a run's ``hyperparameters``: every option that applies to the chosen
    stage, fine-tuning and compute type and holds a value (an option that needs another kind of model is
    sent too: the engine names it when it cannot be used)."""
    stage = values.get("stage") or DEFAULT_STAGE
    fine_tuning = values.get("fine_tuning") or DEFAULT_FINE_TUNING
    compute_type = values.get("compute_type") or _SCHEMA_DEFAULTS["compute_type"]
    hyper: dict[str, Any] = {}
    for key in CONFIG_KEYS:
        if key in ("stage", "fine_tuning") or key not in values:
            continue
        if any(what != "model" for what, _ in unmet(key, stage, fine_tuning, compute_type)):
            continue
        value = config_value(key, values[key])
        if value is not None:
            hyper[key] = value
    return hyper


def dataset_probs(value: Any) -> list[float] | None:
    """The probabilities field (``0.7, 0.3``) as numbers; empty is None (an even mix)."""
    if isinstance(value, list | tuple):
        return [float(v) for v in value] or None
    parts = [p for p in str(value or "").replace(",", " ").split() if p]
    try:
        return [float(p) for p in parts] or None
    except ValueError:
        raise refusal(f"dataset_probs: {value!r} is not numbers separated by commas") from None


def run_spec(values: dict[str, Any]) -> runs_svc.RunSpec:
    """Form values -> the RunSpec the REST API takes too (compute_type and the rest are hyperparameters)."""
    ids = [parse_id(d) for d in values.get("dataset_ids") or []]
    evals = [parse_id(d) for d in values.get("eval_dataset_ids") or []]
    try:
        return runs_svc.RunSpec(
            name=values.get("name") or None,
            base_model=values.get("base_model") or "",
            dataset_ids=[i for i in ids if i is not None],
            dataset_probs=dataset_probs(values.get("dataset_probs")),
            eval_dataset_ids=[i for i in evals if i is not None] or None,
            stage=values.get("stage") or DEFAULT_STAGE,
            fine_tuning=values.get("fine_tuning") or DEFAULT_FINE_TUNING,
            hyperparameters=hyperparameters(values),
            num_devices=int(values.get("num_devices") or 1),
            num_nodes=int(values.get("num_nodes") or 1),
            evaluate=evaluate_after_spec(*(values.get(k) for k in EVALUATE_FIELDS)),
        )
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        hint = text("tr.err.no_dataset", current_language()) if field == "dataset_ids" else first["msg"]
        raise refusal(f"{field}: {hint}") from None


def form_values(spec: runs_svc.RunSpec, keys: list[str]) -> list[Any]:
    """A run's spec -> one value per form field (the clone button fills the form with these): every option,
    the ones the run left out at the engine's defaults for its stage and fine-tuning."""
    defaults = form_defaults(spec.stage, spec.fine_tuning)
    values = defaults | {k: form_value(k, v) for k, v in spec.hyperparameters.items()}
    values |= spec.model_dump(include=set(SPEC_FIELDS))
    values["dataset_probs"] = probs_text(spec.dataset_probs)
    values["eval_dataset_ids"] = spec.eval_dataset_ids or []
    values["name"] = f"{spec.name}-clone" if spec.name else ""
    if spec.evaluate is not None:
        values |= {
            "eval_after": True,
            "eval_holdout": spec.evaluate.holdout,
            "eval_datasets": spec.evaluate.dataset_ids or [],
        }
    return [values.get(k, gr.update()) for k in keys]


def yaml_download(text: str) -> str:
    """Write the YAML preview to a fresh temporary file for the download button; returns its path."""
    path = Path(tempfile.mkdtemp(prefix="ernie-studio-yaml-")) / "train.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---- the choice rows' checks (stage, fine-tuning, compute type) ------------------------------------------


def stage_choices(lang: str = DEFAULT_LANGUAGE) -> list[tuple[str, str]]:
    """The stage radio's (label, value) pairs: a stage with a ``tr.stage.choice.<stage>`` text says what it
    trains (OCR-VL-SFT: document OCR with PaddleOCR-VL); the value stays the engine's name."""
    stages = field_info(TrainConfig, "stage")["choices"]
    return [
        (text(f"tr.stage.choice.{s}", lang) if f"tr.stage.choice.{s}" in STRINGS else s, s) for s in stages
    ]


def choice_update(key: str, problems: list[str], lang: str = DEFAULT_LANGUAGE) -> dict[str, Any]:
    """A choice-row field after a check: the service's and the engine's messages about it (a stage the base
    model's family does not train with, a compute type the stage refuses), else its help; the stage's labels
    in ``lang``."""
    extra = {"choices": stage_choices(lang)} if key == "stage" else {}
    if problems:
        shown = "  \n".join(text("tr.problem", lang, message=localize_message(m, lang)) for m in problems)
        return gr.update(info=shown, interactive=True, elem_classes=["tr-invalid"], **extra)
    return gr.update(info=help_text(key, lang), interactive=True, elem_classes=[], **extra)


def choice_marks(lang: str) -> dict[str, list[Any]]:
    """The choice fields' marks as the form is built (their help, nothing wrong)."""
    return {key: [lang, *option_mark(choice_update(key, [], lang))] for key in CHOICE_KEYS}


# ---- event handlers --------------------------------------------------------------------------------------


class TrainHandlers:
    """The Train tab's event handlers: form values in (in ``keys`` order), plain values out."""

    def __init__(self, ctx: UIContext, keys: list[str]):
        self.ctx = ctx
        self.keys = keys
        # the check of the form as event arguments (set by the layout), for events of other tabs to chain
        self.review_wiring: dict[str, Any] = {}

    def spec(self, values: tuple[Any, ...]) -> runs_svc.RunSpec:
        return run_spec(dict(zip(self.keys, values, strict=True)))

    def show_yaml(self, *values: Any) -> tuple[str, str | None]:
        """The YAML the run would get and a file to download it, or why there is none yet."""
        lang = current_language()
        form = dict(zip(self.keys, values, strict=True))
        if not form.get("base_model") or not form.get("dataset_ids"):
            return text("tr.msg.pick", lang), None
        # the config a run would get (its output dir a placeholder), or why it cannot run yet
        config, err = self.ctx.attempt(runs_svc.preview_config, self.ctx.settings, self.spec(values))
        if err is not None:
            return text("tr.msg.invalid", lang, message=localize_message(err.message, lang)), None
        shown = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
        return shown, yaml_download(shown)

    def model_of(self, base_model: Any) -> ErnieConfig | None:
        """The chosen base model's architecture (None while none is chosen or it cannot be read)."""
        if not base_model:
            return None
        return self.ctx.read(models_svc.model_config, self.ctx.settings, str(base_model), default=None)

    def problems(self, values: tuple[Any, ...]) -> list[str]:
        """Everything Launch would be refused for: the studio's and the engine's own checks of the form. With
        no dataset picked yet, the options are still checked (by the engine alone)."""
        form = dict(zip(self.keys, values, strict=True))
        try:
            spec = self.spec(values)
        except gr.Error as e:
            hyper = hyperparameters(form)
            stage, fine_tuning = (
                form.get("stage") or DEFAULT_STAGE,
                form.get("fine_tuning") or DEFAULT_FINE_TUNING,
            )
            family = self.ctx.read(
                runs_svc.model_family_problems, self.ctx.settings, form.get("base_model") or "", stage, default=[]
            ) if form.get("base_model") else []  # fmt: skip
            return [str(e.message), *family, *runs_svc.config_problems(stage, fine_tuning, hyper)]
        return self.ctx.read(runs_svc.spec_problems, self.ctx.settings, spec, default=[])

    def review(self, *args: Any) -> list[Any]:
        """After any change: each option shows the engine's message for its value, else why it does not
        apply, else its help (sent only where that differs from what the page shows, the marks after the
        form values); groups holding a wrong value open; stage, fine-tuning and compute type show the
        messages about them (a stage the base model's family does not train with); Launch is enabled only
        with no problem left; the problems are listed beside Launch; then the YAML and its file, and the
        marks now shown (``review_outputs`` order)."""
        lang = current_language()
        values, shown = args[: len(self.keys)], (args[len(self.keys) :] or [None])[0]
        form = dict(zip(self.keys, values, strict=True))
        choices = [form.get(k) or _SCHEMA_DEFAULTS[k] for k in CHOICE_KEYS]
        model = self.model_of(form.get("base_model"))
        problems = self.problems(values)
        by_field = problems_by_field(problems)
        updates = {
            key: option_update(key, by_field.get(key, []), unmet(key, *choices, model), lang)
            for key in OPTION_KEYS
        }
        out, marks = changed_updates(updates, shown)
        for _, options in [*grouped_options(), *folded_groups()]:
            wrong = [o for o in options if o.key in by_field]
            out.append(gr.update(open=True) if wrong else gr.skip())
        out += fold_updates(set(by_field))
        for key in CHOICE_KEYS:
            update = choice_update(key, by_field.get(key, []), lang)
            mark = [lang, *option_mark(update)]
            out.append(gr.skip() if (shown or {}).get(key) == mark else update)
            marks[key] = mark
        out.append(gr.update(interactive=not problems))
        out.append(problems_markdown(problems, lang))
        if problems:
            invalid = text("tr.msg.invalid", lang, message=localize_message(problems[0], lang))
            return [*out, invalid, None, marks]
        return [*out, *self.show_yaml(*values), marks]

    def show_estimate(self, *values: Any) -> str:
        est = self.ctx.call(runs_svc.estimate_resources, self.ctx.settings, self.spec(values))
        return format_estimate(est, current_language())

    def launch(self, *values: Any) -> tuple[str, int]:
        """Queue the run; returns the launch message and the new run's id."""
        ctx = self.ctx
        run = ctx.call(runs_svc.create_run, ctx.settings, self.spec(values))
        position = ctx.read(
            lambda s, rid: runs_svc.queue_position(s, runs_svc.get_run(s, rid)), run.id, default=None
        )
        lang = current_language()
        where = text("tr.msg.position", lang, n=position) if position else text("tr.msg.starting", lang)
        gr.Info(text("tr.msg.queued", lang, id=run.id))
        message = text("tr.msg.launched", lang, id=run.id, name=run.name, where=where)
        return launch_warning(run.estimate, lang) + message, run.id

    def model_roots(self) -> str:
        """The folders the base-model picker lists local models from."""
        return model_roots_text(self.ctx.settings)

    def refresh_choices(self, base_model: str | None) -> list[Any]:
        """Fresh base-model and dataset choices (the ``PICKER_KEYS`` fields: training, evaluation and
        evaluate-after sets); the base model is only filled in when empty (this may land after the person
        picked something)."""
        models = self.ctx.read(models_svc.list_models, self.ctx.settings, default=[])
        choices = model_choices(models, current_language())
        items = self.ctx.read(datasets_svc.list_datasets, default=[])
        model_update = gr.update(choices=choices)
        if not base_model and choices:
            model_update["value"] = choices[0][1]
        datasets = gr.update(choices=dataset_choices(items))
        return [model_update, *(datasets for _ in PICKER_KEYS[1:])]

    def open_tab(self, *args: Any) -> list[Any]:
        """The tab opened or the page loaded (``review``'s inputs): fresh choices, then the form checked
        with them, in one event (every event costs the page a pass over each component any event has
        touched, which the form makes hundreds: the tab's five events took it 1.4-1.9 s on a loaded box).
        Returns the pickers' updates, then ``review``'s."""
        values = list(args[: len(self.keys)])
        form = dict(zip(self.keys, values, strict=True))
        pickers = self.refresh_choices(form["base_model"])
        if "value" in pickers[0]:
            values[self.keys.index("base_model")] = pickers[0]["value"]
        return [*pickers, *self.review(*values, *args[len(self.keys) :])]

    def clone_into_form(self, run_id: Any) -> list[Any]:
        """For "clone into Train": one value per form key from the run's choices, then the tabs opened on
        Train and the remembered tab id."""
        rid = parse_id(run_id)
        if rid is None:
            raise refusal(text("tr.err.no_clone", current_language()))
        spec = self.ctx.call(lambda s, i: runs_svc.spec_of(runs_svc.get_run(s, i)), rid)
        return [*form_values(spec, self.keys), gr.Tabs(selected="train"), "train"]


# ---- layout ----------------------------------------------------------------------------------------------


def model_roots_text(settings: Settings) -> str:
    """The folders the base-model picker lists model directories from, as the Train tab shows them."""
    return "  ·  ".join(str(root) for root in models_svc.model_roots(settings))


def _choice_rows(t: Texts, start: dict[str, Any]) -> tuple[dict[str, gr.components.Component], gr.Textbox]:
    """Base model, stage, fine-tuning, compute type, training data and run name."""
    fields: dict[str, gr.components.Component] = {}
    with gr.Row():
        fields["base_model"] = t.make(
            gr.Dropdown,
            "tr.base_model",
            choices=[],
            allow_custom_value=True,
            elem_id="tr-base-model",
            scale=3,
        )
        # Not a form field: where the picker's local models come from (filled on load, like the choices).
        roots = t.make(
            gr.Textbox, "tr.model_roots", interactive=False, max_lines=2, elem_id="tr-model-roots", scale=2
        )
    with gr.Row():
        for key, factory in (("stage", gr.Radio), ("fine_tuning", gr.Radio), ("compute_type", gr.Dropdown)):
            choices = (
                stage_choices(t.lang) if key == "stage" else list(field_info(TrainConfig, key)["choices"])
            )
            elem_id = f"tr-{key.replace('_', '-')}"
            fields[key] = t.make(factory, f"tr.{key}", choices=choices, value=start[key], elem_id=elem_id)
    with gr.Row():
        fields["dataset_ids"] = t.make(
            gr.Dropdown, "tr.datasets", choices=[], multiselect=True, elem_id="tr-datasets", scale=3
        )
        fields["name"] = t.make(gr.Textbox, "tr.run_name", elem_id="tr-run-name", scale=2)
        fields["num_devices"] = t.make(
            gr.Number, "tr.num_devices", value=1, minimum=1, maximum=MAX_DEVICES, precision=0,
            elem_id="tr-num-devices", scale=1,
        )  # fmt: skip
        fields["num_nodes"] = t.make(
            gr.Number, "tr.num_nodes", value=1, minimum=1, maximum=runs_svc.MAX_NODES, precision=0,
            elem_id="tr-num-nodes", scale=1,
        )  # fmt: skip
    return fields, roots


def _data_rows(t: Texts) -> dict[str, gr.components.Component]:
    """How the training datasets mix, and the evaluation datasets (the dataset keys the studio fills in)."""
    fields: dict[str, gr.components.Component] = {}
    with gr.Row():
        fields["dataset_probs"] = t.make(
            gr.Textbox, "tr.dataset_probs", max_lines=1, elem_id="tr-dataset-probs"
        )
        fields["eval_dataset_ids"] = t.make(
            gr.Dropdown, "tr.eval_dataset_ids", choices=[], multiselect=True, elem_id="tr-eval-dataset-ids"
        )
    return fields


def _side_panel(t: Texts) -> _SidePanel:
    estimate_btn = t.make(gr.Button, "tr.estimate_btn", prop="value", size="sm", elem_id="tr-estimate-btn")
    estimate = gr.Markdown("", elem_id="tr-estimate")
    # Enabled by the first check of the form (on load and after every change) when nothing is wrong.
    launch = t.make(
        gr.Button, "tr.launch", prop="value", variant="primary", elem_id="tr-launch", interactive=False
    )
    problems = gr.Markdown("", elem_id="tr-problems")
    launch_status = gr.Markdown("", elem_id="tr-launch-status")
    # Sweep mode: the form is the base run of an Optuna search (folded; studio/ui/sweep_box.py).
    sweep = build_sweep_box(t)
    yaml_view = t.make(gr.Code, "tr.yaml", language="yaml", interactive=False, lines=18, elem_id="tr-yaml")
    yaml_file = t.make(
        gr.DownloadButton, "tr.yaml_download", prop="label", size="sm", elem_id="tr-yaml-download"
    )
    importer = build_import_box(t)
    return _SidePanel(
        estimate_btn, estimate, launch, problems, launch_status, sweep, yaml_view, yaml_file, importer
    )


def build_train_tab(ctx: UIContext) -> TrainTab:
    """Lay out the Train tab and wire its events."""
    t = ctx.texts
    start = form_defaults(DEFAULT_STAGE, DEFAULT_FINE_TUNING)
    with t.make(gr.Tab, "tab.train", id="train") as tab, gr.Row():
        # Inside the tab: a bare State between two Tabs shifts Gradio's tab indices in the browser.
        launched_run = gr.State(None)
        # What each option field shows (help or message, enabled): a check sends only what differs.
        marks = gr.State(starting_marks(*(start[k] for k in CHOICE_KEYS), t.lang) | choice_marks(t.lang))
        with gr.Column(scale=3):
            fields, roots = _choice_rows(t, start)
            build_download_row(ctx, t, fields["base_model"])
            fields |= _data_rows(t)
            fields |= build_evaluate_after_fields(ctx, tab)
            options = build_option_groups(t, start)
            fields |= options.fields
        with gr.Column(scale=2):
            start_box = build_start_box(t)  # recipes and templates: studio/ui/train_templates.py
            side = _side_panel(t)
    handlers = TrainHandlers(ctx, list(fields))
    _wire_search(options)
    _wire_actions(ctx, tab, handlers, fields, options, side, launched_run, marks)
    starts = StartHandlers(ctx, handlers.keys, handlers.spec, form_values)
    wire_start_box(start_box, starts, [fields[k] for k in handlers.keys], handlers.review_wiring)
    _wire_open(ctx, tab, handlers, starts, [fields[k] for k in PICKER_KEYS], start_box)
    ctx.demo.load(handlers.model_roots, None, roots)
    form_inputs = [fields[k] for k in handlers.keys]
    wire_sweep_box(side.sweep, SweepHandlers(ctx, handlers.spec, len(form_inputs)), form_inputs)
    return TrainTab(
        tab=tab,
        fields=fields,
        launched_run=launched_run,
        handlers=handlers,
        options=options,
        launched_sweep=side.sweep.launched,
    )


# Every event that writes the form's review (the YAML, the problems, Launch's state) waits in one queue, so
# they finish in the order they were sent, each with the values of its moment: the last shows the form as it
# is. Apart, a clone's review (or the tab's opening, which the clone causes) could finish after the review of
# an edit made right after it and show the YAML of the values before the edit (seen in test_studio's flow).
REVIEW_QUEUE = {"concurrency_id": "train-review", "concurrency_limit": 1}


def _wire_open(
    ctx: UIContext,
    tab: gr.Tab,
    handlers: TrainHandlers,
    starts: StartHandlers,
    pickers: list[Any],
    box: StartBox,
) -> None:
    """Opening the tab is one event (``TrainHandlers.open_tab``, with the templates and the first recipe's
    verdict, fresh for the nodes as they are); the page's load the same without the verdict."""
    review = handlers.review_wiring
    inputs, outputs = [*review["inputs"], box.template], [*pickers, *review["outputs"], box.template]

    def loaded(*args: Any) -> list[Any]:
        return [*handlers.open_tab(*args[:-1]), starts.template_choices(args[-1])]

    def opened(*args: Any) -> list[Any]:
        return [*loaded(*args[:-1]), starts.verdict(args[-1])]

    tab.select(opened, [*inputs, box.recipe], [*outputs, box.verdict], show_progress="hidden", **REVIEW_QUEUE)
    ctx.demo.load(loaded, inputs, outputs, show_progress="hidden", **REVIEW_QUEUE)


def search_options(query: str) -> list[Any]:
    """The search box changed: options, groups and the no-match line (``search_updates``) in the session's
    language."""
    return search_updates(query, current_language())


def _wire_search(options: OptionGroups) -> None:
    outputs = [
        *(options.fields[k] for k in OPTION_KEYS),
        *options.groups.values(),
        *options.more.values(),
        *options.body_outputs(),
        options.no_match,
    ]
    options.search.change(search_options, options.search, outputs, show_progress="hidden")


def _wire_actions(
    ctx: UIContext,
    tab: gr.Tab,
    handlers: TrainHandlers,
    fields: dict[str, Any],
    options: OptionGroups,
    side: _SidePanel,
    launched_run: gr.State,
    marks: gr.State,
) -> None:
    inputs = [fields[k] for k in handlers.keys]
    review_outputs = [
        *(fields[k] for k in OPTION_KEYS),
        *options.groups.values(),
        *options.more.values(),
        *options.body_outputs(),
        *(fields[k] for k in CHOICE_KEYS),
        side.launch,
        side.problems,
        side.yaml_view,
        side.yaml_file,
        marks,
    ]
    review = {
        "fn": handlers.review,
        "inputs": [*inputs, marks],
        "outputs": review_outputs,
        "show_progress": "hidden",
        **REVIEW_QUEUE,
    }
    # The person's own edits; a value set by a handler (a clone fills ~100 fields at once) is checked once,
    # after that handler (change events would check the form once per field it set).
    gr.on([comp.input for comp in inputs], trigger_mode="always_last", **review)
    dependent = [fields[k] for k in STAGE_DEPENDENT_KEYS]
    for key in CHOICE_KEYS:
        fields[key].input(
            None, [*(fields[k] for k in CHOICE_KEYS), *dependent], dependent, js=choice_changed_js()
        ).then(**review)
    # After a language switch the option tooltips are the help texts again: put the problems back.
    ctx.on_language(handlers.review, [*inputs, marks], review_outputs, needs_selection=False, **REVIEW_QUEUE)
    side.estimate_btn.click(handlers.show_estimate, inputs, side.estimate)
    side.launch.click(handlers.launch, inputs, [side.launch_status, launched_run], concurrency_limit=1)
    importer = ImportHandlers(ctx, handlers.keys)
    imported = [*inputs, side.importer.status]
    side.importer.file.upload(importer.import_file, side.importer.file, imported).then(**review)
    side.importer.button.click(importer.import_text, side.importer.text, imported).then(**review)
    handlers.review_wiring = review
