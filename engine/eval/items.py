"""Eval files read into items to score: chat records (prompt + reference answer) and benchmark questions.

Every problem of a file is reported at once as ``file:line: message`` (``EvalDataError``), before any
model time is spent. Items are keyed ``<file name>:<line>`` so a resumed evaluation knows what it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.data.formats import check_record, detect_record_format
from engine.data.record_types import Conversation
from engine.data.records import RawRecord, iter_raw


class EvalDataError(ValueError):
    """An eval file that cannot be scored; ``problems`` are ``file:line: message`` lines."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__("\n".join(problems[:20]) + more)


@dataclass
class ChatItem:
    """A chat record: the conversation up to its last answer, and that answer as the reference."""

    id: str
    line: int
    conversation: Conversation  # the record as read; the last turn's answer is the reference
    reference: str


@dataclass
class ChoiceItem:
    """A multiple-choice question: choices in order and the index of the right one."""

    id: str
    line: int
    question: str
    choices: list[str]
    answer: int
    subject: str = ""


@dataclass
class NumberItem:
    """A GSM8K-style question whose answer ends in a number."""

    id: str
    line: int
    question: str
    answer_text: str
    answer: str  # the final number, normalised (no commas, no trailing .0)


@dataclass
class EvalFile:
    path: str
    type: str  # erniekit / alpaca / chatml / multiple_choice / gsm8k
    items: list[Any] = field(default_factory=list)

    @property
    def name(self) -> str:
        return Path(self.path).name


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def read_eval_file(path: str, type_: str, max_samples: int = 0) -> EvalFile:
    """The items of one eval file; raises EvalDataError listing every problem with its line."""
    p = Path(path)
    if not p.is_file():
        raise EvalDataError([f"{path}: eval file does not exist"])
    problems: list[str] = []
    items: list[Any] = []
    resolved = (detect_benchmark(p) or "auto") if type_ == "auto" else type_
    for raw in iter_raw(p):
        if max_samples and len(items) >= max_samples:
            break
        where = f"{path}:{raw.line}"
        if raw.error:
            problems.append(f"{where}: {raw.error}")
            continue
        if resolved == "auto":
            found = detect_record_format(raw.record)
            if found is None or found[1] != "sft":
                problems.append(
                    f"{where}: not a chat record (erniekit src/tgt, alpaca, chatml messages) nor a benchmark "
                    "question (question, choices, answer / question, answer); see docs/evaluation.md"
                )
                continue
            resolved = found[0]
        item, item_problems = _item(raw, resolved, f"{p.name}:{raw.line}")
        problems += [f"{where}: {m}" for m in item_problems]
        if item is not None:
            items.append(item)
    if problems:
        raise EvalDataError(problems)
    if not items:
        raise EvalDataError([f"{path}: no records to evaluate"])
    return EvalFile(path, resolved, items)


# Benchmark records are told from chat and preference records by their keys: a question, an answer, and
# (multiple choice) the choices. Records with any of these keys are training records, never benchmarks.
_CHAT_KEYS = {"src", "tgt", "messages", "instruction", "output", "chosen", "rejected", "text_info"}
QUESTION_KEYS = ("question", "Question")
ANSWER_KEYS = ("answer", "Answer", "answerKey")


def benchmark_type(record: Any) -> str | None:
    """``multiple_choice`` or ``gsm8k`` when a record has a benchmark's shape, else None."""
    if not isinstance(record, dict) or record.keys() & _CHAT_KEYS:
        return None
    if _field(record, *QUESTION_KEYS) is None or _field(record, *ANSWER_KEYS) is None:
        return None
    choices, _ = _choices(record)
    return "multiple_choice" if choices else "gsm8k"


def detect_benchmark(path: str | Path, probe: int = 20) -> str | None:
    """The benchmark type of a file (the one most of its first readable records have), or None when most of
    them are no benchmark questions; the one detection ``eval_dataset_type: auto`` and the studio use."""
    votes: dict[str | None, int] = {}
    for i, raw in enumerate(iter_raw(path)):
        if i >= probe:
            break
        if raw.error is None:
            found = benchmark_type(raw.record)
            votes[found] = votes.get(found, 0) + 1
    if not votes:
        return None
    best = max(votes, key=lambda k: votes[k])
    return best if best is not None and 2 * votes[best] >= sum(votes.values()) else None


def _item(raw: RawRecord, type_: str, key: str) -> tuple[Any, list[str]]:
    if type_ == "multiple_choice":
        return choice_item(raw.record, key, raw.line)
    if type_ == "gsm8k":
        return number_item(raw.record, key, raw.line)
    return chat_item(raw.record, type_, key, raw.line)


