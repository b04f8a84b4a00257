"""English and Chinese UI text, and the registry that relabels every component when the language changes.

Gradio's own ``gr.I18n`` follows the browser locale only; ERNIEKit's users switch by hand, so labels are
set on the server: each builder creates components through :class:`Texts`, which remembers which text
key goes to which property, and the language switch returns one ``gr.update`` per registered component.

The tables live beside this module, by area: `forms` (the app, Datasets and Train), `views` (Runs, Compare,
Deploy, Nodes, Sweeps, Evaluate, column headers), `runtime` (text handlers format) and `config_help` (the
Chinese of the config keys' tooltips). Messages the engine and the services build are keyed, and their Chinese
is in ``studio.messages`` (by key, never by parsing the sentence).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import gradio as gr
import pandas as pd
from gradio.context import LocalContext

from engine.train.config import TrainConfig
from studio.messages import DEFAULT_LANGUAGE, LANGUAGES, localize
from studio.ui.i18n.config_help import CONFIG_HELP_ZH
from studio.ui.i18n.forms import FORM_LABELS
from studio.ui.i18n.runtime import RUNTIME_STRINGS
from studio.ui.i18n.views import VIEW_LABELS

# key -> (English, Chinese): every table joined. Keys ending in ".info" are tooltips (Gradio's ``info=``).
STRINGS: dict[str, tuple[str, str]] = {**FORM_LABELS, **VIEW_LABELS}
STRINGS.update(RUNTIME_STRINGS)


def config_texts(cls: type) -> dict[str, tuple[str, str]]:
    """The texts of every key of a config schema: its name as the label (the same in both languages: it is
    what YAML files say) and the engine's help as the English tooltip. A key the schema gains shows its
    English help in Chinese until CONFIG_HELP_ZH has it (tests/studio/test_train_form.py asks for it)."""
    out: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(cls):
        out[f"tr.{f.name}"] = (f.name, f.name)
        out[f"tr.{f.name}.info"] = (f.metadata["help"], CONFIG_HELP_ZH.get(f.name, f.metadata["help"]))
    return out


STRINGS.update(
    {k: v for k, v in config_texts(TrainConfig).items() if k not in STRINGS or k.endswith(".info")}
)

# A shown header (in either language) -> the English header it stands for.
_HEADER_SOURCE = {
    shown: key[len("col.") :] for key, pair in STRINGS.items() if key.startswith("col.") for shown in pair
}
# The language each browser session last switched to, by Gradio session hash. Callbacks read it to
# translate table headers, since a Dataframe's headers come from the value a callback returns.
_SESSION_LANGUAGE: OrderedDict[str, str] = OrderedDict()
_SESSION_LANGUAGE_MAX = 10_000


def text(key: str, lang: str = DEFAULT_LANGUAGE, **fields: Any) -> str:
    """The text for ``key`` in ``lang`` (English when the language is unknown), ``fields`` filled in."""
    en, zh = STRINGS[key]
    chosen = zh if lang == "zh" else en
    return chosen.format(**fields) if fields else chosen


def localize_message(message: str, lang: str = DEFAULT_LANGUAGE) -> str:
    """A message a service or the engine wrote, as the UI shows it in ``lang``: a keyed message
    (``engine.messages.Message``) by its key (``studio.messages``), anything else as it is. The REST API
    translates by ``Accept-Language`` with the same tables."""
    return localize(message, lang)


def status_text(status: str, lang: str = DEFAULT_LANGUAGE) -> str:
    """A run's, export's or deployment's status in ``lang`` (an unknown one is shown as stored)."""
    key = f"status.{status}"
    return text(key, lang) if key in STRINGS else status


def header(column: str, lang: str) -> str:
    """A table header in ``lang``; ``column`` may be shown in either language, unknown ones are kept."""
    source = _HEADER_SOURCE.get(column)
    return text(f"col.{source}", lang) if source is not None else column


def headers_in(frame: pd.DataFrame, lang: str) -> bool:
    """Whether every column header of ``frame`` is already shown in ``lang``."""
    return all(header(str(c), lang) == str(c) for c in frame.columns)


def localize_frame(frame: pd.DataFrame, lang: str) -> pd.DataFrame:
    """``frame`` with its column headers in ``lang``."""
    return frame.rename(columns={c: header(str(c), lang) for c in frame.columns})


def _session_hash() -> str | None:
    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None) if request is not None else None


