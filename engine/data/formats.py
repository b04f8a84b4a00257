"""ERNIEKit dataset formats: detection, per-record checks, and parsing into one conversation model.

Every format becomes a ``Conversation`` (SFT, VL), a ``Preference`` (DPO) or a ``PlainText`` (PT). The
checks return *all* problems of a record as readable messages; parsing refuses a record with problems.
"""

from __future__ import annotations

import difflib
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from engine.data import remote
from engine.data.paddleocr_vl_processor import TASK_PROMPTS
from engine.data.records import iter_raw
from engine.data.vl_processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    FRAME_SUFFIXES,
    MAX_FILE_FRAMES,
    ProcessorSettings,
    VisionInputError,
    image_grid,
    load_image,
    smart_resize,
)
from engine.tokenizer import (
    split_reasoning,
    tool_calls_text,
    tool_definition,
    tool_list_text,
    tool_response_text,
)

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


# ---- detection ---------------------------------------------------------------------------------------
def detect_record_format(record: Any) -> tuple[str, str] | None:
    """(format, kind) of one raw record from its keys, or None when no format matches."""
    if not isinstance(record, dict):
        return None
    keys = set(record)
    if keys & {"image_info", "video_info", "text_info"}:
        return "erniekit_vl", "sft"
    if "image" in keys:
        return "ocr", "sft"
    if "messages" in keys:
        return "chatml", "sft"
    if "src" in keys and ("response" in keys or "sort" in keys):
        return "erniekit", "dpo"
    if "tgt" in keys and "src" not in keys:
        return "erniekit", "pt"  # ERNIEKit's pretraining demo data: {"tgt": ["document", ...]}
    if keys & {"src", "tgt"}:
        return "erniekit", "sft"
    if keys & {"chosen", "rejected"} or "question" in keys:
        return "alpaca", "dpo"
    if keys & {"instruction", "output"}:
        return "alpaca", "sft"
    if "text" in keys:
        return "text", "pt"
    return None


def detect_format(path: str | Path, probe: int = 20) -> tuple[str, str]:
    """(format, kind) of a dataset file, decided by the first readable records."""
    seen: list[str] = []
    votes: dict[tuple[str, str], int] = {}
    for i, raw in enumerate(iter_raw(path)):
        if i >= probe:
            break
        if raw.error is not None:
            continue
        found = detect_record_format(raw.record)
        if found is None:
            keys = sorted(raw.record) if isinstance(raw.record, dict) else type(raw.record).__name__
            seen.append(f"line {raw.line}: keys {keys}")
            continue
        votes[found] = votes.get(found, 0) + 1
    if not votes:
        detail = "; ".join(seen[:3]) if seen else "no readable records"
        raise ValueError(
            f"{path}: unknown dataset format ({detail}); expected erniekit (src/tgt), alpaca "
            "(instruction/output or question/chosen/rejected), chatml (messages), erniekit_vl "
            "(image_info/video_info/text_info), ocr ({'image': ..., 'text': ...}), erniekit PT "
            "({'tgt': [...]}) or text ({'text': ...})"
        )
    return max(votes, key=lambda k: votes[k])


