"""Datasets: streamed uploads confined to home, validation and format detection by engine.data, paging."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.data.messages import MEDIA
from engine.data.record_types import FORMATS
from engine.data.records import TABLE_SUFFIXES
from engine.data.remote import CACHE_DIR as REMOTE_CACHE_DIR
from engine.eval.config import BENCHMARK_TYPES
from studio.config import Settings
from studio.models import Dataset, Run, RunStatus
from studio.services import media as media_svc
from studio.services.dataset_archives import extract_archive
from studio.services.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from studio.services.events import add_event
from studio.services.messages import SERVICES
from studio.services.models import ensure_model_dir
from studio.services.paths import ALLOWED_DATASET_SUFFIXES, confine, relative_to_home, safe_upload_name
from studio.services.store import get_or_404

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # uploads are streamed to disk in pieces this size

MAX_REPORTED_PROBLEMS = 50
ARCHIVE_SUFFIX = ".zip"
# Formats a dataset may have: the engine's training formats, and benchmark files (kind BENCHMARK), which
# only evaluations read.
DATASET_FORMATS = (*FORMATS, *BENCHMARK_TYPES)
BENCHMARK = "benchmark"


def incoming_dir(settings: Settings) -> Path:
    d = settings.datasets_dir / ".incoming"
    d.mkdir(parents=True, exist_ok=True)
    return d


# An upload being received is written to every moment; one nothing has written to for this long was left by
# an API process that died (kill -9, OOM, a reboot) and is never finished.
INCOMING_ABANDONED_AFTER_S = 10 * 60


def clean_incoming(settings: Settings, abandoned_after_s: float = INCOMING_ABANDONED_AFTER_S) -> int:
    """Delete the half-received uploads (and half-extracted archives) a dead API process left in
    `datasets/.incoming`; returns how many went. Called at API start. Only entries untouched for
    `abandoned_after_s` go, never all: another API process sharing this home (`--workers N`, a second
    replica on the same volume) may be receiving an upload into the same folder right now."""
    removed = 0
    cutoff = time.time() - abandoned_after_s
    for entry in incoming_dir(settings).iterdir():
        try:
            if _newest_mtime(entry) >= cutoff:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except FileNotFoundError:  # finished (moved into place) or cleaned by another process meanwhile
            continue
        removed += 1
        log.info("removed the abandoned upload %s", entry.name)
    return removed


def _newest_mtime(entry: Path) -> float:
    """The last time anything under `entry` was written (an archive being extracted writes its members)."""
    newest = entry.lstat().st_mtime
    if entry.is_dir() and not entry.is_symlink():
        for root, dirs, files in os.walk(entry):
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def stage_upload(settings: Settings, chunks: Iterable[bytes], filename: str | None) -> tuple[Path, str]:
    """Write an upload to a private file under home chunk by chunk, enforcing the size limit as it goes."""
    safe = safe_dataset_upload_name(filename)
    staged = incoming_dir(settings) / f"{uuid.uuid4().hex}-{safe}"
    limit = settings.max_upload_bytes
    written = 0
    try:
        with open(staged, "wb") as f:
            for chunk in chunks:
                written += len(chunk)
                if written > limit:
                    raise PayloadTooLarge(
                        SERVICES("upload_too_large", name=filename, mb=settings.max_upload_mb)
                    )
                f.write(chunk)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return staged, safe


def safe_dataset_upload_name(filename: str | None) -> str:
    """`safe_upload_name`, also accepting a .zip archive of a data file and its images."""
    if filename and filename.lower().endswith(ARCHIVE_SUFFIX):
        # The same checks on the name's parts; only the suffix differs.
        checked = safe_upload_name(filename[: -len(ARCHIVE_SUFFIX)] + ".jsonl")
        return checked[: -len(".jsonl")] + ARCHIVE_SUFFIX
    if filename and not filename.lower().endswith(ALLOWED_DATASET_SUFFIXES + TABLE_SUFFIXES):
        raise InvalidInput(
            f"file: {filename!r} is not a .jsonl or .json file, nor a .zip of one with the images it "
            "names; datasets are JSON Lines (one record a line) or a JSON array (benchmark files may also "
            "be .csv / .tsv tables)"
        )
    return safe_upload_name(filename)


def _iter_file(f: BinaryIO) -> Iterable[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def upload_dataset(
    session: Session,
    settings: Settings,
    source: BinaryIO | str | Path,
    filename: str | None = None,
    *,
    name: str | None = None,
    format: str | None = None,
    data_file: str | None = None,
) -> Dataset:
    """Upload from a file object or a local path (the UI hands over its temp file); see `create_dataset`."""
    if isinstance(source, str | Path):
        src = Path(source)
        with open(src, "rb") as f:
            staged, safe = stage_upload(settings, _iter_file(f), filename or src.name)
    else:
        staged, safe = stage_upload(settings, _iter_file(source), filename)
    return create_dataset(session, settings, staged, safe, name=name, format=format, data_file=data_file)


def _check_utf8(path: Path, label: str = "file") -> None:
    """Reject binary / non-UTF-8 files early with the line of the first bad byte."""
    line = 1
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(CHUNK):
            data = tail + chunk
            try:
                data.decode("utf-8")
                tail = b""
            except UnicodeDecodeError as e:
                if e.start >= len(data) - 3 and e.reason == "unexpected end of data":
                    # A multi-byte character split across chunks: carry it over.
                    line += data[: e.start].count(b"\n")
                    tail = data[e.start :]
                    continue
                line += data[: e.start].count(b"\n")
                raise InvalidInput(
                    f"{label}: line {line}: byte 0x{data[e.start]:02x} is not valid UTF-8; save the file as UTF-8"
                ) from None
            line += data.count(b"\n")
        if tail:
            raise InvalidInput(f"{label}: line {line}: the file ends in the middle of a UTF-8 character")


def create_dataset(
    session: Session,
    settings: Settings,
    staged: Path,
    filename: str,
    *,
    name: str | None = None,
    format: str | None = None,
    validate: bool = True,
    data_file: str | None = None,
) -> Dataset:
    """Detect the format, validate every record, and keep the file under home/datasets/<uuid>/.

    A `.zip` upload is extracted first (see `extract_archive`); its data file is then validated the same way.
    """
    if filename.lower().endswith(ARCHIVE_SUFFIX):
        return _create_from_archive(
            session,
            settings,
            staged,
            filename,
            name=name,
            format=format,
            validate=validate,
            data_file=data_file,
        )
    # The file is validated in a folder of its own, which becomes the dataset's folder: images its records
    # name by URL are fetched into it by a worker job queued below (studio.services.media), so training and
    # the preview find them there.
    work = incoming_dir(settings) / f"{uuid.uuid4().hex}.d"
    try:
        if staged.stat().st_size == 0:
            raise InvalidInput(SERVICES("file_empty", name=filename))
        work.mkdir()
        data = work / filename
        os.replace(staged, data)
        fmt, kind, num_records, num_valid, problems = _check_dataset(
            data,
            filename,
            name=name,
            format=format,
            validate=validate,
            strip=_folder_strip(work),
        )
        final_dir = settings.datasets_dir / uuid.uuid4().hex
        os.replace(work, final_dir)
    except BaseException:
        staged.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        raise
    final = final_dir / filename
    return _record(
        session,
        settings,
        final,
        filename,
        name,
        fmt,
        kind,
        final.stat().st_size,
        num_records,
        num_valid,
        problems,
    )


def _folder_strip(work: Path) -> Callable[[str], str]:
    """Problems name files by their staging path; users know them by their path inside the upload."""
    prefixes = sorted({str(work) + os.sep, str(work.resolve()) + os.sep}, key=len, reverse=True)

    def strip(message: str) -> str:
        for prefix in prefixes:
            if prefix in message:  # a message naming no staged path keeps its key (engine.messages)
                message = message.replace(prefix, "")
        return message

    return strip


def _check_dataset(
    path: Path,
    label: str,
    *,
    name: str | None,
    format: str | None,
    validate: bool,
    strip: Callable[[str], str],
    utf8_label: str = "file",
) -> tuple[str, str, int, int, list[str]]:
    """(format, kind, records, valid, problems) of a data file; raises InvalidInput naming `label`."""
    from engine.data import detect_format, validate_file
    from engine.eval.items import detect_benchmark

    if format is not None and format not in DATASET_FORMATS:
        raise InvalidInput(f"format: {format!r} is not one of {', '.join(DATASET_FORMATS)}")
    if name is not None and (len(name) > 200 or not name.strip()):
        raise InvalidInput("name: must be 1 to 200 characters")
    _check_utf8(path, utf8_label)
    benchmark = format if format in BENCHMARK_TYPES else None if format else detect_benchmark(path)
    if benchmark:
        return _check_benchmark(path, label, benchmark, validate=validate, strip=strip)
    if path.suffix.lower() in TABLE_SUFFIXES:
        raise InvalidInput(
            f"file: {label}: a table is read as a benchmark file, and this one's rows are no benchmark "
            "questions: give columns question, A, B, C, D, answer (C-Eval / CMMLU) or question, answer "
            "(GSM8K); see docs/evaluation.md"
        )
    try:
        detected, kind = detect_format(path)
    except ValueError as e:
        raise InvalidInput(f"file: {label}: {strip(str(e))}") from None
    fmt = format or detected
    num_records = num_valid = 0
    problems: list[str] = []
    if validate:
        # Images named by URL are not fetched here (a request never fetches): they pass unchecked, and the
        # fetch job queued once the dataset is kept checks and records them (studio.services.media).
        media_svc.check_url_count(path, fmt, label)
        report = validate_file(path, format=fmt, kind=kind, max_problems=MAX_REPORTED_PROBLEMS)
        kind = report.kind or kind
        num_records, num_valid = report.num_records, report.num_valid
        # keyed, so the upload's refusal lists them in the reader's language (the Datasets tab, REST details)
        problems = [
            MEDIA("at_line", file=strip(p.path), line=p.line, msg=strip(p.message))
            for p in report.problems[:MAX_REPORTED_PROBLEMS]
        ]
        if report.problems or num_valid == 0:
            shown = "; ".join(problems[:5]) or "no valid records"
            raise InvalidInput(
                f"file: {label} is not a valid {fmt} {kind} dataset "
                f"({len(report.problems)} problem(s)): {shown}",
                details={"problems": problems, "format": fmt, "kind": kind},
            )
    return fmt, kind, num_records, num_valid, problems


def _check_benchmark(
    path: Path, label: str, type_: str, *, validate: bool, strip: Callable[[str], str]
) -> tuple[str, str, int, int, list[str]]:
    """(format, kind, records, valid, problems) of a benchmark file, read as `ernie-studio eval` reads it: every
    problem (an answer not among the choices, no question, ...) is refused with its file and line."""
    from engine.eval.items import EvalDataError, read_eval_file

    if not validate:
        return type_, BENCHMARK, 0, 0, []
    try:
        n = len(read_eval_file(str(path), type_).items)
    except EvalDataError as e:
        problems = [strip(p) for p in e.problems[:MAX_REPORTED_PROBLEMS]]
        raise InvalidInput(
            f"file: {label} is not a valid {type_} benchmark file ({len(e.problems)} problem(s)): "
            + "; ".join(problems[:5]),
            details={"problems": problems, "format": type_, "kind": BENCHMARK},
        ) from None
    return type_, BENCHMARK, n, n, []


def _record(
    session: Session,
    settings: Settings,
    final: Path,
    filename: str,
    name: str | None,
    fmt: str,
    kind: str,
    size_bytes: int,
    num_records: int,
    num_valid: int,
    problems: list[str],
) -> Dataset:
    ds = Dataset(
        name=(name or Path(filename).stem).strip(),
        filename=filename,
        path=relative_to_home(settings, final),
        format=fmt,
        kind=kind,
        size_bytes=size_bytes,
        num_records=num_records,
        num_valid=num_valid,
        problems=problems,
    )
    session.add(ds)
    session.flush()
    add_event(session, "dataset.created", f"dataset {ds.name} uploaded ({num_records} records, {fmt})")
    session.commit()
    media_svc.queue_fetch(session, settings, ds, final)
    session.refresh(ds)  # with its fetch, for callers that read it after the session ends (the UI)
    return ds


def _create_from_archive(
    session: Session,
    settings: Settings,
    staged: Path,
    filename: str,
    *,
    name: str | None,
    format: str | None,
    validate: bool,
    data_file: str | None,
) -> Dataset:
    """Extract a zip under its own folder, validate its one data file (images relative to it), keep the folder."""
    work = incoming_dir(settings) / f"{uuid.uuid4().hex}.d"
    try:
        work.mkdir()
        rel, total = extract_archive(settings, staged, work, filename, data_file=data_file)
        data = work / rel
        if data.stat().st_size == 0:
            raise InvalidInput(SERVICES("file_empty", name=f"{filename}: {rel}"))
        fmt, kind, num_records, num_valid, problems = _check_dataset(
            data,
            rel,
            name=name,
            format=format,
            validate=validate,
            strip=_folder_strip(work),
            utf8_label=f"file: {filename}: {rel}",
        )
        final_dir = settings.datasets_dir / uuid.uuid4().hex
        os.replace(work, final_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        staged.unlink(missing_ok=True)
    return _record(
        session, settings, final_dir / rel, filename, name, fmt, kind, total, num_records, num_valid, problems
    )


def list_datasets(session: Session) -> list[Dataset]:
    return list(session.scalars(select(Dataset).order_by(Dataset.id.desc())).all())


def get_dataset(session: Session, dataset_id: int) -> Dataset:
    return get_or_404(session, Dataset, dataset_id, "dataset")


def dataset_path(settings: Settings, ds: Dataset) -> Path:
    """The dataset's data file; `ds.path` is relative to home and is confined there like any outside path."""
    return confine(settings, ds.path, field=f"dataset {ds.id}")


