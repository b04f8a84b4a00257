"""What every tab builder gets: settings, the text registry, and a way to call a service function."""

from __future__ import annotations

import hashlib
import logging
import pickle
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gradio as gr
import pandas as pd

from engine.messages import Message
from studio.config import Settings
from studio.db import session_scope
from studio.services.errors import ServiceError
from studio.ui.i18n import DEFAULT_LANGUAGE, STRINGS, Texts, current_language, localize_message, text

log = logging.getLogger(__name__)
T = TypeVar("T")


def refusal_lines(err: ServiceError) -> list[str]:
    """A refusal as the lines a tab lists, each still a keyed message where it was one (to be shown in the
    session's language): a refusal heading its problems is its head and each problem of ``details``, another
    keyed message one line, a plain text line by line."""
    message = err.message
    problems = err.details.get("problems") if isinstance(err.details, dict) else None
    if (
        isinstance(message, Message)
        and message.key == "services.with_problems"
        and isinstance(problems, list)
    ):
        return [message.fields["head"], *problems]
    if isinstance(message, Message):
        return [message]
    return [m for m in message.splitlines() if m]


def refusal(message: str) -> gr.Error:
    """The error a handler raises when it cannot do what was asked: its toast says why and stays until the
    person closes it (the page's CSS hides Gradio's bare "Error" badge on the outputs, so this is the one
    place the failure shows)."""
    return gr.Error(message, duration=None, print_exception=False)


@dataclass
class LanguageFollower:
    """An event run again after a language switch, so text a handler made shows in the new language."""

    fn: Callable[..., Any]
    inputs: Any
    outputs: Any
    options: dict[str, Any] = field(default_factory=dict)  # the event's own (a queue it shares)