def check_format_name(fmt: str, kind: str | None = None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if kind is not None and kind not in KINDS[fmt]:
        raise ValueError(f"format {fmt!r} holds {'/'.join(KINDS[fmt])} data, not {kind!r}")


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


# ---- erniekit ----------------------------------------------------------------------------------------
ERNIEKIT_SFT_KEYS = {"system", "src", "tgt", "label", "is_system", "id", "source"}
ERNIEKIT_DPO_KEYS = {"system", "src", "tgt", "response", "sort", "is_system", "id", "source"}


def _erniekit_sft(rec: dict, problems: list[str]) -> Conversation | None:
    _unknown_keys(rec, ERNIEKIT_SFT_KEYS, problems)
    if "src" not in rec and "tgt" in rec:
        problems.append(
            "missing field 'src': a record with only 'tgt' is ERNIEKit pretraining text; train it with stage PT, "
            "or add the prompts as 'src' for SFT"
        )
        return None
    system = _text_field(rec, "system", problems, required=False) or None
    is_system = _flag(rec, "is_system", problems)
    src = _text_list(rec, "src", problems)
    tgt = _text_list(rec, "tgt", problems)
    labels_given = _labels(rec, problems)
    if src is None or tgt is None:
        return None
    if is_system:
        if len(src) != len(tgt) + 1:
            problems.append(
                f"with is_system=1 src[0] is the system prompt, so src needs one more entry than tgt "
                f"(src has {len(src)}, tgt has {len(tgt)})"
            )
            return None
        system, src = src[0], src[1:]
    elif len(src) != len(tgt):
        problems.append(f"src has {len(src)} turns but tgt has {len(tgt)}; they must be equal")
        return None
    labels = [1] * len(tgt)
    if labels_given is not None:
        if len(labels_given) != len(tgt):
            problems.append(f"'label' has {len(labels_given)} values but there are {len(tgt)} turns")
            return None
        labels = labels_given
        if not any(labels):
            problems.append("every turn has label 0, so the sample has nothing to learn")
            return None
    if problems:
        return None
    return Conversation(system, [Turn(q, a, bool(lab)) for q, a, lab in zip(src, tgt, labels, strict=True)])


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


def _response_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    return None


def _erniekit_dpo(rec: dict, problems: list[str]) -> Preference | None:
    _unknown_keys(rec, ERNIEKIT_DPO_KEYS, problems)
    system = _text_field(rec, "system", problems, required=False) or None
    is_system = _flag(rec, "is_system", problems)
    src = _text_list(rec, "src", problems)
    tgt = rec.get("tgt", [])
    if isinstance(tgt, str):
        tgt = [tgt]
    tgt_ok = isinstance(tgt, list) and all(isinstance(t, str) and t.strip() for t in tgt)
    if not tgt_ok:
        problems.append("'tgt' must be a list of non-empty strings (the answers of the earlier turns)")
    response, sort = rec.get("response"), rec.get("sort")
    answers: list[str] = []
    if response is None:
        problems.append("missing field 'response'")
    elif not isinstance(response, list) or len(response) != 2:
        n = len(response) if isinstance(response, list) else _type_name(response)
        problems.append(f"'response' must hold exactly two responses [[chosen], [rejected]], got {n}")
    else:
        for i, r in enumerate(response):
            text = _response_text(r)
            if text is None:
                problems.append(f"'response[{i}]' must be a string or a one-element list of strings")
            elif not text.strip():
                problems.append(f"'response[{i}]' is empty")
            else:
                answers.append(text)
    if sort is None:
        problems.append("missing field 'sort'")
    elif (
        not isinstance(sort, list)
        or len(sort) != 2
        or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in sort)
    ):
        problems.append(f"'sort' must be two numbers, one per response, got {json.dumps(sort)}")
    elif sort[0] == sort[1]:
        problems.append(
            f"'sort' values are equal ({sort[0]}, {sort[1]}): the higher one marks the chosen response"
        )
    if src is None or not tgt_ok:
        return None
    if is_system:
        system, src = src[0], src[1:]
        if not src:
            problems.append("with is_system=1 src needs a prompt after the system prompt")
            return None
    if len(src) != len(tgt) + 1:
        problems.append(
            f"DPO needs len(src) == len(tgt) + 1 (the last src is the prompt both responses answer); "
            f"src has {len(src)}, tgt has {len(tgt)}"
        )
    if problems or len(answers) != 2:
        return None
    chosen, rejected = (answers[0], answers[1]) if sort[0] > sort[1] else (answers[1], answers[0])
    history = [Turn(q, a) for q, a in zip(src[:-1], tgt, strict=True)]
    return Preference(system, history, src[-1], chosen, rejected)


# ---- alpaca ------------------------------------------------------------------------------------------
ALPACA_SFT_KEYS = {"instruction", "input", "output", "system", "history", "id"}
ALPACA_DPO_KEYS = {"system", "question", "chosen", "rejected", "history", "id"}


def _history(rec: dict, problems: list[str]) -> list[Turn]:
    h = rec.get("history")
    if h is None:
        return []
    if not isinstance(h, list):
        problems.append(f"'history' must be a list of [question, answer] pairs, got {_type_name(h)}")
        return []
    turns = []
    for i, pair in enumerate(h):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            problems.append(f"'history[{i}]' must be a [question, answer] pair of strings")
        elif not pair[0].strip() or not pair[1].strip():
            problems.append(f"'history[{i}]' has an empty {'question' if not pair[0].strip() else 'answer'}")
        else:
            turns.append(Turn(pair[0], pair[1]))
    return turns


def _alpaca_sft(rec: dict, problems: list[str]) -> Conversation | None:
    _unknown_keys(rec, ALPACA_SFT_KEYS, problems)
    instruction = _text_field(rec, "instruction", problems, empty_ok=True)
    extra = _text_field(rec, "input", problems, required=False)
    output = _text_field(rec, "output", problems)
    system = _text_field(rec, "system", problems, required=False) or None
    history = _history(rec, problems)
    prompt = "\n".join(p for p in (instruction, extra) if p.strip())
    if "instruction" in rec and isinstance(instruction, str) and not prompt.strip():
        problems.append("'instruction' and 'input' are both empty: the sample has no prompt")
    if problems:
        return None
    return Conversation(system, [*history, Turn(prompt, output)])


def _alpaca_dpo(rec: dict, problems: list[str]) -> Preference | None:
    _unknown_keys(rec, ALPACA_DPO_KEYS, problems)
    system = _text_field(rec, "system", problems, required=False) or None
    question = _text_field(rec, "question", problems)
    chosen = _text_field(rec, "chosen", problems)
    rejected = _text_field(rec, "rejected", problems)
    history = _history(rec, problems)
    if chosen and rejected and chosen.strip() == rejected.strip():
        problems.append("'chosen' and 'rejected' are identical: the pair teaches nothing")
    if problems:
        return None
    return Preference(system, history, question, chosen, rejected)


# ---- chatml ------------------------------------------------------------------------------------------
CHATML_KEYS = {"messages", "tools", "label", "id", "source"}


