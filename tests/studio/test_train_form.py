"""The Train form is built from the engine's schema: every training key of every stage and fine-tuning is
reachable with the engine's default, bounds and choices; a new key appears with no UI code; each change is
checked by the engine, its message beside the field, and Launch waits until nothing is wrong."""

from __future__ import annotations

import dataclasses

import gradio as gr
import pytest
from studio_helpers import DEMO_DPO, DEMO_SFT

from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.options import FINE_TUNING, OPTION_GROUPS, field_info, option
from engine.train.run_checks import defaults_for, not_applicable
from engine.train.stages import STAGES
from studio.config import Settings
from studio.migrate import upgrade
from studio.services import datasets as datasets_svc
from studio.ui import train_form
from studio.ui.context import UIContext
from studio.ui.i18n import CONFIG_HELP_ZH, STRINGS, Texts, config_texts, text
from studio.ui.train_form import (
    OPTION_KEYS,
    OPTIONS,
    STUDIO_SOURCES,
    TOP_KEYS,
    form_options,
    matching_options,
    option_field,
    problem_field,
    range_text,
    search_updates,
)
from studio.ui.train_tab import build_train_tab, form_defaults, hyperparameters, run_spec

KINDS = {
    "choice": gr.Dropdown,
    "choices": gr.Dropdown,
    "model_flag": gr.Dropdown,
    "flag": gr.Checkbox,
    "int": gr.Number,
    "float": gr.Number,
    "text": gr.Textbox,
}


@pytest.fixture(scope="module")
def tab():
    with gr.Blocks() as demo:
        return build_train_tab(UIContext(settings=None, texts=Texts(), demo=demo))


TAB_START = train_form.starting_marks("SFT", "LoRA", "fp32", "en")


def _other_value(key: str, default):
    """A value of ``key`` other than its default that the engine accepts (None: left to pass-through)."""
    option = OPTIONS[key]
    if option.kind == "choice":
        return next(c for c in option.choices if c != default)
    if option.kind == "choices":
        return [option.choices[0]]
    if option.kind == "model_flag":
        return "true"
    if option.kind == "flag":
        return not default
    if option.kind in ("int", "float"):
        lo, hi = option.minimum, option.maximum
        value = (default if default is not None else 0) + 1
        value = min(value, hi) if hi is not None else value
        if value == default:
            value = max(lo if lo is not None else value - 1, default - 1)
        return value / 4 if option.kind == "float" and (hi or 2) <= 1 else value
    return None


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fine_tuning", FINE_TUNING)
def test_every_option_of_every_stage_and_method_is_reachable_with_the_engines_facts(tab, stage, fine_tuning):
    fields = tab.fields
    start = form_defaults(stage, fine_tuning)
    engine = defaults_for(stage, fine_tuning)
    for f in dataclasses.fields(TrainConfig):
        key, meta = f.name, f.metadata
        if key in STUDIO_SOURCES:  # set from another field of the form, or the studio's run directory
            source = STUDIO_SOURCES[key]
            assert source is None or source in fields or key == "text_dataset_path", key
            continue
        comp = fields[key]
        assert start[key] == train_form.form_value(key, engine[key]), key
        if key in TOP_KEYS:
            continue
        option = OPTIONS[key]
        assert isinstance(comp, KINDS[option.kind]), key
        assert (option.minimum, option.maximum) == (meta["minimum"], meta["maximum"]), key
        assert range_text(option) in train_form.help_text(key), key  # bounds shown; the engine checks them
        # the field starts as the first check would show it (help, or why it does not apply)
        assert [comp.info, comp.interactive is not False] == TAB_START[key][:2], key
        if meta["choices"] is not None:
            assert [c[1] for c in comp.choices] == list(meta["choices"]), key
        assert option.group == meta["group"] in OPTION_GROUPS, key
        # Reachable: a value other than the default goes from the field into the run's config, unless the
        # key does not apply to this stage and fine-tuning (then it is left out, and the form says why).
        other = _other_value(key, start[key])
        if other is None:
            continue
        form = start | {key: other}
        hyper = hyperparameters(form)
        if not_applicable(TrainConfig, key, stage, fine_tuning, start["compute_type"]):
            assert key not in hyper, key
            continue
        required = {"model_name_or_path": "/m", "train_dataset_path": "/d", "stage": stage}
        try:
            cfg = config_from_dict(TrainConfig, {**required, "fine_tuning": fine_tuning, **hyper})
        except ValueError as e:  # a value the engine refuses in this combination: still reached the engine
            assert key in str(e), (key, str(e))
            continue
        expected = train_form.config_value(key, other)
        got = getattr(cfg, key)
        assert (",".join(got) if isinstance(got, list) else got) == expected, key


