"""What every dataset format is parsed into (`Conversation`, `Preference`, `PlainText`, their turns and video
clips), the formats and the data kinds they hold, `RecordError`, and the field checks every reader shares.
`engine.data.formats` reads the files."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("erniekit", "alpaca", "chatml", "erniekit_vl", "ocr", "text")
KINDS = {
    "erniekit": ("sft", "dpo", "pt"),
    "alpaca": ("sft", "dpo"),
    "chatml": ("sft",),
    "erniekit_vl": ("sft",),
    "ocr": ("sft",),
    "text": ("pt",),
}
# Stand for one image / one video inside a prompt until the encoder knows how many tokens it takes.
IMAGE_MARK = "\ue000"
VIDEO_MARK = "\ue001"
REMOTE_PREFIXES = ("http://", "https://", "ftp://", "s3://", "data:")
CHATML_ROLES = ("system", "user", "assistant", "tool")


class RecordError(ValueError):
    """A record that cannot be used; ``problems`` lists every reason."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class VideoClip:
    """A video of a VL record as its headers describe it: a directory of frames or an animated image."""

    path: Path
    num_frames: int
    width: int
    height: int
    fps: float | None = None  # an animated file's own frame rate; None for a directory of frames


Media = Path | VideoClip  # one image (its file) or one video of a prompt


@dataclass
class Turn:
    """One exchange: the prompt side (user / tool text) and the answer; ``trained`` False = no loss.

    ``media``: the images (paths) and videos of the prompt in the order their marks appear in ``user``."""

    user: str
    assistant: str
    trained: bool = True
    media: list[Media] = field(default_factory=list)
    # The answer's reasoning (rendered ``<think>...</think>`` before it); "" = an empty think block, None = none.
    reasoning: str | None = None
    # The record field(s) the answer was read from (``text_info[1].text``), for messages about it.
    answer_field: str = ""


@dataclass
class Conversation:
    """``per_turn``: train each assistant turn as its own sample whose history has no reasoning (ERNIEKit trains
    function-call and thinking conversations one assistant turn at a time)."""

    system: str | None
    turns: list[Turn]
    per_turn: bool = False


@dataclass
class Preference:
    """A DPO pair: shared system + history + prompt, then the chosen and the rejected answer."""

    system: str | None
    history: list[Turn]
    prompt: str
    chosen: str
    rejected: str


@dataclass
class PlainText:
    text: str


Example = Conversation | Preference | PlainText


# ---- field helpers -----------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, int | float) else type(v).__name__
    )


def _text_field(
    rec: dict, key: str, problems: list[str], *, required: bool = True, empty_ok: bool = False
) -> str:
    if key not in rec or rec[key] is None:
        if required:
            problems.append(f"missing field '{key}'")
        return ""
    v = rec[key]
    if not isinstance(v, str):
        problems.append(f"'{key}' must be a string, got {_type_name(v)}")
        return ""
    if required and not empty_ok and not v.strip():
        problems.append(f"'{key}' is empty")
    return v


def _text_list(rec: dict, key: str, problems: list[str]) -> list[str] | None:
    """A list of non-empty strings (a bare string counts as a one-element list)."""
    if key not in rec or rec[key] is None:
        problems.append(f"missing field '{key}'")
        return None
    v = rec[key]
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        problems.append(f"'{key}' must be a list of strings, got {_type_name(v)}")
        return None
    ok = True
    for i, item in enumerate(v):
        if not isinstance(item, str):
            problems.append(f"'{key}[{i}]' must be a string, got {_type_name(item)}")
            ok = False
        elif not item.strip():
            problems.append(f"'{key}[{i}]' is an empty turn")
            ok = False
    if not v:
        problems.append(f"'{key}' is an empty list")
        ok = False
    return v if ok else None


def _flag(rec: dict, key: str, problems: list[str]) -> int:
    v = rec.get(key, 0)
    if v in (0, 1) and not isinstance(v, float):
        return int(v)
    problems.append(f"'{key}' must be 0 or 1, got {json.dumps(v)}")
    return 0


def _unknown_keys(rec: dict, allowed: set[str], problems: list[str]) -> None:
    """Flag keys that look like typos of a known field ('lable'); other extra keys (metadata) are fine."""
    for key in sorted(k for k in rec if k not in allowed and isinstance(k, str)):
        close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.75)
        if close:
            problems.append(
                f"unknown field '{key}'; did you mean '{close[0]}'? (the value is ignored otherwise)"
            )


def _labels(rec: dict, problems: list[str]) -> list[int] | None:
    """The per-turn 0/1 loss switches, checked on their own so their problems show with the others."""
    if "label" not in rec:
        return None
    lab = rec["label"]
    if not isinstance(lab, list):
        problems.append(f"'label' must be a list of 0/1 per turn, got {_type_name(lab)}")
        return None
    bad = [
        f"label[{i}]={json.dumps(v)}"
        for i, v in enumerate(lab)
        if v not in (0, 1) or isinstance(v, bool | float)
    ]
    if bad:
        problems.append(f"label values must be 0 or 1: {', '.join(bad)}")
        return None
    return [int(v) for v in lab]