def dataset_folder(settings: Settings, ds: Dataset) -> Path:
    """The folder the upload created under home/datasets (a zip's data file may sit deeper inside it)."""
    path = dataset_path(settings, ds)
    if path.is_relative_to(settings.datasets_dir):
        return settings.datasets_dir / path.relative_to(settings.datasets_dir).parts[0]
    return path.parent


def dataset_file(session: Session, settings: Settings, dataset_id: int, rel_path: str) -> Path:
    """A file of a dataset (e.g. an image a VL record names), by its path relative to the data file."""
    ds = get_dataset(session, dataset_id)
    base = dataset_path(settings, ds).parent
    if rel_path.startswith("/") or ".." in rel_path.split("/"):
        raise InvalidInput(f"path: {rel_path!r} must be a relative path inside the dataset")
    target = confine(settings, rel_path, field="path", within=base, label=f"dataset {dataset_id}")
    if (
        REMOTE_CACHE_DIR in Path(rel_path).parts
        or REMOTE_CACHE_DIR in target.parts[len(base.resolve().parts) :]
    ):
        # fetched copies of the URLs records name: what a record's server sent is not the studio's to serve
        raise NotFound(f"path: {REMOTE_CACHE_DIR}/ of dataset {dataset_id} is not served")
    try:
        found = target != base and target.is_file()
    except OSError as e:
        raise InvalidInput(f"path: {rel_path!r} cannot be read ({e.__class__.__name__})") from None
    if not found:
        raise NotFound(f"path: dataset {dataset_id} has no file {rel_path!r}")
    return target


