"""The Train form's options, built from the engine's schema (``engine.train.config.TrainConfig``).

Every training key the studio does not fill in itself becomes one field: its kind, default, bounds and
choices from the key's type and ``option(...)`` metadata, its group (data, schedule, ...) and whether it is
common (shown unfolded) from the same metadata, and whether it has an effect on the chosen stage, fine-tuning,
compute type and model from its ``applies``. A key added to the schema is in the form with no code here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

import gradio as gr

from engine.models.config import ErnieConfig
from engine.train.config import TrainConfig
from engine.train.options import OPTION_GROUPS
from engine.train.run_checks import defaults_for, not_applicable, problem_key
from engine.train.stages import STAGE_DEFAULTS
from studio.ui.i18n import DEFAULT_LANGUAGE, STRINGS, Texts, localize_message, text

# In the choice rows above the groups (radios and a dropdown of their own).
TOP_KEYS = ("stage", "fine_tuning", "compute_type")
# Keys the studio fills in for a run, each from the form field that sets it (None: the studio's own run
# directory, runs/<id>/output); they are not fields of their own.
STUDIO_SOURCES: dict[str, str | None] = {
    "model_name_or_path": "base_model",
    "train_dataset_type": "dataset_ids",
    "train_dataset_path": "dataset_ids",
    "train_dataset_prob": "dataset_probs",
    "eval_dataset_type": "eval_dataset_ids",
    "eval_dataset_path": "eval_dataset_ids",
    "eval_dataset_prob": "eval_dataset_ids",
    "text_dataset_path": "text_dataset_ids",
    "output_dir": None,
    "logging_dir": None,
}
# Keys whose None default is resolved per stage (STAGE_DEFAULTS): the form always holds a value for them.
_RESOLVED = {key for values in STAGE_DEFAULTS.values() for key in values}
OPTIONS_PER_ROW = 4
# The choices of a flag that may be left to the model's config.json (``bool | None``): the first keeps the
# model's value (a name both languages show as it is).
MODEL_FLAG_CHOICES = ("config.json", "true", "false")


@dataclass(frozen=True)
class FormOption:
    """One training key as the form shows it."""

    key: str
    group: str
    common: bool
    kind: str  # choice, choices (several), flag, model_flag (true / false / the model's), int, float, text
    default: Any
    minimum: float | None
    maximum: float | None
    choices: tuple[str, ...] | None

    @property
    def elem_id(self) -> str:
        return f"tr-{self.key.replace('_', '-')}"


def _kind(tp: Any, key: str, choices: tuple[str, ...] | None) -> str:
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    base = [a for a in args if a is not type(None)]
    optional = type(None) in args and key not in _RESOLVED
    if any(typing.get_origin(a) is list for a in base):
        return "choices" if choices else "text"
    if bool in base:
        return "model_flag" if optional else "flag"
    if int in base:
        return "int"
    if float in base:
        return "float"
    return "choice" if choices else "text"


@functools.cache
def form_options() -> tuple[FormOption, ...]:
    """Every option field of the form, in schema order (the top rows' keys and the studio's own left out)."""
    hints = typing.get_type_hints(TrainConfig)
    defaults = dataclasses.asdict(TrainConfig())
    out = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in TOP_KEYS or f.name in STUDIO_SOURCES:
            continue
        meta = f.metadata
        out.append(
            FormOption(
                key=f.name,
                group=meta.get("group") or "run",
                common=bool(meta.get("common")),
                kind=_kind(hints[f.name], f.name, meta.get("choices")),
                default=defaults[f.name],
                minimum=meta.get("minimum"),
                maximum=meta.get("maximum"),
                choices=meta.get("choices"),
            )
        )
    return tuple(out)


OPTIONS: dict[str, FormOption] = {o.key: o for o in form_options()}
OPTION_KEYS: tuple[str, ...] = tuple(OPTIONS)


def grouped_options() -> list[tuple[str, list[FormOption]]]:
    """(group, its options) in OPTION_GROUPS order, common options first; a group without options is left out."""
    out = []
    for group in OPTION_GROUPS:
        members = [o for o in form_options() if o.group == group]
        if members:
            out.append((group, sorted(members, key=lambda o: not o.common)))
    return out


# ---- values between the form and a config --------------------------------------------------------------


def form_value(key: str, value: Any) -> Any:
    """A config value as the field of ``key`` holds it."""
    option = OPTIONS.get(key)
    if option is None:
        return value
    if option.kind == "model_flag":
        if value in MODEL_FLAG_CHOICES:  # already a field value
            return value
        return MODEL_FLAG_CHOICES[0] if value is None else str(bool(value)).lower()
    if option.kind == "choices":
        return (
            list(value) if isinstance(value, list | tuple) else [v for v in str(value or "").split(",") if v]
        )
    if option.kind == "text" and isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value


def form_defaults(stage: str, fine_tuning: str) -> dict[str, Any]:
    """The values the form starts with for ``stage`` and ``fine_tuning``: the engine's, one per config key
    (the choice rows' and every option's)."""
    defaults = defaults_for(stage, fine_tuning)
    return {key: form_value(key, defaults[key]) for key in (*TOP_KEYS, *OPTION_KEYS)}


def probs_text(probs: list[float] | None) -> str:
    """Dataset probabilities as the form's field holds them (``0.7, 0.3``; empty: an even mix)."""
    return ", ".join(f"{p:g}" for p in probs or [])