NO_REFERENCE = (
    "no reference answer: the last turn's answer ({field}) is missing or empty, so there is nothing to compare "
    "the prediction with; eval files need the expected answers"
)


def _reference_field(record: Any, fmt: str) -> str | None:
    """Where the reference answer should be, when it is missing or empty (else None)."""
    if not isinstance(record, dict):
        return None
    if fmt == "erniekit":
        tgt = record.get("tgt")
        empty = not isinstance(tgt, list) or not tgt or not str(tgt[-1]).strip()
        return "tgt" if empty else None
    if fmt == "alpaca":
        return "output" if not str(record.get("output") or "").strip() else None
    messages = record.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        last = messages[-1]
        if last.get("role") != "assistant" or not str(last.get("content") or "").strip():
            return "a last assistant message"
    return None


def chat_item(record: Any, fmt: str, key: str, line: int) -> tuple[ChatItem | None, list[str]]:
    missing = _reference_field(record, fmt)
    if missing:
        return None, [NO_REFERENCE.format(field=missing)]
    example, problems = check_record(record, fmt, "sft")
    if problems or not isinstance(example, Conversation):
        return None, problems
    if any(t.media for t in example.turns):
        return None, [
            "records with images or videos are not scored by generation yet; use eval_loss (do_train: "
            "false in ernie-studio train) for VL data"
        ]
    reference = example.turns[-1].assistant
    if not reference.strip():
        return None, [
            "no reference answer: the last turn's answer (tgt / output / last assistant message) "
            "is empty, so there is nothing to compare the prediction with"
        ]
    return ChatItem(key, line, example, example.turns[-1].assistant), []


def _field(record: dict, *names: str) -> Any:
    for name in names:
        if name in record:
            return record[name]
    return None


def _choices(record: dict) -> tuple[list[str] | None, list[str]]:
    """MMLU ``choices: [...]``, ARC ``choices: {text: [...], label: [...]}``, C-Eval / CMMLU columns A, B, C, D."""
    value = _field(record, "choices", "options")
    if isinstance(value, dict):
        texts, labels = value.get("text"), value.get("label")
        if isinstance(texts, list):
            return [str(t) for t in texts], [str(x) for x in labels] if isinstance(labels, list) else []
    if isinstance(value, list):
        return [str(t) for t in value], []
    letters = [c for c in LETTERS if c in record and record[c] not in (None, "")]
    if len(letters) >= 2:
        return [str(record[c]) for c in letters], letters
    return None, []


def choice_item(record: Any, key: str, line: int) -> tuple[ChoiceItem | None, list[str]]:
    if not isinstance(record, dict):
        return None, ["a multiple_choice record must be an object with question, choices and answer"]
    question = _field(record, "question", "Question", "input")
    choices, labels = _choices(record)
    answer = _field(record, "answer", "Answer", "answerKey", "label")
    problems = []
    if not isinstance(question, str) or not question.strip():
        problems.append("no question (question / Question column)")
    if not choices or len(choices) < 2:
        problems.append("no choices: give choices [...], choices {text, label} (ARC) or columns A, B, C, D")
    if answer is None or answer == "":
        problems.append(
            "no answer (answer / Answer / answerKey): the index, letter or text of the right choice"
        )
    if problems:
        return None, problems
    index = _answer_index(answer, choices, labels)
    if index is None:
        shown = ", ".join(labels or LETTERS[: len(choices)])
        return None, [
            f"answer {answer!r} is not among the choices ({shown}, an index 0-{len(choices) - 1}, "
            "or a choice's text)"
        ]
    subject = str(_field(record, "subject", "category") or "")
    return ChoiceItem(key, line, question.strip(), choices, index, subject), []


def _answer_index(answer: Any, choices: list[str], labels: list[str]) -> int | None:
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer if 0 <= answer < len(choices) else None
    text = str(answer).strip()
    names = labels or list(LETTERS[: len(choices)])
    if text in names:
        return names.index(text)
    if text.upper() in LETTERS[: len(choices)] and not labels:
        return LETTERS.index(text.upper())
    if text in choices:
        return choices.index(text)
    return None


def number_item(record: Any, key: str, line: int) -> tuple[NumberItem | None, list[str]]:
    from engine.eval.answers import final_number, reference_number

    if not isinstance(record, dict):
        return None, ["a gsm8k record must be an object with question and answer"]
    question, answer = _field(record, "question", "Question"), _field(record, "answer", "Answer")
    if not isinstance(question, str) or not question.strip():
        return None, ["no question"]
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        return None, ["no answer: GSM8K answers end in '#### <number>'"]
    number = reference_number(answer) or final_number(answer)
    if number is None:
        return None, [f"answer {answer[-60:]!r} has no final number (GSM8K answers end in '#### <number>')"]
    return NumberItem(key, line, question.strip(), answer, number), []
