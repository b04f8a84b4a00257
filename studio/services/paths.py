"""Confinement of every outside path to ERNIE_STUDIO_HOME (plus configured model roots)."""

from __future__ import annotations

import re
from pathlib import Path

from studio.config import Settings
from studio.services.errors import InvalidInput

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
ALLOWED_DATASET_SUFFIXES = (".jsonl", ".json")


def confine(
    settings: Settings, path: str | Path, *, field: str = "path", roots: list[Path] | None = None
) -> Path:
    """Resolve `path` (relative paths are taken from home) and require it to lie inside home or `roots`."""
    raw = str(path)
    if "\x00" in raw:
        raise InvalidInput(f"{field}: contains a NUL byte")
    if len(raw) > 4096 or any(len(part.encode()) > 255 for part in Path(raw).parts):
        raise InvalidInput(f"{field}: the path is too long (at most 255 bytes per name and 4096 in all)")
    p = Path(raw).expanduser()
    if not p.is_absolute():
        p = settings.home / p
    resolved = p.resolve()
    allowed = [settings.home, *(roots or [])]
    for root in allowed:
        if resolved == root or resolved.is_relative_to(root):
            return resolved
    raise InvalidInput(
        f"{field}: {raw!r} is outside the studio's storage ({settings.home}); "
        "put the files under ERNIE_STUDIO_HOME or add the directory to ERNIE_STUDIO_MODEL_ROOTS"
    )


def safe_upload_name(filename: str | None) -> str:
    """Check an uploaded file's name: a plain base name ending in .jsonl or .json, no path parts."""
    if not filename:
        raise InvalidInput(
            "file: the upload has no file name; send it as multipart field `file` with a filename"
        )
    if (
        "\x00" in filename
        or "/" in filename
        or "\\" in filename
        or filename in (".", "..")
        or ".." in filename
    ):
        raise InvalidInput(
            f"file: the file name {filename!r} contains path parts ('/', '\\\\' or '..'); send a plain name "
            "such as data.jsonl"
        )
    if filename.startswith("."):
        raise InvalidInput(
            f"file: the file name {filename!r} starts with '.'; use a visible name such as data.jsonl"
        )
    if not filename.lower().endswith(ALLOWED_DATASET_SUFFIXES):
        raise InvalidInput(
            f"file: {filename!r} is not a .jsonl or .json file; datasets are JSON Lines (one record a line) "
            "or a JSON array"
        )
    cleaned = _SAFE_CHARS.sub("_", filename)[-120:]
    return cleaned.lstrip("._") or "data.jsonl"


def relative_to_home(settings: Settings, path: Path) -> str:
    return str(path.resolve().relative_to(settings.home))
