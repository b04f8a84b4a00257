"""A dataset handed in as a zip: images plus one labels file, unpacked once into a folder beside the zip.

Every member is checked before anything is written (no absolute or ``..`` path, no link, no encryption, a
bounded number of members and bytes), so no path from the archive lands outside that folder; the labels
file is then read like any dataset file, its image paths relative to it (and confined to the folder by the
record checks, ``formats.resolve_image``). The labels file is the archive's one ``.jsonl`` / ``.json`` /
``.tsv`` / ``.csv`` / ``.txt`` file: OCR pairs ``{"image", "text"}``, ERNIEKit VL records, a table with
``image`` and ``text`` columns, or PaddleOCR's ``image<TAB>text`` lines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".zip",)
LABEL_FILE_SUFFIXES = (".jsonl", ".json", ".tsv", ".csv", ".txt")
MAX_MEMBERS = 200_000
MAX_UNPACKED_BYTES = 8 << 30
STAMP = ".unpacked-from.json"
_JUNK = ("__MACOSX/", "/.DS_Store")
_CHUNK = 1 << 20


class ArchiveError(ValueError):
    """A zip that cannot be used as a dataset; the message names the archive and the member. ``too_large``:
    a limit on members or bytes refused it (the studio answers 413)."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def is_archive(path: str | Path) -> bool:
    return Path(path).suffix.lower() in ARCHIVE_SUFFIXES


def dataset_file(path: str | Path) -> tuple[Path, str]:
    """(the file to read, how messages name it): a zip's labels file inside its unpacked folder, named
    ``archive.zip/labels.txt``; any other path as it is."""
    p = Path(path)
    if not is_archive(p):
        return p, str(path)
    folder = unpack(p)
    labels = json.loads((folder / STAMP).read_text())["labels"]
    return folder / labels, f"{path}/{labels}"


def unpacked_dir(archive: Path) -> Path:
    return archive.resolve().parent / f".{archive.name}.unpacked"


def unpack(archive: str | Path) -> Path:
    """The folder holding the archive's files, unpacked now unless an unpacking of this very zip (same size
    and modification time) is there already."""
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"{archive}: dataset archive not found")
    st = archive.stat()
    source = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    final = unpacked_dir(archive)
    stamp = final / STAMP
    if stamp.is_file():
        kept = json.loads(stamp.read_text())
        if {k: kept.get(k) for k in source} == source:
            return final
    work = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", dir=final.parent))
    try:
        labels = _extract(archive, work)
        (work / STAMP).write_text(json.dumps({**source, "labels": labels}) + "\n")
        if final.exists():  # an unpacking of an earlier version of the zip
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(work, final)
        log.info("unpacked %s into %s (labels file %s)", archive, final, labels)
    except OSError:
        if not (final / STAMP).is_file():  # not another process that unpacked it first
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def member_problem(info: zipfile.ZipInfo) -> str | None:
    """Why one member may not be unpacked (its path leaves the folder or is too long, a link, encryption),
    or None. The studio's dataset upload checks its zips with it too."""
    n = info.filename
    if "\x00" in n:
        return "its name contains a NUL byte"
    if "\\" in n:
        return "its name contains '\\'; archives must use '/' between folders"
    if n.startswith("/") or (len(n) > 1 and n[1] == ":"):
        return "it has an absolute path; archive members must be relative"
    parts = [p for p in n.split("/") if p not in ("", ".")]
    if ".." in parts:
        return "its path contains '..' and would land outside the dataset folder"
    if any(len(p.encode()) > 255 for p in parts) or len(n) > 1024:
        return "its path is too long"
    if stat.S_ISLNK(info.external_attr >> 16):
        return "it is a symbolic link; put the file itself in the archive"
    if info.flag_bits & 0x1:
        return "it is encrypted; archives must not use a password"
    return None


def _extract(archive: Path, dest: Path) -> str:
    """Unpack every member into ``dest`` after checking them all; returns the labels file's path in it."""
    root, limits = dest.resolve(), Limits(members=MAX_MEMBERS, bytes=MAX_UNPACKED_BYTES)
    with open_zip(archive, str(archive)) as zf:
        files = checked_files(zf, root, str(archive), limits)
        labels = _labels_file(archive, [rel for _, rel in files])
        extract_files(zf, files, root, str(archive), limits)
    return labels


