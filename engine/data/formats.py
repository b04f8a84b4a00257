"""ERNIEKit dataset formats: detection, per-record checks, and parsing into one conversation model.

Every format becomes a ``Conversation`` (SFT, VL), a ``Preference`` (DPO) or a ``PlainText`` (PT). The
checks return *all* problems of a record as readable messages; parsing refuses a record with problems.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.data.formats_chatml import _chatml
from engine.data.formats_vl import _erniekit_vl, resolve_image
from engine.data.paddleocr_vl_processor import TASK_PROMPTS
from engine.data.record_types import (
    FORMATS,
    IMAGE_MARK,
    KINDS,
    VIDEO_MARK,
    Conversation,
    Example,
    PlainText,
    Preference,
    RecordError,
    Turn,
    _flag,
    _labels,
    _text_field,
    _text_list,
    _type_name,
    _unknown_keys,
)
from engine.data.records import iter_raw


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