def _tool_definitions(tools: Any, problems: list[str]) -> list[dict] | None:
    """The record's tool list, each an OpenAI-style function (``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        problems.append(f"'tools' must be a list of tool definitions (objects), got {_type_name(tools)}")
        return None
    for i, tool in enumerate(tools):
        fn = tool_definition(tool)["function"]
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            problems.append(
                f"tools[{i}] has no function name ({{'type': 'function', 'function': {{'name': ...}}}})"
            )
    return tools or None


def _message_text(content: Any, role: str, where: str, problems: list[str]) -> str | None:
    """A message's text: a string, a list of text parts, or (a tool's result) any JSON value."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
    ):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    if role == "tool" and content is not None:
        return json.dumps(content, ensure_ascii=False)  # ERNIEKit's function-call data holds results as JSON
    problems.append(
        f"{where}.content must be a string or a list of text parts ({{'type': 'text', 'text': ...}}), "
        f"got {_type_name(content)}"
    )
    return None


def _tool_calls(calls: Any, where: str, problems: list[str]) -> list[tuple[str, Any]] | None:
    """(name, arguments) of an assistant's tool_calls; arguments written as a JSON string are read as JSON."""
    if not isinstance(calls, list) or not calls:
        problems.append(f"{where}.tool_calls must be a non-empty list of calls, got {_type_name(calls)}")
        return None
    out: list[tuple[str, Any]] = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            problems.append(
                f'{at} must be {{"type": "function", "function": {{"name": ..., "arguments": {{...}}}}}}'
            )
            continue
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                problems.append(f"{at}.function.arguments is a string that is not JSON ({e.msg})")
                continue
        if not isinstance(args, dict):
            problems.append(f"{at}.function.arguments must be an object, got {_type_name(args)}")
            continue
        out.append((fn["name"], args))
    return out if len(out) == len(calls) else None


def _assistant_parts(m: dict, text: str, where: str, problems: list[str]) -> tuple[str | None, str]:
    """(reasoning, answer with its tool calls) of an assistant message."""
    reasoning, answer = split_reasoning(text)
    given = m.get("reasoning_content")
    if given is not None:
        if not isinstance(given, str):
            problems.append(f"{where}.reasoning_content must be a string, got {_type_name(given)}")
        elif reasoning is not None:
            problems.append(f"{where} has both reasoning_content and a <think> block in content; keep one")
        else:
            reasoning = given.strip("\n")
    calls = m.get("tool_calls")
    if calls is not None:
        parsed = _tool_calls(calls, where, problems)
        if parsed:
            # ERNIE's function formatter always opens the calls with a newline ("\n<tool_call>...")
            answer = answer + "\n" + tool_calls_text(parsed)
    return reasoning, answer


def _chatml_labels(rec: dict, n_assistant: int, problems: list[str]) -> list[int] | None:
    """ERNIEKit's per-assistant-message 0/1 loss switches of a chatml record (``label``)."""
    labels = _labels(rec, problems)
    if labels is not None and len(labels) != n_assistant:
        problems.append(f"'label' has {len(labels)} values but there are {n_assistant} assistant messages")
        return None
    return labels


# (index, role, text, reasoning, trained) of one usable chatml message
CleanMessage = tuple[int, str, str, str | None, bool]


def _chatml(rec: dict, problems: list[str]) -> Conversation | None:
    _unknown_keys(rec, CHATML_KEYS, problems)
    msgs = rec.get("messages")
    tools = _tool_definitions(rec.get("tools"), problems)
    if not isinstance(msgs, list):
        problems.append(
            "missing field 'messages'"
            if msgs is None
            else f"'messages' must be a list, got {_type_name(msgs)}"
        )
        return None
    if not msgs:
        problems.append("'messages' is empty")
        return None
    clean = [c for i, m in enumerate(msgs) if (c := _chatml_message(i, m, problems)) is not None]
    labels = _chatml_labels(
        rec, sum(1 for m in msgs if isinstance(m, dict) and m.get("role") == "assistant"), problems
    )
    if problems:
        return None
    if labels is not None:
        answers = iter(labels)
        clean = [
            (i, r, t, rs, bool(next(answers)) and tr if r == "assistant" else tr) for i, r, t, rs, tr in clean
        ]
    system = None
    if clean[0][1] == "system":
        system = clean[0][2]
        clean = clean[1:]
    if tools:
        system = (system + "\n" if system else "") + tool_list_text(tools)
    turns, called = _chatml_turns(clean, problems)
    if problems:
        return None
    thinking = any(t.reasoning is not None for t in turns)
    if thinking:  # ERNIE's Thinking template gives answers without reasoning an empty think block
        for t in turns:
            t.reasoning = "" if t.reasoning is None else t.reasoning
    return Conversation(system, turns, per_turn=thinking or tools is not None or called)


