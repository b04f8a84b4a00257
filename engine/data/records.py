"""Raw records of a dataset file: JSONL by lines or a JSON array streamed (or a CSV table with a header row,
the shape C-Eval and CMMLU ship, or a PaddleOCR label file of ``image<TAB>text`` lines), each with its line
number."""

from __future__ import annotations

import codecs
import csv
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
_SURROGATE = re.compile("[\udc80-\udcff]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Records are a few levels deep; anything deeper is an attack or a broken export, and would reach code
# (validation, rendering, JSON responses) that recurses.
MAX_JSON_DEPTH = 64
# A JSON array element whose parse error stays put after this much more text is really malformed.
ARRAY_LOOKAHEAD = 1 << 20
# Files up to this size get an exact record count in read_page (counting newlines is ~1 s per GB).
COUNT_LIMIT = 64 << 20
# read_page remembers the byte offset of every INDEX_STRIDE-th record so deep pages need not rescan.
INDEX_STRIDE = 4096
# Tables with a header row: one record per row, the header's names as keys (benchmark files, OCR labels).
TABLE_SUFFIXES = (".csv", ".tsv")
# PaddleOCR's recognition label files: ``<image path><TAB><text>`` per line, no header; read as OCR pairs.
LABEL_SUFFIXES = (".txt",)


@dataclass
class RawRecord:
    """One record of a file: its 1-based line, the parsed object (or None) and the read error (or None)."""

    line: int
    record: Any = None
    error: str | None = None


@dataclass
class Page:
    """A page of raw records; ``total`` is None when counting would mean reading a large file whole."""

    records: list[dict]
    total: int | None
    next_offset: int | None
    lines: list[int] = field(default_factory=list)


def is_json_array(path: str | Path) -> bool:
    """True when the first non-blank character of the file is ``[``."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return False
            stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
            if stripped:
                return stripped[:1] == b"["


def is_table(path: str | Path) -> bool:
    return Path(path).suffix.lower() in TABLE_SUFFIXES


def is_label_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() in LABEL_SUFFIXES


def iter_raw(path: str | Path) -> Iterator[RawRecord]:
    """Every record of a JSONL file, JSON array, CSV / TSV table or PaddleOCR label file, with read errors
    as records instead of exceptions."""
    if is_table(path):
        yield from _iter_table(path)
    elif is_label_file(path):
        yield from _iter_labels(path)
    elif is_json_array(path):
        yield from _iter_array(path)
    else:
        yield from _iter_lines(path)


def _iter_table(path: str | Path) -> Iterator[RawRecord]:
    """A header row, then one record per row (line numbers as in the file, so a quoted cell over two lines
    counts both)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter="\t" if str(path).lower().endswith(".tsv") else ",")
        try:
            for row in reader:
                extra = row.pop(None, None)  # cells past the header's columns
                if extra:
                    yield RawRecord(
                        reader.line_num, error=f"{len(extra)} cell(s) more than the header row's columns"
                    )
                    continue
                yield RawRecord(reader.line_num, record={(k or "").strip(): v for k, v in row.items()})
        except csv.Error as e:
            yield RawRecord(reader.line_num, error=f"unreadable CSV: {e}")


def _iter_labels(path: str | Path) -> Iterator[RawRecord]:
    """``image<TAB>text`` lines as ``{"image": ..., "text": ...}`` (the text is the rest of the line)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n").lstrip("\ufeff")
            except UnicodeDecodeError as e:
                yield RawRecord(
                    lineno, error=f"not valid UTF-8 at column {e.start + 1}; save the file as UTF-8"
                )
                continue
            if not text.strip():
                continue
            image, tab, label = text.partition("\t")
            if not tab:
                yield RawRecord(
                    lineno,
                    error="expected '<image path><TAB><text>' (PaddleOCR's label format); this line has no tab",
                )
                continue
            yield RawRecord(lineno, record={"image": image, "text": label})


def _decode_line(raw: bytes, lineno: int) -> RawRecord | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start : e.start + 1].hex()
        return RawRecord(
            lineno, error=f"not valid UTF-8: byte 0x{bad} at column {e.start + 1}; save the file as UTF-8"
        )
    text = text.strip().lstrip("\ufeff")
    if not text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return RawRecord(lineno, error=f"invalid JSON: {e.msg} (column {e.colno})")
    except (RecursionError, ValueError) as e:  # nesting past the parser's stack; integers over 4300 digits
        return RawRecord(lineno, error=f"invalid JSON: {_parse_failure(e)}")
    problem = json_value_problem(record)
    return RawRecord(lineno, error=problem) if problem else RawRecord(lineno, record=record)


def _parse_failure(e: Exception) -> str:
    if isinstance(e, RecursionError):
        return f"nested deeper than {MAX_JSON_DEPTH} levels"
    return f"a number cannot be read ({str(e).split(';')[0]})"


def json_value_problem(value: Any) -> str | None:
    """What a parsed record holds that JSON allows but a dataset must not: nesting deeper than
    MAX_JSON_DEPTH, or a string with a lone UTF-16 surrogate (an escape like "\\ud800" with no pair)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return "invalid JSON: a string holds a lone surrogate escape (\\ud800-\\udfff) that is no character"
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            return f"invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels"
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return None