@dataclass(frozen=True)
class Limits:
    """How much an archive may hold, and what a refusal tells the person to do about each limit."""

    members: int
    bytes: int
    members_hint: str = "split it"
    bytes_hint: str = "split it"


def open_zip(archive: Path, name: str) -> zipfile.ZipFile:
    """The archive opened for reading; `name` is how messages call it (a path, or an upload's field)."""
    try:
        return zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise ArchiveError(f"{name} is not a readable zip archive ({e})") from None


def checked_files(
    zf: zipfile.ZipFile, root: Path, name: str, limits: Limits
) -> list[tuple[zipfile.ZipInfo, str]]:
    """The archive's files with their paths relative to ``root``, after checking the member count, the
    declared size, every member's path (`member_problem`, and where it resolves) and that no path comes
    twice; folders and macOS junk are left out. Nothing is written."""
    infos = [i for i in zf.infolist() if not any(j in "/" + i.filename for j in _JUNK)]
    if len(infos) > limits.members:
        raise ArchiveError(
            f"{name} has {len(infos)} members, more than the limit of {limits.members}; {limits.members_hint}",
            too_large=True,
        )
    declared = sum(i.file_size for i in infos)
    if declared > limits.bytes:
        raise ArchiveError(
            f"{name} unpacks to {declared / 2**20:.1f} MB, over the limit of {_mb(limits.bytes)}; "
            f"{limits.bytes_hint}",
            too_large=True,
        )
    seen: set[str] = set()
    files: list[tuple[zipfile.ZipInfo, str]] = []
    for info in infos:
        why = member_problem(info)
        rel = "/".join(p for p in info.filename.split("/") if p not in ("", "."))
        if why is None and not (root / rel).resolve().is_relative_to(root):
            why = "it would land outside the dataset folder"
        if why:
            raise ArchiveError(f"{name}: member {info.filename!r} refused: {why}")
        if info.is_dir() or not rel:
            continue
        if rel in seen:
            raise ArchiveError(f"{name}: member {info.filename!r} appears twice")
        seen.add(rel)
        files.append((info, rel))
    return files


def extract_files(
    zf: zipfile.ZipFile, files: list[tuple[zipfile.ZipInfo, str]], root: Path, name: str, limits: Limits
) -> int:
    """Write the checked files under ``root``; returns the bytes written, counted as they come out (the
    sizes in the archive's directory can lie) against the limit."""
    written = 0
    for info, rel in files:
        written = _write_member(zf, info, root / rel, name, written, limits)
    return written


def _mb(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 1 << 30 else f"{n / 2**20:g} MB"


def _labels_file(archive: Path, members: list[str]) -> str:
    found = [
        m
        for m in members
        if m.lower().endswith(LABEL_FILE_SUFFIXES) and not m.rsplit("/", 1)[-1].startswith(".")
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ArchiveError(
            f"{archive}: no labels file; put one .jsonl, .json, .tsv, .csv or .txt file (e.g. labels.txt with "
            "'<image path><TAB><text>' lines) next to the images"
        )
    raise ArchiveError(f"{archive}: {len(found)} labels files ({', '.join(found[:10])}); keep one")


def _write_member(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, name: str, written: int, limits: Limits
) -> int:
    """One member to ``target``; the bytes written so far."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(info) as src, open(target, "xb") as out:
            while chunk := src.read(_CHUNK):
                written += len(chunk)
                if written > limits.bytes:
                    raise ArchiveError(
                        f"{name} unpacks to more than the limit of {_mb(limits.bytes)}; {limits.bytes_hint}",
                        too_large=True,
                    )
                out.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
        raise ArchiveError(
            f"{name}: member {info.filename!r} cannot be extracted ({e}); the archive is damaged or uses an "
            "unsupported compression (use deflate)"
        ) from None
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        raise ArchiveError(
            f"{name}: member {info.filename!r} clashes with a file or folder of the same name"
        ) from None
    return written
