"""Dataset validation that reports every problem as ``file:line: what is wrong``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.data.archive import ArchiveError, dataset_file
from engine.data.formats import check_record, detect_format, detect_record_format
from engine.data.record_types import FORMATS, KINDS, Example
from engine.data.records import iter_raw
from engine.tokenizer import SPECIAL_TOKENS, ErnieTokenizer


@dataclass
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class ValidationReport:
    path: str
    format: str | None
    kind: str | None
    num_records: int = 0
    num_valid: int = 0
    problems: list[Problem] = field(default_factory=list)
    truncated_problems: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "kind": self.kind,
            "num_records": self.num_records,
            "num_valid": self.num_valid,
            "ok": self.ok,
            "problems": [{"line": p.line, "message": p.message, "text": str(p)} for p in self.problems],
            "more_problems": self.truncated_problems,
        }

    def summary(self, limit: int = 20) -> str:
        """A multi-line text listing the first ``limit`` problems."""
        head = (
            f"{self.path}: {self.num_valid} of {self.num_records} records usable ({self.format}/{self.kind})"
        )
        lines = [head, *(str(p) for p in self.problems[:limit])]
        hidden = len(self.problems) - limit + self.truncated_problems
        if hidden > 0:
            lines.append(f"... and {hidden} more problems")
        return "\n".join(lines)


class DatasetError(ValueError):
    """A dataset with problems; ``report`` holds all of them."""

    def __init__(self, report: ValidationReport):
        super().__init__(report.summary() + "\nrun `ernie-studio data validate FILE` for the full list")
        self.report = report


# Reasoning tags are answer text, not template tokens: VL-Thinking data writes <think>...</think> into its
# no_mask answers (ERNIEKit trains them as they are), and thinking models' tokenizers hold them as added tokens.
ANSWER_TAGS = ("<think>", "</think>")


def reserved_tokens(tokenizer: ErnieTokenizer | None) -> list[str]:
    """The tokens a record's text must not contain because the chat template writes them."""
    tokens = sorted(tokenizer.added_tokens) if tokenizer is not None else SPECIAL_TOKENS
    return [t for t in tokens if t not in ANSWER_TAGS]


def _special_tokens_in(value: Any, tokens: list[str], where: str = "") -> list[str]:
    found = []
    if isinstance(value, str):
        hits = [t for t in tokens if t in value]
        if hits:
            found.append(
                f"{where or 'text'} contains the reserved token(s) {hits}; the chat template adds them"
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            found += _special_tokens_in(v, tokens, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _special_tokens_in(v, tokens, f"{where}[{i}]")
    return found


def read_examples(
    path: str | Path,
    fmt: str,
    kind: str,
    tokenizer: ErnieTokenizer | None = None,
    *,
    fetch_urls: bool = False,
    decode_images: bool = False,
) -> Iterator[tuple[int, Example | None, list[str]]]:
    """(line, example or None, problems) for every record of a file; images named by URL are fetched only
    when ``fetch_urls`` (``engine.data.formats.resolve_image``), and decoded whole with ``decode_images``."""
    base_dir = Path(path).resolve().parent
    reserved = reserved_tokens(tokenizer)
    for raw in iter_raw(path):
        if raw.error is not None:
            yield raw.line, None, [raw.error]
            continue
        ex, problems = check_record(
            raw.record, fmt, kind, base_dir, fetch_urls=fetch_urls, decode_images=decode_images
        )
        problems += _special_tokens_in(raw.record, reserved)
        if problems:
            looks = detect_record_format(raw.record)
            if looks is not None and looks != (fmt, kind):
                problems.append(
                    f"this record looks like {looks[0]}/{looks[1]} data, but the file is read as {fmt}/{kind}"
                )
            ex = None
        yield raw.line, ex, problems


def validate_file(
    path: str | Path,
    format: str | None = None,
    kind: str | None = None,
    tokenizer: ErnieTokenizer | None = None,
    max_problems: int = 1000,
    *,
    fetch_urls: bool = False,
) -> ValidationReport:
    """Check every record of a dataset file (or of the labels file of a zip of images); never raises on bad
    data and never stops at the first problem. Images named by URL are fetched (and checked) only when
    ``fetch_urls``; otherwise those not fetched yet pass unchecked."""
    name = str(path)
    report = ValidationReport(name, format, kind)

    def add(line: int, message: str) -> None:
        if len(report.problems) < max_problems:
            report.problems.append(Problem(name, line, message))
        else:
            report.truncated_problems += 1

    p = Path(path)
    if not p.is_file():
        add(0, "file not found" if not p.exists() else "not a regular file")
        return report
    try:
        p, name = dataset_file(p)
    except ArchiveError as e:
        add(0, str(e).removeprefix(f"{path}: "))
        return report
    report.path = name
    with open(p, "rb") as f:
        head = f.read(1 << 16)
    if not head.strip(b" \t\r\n\xef\xbb\xbf"):
        add(1, "the file is empty; a dataset needs at least one record")
        return report
    if format is not None and format not in FORMATS:
        add(1, f"unknown dataset format {format!r}; choose one of: {', '.join(FORMATS)}")
        return report
    if format is None or kind is None:
        try:
            found_format, found_kind = detect_format(p)
        except ValueError as e:
            add(1, str(e).split(": ", 1)[-1])
            return report
        if format is None:
            format = found_format
        if kind is None:
            kind = found_kind if found_format == format else KINDS[format][0]
    if kind not in KINDS[format]:
        add(1, f"format {format!r} holds {'/'.join(KINDS[format])} data, not {kind!r}")
        return report
    report.format, report.kind = format, kind
    for line, ex, problems in read_examples(p, format, kind, tokenizer, fetch_urls=fetch_urls):
        report.num_records += 1
        if ex is not None and not problems:
            report.num_valid += 1
        for message in problems:
            add(line, message)
    if report.num_records == 0:
        add(1, "the file holds no records")
    return report
