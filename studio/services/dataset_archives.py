"""A dataset uploaded as a zip archive (a data file beside its images): every member checked before it is
written (paths, links, encryption, member count, sizes counted as they come out), and the one data file
picked. `studio.services.datasets` stores the dataset made from it."""

from __future__ import annotations

import logging
import zipfile
import zlib
from pathlib import Path

from engine.data.archive import member_problem
from studio.config import Settings
from studio.services.errors import InvalidInput, PayloadTooLarge
from studio.services.paths import ALLOWED_DATASET_SUFFIXES

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
# Files macOS adds to archives; they are neither data nor images, so they are not extracted.
_ARCHIVE_JUNK = ("__MACOSX/", ".DS_Store")


def extract_archive(
    settings: Settings, archive: Path, dest: Path, filename: str, *, data_file: str | None = None
) -> tuple[str, int]:
    """Extract `archive` into `dest` checking every member; (data file path inside the archive, bytes written).

    Refused (nothing kept): absolute or `..` paths, links, encrypted or corrupt members, more than
    max_archive_members members or more than max_upload_mb uncompressed, and anything but exactly one
    .jsonl/.json data file unless `data_file` names it.
    """
    root = dest.resolve()
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise InvalidInput(f"file: {filename} is not a readable zip archive ({e})") from None
    with zf:
        files = _archive_files(settings, zf, root, filename)
        rel_data = _pick_data_file(filename, [r for _, r in files], data_file)
        written = 0
        for info, rel in files:
            written = _extract_member(settings, zf, info, root / rel, filename, written)
    log.info("extracted %s: %d files, %d bytes, data file %s", filename, len(files), written, rel_data)
    return rel_data, written


def _archive_files(
    settings: Settings, zf: zipfile.ZipFile, root: Path, filename: str
) -> list[tuple[zipfile.ZipInfo, str]]:
    """The archive's files with their relative paths, after checking the member count, the declared size
    and every member's path (folders and macOS junk are left out)."""
    infos = [i for i in zf.infolist() if not any(j in i.filename for j in _ARCHIVE_JUNK)]
    if len(infos) > settings.max_archive_members:
        raise PayloadTooLarge(
            f"file: {filename} has {len(infos)} members, more than the limit of "
            f"{settings.max_archive_members}; split it or raise ERNIE_STUDIO_MAX_ARCHIVE_MEMBERS"
        )
    declared = sum(i.file_size for i in infos)
    if declared > settings.max_upload_bytes:
        raise PayloadTooLarge(
            f"file: {filename} unpacks to {declared / 2**20:.1f} MB, over the upload limit of "
            f"{settings.max_upload_mb} MB; split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
        )
    seen: set[str] = set()
    files: list[tuple[zipfile.ZipInfo, str]] = []
    for info in infos:
        why = member_problem(info)
        if why:
            raise InvalidInput(f"file: {filename}: member {info.filename!r} refused: {why}")
        rel = "/".join(p for p in info.filename.split("/") if p not in ("", "."))
        if not (root / rel).resolve().is_relative_to(root):
            raise InvalidInput(
                f"file: {filename}: member {info.filename!r} refused: it would land outside the dataset folder"
            )
        if info.is_dir() or not rel:
            continue
        if rel in seen:
            raise InvalidInput(f"file: {filename}: member {info.filename!r} appears twice")
        seen.add(rel)
        files.append((info, rel))
    return files


def _extract_member(
    settings: Settings, zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, filename: str, written: int
) -> int:
    """Write one member to `target`; returns the bytes written so far, counted against max_upload_mb."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(info) as src, open(target, "xb") as out:
            while chunk := src.read(CHUNK):
                written += len(chunk)
                if (
                    written > settings.max_upload_bytes
                ):  # sizes in the directory can lie; count what comes out
                    raise PayloadTooLarge(
                        f"file: {filename} unpacks to more than the upload limit of "
                        f"{settings.max_upload_mb} MB; split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
                    )
                out.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
        raise InvalidInput(
            f"file: {filename}: member {info.filename!r} cannot be extracted ({e}); the archive is "
            "damaged or uses an unsupported compression (use deflate)"
        ) from None
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        raise InvalidInput(
            f"file: {filename}: member {info.filename!r} clashes with a file or folder of the same name"
        ) from None
    return written


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