def _iter_lines(path: str | Path, start_byte: int = 0, start_line: int = 1) -> Iterator[RawRecord]:
    with open(path, "rb") as f:
        f.seek(start_byte)
        for lineno, raw in enumerate(f, start=start_line):
            rec = _decode_line(raw, lineno)
            if rec is not None:
                yield rec


def _iter_array(path: str | Path) -> Iterator[RawRecord]:
    """Stream the elements of a top-level JSON array without loading the file whole."""
    decoder = json.JSONDecoder()
    with open(path, "rb") as f:
        text = _ArrayText(f)
        if not text.open_array():
            return
        line, expect_value, seen_comma = 1, True, False
        while True:
            new_pos = _skip_ws(text.buf, text.pos)
            line += text.buf.count("\n", text.pos, new_pos)
            text.pos = new_pos
            if text.pos >= len(text.buf) and not text.eof:
                text.refill(CHUNK)
                continue
            if text.pos >= len(text.buf):
                yield RawRecord(line, error="invalid JSON: the array is not closed with ']'")
                return
            ch = text.buf[text.pos]
            if ch == "]":
                if expect_value and seen_comma:
                    yield RawRecord(line, error="invalid JSON: a trailing ',' before ']'")
                return
            if ch == "," and not expect_value:
                text.pos += 1
                expect_value = seen_comma = True
                continue
            if not expect_value:
                yield RawRecord(
                    line, error=f"invalid JSON: expected ',' or ']' between array elements, found {ch!r}"
                )
                return
            decoded = text.decode(decoder, line)
            if isinstance(decoded, RawRecord):  # the array cannot be read on
                yield decoded
                return
            obj, end = decoded
            yield _array_record(obj, line, _SURROGATE.search(text.buf, text.pos, end) is not None)
            line += text.buf.count("\n", text.pos, end)
            text.pos = end
            expect_value = False
            if text.pos > CHUNK:
                text.buf, text.pos = text.buf[text.pos :], 0


class _ArrayText:
    """The decoded text of a JSON array file from ``pos`` on, read chunk by chunk."""

    def __init__(self, f: Any) -> None:
        self.f = f
        # Incremental: a chunk may end inside a multi-byte character. Bad bytes become surrogates and are
        # reported per record instead of failing the whole file.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf, self.pos, self.eof = "", 0, False
        self.refill(CHUNK)

    def refill(self, size: int) -> None:
        """Drop the text before ``pos`` and append the next ``size`` bytes of the file."""
        data = self.f.read(size)
        self.eof = len(data) < CHUNK
        self.buf = self.buf[self.pos :] + self._utf8.decode(data, final=self.eof)
        self.pos = 0

    def open_array(self) -> bool:
        """Skip a BOM, whitespace and the opening bracket; False for a file of whitespace only."""
        while True:
            self.pos = _skip_ws(self.buf, self.pos)
            if self.pos < len(self.buf):
                break
            if self.eof:
                return False
            self.refill(CHUNK)
        if self.buf[self.pos] == "\ufeff":
            self.pos += 1
        self.pos = _skip_ws(self.buf, self.pos) + 1  # the '['
        return True

    def decode(self, decoder: json.JSONDecoder, line: int) -> tuple[Any, int] | RawRecord:
        """(value, end) of the JSON value at ``pos``, reading on while it is cut by the chunk's end; a
        RawRecord with the error when it cannot be read (nor anything after it)."""
        while True:
            try:
                return decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self.eof or (
                    e.pos + ARRAY_LOOKAHEAD < len(self.buf) and e.msg != "Unterminated string starting at"
                ):
                    err_line = line + self.buf.count("\n", self.pos, e.pos)
                    return RawRecord(
                        err_line, error=f"invalid JSON: {e.msg}; the rest of the array cannot be read"
                    )
                self.refill(max(CHUNK, len(self.buf) - self.pos))
            except (RecursionError, ValueError) as e:  # past the parser's stack; over-long integers
                return RawRecord(
                    line, error=f"invalid JSON: {_parse_failure(e)}; the rest of the array cannot be read"
                )