def _chatml_message(i: int, m: Any, problems: list[str]) -> CleanMessage | None:
    """One chatml message checked and split into its parts; None (with the problem noted) if unusable."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        problems.append(f"{where} must be an object with 'role' and 'content', got {_type_name(m)}")
        return None
    role, content = m.get("role"), m.get("content")
    if role not in CHATML_ROLES:
        problems.append(f"{where}.role is {json.dumps(role)}; use one of {', '.join(CHATML_ROLES)}")
        return None
    if m.get("tool_calls") is not None and role != "assistant":
        problems.append(f"{where} is a {role} message with tool_calls; only assistant messages call tools")
        return None
    if content is None and (m.get("tool_calls") or m.get("reasoning_content")):
        content = ""
    text = _message_text(content, role, where, problems)
    if text is None:
        return None
    reasoning = None
    if role == "assistant":
        reasoning, text = _assistant_parts(m, text, where, problems)
    if not text.strip() and not reasoning:
        problems.append(f"{where} ({role}) has empty content")
        return None
    trained = m.get("loss", True)
    if not isinstance(trained, bool):
        problems.append(f"{where}.loss must be true or false, got {json.dumps(trained)}")
        trained = True
    return i, role, text, reasoning, trained


def _chatml_turns(clean: list[CleanMessage], problems: list[str]) -> tuple[list[Turn], bool]:
    """The (prompt, answer) turns of the messages after the system prompt, and whether an assistant
    message called a tool through tool_calls; the order's problems are noted."""
    turns: list[Turn] = []
    prompt: list[str] = []
    called = False
    for i, role, text, reasoning, trained in clean:
        if role == "system":
            problems.append(
                f"messages[{i}] is a system message; only the first message may be the system prompt"
            )
        elif role in ("user", "tool"):
            if role == "tool" and not turns:
                problems.append(f"messages[{i}] is a tool result before any assistant message called a tool")
            prompt.append(text if role == "user" else tool_response_text(text))
        elif not prompt:
            problems.append(
                f"messages[{i}] is an assistant message that does not follow a user message "
                "(roles must alternate user -> assistant)"
            )
        else:
            called = called or "<tool_call>" in text
            turns.append(Turn("\n".join(prompt), text, trained, reasoning=reasoning))
            prompt = []
    if prompt and not problems:
        problems.append(
            "the conversation ends with a user/tool message; the last message must be the assistant's"
        )
    if not turns and not problems:
        problems.append("no assistant message: nothing to learn")
    if turns and not any(t.trained for t in turns) and not problems:
        problems.append("every assistant message has loss false, so the sample has nothing to learn")
    return turns, called


# ---- VL ----------------------------------------------------------------------------------------------
# ERNIEKit's sft_vl records: text_info (mask = prompt, no_mask = answer), image_info and video_info (whose
# entries also name their file "image_url"), and "order" placing texts, images and videos when a record has
# both kinds (PaddleFormers' convert_mm_data requires it then).
VL_KEYS = {"image_info", "video_info", "text_info", "order", "system", "id"}
MEDIA_FIELDS = {"image": "image_info", "video": "video_info"}
MEDIA_MARKS = {"image": IMAGE_MARK, "video": VIDEO_MARK}
ORDER_TYPES = ("text", "image", "video")
# Containers this engine cannot decode: it depends on no video codec (frames or animated images work).
VIDEO_FILE_SUFFIXES = (
    ".mp4",
    ".m4v",
    ".mov",
    ".avi",
    ".mkv",
    ".webm",
    ".flv",
    ".wmv",
    ".mpg",
    ".mpeg",
    ".ts",
    ".3gp",
)


def _local_path(url: str, base_dir: Path | None, what: str) -> tuple[Path | None, str | None]:
    """The path a media reference names inside the dataset directory, or why it cannot be used."""
    if url.startswith(REMOTE_PREFIXES):
        return (
            None,
            f"{what} {url!r} is remote; training reads local files only: save it next to the data file",
        )
    if base_dir is None:  # a record seen without its file (preview): only the path's shape can be checked
        rel = Path(url)
        if rel.is_absolute() or ".." in rel.parts:
            return None, f"{what} path {url!r} escapes the dataset directory; keep {what}s inside it"
        return rel, None
    base = base_dir.resolve()
    p = (base / url).resolve()
    if p != base and base not in p.parents:
        return None, f"{what} path {url!r} escapes the dataset directory {base}; keep {what}s inside it"
    return p, None


def _fetched_image(url: str, base_dir: Path, fetch_urls: bool) -> tuple[Path | None, str | None]:
    """An image named by an http(s) URL: its copy in the dataset directory (``engine.data.remote``), fetched
    now only when ``fetch_urls`` (a training run or the fetch job, never a request or a preview)."""
    if not fetch_urls:
        return remote.cached(url, base_dir.resolve()), None
    try:
        return remote.fetch(url, base_dir.resolve()), None
    except remote.FetchError as e:
        return None, f"image {url!r} could not be fetched: {e}; or save it next to the data file"


def resolve_image(
    url: str, base_dir: Path | None, *, fetch_urls: bool = False, decode: bool = False
) -> tuple[Path | None, str | None]:
    """The local file of an image reference relative to the dataset directory, or the reason it is unusable.

    An http(s) URL is fetched into the directory first when ``fetch_urls``; otherwise its kept copy is used,
    and a URL not fetched yet is passed unchecked (``Path(url)``: the fetch job or the run checks it). The
    header is always read; ``decode`` also decodes the pixels (a truncated file has a good header).
    """
    if url.startswith(("http://", "https://")):
        if base_dir is None:  # a record seen without its file (preview)
            return Path(url), None
        p, why = _fetched_image(url, base_dir, fetch_urls)
        if p is None and why is None:  # not fetched yet
            return Path(url), None
    else:
        p, why = _local_path(url, base_dir, "image")
    if p is None or base_dir is None:
        return p, why
    if not p.is_file():
        return None, f"image {url!r} not found (looked for {p})"
    try:
        image_grid(p)  # header, pixel limit and aspect ratio, as the processor will need them
        if decode:
            load_image(p)
    except VisionInputError as e:
        return None, str(e).replace(f"image file {p}", f"image {url!r}", 1)
    return p, None


