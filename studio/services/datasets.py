"""Datasets: streamed uploads confined to home, validation and format detection by engine.data, paging."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from studio.config import Settings
from studio.models import Dataset
from studio.services.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from studio.services.events import add_event
from studio.services.paths import relative_to_home, safe_upload_name

log = logging.getLogger(__name__)

FORMATS = ("erniekit", "alpaca", "chatml", "erniekit_vl")
KINDS = ("sft", "dpo")
MAX_REPORTED_PROBLEMS = 50
CHUNK = 1024 * 1024


def incoming_dir(settings: Settings) -> Path:
    d = settings.datasets_dir / ".incoming"
    d.mkdir(parents=True, exist_ok=True)
    return d


def stage_upload(settings: Settings, chunks: Iterable[bytes], filename: str | None) -> tuple[Path, str]:
    """Write an upload to a private file under home chunk by chunk, enforcing the size limit as it goes."""
    safe = safe_upload_name(filename)
    staged = incoming_dir(settings) / f"{uuid.uuid4().hex}-{safe}"
    limit = settings.max_upload_bytes
    written = 0
    try:
        with open(staged, "wb") as f:
            for chunk in chunks:
                written += len(chunk)
                if written > limit:
                    raise PayloadTooLarge(
                        f"file: {filename} is larger than the upload limit of {settings.max_upload_mb} MB; "
                        "split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
                    )
                f.write(chunk)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return staged, safe


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
) -> Dataset:
    """Upload from a file object or a local path (the UI hands over its temp file); see `create_dataset`."""
    if isinstance(source, str | Path):
        src = Path(source)
        with open(src, "rb") as f:
            staged, safe = stage_upload(settings, _iter_file(f), filename or src.name)
    else:
        staged, safe = stage_upload(settings, _iter_file(source), filename)
    return create_dataset(session, settings, staged, safe, name=name, format=format)


def _check_utf8(path: Path) -> None:
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
                    f"file: line {line}: byte 0x{data[e.start]:02x} is not valid UTF-8; save the file as UTF-8"
                ) from None
            line += data.count(b"\n")
        if tail:
            raise InvalidInput(f"file: line {line}: the file ends in the middle of a UTF-8 character")


def create_dataset(
    session: Session,
    settings: Settings,
    staged: Path,
    filename: str,
    *,
    name: str | None = None,
    format: str | None = None,
    validate: bool = True,
) -> Dataset:
    """Detect the format, validate every record, and keep the file under home/datasets/<uuid>/."""
    from engine.data import detect_format, validate_file

    try:
        if staged.stat().st_size == 0:
            raise InvalidInput(f"file: {filename} is empty")
        if format is not None and format not in FORMATS:
            raise InvalidInput(f"format: {format!r} is not one of {', '.join(FORMATS)}")
        if name is not None and (len(name) > 200 or not name.strip()):
            raise InvalidInput("name: must be 1 to 200 characters")
        _check_utf8(staged)
        try:
            detected, kind = detect_format(staged)
        except ValueError as e:
            raise InvalidInput(f"file: {filename}: {_strip_path(str(e), staged, filename)}") from None
        fmt = format or detected
        num_records = num_valid = 0
        problems: list[str] = []
        if validate:
            report = validate_file(staged, format=fmt, kind=kind, max_problems=MAX_REPORTED_PROBLEMS)
            kind = report.kind or kind
            num_records, num_valid = report.num_records, report.num_valid
            problems = [
                _strip_path(str(p), staged, filename) for p in report.problems[:MAX_REPORTED_PROBLEMS]
            ]
            if report.problems or num_valid == 0:
                shown = "; ".join(problems[:5]) or "no valid records"
                raise InvalidInput(
                    f"file: {filename} is not a valid {fmt} {kind} dataset "
                    f"({len(report.problems)} problem(s)): {shown}",
                    details={"problems": problems, "format": fmt, "kind": kind},
                )
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    final_dir = settings.datasets_dir / uuid.uuid4().hex
    final_dir.mkdir(parents=True)
    final = final_dir / filename
    os.replace(staged, final)
    ds = Dataset(
        name=(name or Path(filename).stem).strip(),
        filename=filename,
        path=relative_to_home(settings, final),
        format=fmt,
        kind=kind,
        size_bytes=final.stat().st_size,
        num_records=num_records,
        num_valid=num_valid,
        problems=problems,
    )
    session.add(ds)
    session.flush()
    add_event(session, "dataset.created", f"dataset {ds.name} uploaded ({num_records} records, {fmt})")
    session.commit()
    return ds


def _strip_path(message: str, staged: Path, filename: str) -> str:
    # Problems name the staged temp file; users know the file by the name they uploaded.
    return message.replace(str(staged), filename)


def list_datasets(session: Session) -> list[Dataset]:
    return list(session.scalars(select(Dataset).order_by(Dataset.id.desc())).all())


def get_dataset(session: Session, dataset_id: int) -> Dataset:
    ds = session.get(Dataset, dataset_id) if 1 <= dataset_id < 2**31 else None
    if ds is None:
        raise NotFound(f"dataset {dataset_id} does not exist")
    return ds


def dataset_path(settings: Settings, ds: Dataset) -> Path:
    return settings.home / ds.path


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
    if render_with:
        from engine.data import render_record

        tok = _tokenizer(session, settings, render_with)
        out["rendered"] = [render_record(r, ds.format, ds.kind, tok) for r in page.records]
    return out


def _tokenizer(session: Session, settings: Settings, model: str):
    from engine import load_tokenizer
    from studio.services.models import ensure_model_dir

    return load_tokenizer(str(ensure_model_dir(session, settings, model)))


def dataset_stats(
    session: Session, settings: Settings, dataset_id: int, *, model: str = "tiny", max_seq_len: int = 2048
) -> dict[str, Any]:
    """Token-length statistics with `model`'s tokenizer; cached on the dataset per (model, max_seq_len)."""
    from engine.data import dataset_stats as engine_stats

    if not 16 <= max_seq_len <= 1_048_576:
        raise InvalidInput(f"max_seq_len: must be between 16 and 1048576, got {max_seq_len}")
    ds = get_dataset(session, dataset_id)
    key = f"{model}@{max_seq_len}"
    cached = dict(ds.stats or {})
    if key not in cached:
        tok = _tokenizer(session, settings, model)
        cached[key] = engine_stats(dataset_path(settings, ds), ds.format, ds.kind, tok, max_seq_len)
        ds.stats = cached
        session.commit()
    return {"dataset_id": ds.id, "model": model, "max_seq_len": max_seq_len, **cached[key]}


def delete_dataset(session: Session, settings: Settings, dataset_id: int) -> None:
    """Remove a dataset and its file; refused while a queued or running run trains on it."""
    from studio.models import Run, RunStatus

    ds = get_dataset(session, dataset_id)
    active = session.scalars(select(Run).where(Run.status.in_([RunStatus.QUEUED, RunStatus.RUNNING]))).all()
    users = [r.id for r in active if dataset_id in (r.dataset_ids or [])]
    if users:
        raise Conflict(f"dataset {dataset_id} is used by queued or running run(s) {users}; cancel them first")
    folder = dataset_path(settings, ds).parent
    session.delete(ds)
    add_event(session, "dataset.deleted", f"dataset {ds.name} deleted")
    session.commit()
    # Only ever remove a folder we created under home/datasets.
    if folder.is_relative_to(settings.datasets_dir) and folder != settings.datasets_dir:
        shutil.rmtree(folder, ignore_errors=True)