def _array_record(obj: Any, line: int, bad_bytes: bool) -> RawRecord:
    """One decoded array element as a record, or the reason it is none (bytes that were not UTF-8, a
    value JSON allows but a dataset must not)."""
    if bad_bytes:
        return RawRecord(
            line, error="not valid UTF-8: the record holds bytes that are not UTF-8; save the file as UTF-8"
        )
    problem = json_value_problem(obj)
    return RawRecord(line, error=problem) if problem else RawRecord(line, record=obj)


def _skip_ws(buf: str, pos: int) -> int:
    n = len(buf)
    while pos < n and buf[pos] in " \t\r\n":
        pos += 1
    return pos


# ---- paging ------------------------------------------------------------------------------------------
_index_lock = threading.Lock()
# Per file version (path, size, mtime, stride): byte offsets of every INDEX_STRIDE-th record, record count.
_line_index: dict[tuple, list[tuple[int, int]]] = {}
_counts: dict[tuple, int] = {}
MAX_INDEXED_FILES = 64


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, INDEX_STRIDE)


def _remember(table: dict, key: tuple, value: object) -> None:
    if key not in table and len(table) >= MAX_INDEXED_FILES:
        table.pop(next(iter(table)))
    table[key] = value


def count_records(path: str | Path) -> int:
    """The number of non-blank lines of a JSONL file (or elements of a JSON array, rows of a table)."""
    if is_table(path) or is_label_file(path):
        return sum(1 for _ in iter_raw(path))
    if is_json_array(path):
        return sum(1 for _ in _iter_array(path))
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                n += 1
    return n


def read_page(path: str | Path, offset: int = 0, limit: int = 20) -> Page:
    """Records ``offset .. offset+limit`` of a dataset file, read without loading the file whole.

    JSONL pages seek through a sparse line index; JSON arrays are streamed from the start each time.
    Unreadable records appear as ``{"__error__": "line N: ..."}`` so a preview shows them in place.
    """
    path = Path(path)
    if offset < 0 or limit < 0:
        raise ValueError(f"offset and limit must be >= 0 (got offset={offset}, limit={limit})")
    total = None
    if path.stat().st_size <= COUNT_LIMIT:
        key = _file_key(path)
        with _index_lock:
            total = _counts.get(key)
        if total is None:
            total = count_records(path)
            with _index_lock:
                _remember(_counts, key, total)
    if is_table(path) or is_label_file(path) or is_json_array(path):
        records, lines, more = _page_from(iter_raw(path), offset, limit)
    else:
        records, lines, more = _page_jsonl(path, offset, limit)
    next_offset = offset + len(records) if more else None
    return Page(records=records, total=total, next_offset=next_offset, lines=lines)


def _page_from(it: Iterator[RawRecord], skip: int, limit: int) -> tuple[list[dict], list[int], bool]:
    records: list[dict] = []
    lines: list[int] = []
    for i, rec in enumerate(it):
        if i < skip:
            continue
        if len(records) == limit:
            return records, lines, True
        records.append(rec.record if rec.error is None else {"__error__": f"line {rec.line}: {rec.error}"})
        lines.append(rec.line)
    return records, lines, False


def _page_jsonl(path: Path, offset: int, limit: int) -> tuple[list[dict], list[int], bool]:
    """Seek to the nearest remembered record offset, then skip lines without decoding them."""
    key = _file_key(path)
    with _index_lock:
        known = list(_line_index.get(key, [(0, 0)]))  # [(byte offset, lines before)] per INDEX_STRIDE records
    k = min(offset // INDEX_STRIDE, len(known) - 1)
    byte, line0 = known[k]
    record_i = k * INDEX_STRIDE
    new_marks: list[tuple[int, int, int]] = []  # (record index, byte offset, lines before it)
    records: list[dict] = []
    lines: list[int] = []
    raw = b""
    with open(path, "rb") as f:
        f.seek(byte)
        lineno = line0
        while True:
            raw = f.readline()
            if not raw:
                break
            lineno += 1
            if not raw.strip():
                byte += len(raw)
                continue
            if record_i % INDEX_STRIDE == 0 and record_i // INDEX_STRIDE >= len(known):
                new_marks.append((record_i, byte, lineno - 1))
            byte += len(raw)
            if record_i >= offset:
                if len(records) == limit:
                    break
                rec = _decode_line(raw, lineno)
                if rec is not None:
                    records.append(
                        rec.record if rec.error is None else {"__error__": f"line {rec.line}: {rec.error}"}
                    )
                    lines.append(lineno)
            record_i += 1
    if new_marks:
        with _index_lock:
            index = _line_index.get(key) or [(0, 0)]
            _remember(_line_index, key, index)
            for rec_i, mark_byte, mark_line in new_marks:
                if rec_i == len(index) * INDEX_STRIDE:
                    index.append((mark_byte, mark_line))
    return records, lines, bool(raw)