def record_images(settings: Settings, ds: Dataset, record: Any) -> list[tuple[Path | None, str]]:
    """(local file, name) of every image a VL record names, in order; the file is None for an image named by
    URL that has not been fetched yet (the preview says so; it never fetches)."""
    from engine.data.formats_vl import resolve_image

    infos = record.get("image_info") if isinstance(record, dict) else None
    base = dataset_path(settings, ds).parent
    out: list[tuple[Path | None, str]] = []
    for info in infos if isinstance(infos, list) else []:
        url = info.get("image_url") if isinstance(info, dict) else None
        if isinstance(url, str) and url:
            path, why = resolve_image(url, base)  # never fetches
            if path is not None and why is None:
                out.append((path, path.name) if path.is_file() else (None, url))
    return out


def preview_dataset(
    session: Session,
    settings: Settings,
    dataset_id: int,
    offset: int = 0,
    limit: int = 20,
    *,
    render_with: str | None = None,
) -> dict[str, Any]:
    """One page of raw records (never reads the whole file); `render_with` a model adds the chat rendering."""
    from engine.data import read_page

    if offset < 0:
        raise InvalidInput(f"offset: must be >= 0, got {offset}")
    if not 1 <= limit <= 500:
        raise InvalidInput(f"limit: must be between 1 and 500, got {limit}")
    ds = get_dataset(session, dataset_id)
    page = read_page(dataset_path(settings, ds), offset, limit)
    out: dict[str, Any] = {
        "dataset_id": ds.id,
        "offset": offset,
        "limit": limit,
        "records": page.records,
        "total": page.total,
        "next_offset": page.next_offset,
    }
    if render_with and ds.kind == BENCHMARK:
        raise InvalidInput(
            f"render_with: dataset {ds.id} is a {ds.format} benchmark; its questions are scored as they are "
            "(docs/evaluation.md), not rendered in the chat template"
        )
    if render_with:
        from engine.data import render_record

        tok = _tokenizer(session, settings, render_with, "render_with")
        base = dataset_path(settings, ds).parent  # VL images resolve next to the data file
        out["rendered"] = [render_record(r, ds.format, ds.kind, tok, base_dir=base) for r in page.records]
    return out