def config_value(key: str, value: Any) -> Any:
    """A field's value as the run's config takes it; None leaves the key out (the engine's default)."""
    option = OPTIONS.get(key)
    if value is None or value == "" or value == []:
        return None
    if option is None:
        return value
    if option.kind == "model_flag":
        return None if value == MODEL_FLAG_CHOICES[0] else value == "true"
    if option.kind == "choices":
        return ",".join(value)  # a run's hyperparameters are plain values; the engine splits the list
    if option.kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def folded_groups() -> list[tuple[str, list[FormOption]]]:
    """The groups that fold their uncommon options under "More options", with those options."""
    return [
        (group, [o for o in options if not o.common])
        for group, options in grouped_options()
        if any(o.common for o in options) and any(not o.common for o in options)
    ]


def folds() -> list[tuple[str, list[FormOption]]]:
    """Every folded box with the options it holds, as (id, options): a group without common options (id: the
    group), then each group's "More options" (id: ``<group>-more``). Their fields are put on the page when the
    box is first opened (or a search or a wrong value opens it), so the tab opens with the common ones only."""
    closed = [(group, options) for group, options in grouped_options() if not any(o.common for o in options)]
    return [*closed, *((f"{group}-more", options) for group, options in folded_groups())]


# ---- what applies ---------------------------------------------------------------------------------------


def unmet(
    key: str, stage: str, fine_tuning: str, compute_type: str, model: ErnieConfig | None = None
) -> list:
    """Why ``key`` has no effect on a run of these choices (the schema's ``applies``), as (what, needed)."""
    return not_applicable(TrainConfig, key, stage, fine_tuning, compute_type, model)


def unmet_text(reasons: list[tuple[str, str]], lang: str = DEFAULT_LANGUAGE) -> str:
    """The reasons a key does not apply, as the form shows them."""
    parts = [
        text(f"tr.na.model.{needed}", lang) if what == "model" else text(f"tr.na.{what}", lang, needed=needed)
        for what, needed in reasons
    ]
    return text("tr.na", lang, reasons="; ".join(parts))


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def range_text(option: FormOption) -> str:
    """The engine's bounds of a number, shown after its help (the engine checks them, with its message)."""
    lo, hi = option.minimum, option.maximum
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" [≥ {_number(lo)}]"
    if lo is None:
        return f" [≤ {_number(hi)}]"
    return f" [{_number(lo)} … {_number(hi)}]"


def help_text(key: str, lang: str = DEFAULT_LANGUAGE, option: FormOption | None = None) -> str:
    """An option's tooltip: the engine's help (Chinese from i18n) and its bounds."""
    option = option or OPTIONS.get(key)
    shown = text(f"tr.{key}.info", lang) if f"tr.{key}.info" in STRINGS else ""
    return shown + (range_text(option) if option else "")


# ---- problems by field ------------------------------------------------------------------------------------

# RunSpec fields a service message may start with ("num_devices: ...").
SPEC_PREFIXES = ("base_model", "dataset_ids", "dataset_probs", "eval_dataset_ids", "num_devices", "num_nodes")


def problem_field(message: str) -> str | None:
    """The form field a refusal is about: a spec field it starts with, else the training key it names."""
    head = message.split(":", 1)[0].strip()
    if head in SPEC_PREFIXES:
        return head
    key = problem_key(message)
    if key in STUDIO_SOURCES:
        return STUDIO_SOURCES[key]
    return key