def resolve_video(url: str, base_dir: Path | None) -> tuple[VideoClip | None, str | None]:
    """The frames of a video reference (a directory of frames or an animated GIF/PNG/WebP inside the dataset
    directory) described from their headers, or the reason it is unusable."""
    p, why = _local_path(url, base_dir, "video")
    if p is None:
        return None, why
    if p.suffix.lower() in VIDEO_FILE_SUFFIXES:
        frames = Path(url).with_suffix("").as_posix()
        return None, (
            f"video {url!r} is a {p.suffix} file, and this engine decodes no video formats: extract its frames "
            f"into a directory (e.g. `ffmpeg -i {url} -vf fps=2 {frames}/%05d.png`) and name that directory "
            f"({frames!r}) in image_url, or convert the clip to an animated GIF/WebP"
        )
    if base_dir is None:
        return VideoClip(p, 0, 0, 0), None  # not inspected: the encoder probes it when it needs the size
    if not p.exists():
        return None, f"video {url!r} not found (looked for {p})"
    try:
        clip = probe_video(p)
    except VisionInputError as e:
        return None, f"video {url!r}: {e}"
    base = base_dir.resolve()
    outside = [f.name for f in video_frame_files(p) if base not in f.resolve().parents] if p.is_dir() else []
    if outside:
        return (
            None,
            f"video {url!r}: frame {outside[0]} links outside the dataset directory; keep frames inside it",
        )
    return clip, None


def video_frame_files(directory: Path) -> list[Path]:
    """The frame images of a frame directory in the order ``read_video_frames`` reads them."""
    return sorted(p for p in directory.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)


