"""Confinement of every outside path to ERNIE_STUDIO_HOME (plus configured model roots)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from engine.data.records import TABLE_SUFFIXES  # benchmark tables: uploaded as they are, never in a .zip
from engine.train.config import TrainConfig
from engine.train.erniekit_keys import ERNIEKIT_ALIASES, ERNIEKIT_NOTICES
from studio.config import Settings
from studio.services.errors import InvalidInput

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
ALLOWED_DATASET_SUFFIXES = (".jsonl", ".json")
# Config keys whose value is a path on the server, read from the engine's schema (its text `*_path`, `*_dir`
# and `*_file` keys, and the ERNIEKit `*_path` keys it ignores): a path is never taken from a request, only
# ids the studio resolves to confined paths (`runs` says what to send instead of each).
PATH_KEYS = tuple(
    sorted(
        {
            f.name
            for f in dataclasses.fields(TrainConfig)
            if f.type in (str, "str") and f.name.endswith(("_path", "_dir", "_file"))
        }
        # ERNIEKit keys this engine accepts without effect may name paths too (overwrite_output_dir is a flag)
        | {
            key
            for key in {*ERNIEKIT_NOTICES, *ERNIEKIT_ALIASES}
            if key.endswith("_path") or key == "input_dir"
        }
    )
)


def confine(
    settings: Settings,
    path: str | Path,
    *,
    field: str = "path",
    roots: list[Path] | None = None,
    within: Path | None = None,
    label: str = "",
) -> Path:
    """Resolve `path` and require it to lie inside home or one of `roots` (relative paths are taken from
    home); with `within`, inside that folder only (relative paths are taken from it; `label` names it). Symlinks are followed
    before the check, so a link pointing out is refused like the path it points to."""
    raw = str(path)
    if "\x00" in raw:
        raise InvalidInput(f"{field}: contains a NUL byte")
    if len(raw) > 4096 or any(len(part.encode()) > 255 for part in Path(raw).parts):
        raise InvalidInput(f"{field}: the path is too long (at most 255 bytes per name and 4096 in all)")
    base = within.resolve() if within is not None else settings.home
    p = Path(raw) if within is not None else Path(raw).expanduser()
    try:
        resolved = (p if p.is_absolute() else base / p).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, an unreadable directory
        raise InvalidInput(f"{field}: {raw!r} cannot be resolved ({e.__class__.__name__})") from None
    allowed = [base] if within is not None else [settings.home, *(roots or [])]
    if any(resolved == root or resolved.is_relative_to(root) for root in allowed):
        return resolved
    if within is not None:
        raise InvalidInput(f"{field}: {raw!r} leads outside {label or within.name}; give a path inside it")
    raise InvalidInput(
        f"{field}: {raw!r} is outside the studio's storage ({settings.home}); "
        "put the files under ERNIE_STUDIO_HOME or add the directory to ERNIE_STUDIO_MODEL_ROOTS"
    )


def confine_list(
    settings: Settings, value: str, *, field: str, roots: list[Path] | None = None
) -> list[Path]:
    """`confine` for each entry of an ERNIEKit comma-separated path list (`train_dataset_path: a,b`)."""
    return [
        confine(settings, part.strip(), field=field, roots=roots) for part in value.split(",") if part.strip()
    ]


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
    if not filename.lower().endswith(ALLOWED_DATASET_SUFFIXES + TABLE_SUFFIXES):
        raise InvalidInput(
            f"file: {filename!r} is not a .jsonl, .json or .csv file; datasets are JSON Lines (one record a "
            "line) or a JSON array, benchmark files may also be CSV / TSV tables with a header row"
        )
    cleaned = _SAFE_CHARS.sub("_", filename)[-120:]
    return cleaned.lstrip("._") or "data.jsonl"


def relative_to_home(settings: Settings, path: Path) -> str:
    return str(path.resolve().relative_to(settings.home))


def confine_config_paths(settings: Settings, cfg: dict[str, Any], where: str) -> None:
    """Check every path a stored config names lies under home (a model also under ERNIE_STUDIO_MODEL_ROOTS):
    for configs written before paths were refused in hyperparameters."""
    for key in PATH_KEYS:
        if cfg.get(key):
            roots = settings.extra_model_roots if key == "model_name_or_path" else None
            confine_list(settings, str(cfg[key]), field=f"{where}: {key}", roots=roots)