def problems_by_field(problems: list[str]) -> dict[str | None, list[str]]:
    """Each problem under the field it is about (None: about no one field)."""
    out: dict[str | None, list[str]] = {}
    for message in problems:
        out.setdefault(problem_field(message), []).append(message)
    return out


def problems_markdown(problems: list[str], lang: str = DEFAULT_LANGUAGE) -> str:
    """The problems Launch waits on, each with the field it is about, beside the Launch button."""
    if not problems:
        return ""
    lines = [f"**{text('tr.problems', lang)}**"]
    for message in problems:
        field = problem_field(message)
        where = f"`{field}`: " if field and not message.startswith(f"{field}") else ""
        lines.append(f"- {where}{localize_message(message, lang)}")
    return "\n".join(lines)


def option_update(
    key: str, problems: list[str], reasons: list[tuple[str, str]], lang: str = DEFAULT_LANGUAGE
) -> dict[str, Any]:
    """One option field after a change: its engine error first, else why it does not apply, else its help."""
    if problems:
        shown = "  \n".join(text("tr.problem", lang, message=localize_message(m, lang)) for m in problems)
        return gr.update(info=shown, interactive=True, elem_classes=["tr-option", "tr-invalid"])
    if reasons:
        return gr.update(
            info=unmet_text(reasons, lang), interactive=False, elem_classes=["tr-option", "tr-na"]
        )
    return gr.update(info=help_text(key, lang), interactive=True, elem_classes=["tr-option"])


def option_mark(update: dict[str, Any]) -> list[Any]:
    """What an ``option_update`` shows (help or message, enabled, classes), to compare with what is shown."""
    return [update["info"], update["interactive"], list(update["elem_classes"])]


def starting_marks(stage: str, fine_tuning: str, compute_type: str, lang: str) -> dict[str, list[Any]]:
    """Each option's mark as the form is built (no model chosen yet, nothing wrong)."""
    return {
        key: option_mark(option_update(key, [], unmet(key, stage, fine_tuning, compute_type), lang))
        for key in OPTION_KEYS
    }


def changed_updates(
    updates: dict[str, dict[str, Any]], shown: dict[str, list[Any]] | None
) -> tuple[list[Any], dict[str, list[Any]]]:
    """The option updates (OPTION_KEYS order) whose mark differs from what the page shows (the rest skipped:
    an update to a field off the page costs the browser a redraw), and the marks shown after them."""
    marks = {key: option_mark(update) for key, update in updates.items()}
    shown = shown or {}
    out = [gr.skip() if shown.get(key) == marks[key] else updates[key] for key in OPTION_KEYS]
    return out, marks


# ---- search ------------------------------------------------------------------------------------------------


@functools.cache
def _haystack(key: str) -> str:
    option = OPTIONS[key]
    words = [key, *STRINGS.get(f"tr.{key}.info", ("", "")), *STRINGS[f"tr.group.{option.group}"]]
    return " ".join(words).lower()


def matching_options(query: str) -> list[str]:
    """The option keys whose name, help text or group (English or Chinese) holds every word of ``query``."""
    words = (query or "").lower().split()
    return [key for key in OPTION_KEYS if all(w in _haystack(key) for w in words)]


# ---- layout ------------------------------------------------------------------------------------------------


@dataclass
class OptionGroups:
    fields: dict[str, gr.components.Component]
    groups: dict[str, gr.Accordion]
    more: dict[str, gr.Accordion]
    search: gr.Textbox
    no_match: gr.Markdown
    # Per fold (``folds()`` order): the box, and the column holding its fields (off the page until opened).
    fold_boxes: dict[str, gr.Accordion]
    bodies: dict[str, gr.Column]

    def body_outputs(self) -> list[gr.Column]:
        return [self.bodies[fold] for fold, _ in folds()]


def option_field(
    t: Texts, option: FormOption, value: Any, mark: list[Any] | None = None
) -> gr.components.Component:
    """One option's component, its kind from the schema; bounds are shown, and checked by the engine. ``mark``
    (``starting_marks``) starts it disabled with the reason when it does not apply."""
    info, interactive, classes = mark or (help_text(option.key, t.lang, option), True, ["tr-option"])
    common = {
        "value": form_value(option.key, value),
        "elem_id": option.elem_id,
        "elem_classes": classes,
        "info": info,
        "interactive": interactive,
    }
    label = f"tr.{option.key}"
    if option.kind == "choice":
        return t.make(gr.Dropdown, label, choices=list(option.choices or ()), **common)
    if option.kind == "choices":
        return t.make(gr.Dropdown, label, choices=list(option.choices or ()), multiselect=True, **common)
    if option.kind == "model_flag":
        return t.make(gr.Dropdown, label, choices=list(MODEL_FLAG_CHOICES), **common)
    if option.kind == "flag":
        return t.make(gr.Checkbox, label, **common)
    if option.kind == "int":
        return t.make(gr.Number, label, precision=0, **common)
    if option.kind == "float":
        return t.make(gr.Number, label, **common)
    return t.make(gr.Textbox, label, max_lines=1, **common)