def _frame_size(path: Path) -> tuple[int, int]:
    """(width, height) of one frame as ``load_image`` will see it (EXIF rotation applied), from its header."""
    try:
        with Image.open(path) as im:
            width, height = im.size
            if im.getexif().get(0x0112) in (5, 6, 7, 8):  # orientations that turn the frame on its side
                width, height = height, width
    except UnidentifiedImageError:
        raise VisionInputError(f"frame {path.name} is not an image PIL can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise VisionInputError(f"frame {path.name} cannot be read ({e})") from None
    return width, height


def _check_canvas(width: int, height: int, max_image_pixels: int) -> None:
    if width * height > max_image_pixels:
        raise VisionInputError(
            f"{width}x{height} pixels ({width * height:,}) is more than "
            f"max_image_pixels={max_image_pixels:,}; downscale the frames first"
        )


def _gif_durations(path: Path) -> list[int]:
    """Each frame's duration in ms, as PIL reports it (``info["duration"]``, 0 without a graphic control
    block), read from a GIF's blocks without decoding a pixel."""
    with open(path, "rb") as f:

        def byte() -> int:
            b = f.read(1)
            if not b:
                raise EOFError("the file ends inside a block")
            return b[0]

        def skip_sub_blocks() -> None:
            while size := byte():
                f.seek(size, 1)

        head = f.read(13)
        if len(head) < 13:
            raise EOFError("the file ends inside the header")
        if head[10] & 0x80:
            f.seek(3 << ((head[10] & 7) + 1), 1)  # global colour table
        durations: list[int] = []
        delay = None
        while (kind := f.read(1)) not in (b"", b";"):
            if kind == b"!":
                label = byte()
                if label == 0xF9:
                    block = f.read(byte())
                    delay = struct.unpack("<H", block[1:3])[0] * 10
                skip_sub_blocks()
            elif kind == b",":
                descriptor = f.read(9)
                if len(descriptor) < 9:
                    raise EOFError("the file ends inside an image descriptor")
                flags = descriptor[8]
                if flags & 0x80:
                    f.seek(3 << ((flags & 7) + 1), 1)  # local colour table
                byte()  # LZW minimum code size
                skip_sub_blocks()
                durations.append(delay or 0)
                delay = None
            else:
                raise VisionInputError(f"truncated or corrupt (unknown GIF block 0x{kind[0]:02x})")
    return durations


def _probe_animated(path: Path, max_image_pixels: int) -> VideoClip:
    """Frame count, size and frame rate of an animated image; frame timing as ``read_video_frames`` takes it.

    The canvas size is checked from the header before any frame is counted or seeked to: seeking composes
    each frame on the full canvas, so a tiny file declaring a huge canvas would otherwise allocate it.
    """
    try:
        with Image.open(path) as im:
            width, height = im.size
            _check_canvas(width, height, max_image_pixels)
            count = int(getattr(im, "n_frames", 1))
            if count > MAX_FILE_FRAMES:
                raise VisionInputError(f"more than {MAX_FILE_FRAMES} frames")
            if im.format == "GIF":  # from the blocks: seeking would compose every frame on the canvas
                durations = _gif_durations(path)
                if len(durations) != count:
                    raise VisionInputError(
                        f"truncated or corrupt ({count} frames but {len(durations)} images)"
                    )
            else:
                durations = []
                for index in range(count):
                    im.seek(index)
                    durations.append(im.info.get("duration") or 0)
    except VisionInputError:
        raise
    except UnidentifiedImageError:
        raise VisionInputError(
            "not an image PIL can read; a video is a directory of frames or an animated GIF/PNG/WebP"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as e:
        raise VisionInputError(f"truncated or corrupt ({e})") from None
    fps = 1000.0 / (sum(durations) / count) if all(durations) else None
    return VideoClip(path, count, width, height, fps)


def probe_video(path: Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> VideoClip:
    """A video's frame count, frame size and frame rate from headers only (no frame is decoded); raises
    ``VisionInputError`` for no frames, frames of different sizes or a size the processor refuses."""
    if path.is_dir():
        files = video_frame_files(path)
        if not files:
            raise VisionInputError(
                f"has no frames: the directory holds no image files ({', '.join(FRAME_SUFFIXES)})"
            )
        width, height = _frame_size(files[0])
        for frame in files[1:]:
            w, h = _frame_size(frame)
            if (w, h) != (width, height):
                raise VisionInputError(
                    f"frame {frame.name} is {w}x{h} pixels but {files[0].name} is {width}x{height}; "
                    "all frames of a video need one size"
                )
        clip = VideoClip(path, len(files), width, height)
    else:
        clip = _probe_animated(path, max_image_pixels)
    _check_canvas(clip.width, clip.height, max_image_pixels)
    s = ProcessorSettings()
    smart_resize(clip.height, clip.width, s.factor, s.video_min_pixels, s.video_max_pixels)  # aspect ratio
    return clip


def _vl_texts(rec: dict, problems: list[str]) -> list[tuple[str, str]] | None:
    """(text, tag) of every text_info entry."""
    texts = rec.get("text_info")
    if not isinstance(texts, list) or not texts:
        problems.append(
            "missing field 'text_info'" if texts is None else "'text_info' must be a non-empty list"
        )
        return None
    parts: list[tuple[str, str]] = []
    for i, t in enumerate(texts):
        if not isinstance(t, dict):
            problems.append(f"text_info[{i}] must be an object with 'text' and 'tag'")
            parts.append(("", "mask"))
            continue
        text, tag = t.get("text"), t.get("tag")
        if not isinstance(text, str):
            problems.append(f"text_info[{i}].text must be a string, got {_type_name(text)}")
        elif not text.strip():
            problems.append(f"text_info[{i}].text is empty")
        elif IMAGE_MARK in text or VIDEO_MARK in text:
            problems.append(
                f"text_info[{i}].text holds U+E000 or U+E001, private-use characters that mark where images "
                "and videos go; remove them"
            )
        if tag not in ("mask", "no_mask"):
            problems.append(
                f"text_info[{i}].tag is {json.dumps(tag)}; use 'mask' (prompt) or 'no_mask' (answer)"
            )
        parts.append((text if isinstance(text, str) else "", tag))
    return parts


def _is_index(value: Any, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def _vl_media(
    rec: dict,
    kind: str,
    parts: list[tuple[str, str]],
    matched: bool,
    base_dir: Path | None,
    problems: list[str],
    fetch_urls: bool = False,
    decode: bool = False,
) -> list[tuple[int, Media] | None]:
    """(matched_text_index, file) of every image_info or video_info entry (None where the entry is unusable);
    ``matched``: the entries are placed by matched_text_index (no ``order``), so it is checked; ``decode``:
    images are decoded, not only their headers read."""
    key = MEDIA_FIELDS[kind]
    infos = rec.get(key)
    if infos is None:
        return []
    if not isinstance(infos, list):
        problems.append(f"'{key}' must be a list, got {_type_name(infos)}")
        return []
    out: list[tuple[int, Media] | None] = []
    for i, info in enumerate(infos):
        out.append(None)
        if not isinstance(info, dict):
            problems.append(f"{key}[{i}] must be an object with 'image_url' and 'matched_text_index'")
            continue
        url, idx = info.get("image_url"), info.get("matched_text_index", 0)
        if not isinstance(url, str) or not url.strip():
            also = " (ERNIEKit names a video's path image_url too)" if kind == "video" else ""
            problems.append(f"{key}[{i}].image_url is missing or empty{also}")
            continue
        if matched and not _is_index(idx, len(parts)):
            problems.append(
                f"{key}[{i}].matched_text_index {json.dumps(idx)} is not an index into text_info (0..{len(parts) - 1})"
            )
            continue
        if kind == "video":
            found, why = resolve_video(url, base_dir)
        else:
            found, why = resolve_image(url, base_dir, fetch_urls=fetch_urls, decode=decode)
        if why:
            problems.append(f"{key}[{i}]: {why}")
        else:
            out[-1] = (idx if matched else -1, found)
    return out


def _matched_sequence(media: dict[str, list], n_texts: int) -> list[tuple[str, int]]:
    """ERNIEKit's placement without ``order``: each entry goes right before text_info[matched_text_index]."""
    before: dict[int, list[tuple[str, int]]] = {}
    for kind in ("image", "video"):
        for i, entry in enumerate(media[kind]):
            before.setdefault(entry[0], []).append((kind, i))
    return [item for t in range(n_texts) for item in [*before.get(t, []), ("text", t)]]


def _order_sequence(order: Any, counts: dict[str, int], problems: list[str]) -> list[tuple[str, int]] | None:
    """The (kind, index) sequence an ``order`` object gives, checked to list every entry exactly once."""
    if not (
        isinstance(order, dict)
        and isinstance(order.get("type"), list)
        and isinstance(order.get("index"), list)
    ):
        problems.append(
            '\'order\' must be an object {"type": [...], "index": [...]} listing every text, image and '
            f"video entry in prompt order, got {_type_name(order)}"
        )
        return None
    types, indices = order["type"], order["index"]
    if len(types) != len(indices):
        problems.append(
            f"'order.type' has {len(types)} entries but 'order.index' has {len(indices)}; they pair up one to one"
        )
        return None
    seq: list[tuple[str, int]] = []
    seen: dict[tuple[str, int], int] = {}
    start = len(problems)
    for k, (kind, idx) in enumerate(zip(types, indices, strict=True)):
        if kind not in ORDER_TYPES:
            problems.append(f"order.type[{k}] is {json.dumps(kind)}; use 'text', 'image' or 'video'")
        elif not _is_index(idx, counts[kind]):
            size = f"0..{counts[kind] - 1}" if counts[kind] else "it is empty"
            problems.append(f"order.index[{k}] is {json.dumps(idx)}, not an index into {kind}_info ({size})")
        elif (kind, idx) in seen:
            problems.append(
                f"order lists {kind}_info[{idx}] twice (order positions {seen[(kind, idx)]} and {k})"
            )
        else:
            seen[(kind, idx)] = k
            seq.append((kind, idx))
    missing = [
        f"{kind}_info[{i}]" for kind in ORDER_TYPES for i in range(counts[kind]) if (kind, i) not in seen
    ]
    if missing:
        problems.append(
            f"order leaves out {', '.join(missing)}; it must list every text, image and video once"
        )
    texts = [i for kind, i in seq if kind == "text"]
    if texts != sorted(texts):
        problems.append(
            "order lists the text_info entries out of their order; texts keep their text_info order"
        )
    return None if len(problems) > start else seq


def _vl_sequence(
    rec: dict, media: dict[str, list], n_texts: int, problems: list[str]
) -> list[tuple[str, int]] | None:
    """Texts, images and videos in prompt order: by ``order`` when given, else by matched_text_index."""
    counts = {"text": n_texts, "image": len(media["image"]), "video": len(media["video"])}
    both = counts["image"] > 0 and counts["video"] > 0
    if rec.get("order") is None:
        if both:
            problems.append(
                "missing field 'order': a record with both image_info and video_info needs "
                'order {"type": [...], "index": [...]} listing its texts, images and videos in prompt order'
            )
            return None
        return _matched_sequence(media, n_texts)
    seq = _order_sequence(rec["order"], counts, problems)
    if seq is not None and not both and seq != _matched_sequence(media, n_texts):
        problems.append(
            "'order' places the media differently from their matched_text_index, which ERNIEKit follows when "
            "a record holds only images or only videos; make them agree or drop 'order'"
        )
        return None
    return seq


def _vl_turns(
    parts: list[tuple[str, str]], media: dict[str, list], sequence: list[tuple[str, int]], problems: list[str]
) -> list[Turn]:
    """Turns from the sequence; media ahead of a prompt's text lead it, media after it (before the answer)
    close the prompt, as ERNIEKit concatenates them."""
    turns: list[Turn] = []
    prompt: list[str] = []
    answer: list[str] = []
    fields: list[str] = []
    files: list[Media] = []
    marks, last_media = "", ""
    for kind, i in sequence:
        text, tag = parts[i] if kind == "text" else ("", "mask")
        if answer and tag == "mask":
            turns.append(
                Turn("\n".join(prompt), "\n".join(answer), True, files, answer_field=", ".join(fields))
            )
            prompt, answer, fields, files = [], [], [], []
        if kind != "text":
            marks += MEDIA_MARKS[kind]
            files.append(media[kind][i][1])
            last_media = f"{MEDIA_FIELDS[kind]}[{i}]"
        elif tag == "mask":
            prompt.append(marks + text)
            marks = ""
        else:
            if marks and prompt:
                prompt[-1] += marks
            elif marks:
                prompt.append(marks)
            marks = ""
            answer.append(text)
            fields.append(f"text_info[{i}].text")
    if marks:
        problems.append(f"{last_media} comes after the last answer; images and videos belong to a prompt")
    turns.append(Turn("\n".join(prompt), "\n".join(answer), True, files, answer_field=", ".join(fields)))
    return turns


def _erniekit_vl(
    rec: dict, problems: list[str], base_dir: Path | None, fetch_urls: bool = False, decode: bool = False
) -> Conversation | None:
    _unknown_keys(rec, VL_KEYS, problems)
    system = _text_field(rec, "system", problems, required=False) or None
    parts = _vl_texts(rec, problems)
    if parts is None:
        return None
    lists = [rec.get(MEDIA_FIELDS[k]) for k in ("image", "video")]
    # Without order, or with one kind only (ERNIEKit then ignores order), matched_text_index places them.
    matched = rec.get("order") is None or not all(isinstance(v, list) and v for v in lists)
    media = {
        kind: _vl_media(rec, kind, parts, matched, base_dir, problems, fetch_urls, decode)
        for kind in ("image", "video")
    }
    if problems:
        return None
    if parts[0][1] != "mask":
        problems.append("text_info[0] must be a prompt (tag 'mask'); an answer cannot come first")
    if parts[-1][1] != "no_mask":
        problems.append(
            f"text_info[{len(parts) - 1}] is a prompt with no answer after it (the last tag must be 'no_mask')"
        )
    sequence = None if problems else _vl_sequence(rec, media, len(parts), problems)
    if sequence is None:
        return None
    turns = _vl_turns(parts, media, sequence, problems)
    return None if problems else Conversation(system, turns)


# ---- OCR pairs ---------------------------------------------------------------------------------------
# {"image": "scans/1.png", "text": "what it says"}: one image and its transcription, with the task prompt named
# by "task" (PaddleOCR-VL's four: ocr, table, formula, chart; default ocr) or written out in "prompt".
OCR_KEYS = {"image", "text", "task", "prompt", "id", "source"}
DEFAULT_OCR_TASK = "ocr"


def _ocr_prompt(rec: dict, problems: list[str]) -> str:
    if "task" in rec and "prompt" in rec:
        problems.append("give 'task' or 'prompt', not both (a task names one of PaddleOCR-VL's prompts)")
        return ""
    if "prompt" in rec:
        return _text_field(rec, "prompt", problems)
    task = rec.get("task", DEFAULT_OCR_TASK)
    if task not in TASK_PROMPTS:
        problems.append(
            f"'task' is {json.dumps(task)}; choose one of {', '.join(TASK_PROMPTS)} (the prompts "
            f"{', '.join(repr(p) for p in TASK_PROMPTS.values())}), or write the prompt out in 'prompt'"
        )
        return ""
    return TASK_PROMPTS[task]


def _ocr_pair(
    rec: dict, problems: list[str], base_dir: Path | None, fetch_urls: bool = False
) -> Conversation | None:
    """An OCR pair; its image is decoded when the file is at hand (a truncated image fails here, not in a batch)."""
    _unknown_keys(rec, OCR_KEYS, problems)
    url = rec.get("image")
    path = None
    if url is None:
        problems.append("missing field 'image': an OCR record pairs one image with the text it shows")
    elif not isinstance(url, str) or not url.strip():
        problems.append(
            f"'image' must be the image's path inside the dataset directory, got {_type_name(url)}"
        )
    else:
        path, why = resolve_image(url, base_dir, fetch_urls=fetch_urls, decode=True)
        if why:
            problems.append(f"field 'image': {why}")
    text = _text_field(rec, "text", problems)
    prompt = _ocr_prompt(rec, problems)
    if prompt and (IMAGE_MARK in prompt or VIDEO_MARK in prompt):
        problems.append(
            "'prompt' holds U+E000 or U+E001, private-use characters that mark images; remove them"
        )
    if problems or path is None:
        return None
    return Conversation(None, [Turn(IMAGE_MARK + prompt, text, True, [path], answer_field="text")])


# ---- text (PT) ---------------------------------------------------------------------------------------
def _text(rec: dict, problems: list[str]) -> PlainText | None:
    _unknown_keys(rec, {"text", "id", "source", "meta"}, problems)
    text = _text_field(rec, "text", problems)
    return None if problems else PlainText(text)


def _erniekit_pt(rec: dict, problems: list[str]) -> PlainText | None:
    """ERNIEKit's pretraining records: ``{"tgt": ["document"]}`` (its demo data) or ``{"text": ...}``; several
    strings in one record are one document, joined by newlines."""
    _unknown_keys(rec, {"tgt", "text", "id", "source", "meta"}, problems)
    if "src" in rec or "response" in rec:
        problems.append(
            "a pretraining record holds only 'tgt' (the text); 'src' / 'response' belong to SFT / DPO"
        )
        return None
    key = "tgt" if "tgt" in rec else "text"
    parts = _text_list(rec, key, problems)
    return None if problems or parts is None else PlainText("\n".join(parts))


# ---- entry points ------------------------------------------------------------------------------------
def check_record(
    record: Any,
    fmt: str,
    kind: str,
    base_dir: Path | None = None,
    *,
    fetch_urls: bool = False,
    decode_images: bool = False,
) -> tuple[Example | None, list[str]]:
    """Parse one raw record; returns the example (None when unusable) and every problem found. Images named
    by URL are fetched only when ``fetch_urls`` (see ``resolve_image``); ``decode_images`` decodes every
    image of an erniekit_vl record (an OCR pair's always is)."""
    problems: list[str] = []
    if not isinstance(record, dict):
        return None, [f"a record must be a JSON object, got {_type_name(record)}"]
    if fmt == "erniekit" and kind == "pt":
        ex = _erniekit_pt(record, problems)
    elif fmt == "erniekit":
        ex = _erniekit_dpo(record, problems) if kind == "dpo" else _erniekit_sft(record, problems)
    elif fmt == "alpaca":
        ex = _alpaca_dpo(record, problems) if kind == "dpo" else _alpaca_sft(record, problems)
    elif fmt == "chatml":
        ex = _chatml(record, problems)
    elif fmt == "erniekit_vl":
        ex = _erniekit_vl(record, problems, base_dir, fetch_urls, decode_images)
    elif fmt == "ocr":
        ex = _ocr_pair(record, problems, base_dir, fetch_urls)
    elif fmt == "text":
        ex = _text(record, problems)
    else:
        raise ValueError(f"unknown dataset format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return (None if problems else ex), problems


def parse_record(
    record: Any, fmt: str, kind: str, base_dir: Path | None = None, *, fetch_urls: bool = False
) -> Example:
    """The example of a raw record; raises ``RecordError`` listing every problem."""
    ex, problems = check_record(record, fmt, kind, base_dir, fetch_urls=fetch_urls)
    if problems or ex is None:
        raise RecordError(problems or ["unusable record"])
    return ex