def remember_language(lang: str) -> None:
    """Record ``lang`` for the browser session of the running callback (no-op outside a callback)."""
    session = _session_hash()
    if session is None:
        return
    _SESSION_LANGUAGE[session] = lang if lang in LANGUAGES else DEFAULT_LANGUAGE
    _SESSION_LANGUAGE.move_to_end(session)
    while len(_SESSION_LANGUAGE) > _SESSION_LANGUAGE_MAX:
        _SESSION_LANGUAGE.popitem(last=False)


def current_language() -> str:
    """The language of the browser session whose callback is running (the default outside one)."""
    session = _session_hash()
    return _SESSION_LANGUAGE.get(session, DEFAULT_LANGUAGE) if session else DEFAULT_LANGUAGE


class Texts:
    """Creates components with translated labels and relabels all of them when the language changes."""

    def __init__(self, lang: str = DEFAULT_LANGUAGE):
        self.lang = lang
        # (component, {property: key})
        self._bound: list[tuple[gr.components.Component | gr.blocks.BlockContext, dict[str, str]]] = []
        self.tables: list[gr.Dataframe] = []
        # Components that show Gradio's own texts ("Drop File Here"): drawn again after a language switch.
        self.uploads: list[gr.File] = []

    def __call__(self, key: str) -> str:
        return text(key, self.lang)

    def make(
        self,
        factory: Callable[..., Any],
        key: str,
        *,
        prop: str = "label",
        also: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``factory(label=text(key), info=text(key + '.info') if present, **kwargs)``, remembered for relabelling.

        ``also`` names more translated properties, e.g. a plot's ``{"x_title": "plot.step"}``.
        """
        props = {prop: key, **(also or {})}
        kwargs.update({p: self(k) for p, k in props.items()})
        if prop == "label" and f"{key}.info" in STRINGS and "info" not in kwargs:
            props["info"] = f"{key}.info"
            kwargs["info"] = self(f"{key}.info")
        component = factory(**kwargs)
        self._bound.append((component, props))
        if isinstance(component, gr.Dataframe):
            self.tables.append(component)
        if isinstance(component, gr.File):
            self.uploads.append(component)
        return component

    def bind(self, component: Any, **props: str) -> Any:
        """Remember that ``component``'s properties (e.g. ``label="tab.runs"``) come from text keys."""
        self._bound.append((component, props))
        return component

    @property
    def components(self) -> list[Any]:
        return [c for c, _ in self._bound]

    def updates(self, lang: str, frames: list[Any] | None = None) -> list[dict[str, Any]]:
        """One ``gr.update`` per bound component, in :attr:`components` order.

        ``frames`` are the current values of :attr:`tables`; those whose headers are not all in ``lang`` come
        back translated. The others get no value: ``frames`` are what the page held when the event was sent,
        and a table filled meanwhile (the page's load events run beside the language restore) must not be set
        back to that older value (a fresh page lost its Nodes table that way, keeping only its header).
        """
        lang = lang if lang in LANGUAGES else DEFAULT_LANGUAGE
        values = dict(zip(map(id, self.tables), frames or [], strict=False))
        out = []
        for component, props in self._bound:
            update = gr.update(**{p: text(k, lang) for p, k in props.items()})
            frame = values.get(id(component))
            if isinstance(frame, pd.DataFrame) and not headers_in(frame, lang):
                update["value"] = localize_frame(frame, lang)
            out.append(update)
        return out

    def localize_tables(self, demo: gr.Blocks) -> None:
        """Make every event that fills a table return it with headers in its session's language.

        Called once the Blocks is built, so no tab has to pass the language through its callbacks.
        """
        table_ids = {t._id for t in self.tables}
        for block_fn in demo.fns.values():
            fn = block_fn.fn
            outputs = [getattr(o, "_id", None) in table_ids for o in block_fn.outputs]
            if fn is None or not any(outputs) or inspect.isgeneratorfunction(fn):
                continue
            if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
                continue
            block_fn.fn = _localizing(fn, outputs)


def _localizing(fn: Callable[..., Any], is_table: list[bool]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        lang = current_language()
        single = len(is_table) == 1
        values = [result] if single else result
        if not isinstance(values, list | tuple) or len(values) != len(is_table):
            return result
        fixed = [_localize_value(v, lang) if table else v for v, table in zip(values, is_table, strict=True)]
        return fixed[0] if single else type(values)(fixed) if isinstance(values, tuple) else fixed

    return wrapper


def _localize_value(value: Any, lang: str) -> Any:
    if isinstance(value, pd.DataFrame):
        return localize_frame(value, lang)
    if isinstance(value, dict) and isinstance(value.get("value"), pd.DataFrame):
        return {**value, "value": localize_frame(value["value"], lang)}
    return value