def test_the_form_holds_every_key_but_the_studios_own(tab):
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(OPTION_KEYS) | set(TOP_KEYS) | set(STUDIO_SOURCES) == keys
    assert not set(OPTION_KEYS) & set(STUDIO_SOURCES)
    assert set(OPTION_KEYS) <= set(tab.fields) and set(TOP_KEYS) <= set(tab.fields)
    # one accordion per group, common options open, the rest folded
    assert list(tab.options.groups) == [g for g in OPTION_GROUPS if any(o.group == g for o in form_options())]
    assert tab.options.groups["schedule"].open and not tab.options.groups["elastic"].open
    assert tab.options.more["schedule"].open is False
    # folded options are off the page until their box opens (the tab opens with the common ones only)
    folded = {o.key for _, options in train_form.folds() for o in options}
    assert folded == {o.key for o in form_options() if not o.common}
    assert all(body.visible is False for body in tab.options.bodies.values())
    assert set(tab.options.bodies) == {fold for fold, _ in train_form.folds()}
    assert len(OPTION_KEYS) >= 75
    # a flag the model's config.json decides until it is set: left out of the run by default
    assert tab.fields["moe_use_aux_free"].value == "config.json"
    assert "moe_use_aux_free" not in hyperparameters(form_defaults("SFT", "Full"))


def test_a_new_schema_key_appears_in_the_form_with_no_ui_code(monkeypatch):
    knob = option(3, "A new knob.", minimum=0, maximum=9, group="optimizer", applies=train_form_applies())
    grown = dataclasses.make_dataclass("TrainConfig", [("new_knob", int, knob)], bases=(TrainConfig,))
    monkeypatch.setattr(train_form, "TrainConfig", grown)
    for key, value in config_texts(grown).items():  # what i18n registers for every key of the schema
        monkeypatch.setitem(STRINGS, key, value)
    train_form.form_options.cache_clear()
    try:
        option_ = next(o for o in train_form.form_options() if o.key == "new_knob")
        assert (option_.group, option_.kind, option_.default) == ("optimizer", "int", 3)
        assert (option_.minimum, option_.maximum) == (0, 9)
        with gr.Blocks():
            comp = option_field(Texts(), option_, 3)
        assert isinstance(comp, gr.Number) and comp.value == 3 and comp.label == "new_knob"
        assert comp.info == "A new knob. [0 … 9]"
    finally:
        train_form.form_options.cache_clear()


def train_form_applies():
    from engine.train.options import DPO_RUNS

    return DPO_RUNS


def test_options_that_do_not_apply_say_why_from_the_schema():
    assert not_applicable(TrainConfig, "beta", "SFT", "LoRA", "fp32") == [("stage", "DPO")]
    assert not_applicable(TrainConfig, "lora_rank", "SFT", "Full", "fp32") == [("adapters", "LoRA")]
    assert not_applicable(TrainConfig, "lora_rank", "SFT", "Full", "wint8") == []  # a quantized base: LoRA
    assert not_applicable(TrainConfig, "gpas", "SFT", "LoRA", "fp32") == [("adapters", "Full")]
    assert not_applicable(TrainConfig, "fp8_hadamard", "SFT", "Full", "bf16") == [("compute_type", "fp8")]
    update = train_form.option_update("beta", [], [("stage", "DPO")], "zh")
    assert update["interactive"] is False and update["info"] == "此处不生效：仅适用于阶段 DPO。"
    update = train_form.option_update("elastic", [], [("model", "text-moe")])
    assert update["info"] == "Not used here: applies to text MoE models only."
    # the run gets no key that does not apply
    form = form_defaults("SFT", "Full") | {"beta": 0.5, "lora_rank": 64}
    assert "beta" not in hyperparameters(form) and "lora_rank" not in hyperparameters(form)


