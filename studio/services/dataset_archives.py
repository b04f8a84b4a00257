"""A dataset uploaded as a zip archive (a data file beside its images): every member checked before it is
written (paths, links, encryption, repeats, member count, sizes counted as they come out), and the one data
file picked. `studio.services.datasets` stores the dataset made from it."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.data.archive import ArchiveError, Limits, checked_files, extract_files, open_zip
from studio.config import Settings
from studio.services.errors import InvalidInput, PayloadTooLarge
from studio.services.paths import ALLOWED_DATASET_SUFFIXES

log = logging.getLogger(__name__)


def extract_archive(
    settings: Settings, archive: Path, dest: Path, filename: str, *, data_file: str | None = None
) -> tuple[str, int]:
    """Extract `archive` into `dest` checking every member; (data file path inside the archive, bytes written).

    Refused (nothing kept): absolute or `..` paths, links, encrypted, corrupt or repeated members, more than
    max_archive_members members or more than max_upload_mb uncompressed, and anything but exactly one
    .jsonl/.json data file unless `data_file` names it. The checks are the engine's (`engine.data.archive`),
    which unpacks zips named in a config the same way.
    """
    name = f"file: {filename}"
    limits = Limits(
        members=settings.max_archive_members,
        bytes=settings.max_upload_bytes,
        members_hint="split it or raise ERNIE_STUDIO_MAX_ARCHIVE_MEMBERS",
        bytes_hint="split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB",
    )
    root = dest.resolve()
    try:
        with open_zip(archive, name) as zf:
            files = checked_files(zf, root, name, limits)
            rel_data = _pick_data_file(filename, [r for _, r in files], data_file)
            written = extract_files(zf, files, root, name, limits)
    except ArchiveError as e:
        raise (PayloadTooLarge if e.too_large else InvalidInput)(str(e)) from None
    log.info("extracted %s: %d files, %d bytes, data file %s", filename, len(files), written, rel_data)
    return rel_data, written


def _pick_data_file(filename: str, members: list[str], data_file: str | None) -> str:
    candidates = [
        m
        for m in members
        if m.lower().endswith(ALLOWED_DATASET_SUFFIXES) and not m.rsplit("/", 1)[-1].startswith(".")
    ]
    if data_file:
        want = "/".join(p for p in data_file.split("/") if p not in ("", "."))
        if want not in members:
            raise InvalidInput(
                f"data_file: {data_file!r} is not in {filename}; its data files are: "
                f"{', '.join(candidates) or 'none'}"
            )
        if not want.lower().endswith(ALLOWED_DATASET_SUFFIXES):
            raise InvalidInput(f"data_file: {data_file!r} is not a .jsonl or .json file")
        return want
    if not candidates:
        raise InvalidInput(
            f"file: {filename} holds no .jsonl or .json data file; put the dataset file in the archive next to "
            "its images"
        )
    if len(candidates) > 1:
        raise InvalidInput(
            f"file: {filename} holds {len(candidates)} data files ({', '.join(candidates[:10])}); keep one, or "
            "name the one to use in the form field `data_file`"
        )
    return candidates[0]