def _rows(t: Texts, options: list[FormOption], start: dict[str, Any], fields: dict[str, Any]) -> None:
    marks = starting_marks(start["stage"], start["fine_tuning"], start["compute_type"], t.lang)
    for first in range(0, len(options), OPTIONS_PER_ROW):
        with gr.Row(equal_height=False):
            for option in options[first : first + OPTIONS_PER_ROW]:
                fields[option.key] = option_field(t, option, start[option.key], marks[option.key])


def _folded_rows(
    t: Texts, fold: str, options: list[FormOption], start: dict[str, Any], fields: dict[str, Any]
) -> gr.Column:
    # Not visible: Gradio leaves the column's fields off the page (their values are kept and sent as usual)
    # until opening the box shows it; ~60 folded fields made the tab take seconds to open.
    with gr.Column(visible=False, elem_id=f"tr-fold-{fold}") as body:
        _rows(t, options, start, fields)
    return body


def build_option_groups(t: Texts, start: dict[str, Any]) -> OptionGroups:
    """The search box and one accordion per group: open when it holds common options (shown first), the
    rest of its options folded under "More options"; a folded box's fields are drawn when it first opens."""
    search = t.make(gr.Textbox, "tr.search", max_lines=1, elem_id="tr-search")
    no_match = gr.Markdown("", elem_id="tr-no-match")
    fields: dict[str, Any] = {}
    groups: dict[str, gr.Accordion] = {}
    more: dict[str, gr.Accordion] = {}
    fold_boxes: dict[str, gr.Accordion] = {}
    bodies: dict[str, gr.Column] = {}
    for group, options in grouped_options():
        common = [o for o in options if o.common]
        rest = [o for o in options if not o.common]
        elem = f"tr-group-{group}"
        with t.make(gr.Accordion, f"tr.group.{group}", open=bool(common), elem_id=elem) as box:
            groups[group] = box
            if not common:
                fold_boxes[group] = box
                bodies[group] = _folded_rows(t, group, rest, start, fields)
                continue
            _rows(t, common, start, fields)
            if rest:
                with t.make(gr.Accordion, "tr.more", open=False, elem_id=f"{elem}-more") as folded:
                    more[group] = fold_boxes[f"{group}-more"] = folded
                    bodies[f"{group}-more"] = _folded_rows(t, f"{group}-more", rest, start, fields)
    for fold, box in fold_boxes.items():
        box.expand(show_fold, None, bodies[fold], queue=False, show_progress="hidden")
    return OptionGroups(fields, groups, more, search, no_match, fold_boxes, bodies)


def show_fold() -> dict[str, Any]:
    """A folded box was opened: its fields go on the page."""
    return gr.update(visible=True)


def fold_updates(keys: set[str]) -> list[Any]:
    """One update per fold (``folds()`` order): shown when it holds one of ``keys``, else left as it is."""
    return [
        gr.update(visible=True) if any(o.key in keys for o in options) else gr.skip()
        for _, options in folds()
    ]


def search_updates(query: str, lang: str = DEFAULT_LANGUAGE) -> list[Any]:
    """The search box changed: one update per option (shown or not, in OPTION_KEYS order), then per group
    and per "More options" accordion (in ``grouped_options`` order), per fold's fields (``folds`` order),
    then the no-match line."""
    found = set(matching_options(query))
    searching = bool((query or "").strip())
    out: list[Any] = [gr.update(visible=key in found) for key in OPTION_KEYS]
    for _, options in grouped_options():
        hit = any(o.key in found for o in options)
        out.append(
            gr.update(visible=hit, open=True)
            if searching and hit
            else gr.update(visible=hit or not searching)
        )
    for _, folded in folded_groups():
        hit = any(o.key in found for o in folded)
        out.append(gr.update(open=True) if searching and hit else gr.skip())
    out += fold_updates(found if searching else set())
    out.append(text("tr.search.none", lang, query=query) if searching and not found else "")
    return out