def test_search_finds_options_by_name_and_help_in_english_and_chinese():
    assert "rslora" in matching_options("rslora")
    assert {"warmup_steps", "warmup_ratio"} <= set(matching_options("warm-up"))
    assert "learning_rate" in matching_options("学习率") and "lora_plus_scale" in matching_options("学习率")
    assert matching_options("") == list(OPTION_KEYS)
    updates = search_updates("recompute")
    shown = {k for k, u in zip(OPTION_KEYS, updates, strict=False) if u["visible"]}
    assert {"recompute", "recompute_granularity", "use_recompute_moe"} <= shown and "lora_rank" not in shown
    assert search_updates("no such option at all")[-1] == "No option matches “no such option at all”."
    # a match in a folded box puts its fields on the page
    folds = [fold for fold, _ in train_form.folds()]
    bodies = dict(zip(folds, updates[-1 - len(folds) : -1], strict=True))
    assert bodies["precision"]["visible"] is True and bodies["gpas"] == gr.skip()


def test_every_key_group_and_form_text_has_chinese():
    for f in dataclasses.fields(TrainConfig):
        assert f.name in CONFIG_HELP_ZH, f"{f.name}: add its Chinese help to CONFIG_HELP_ZH"
        assert text(f"tr.{f.name}.info", "en") == field_info(TrainConfig, f.name)["help"]
    for group in OPTION_GROUPS:
        en, zh = STRINGS[f"tr.group.{group}"]
        assert en and zh and (en != zh or group in ("lora", "dpo", "moe", "gpas"))


def test_problems_land_on_the_field_they_name():
    assert problem_field("lora_rank must be >= 1, got 0") == "lora_rank"
    assert problem_field("set max_steps >= 1 or num_train_epochs > 0") == "max_steps"
    assert problem_field("num_devices: 32 devices of one node are more than ...") == "num_devices"
    assert problem_field("train_dataset_path is required (comma-separated files for mixing)") == "dataset_ids"
    assert problem_field("gradient_checkpointing is not a number") == "recompute"  # ERNIEKit's name
    assert problem_field("something about nothing") is None


# ---- the live check, against a real store ------------------------------------------------------------------


@pytest.fixture(scope="module")
def form(tmp_path_factory):
    """A built Train tab on a real store, its handlers and the starting values with the demo dataset picked
    (one per module: the checks only read the store)."""
    settings = Settings(home=tmp_path_factory.mktemp("form") / "home", max_upload_mb=2)
    upgrade(settings)
    with gr.Blocks() as demo:
        built = build_train_tab(UIContext(settings=settings, texts=Texts(), demo=demo))
    ctx = built.handlers.ctx
    sft = ctx.call(datasets_svc.upload_dataset, settings, str(DEMO_SFT)).id
    dpo = ctx.call(datasets_svc.upload_dataset, settings, str(DEMO_DPO)).id
    values = {k: c.value for k, c in built.fields.items()} | {"base_model": "tiny", "dataset_ids": [sft]}
    return built, values, {"sft": sft, "dpo": dpo}


def _review(built, values):
    return _review_all(built, values)[:5]


def _review_all(built, values):
    """The review's updates: per option, per group and "More options" box, Launch, the problems, the YAML,
    and per fold's fields (by fold id)."""
    out = built.handlers.review(*(values[k] for k in built.handlers.keys))
    n = len(OPTION_KEYS)
    updates = dict(zip(OPTION_KEYS, out[:n], strict=True))
    g = n + len(built.options.groups) + len(built.options.more)
    groups = out[n:g]
    folds = [fold for fold, _ in train_form.folds()]
    bodies = dict(zip(folds, out[g : g + len(folds)], strict=True))
    launch, problems, yaml_text, _, _ = out[-5:]
    return updates, groups, launch, problems, yaml_text, bodies