def _tokenizer(session: Session, settings: Settings, model: str, field: str):
    """The tokenizer of model `model` (any name /models lists, or a model directory), named by `field`."""
    from engine import load_tokenizer
    from engine.models.paths import tokenizer_dir
    from engine.tokenizer import ChatTemplateRefused

    d = ensure_model_dir(session, settings, model, field=field)
    try:
        return load_tokenizer(str(tokenizer_dir(d)))
    except (FileNotFoundError, ChatTemplateRefused) as e:
        raise InvalidInput(f"{field}: {e}") from None


def dataset_stats(
    session: Session, settings: Settings, dataset_id: int, *, model: str = "tiny", max_seq_len: int = 2048
) -> dict[str, Any]:
    """Token-length statistics with `model`'s tokenizer; cached on the dataset per (model, max_seq_len)."""
    from engine.data import dataset_stats as engine_stats

    if not 16 <= max_seq_len <= 1_048_576:
        raise InvalidInput(f"max_seq_len: must be between 16 and 1048576, got {max_seq_len}")
    ds = get_dataset(session, dataset_id)
    if ds.kind == BENCHMARK:
        raise InvalidInput(
            f"dataset {ds.id} is a {ds.format} benchmark: token statistics are for training data, and "
            "benchmarks are not trained on"
        )
    fetch = ds.media_fetch
    if fetch is not None and fetch.status in ("queued", "running"):
        raise Conflict(SERVICES("media_fetching", id=ds.id, done=fetch.urls_done, total=fetch.urls_total))
    key = f"{model}@{max_seq_len}"
    cached = dict(ds.stats or {})
    if key not in cached:
        tok = _tokenizer(session, settings, model, "model")
        cached[key] = engine_stats(dataset_path(settings, ds), ds.format, ds.kind, tok, max_seq_len)
        ds.stats = cached
        session.commit()
    return {"dataset_id": ds.id, "model": model, "max_seq_len": max_seq_len, **cached[key]}


def delete_dataset(session: Session, settings: Settings, dataset_id: int) -> None:
    """Remove a dataset and its file; refused while a queued or running run trains on it."""
    ds = get_dataset(session, dataset_id)
    active = session.scalars(select(Run).where(Run.status.in_([RunStatus.QUEUED, RunStatus.RUNNING]))).all()
    users = [r.id for r in active if dataset_id in (r.dataset_ids or [])]
    if users:
        raise Conflict(SERVICES("dataset_in_use", id=dataset_id, runs=users))
    folder = dataset_folder(settings, ds)
    session.delete(ds)
    add_event(session, "dataset.deleted", f"dataset {ds.name} deleted")
    session.commit()
    # Only ever remove a folder we created under home/datasets.
    if folder.is_relative_to(settings.datasets_dir) and folder != settings.datasets_dir:
        shutil.rmtree(folder, ignore_errors=True)
