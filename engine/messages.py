"""Messages for a person as keys with fields: the engine and the services build them, the edge shows them.

A ``Message`` is the English sentence (it is a ``str``: logs, exceptions, the CLI and the REST API's
``message`` read it as they always did) that also carries the key and the fields it was made from, so the UI
and the REST API can show it in another language by looking the key up (``studio.messages``), never by
parsing the sentence. Each area of the code keeps its English texts in one ``Catalog``::

    ESTIMATE = Catalog("estimate", {"data_parallel": "{n} data-parallel ranks, each holding the whole model"})
    ESTIMATE("data_parallel", n=2)  # Message 'estimate.data_parallel', "2 data-parallel ranks, ..."

A field that is itself a ``Message`` is shown in the reader's language in turn; a ``Word`` field is text of
ours (what a refusal names: "run", "dataset") rather than the person's data, and is translated by word.

A Message stored as text (a JSON column, a run's error) keeps its key through ``with_keys`` / ``restored``:
the stored object carries, under ``MESSAGE_KEYS``, each message's text with its key and fields, and reading
it back gives the same Messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from string import Formatter
from typing import Any

# Under this key a stored object keeps its messages' keys and fields, by text (with_keys / restored).
MESSAGE_KEYS = "message_keys"

CATALOGS: dict[str, Catalog] = {}


class Word(str):
    """A word of ours inside a message (what a refusal names, a kind of address): translated by word."""

    __slots__ = ()


class Message(str):
    """An English sentence with the key and fields it was built from."""

    key: str
    fields: dict[str, Any]

    def __new__(cls, key: str, template: str, /, **fields: Any) -> Message:
        self = super().__new__(cls, template.format(**fields))
        self.key = key
        self.fields = fields
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # pickling (Celery's results, multiprocessing) keeps the key: str's own reduction would drop it
        return (_rebuilt, (str(self), self.key, self.fields))

    def to_json(self) -> dict[str, Any]:
        """The key and fields as JSON (nested messages and words marked, so ``from_json`` restores them)."""
        return {"key": self.key, "fields": {k: _field_to_json(v) for k, v in self.fields.items()}}

    @classmethod
    def from_json(cls, text: str, data: Mapping[str, Any]) -> Message:
        """The Message ``text`` was rendered from, given what ``to_json`` stored (the text is kept as stored:
        a catalog edited since still shows the words the person read)."""
        fields = {k: _field_from_json(v) for k, v in dict(data.get("fields") or {}).items()}
        return _rebuilt(text, str(data["key"]), fields)


def _rebuilt(text: str, key: str, fields: dict[str, Any]) -> Message:
    self = str.__new__(Message, text)
    self.key = key
    self.fields = fields
    return self


def _field_to_json(value: Any) -> Any:
    if isinstance(value, Message):
        return {"message": str(value), **value.to_json()}
    if isinstance(value, Word):
        return {"word": str(value)}
    return value


def _field_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "message" in value and "key" in value:
        return Message.from_json(value["message"], value)
    if isinstance(value, dict) and set(value) == {"word"}:
        return Word(value["word"])
    return value


class Catalog:
    """One area's English texts by name. ``catalog(name, **fields)`` is the Message ``"<area>.<name>"``."""

    def __init__(self, area: str, texts: Mapping[str, str]) -> None:
        if area in CATALOGS:
            raise ValueError(f"a message catalog named {area!r} exists already")
        self.area = area
        self.texts = dict(texts)
        CATALOGS[area] = self

    def __call__(self, name: str, /, **fields: Any) -> Message:
        return Message(f"{self.area}.{name}", self.texts[name], **fields)

    def keys(self) -> dict[str, str]:
        """Every message of the area by its full key, with its English text."""
        return {f"{self.area}.{name}": text for name, text in self.texts.items()}


def field_names(template: str) -> set[str]:
    """The fields a text fills (``"{n:,} of {total}"`` -> {"n", "total"})."""
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in Formatter().parse(template) if name}


def with_keys(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` (a JSON object about to be stored) with the keys of every Message inside it kept under
    ``MESSAGE_KEYS``, by text; the messages themselves stay in place as their English text."""
    keys: dict[str, Any] = {}
    _collect(value, keys)
    return {**value, MESSAGE_KEYS: keys} if keys else dict(value)


def _collect(value: Any, keys: dict[str, Any]) -> None:
    if isinstance(value, Message):
        keys[str(value)] = value.to_json()
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if k != MESSAGE_KEYS:
                _collect(v, keys)
    elif isinstance(value, list | tuple):
        for v in value:
            _collect(v, keys)


def restored(value: Any, keys: Mapping[str, Any] | None = None) -> Any:
    """A stored object with its texts turned back into the Messages ``with_keys`` kept (``MESSAGE_KEYS``
    itself dropped); texts it kept no key for stay plain text. An object stored with no message comes back
    as it is, uncopied (a run row's estimate is read on every poll of the Runs tab)."""
    if keys is None:
        if not isinstance(value, Mapping) or MESSAGE_KEYS not in value:
            return value
        keys = value[MESSAGE_KEYS]
    if isinstance(value, str):
        data = keys.get(value)
        return (
            Message.from_json(value, data) if data is not None and not isinstance(value, Message) else value
        )
    if isinstance(value, Mapping):
        return {k: restored(v, keys) for k, v in value.items() if k != MESSAGE_KEYS}
    if isinstance(value, list | tuple):
        return type(value)(restored(v, keys) for v in value)
    return value