def test_each_change_shows_the_engines_message_beside_its_field_and_launch_waits(form):
    built, values, _ = form
    updates, _, launch, problems, yaml_text = _review(built, values)
    assert launch["interactive"] is True and problems == "" and "lora_rank: 8" in yaml_text
    assert updates["beta"]["interactive"] is False  # SFT: the DPO options say why they are off

    # a value out of the engine's bounds
    updates, groups, launch, problems, _ = _review(built, values | {"lora_rank": 0})
    assert updates["lora_rank"]["info"] == "⚠️ lora_rank must be >= 1, got 0"
    assert "tr-invalid" in updates["lora_rank"]["elem_classes"]
    assert launch["interactive"] is False and "lora_rank must be >= 1, got 0" in problems
    assert groups[list(built.options.groups).index("lora")]["open"] is True

    # a choice the engine does not know, and a combination that does not hold
    bad = values | {"freeze_config": "freeze_everything", "fine_tuning": "Full"}
    updates, *_ = _review(built, bad)
    assert "freeze_config must be one of freeze_vision, freeze_lm" in updates["freeze_config"]["info"]
    updates, _, launch, *_ = _review(built, values | {"elastic_topk_choices": "1"})
    assert "elastic_topk_choices is set but elastic is false" in updates["elastic_topk_choices"]["info"]
    assert launch["interactive"] is False

    # the model decides too: elastic top-k above the tiny MoE model's moe_k
    moe = values | {"base_model": "tiny-moe", "elastic": True, "elastic_topk_choices": "1,64"}
    updates, _, launch, problems, _ = _review(built, moe)
    assert (
        "elastic_topk_choices 64: k' must be between 1 and the model's moe_k"
        in updates["elastic_topk_choices"]["info"]
    )
    assert launch["interactive"] is False
    ok = values | {"base_model": "tiny-moe", "elastic": True, "elastic_topk_choices": "1"}
    assert _review(built, ok)[2]["interactive"] is True

    # in Chinese, the help and the reasons are Chinese; unknown values keep the engine's words
    assert updates["learning_rate"]["info"].startswith("Peak learning rate")


def test_a_check_sends_only_the_fields_whose_message_changed(form):
    built, values, _ = form
    args = [values[k] for k in built.handlers.keys]
    start = train_form.starting_marks("SFT", "LoRA", "fp32", "en")
    out = built.handlers.review(*args, start)
    # the tiny dense model: only the options it cannot use change (e.g. the MoE ones), the rest are skipped
    sent = {k for k, u in zip(OPTION_KEYS, out, strict=False) if u != gr.skip()}
    assert sent and "moe_use_aux_free" in sent and "learning_rate" not in sent and "lora_rank" not in sent
    marks = out[-1]
    out = built.handlers.review(*[values[k] if k != "lora_rank" else 0 for k in built.handlers.keys], marks)
    sent = {k for k, u in zip(OPTION_KEYS, out, strict=False) if u != gr.skip()}
    assert sent == {"lora_rank"} and "lora_rank must be >= 1" in out[OPTION_KEYS.index("lora_rank")]["info"]
    # the field is built as the first check would show it: an option that does not apply starts disabled
    assert built.fields["beta"].interactive is False and built.fields["lora_rank"].interactive is not False


def test_with_no_dataset_the_options_are_still_checked(form):
    built, values, _ = form
    updates, _, launch, problems, _, bodies = _review_all(
        built, values | {"dataset_ids": [], "max_grad_norm": -1}
    )
    assert launch["interactive"] is False and "dataset_ids" in problems
    assert updates["max_grad_norm"]["info"] == "⚠️ max_grad_norm must be >= 0, got -1.0"
    # a folded field with a wrong value is put on the page (its box opens), the others are left as they are
    assert bodies["optimizer-more"] == {"__type__": "update", "visible": True}
    assert all(u == gr.skip() for fold, u in bodies.items() if fold != "optimizer-more")


def test_a_dpo_form_reaches_the_dpo_options(form):
    built, values, ids = form
    dpo = values | {
        "stage": "DPO",
        "dataset_ids": [ids["dpo"]],
        "label_smoothing": 0.1,
        "reference_free": True,
    }
    updates, _, launch, problems, yaml_text = _review(built, dpo)
    assert launch["interactive"] is True, problems
    assert "label_smoothing: 0.1" in yaml_text and "reference_free: true" in yaml_text
    assert updates["beta"]["interactive"] is True
    spec = run_spec(dpo)
    assert spec.hyperparameters["label_smoothing"] == 0.1