@dataclass
class UIContext:
    settings: Settings
    texts: Texts
    demo: gr.Blocks
    language_followers: list[LanguageFollower] = field(default_factory=list)

    def on_language(
        self,
        fn: Callable[..., Any],
        inputs: Any,
        outputs: Any,
        *,
        needs_selection: bool = True,
        **options: Any,
    ) -> None:
        """Run ``fn(inputs) -> outputs`` after every language switch (and after the language is restored
        when the page loads). With ``needs_selection``, ``inputs`` start with a selection (an id) and with
        none it changes nothing (on load it may run before the selection is restored). ``options`` go to the
        event (``concurrency_id``...)."""
        count = len(outputs) if isinstance(outputs, list | tuple) else 1

        def follow(selection: Any, *rest: Any) -> Any:
            if needs_selection and parse_id(selection) is None:
                return gr.skip() if count == 1 else tuple(gr.skip() for _ in range(count))
            result = fn(selection, *rest)
            # A generator handler (one that says it is busy first) is run to its last value.
            return deque(result, maxlen=1)[0] if isinstance(result, Iterator) else result

        self.language_followers.append(LanguageFollower(follow, inputs, outputs, options))

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a service function in its own session; its error message becomes a visible Gradio error (in the
        session's language: a keyed message by its key)."""
        try:
            with session_scope(self.settings) as session:
                return fn(session, *args, **kwargs)
        except ServiceError as e:
            raise refusal(localize_message(e.message, current_language())) from e

    def attempt(
        self, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> tuple[T | None, ServiceError | None]:
        """Run a service function and hand back its error instead of raising (to show details in place)."""
        try:
            with session_scope(self.settings) as session:
                return fn(session, *args, **kwargs), None
        except ServiceError as e:
            return None, e

    def stream(self, fn: Callable[..., Iterator[T]], *args: Any, **kwargs: Any) -> Iterator[T]:
        """Iterate a streaming service function; its session is closed once the stream is set up."""
        try:
            with session_scope(self.settings) as session:
                deltas = fn(session, *args, **kwargs)
            yield from deltas
        except ServiceError as e:
            raise refusal(localize_message(e.message, current_language())) from e

    def read(self, fn: Callable[..., T], *args: Any, default: T, **kwargs: Any) -> T:
        """Like :meth:`call` for background refreshes: a failure is logged and ``default`` returned."""
        try:
            with session_scope(self.settings) as session:
                return fn(session, *args, **kwargs)
        except ServiceError as e:
            log.info("UI refresh %s failed: %s", getattr(fn, "__name__", fn), e.message)
            return default


class SentValues:
    """What a timer last sent each browser session for its outputs, so a tick sends only the values that
    changed.

    Gradio's page redoes its state for every value it receives, at a cost that grows with the number of
    components on the page: the Runs tab's tick re-sent its table, four plots, the log and the buttons every
    2 s, unchanged, and kept the browser's renderer 70-90% busy on a page nobody touched. An event other
    than the tick that writes the same outputs calls :meth:`forget`, so the next tick sends them all again
    (it cannot skip a value the page no longer shows).
    """

    def __init__(self, sessions: int = 1000) -> None:
        self._sent: OrderedDict[str, list[bytes | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._sessions = sessions

    def changed(self, request: gr.Request | None, values: Sequence[Any]) -> tuple[Any, ...]:
        """``values`` with those this session was last sent replaced by ``gr.skip()``."""
        session = getattr(request, "session_hash", None)
        if not session:
            return tuple(values)
        digests = [value_digest(v) for v in values]
        with self._lock:
            before = self._sent.pop(session, None)
            if before is None or len(before) != len(digests):
                before = [None] * len(digests)
            # a value skipped by the handler itself leaves what the page shows, and its digest, as they were
            self._sent[session] = [d if d is not None else b for d, b in zip(digests, before, strict=True)]
            while len(self._sent) > self._sessions:
                self._sent.popitem(last=False)
        return tuple(
            gr.skip() if d is not None and d == b else v
            for v, d, b in zip(values, digests, before, strict=True)
        )

    def forget(self, request: gr.Request | None) -> None:
        session = getattr(request, "session_hash", None)
        if session:
            with self._lock:
                self._sent.pop(session, None)


def value_digest(value: Any) -> bytes | None:
    """A digest of a handler's output value (None for ``gr.skip()``)."""
    if isinstance(value, dict) and set(value) == {"__type__"}:
        return None
    try:
        data = pickle.dumps(_plain(value), protocol=5)
    except (pickle.PicklingError, TypeError, AttributeError):
        data = repr(value).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def _plain(value: Any) -> Any:
    if isinstance(value, pd.DataFrame):
        return ("frame", [str(c) for c in value.columns], value.to_numpy().tolist(), value.index.tolist())
    if isinstance(value, dict):
        return ("dict", sorted((str(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("list", [_plain(v) for v in value])
    return value


def ranks_text(ranks: list[int]) -> str:
    """0-3 for a run of consecutive ranks, 2 for one."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]) if ranks else ""


def parse_id(choice: Any) -> int | None:
    """Dropdown choices are ``(label, id)`` pairs; the value comes back as an int or a numeric string."""
    if choice in (None, ""):
        return None
    try:
        return int(choice)
    except (TypeError, ValueError):
        return None


def fmt_time(dt: Any) -> str:
    return dt.strftime("%Y-%m-%d %H:%M:%S") if dt is not None else ""


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def model_choices(models: list[dict[str, Any]], lang: str = DEFAULT_LANGUAGE) -> list[tuple[str, str]]:
    """``list_models`` entries -> dropdown choices whose values are the refs a RunSpec takes."""
    choices = []
    for m in models:
        ref = m["name"]  # every name /models lists is accepted back as a base model
        label = m["name"] if m.get("kind") != "run" else f"{m['name']} ({m.get('run_name', '')})"
        size = ""
        if m.get("num_parameters"):
            size = f" · {_count(m['num_parameters'])}"
            active = m.get("active_parameters")
            if active and active < m["num_parameters"] * 0.9:
                size += text("model.active", lang, n=_count(active))
            if m.get("kind") == "official" and m.get("weights_bf16_bytes"):
                size += text("model.bf16_size", lang, gb=m["weights_bf16_bytes"] / 2**30)
        if m.get("available") or m.get("kind") == "preset":
            tag = " · LoRA" if m.get("adapter") else ""
        else:
            tag = text("model.base_missing" if m.get("adapter") else "model.not_downloaded", lang)
        kind = m.get("kind") or ""
        kind = text(f"model.kind.{kind}", lang) if f"model.kind.{kind}" in STRINGS else kind
        choices.append((f"{label} [{kind}]{size}{tag}", ref))
    return choices


def echo(value: Any) -> Any:
    """Hand a component's value to another one unchanged (e.g. a selection into browser storage)."""
    return value
