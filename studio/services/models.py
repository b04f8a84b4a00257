"""Base models the studio knows: tiny presets (built on demand), local model dirs, finished runs' outputs."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.models.config import ErnieConfig
from engine.models.counts import count_parameters
from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir
from engine.models.paths import architecture_dir, is_lora_dir, lora_base_dir, read_adapter_config
from engine.models.presets import OCR_PRESETS, OFFICIAL, ocr_preset_config
from engine.models.presets import preset_config as engine_preset_config
from studio.config import Settings
from studio.models import Run, RunStatus
from studio.services.downloads import active_download
from studio.services.errors import InvalidInput
from studio.services.paths import confine
from studio.services.store import MAX_ID, get_or_404

log = logging.getLogger(__name__)

# Presets `ernie-studio init-model` can build locally without downloads.
BUILDABLE_PRESETS = ("tiny", "tiny-moe", "tiny-vl", "tiny-ocr-vl")
_build_lock = threading.Lock()


def _read_config(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _describe(name: str, kind: str, path: Path | None, config: dict[str, Any] | None, **extra: Any) -> dict:
    return {
        "name": name,
        "kind": kind,
        "path": str(path) if path else None,
        "available": bool(path and (path / "config.json").exists()),
        "model_type": (config or {}).get("model_type"),
        **_sizes(config),
        **extra,
    }


def _sizes(config: dict[str, Any] | None) -> dict[str, int | None]:
    """All parameters, those a token uses (MoE: its routed experts) and the bytes of the weights in bf16,
    counted by `engine.estimate` from config.json alone (what the picker shows beside the size)."""
    unknown = {"num_parameters": None, "active_parameters": None, "weights_bf16_bytes": None}
    if not config:
        return unknown
    try:
        counts = count_parameters(ErnieConfig.from_dict(config))
    except (TypeError, ValueError, KeyError):
        return unknown
    return {
        "num_parameters": counts.total,
        "active_parameters": counts.active,
        "weights_bf16_bytes": 2 * counts.total,
    }


def _describe_run(run: Run) -> dict:
    """A succeeded run's model; a LoRA run (adapter, no config.json) is listed with its base's architecture
    and size, and available while that base is there (it deploys and exports merged into it)."""
    d = Path(run.model_dir)
    extra = {"run_id": run.id, "run_name": run.name}
    if not is_lora_dir(d):
        return _describe(f"run:{run.id}", "run", d, _read_config(d), **extra)
    adapter = read_adapter_config(d) or {}
    info = {k: adapter.get(k) for k in ("r", "lora_alpha", "target_modules", "compute_type")}
    try:
        base = architecture_dir(d)
    except FileNotFoundError:
        return _describe(f"run:{run.id}", "run", d, None, **extra, adapter=info) | {"available": False}
    described = _describe(f"run:{run.id}", "run", d, _read_config(base), **extra, adapter=info)
    return described | {"available": True, "base_model": str(lora_base_dir(d, adapter))}


def model_roots(settings: Settings) -> list[Path]:
    """The folders whose model directories are listed and may be named: home/models, then
    ERNIE_STUDIO_MODEL_ROOTS in the order given."""
    return [settings.models_dir, *settings.extra_model_roots]


def local_models(settings: Settings) -> dict[str, Path]:
    """{name: dir} of the model directories in the model roots (presets, official sizes and hidden folders
    aside). The name is the folder's; a folder whose name an earlier root already has is named by its full
    path."""
    reserved = {settings.models_dir / p for p in (*BUILDABLE_PRESETS, *OFFICIAL)}
    found: dict[str, Path] = {}
    for root in model_roots(settings):
        if not root.is_dir():
            continue
        for d in sorted(root.iterdir()):
            # hidden folders are work in progress (an export being written, a preset being built)
            if d in reserved or d.name.startswith(".") or not (d / "config.json").is_file():
                continue
            name = d.name if d.name not in found and d.name not in (*BUILDABLE_PRESETS, *OFFICIAL) else str(d)
            found[name] = d
    return found


def list_models(session: Session, settings: Settings) -> list[dict]:
    """Presets, model dirs under home/models (and ERNIE_STUDIO_MODEL_ROOTS), and succeeded runs' models;
    every `name` here is accepted back wherever a model is asked for (`model_dir_for`)."""
    out: list[dict] = []
    for preset in BUILDABLE_PRESETS:
        d = settings.models_dir / preset
        out.append(_describe(preset, "preset", d, _read_config(d) or preset_config(preset)))
    for name in OFFICIAL:
        d = settings.models_dir / name
        described = _describe(name, "official", d, _read_config(d) or engine_preset_config(name).to_dict())
        fetching = active_download(session, d)
        if fetching is not None:
            described["download"] = {
                "id": fetching.id,
                "status": fetching.status,
                "bytes_done": fetching.bytes_done,
                "bytes_total": fetching.bytes_total,
            }
        out.append(described)
    for name, d in local_models(settings).items():
        out.append(_describe(name, "local", d, _read_config(d)))
    runs = session.scalars(
        select(Run).where(Run.status == RunStatus.SUCCEEDED, Run.model_dir.is_not(None)).order_by(Run.id)
    ).all()
    out.extend(_describe_run(run) for run in runs)
    return out


def preset_config(preset: str) -> dict[str, Any]:
    """A preset's config.json as `init-model` writes it (for listing a preset before it is built)."""
    if preset in OCR_PRESETS:
        return ocr_preset_config(preset, vocab_size=TINY_VOCAB).official_dict("bfloat16")
    return _preset_config(preset).to_dict()


# Tiny presets get their vocab from the tokenizer init-model trains; 1024 is what it builds.
TINY_VOCAB = 1024


def _preset_config(preset: str) -> ErnieConfig:
    if preset in OCR_PRESETS:  # read as its config.json will be once built (decoder and vision encoder)
        return ErnieConfig.from_dict(preset_config(preset))
    return engine_preset_config(preset, vocab_size=TINY_VOCAB)


def model_config(session: Session, settings: Settings, ref: str, *, field: str = "base_model") -> ErnieConfig:
    """The architecture of model `ref` (a tiny preset's even before it is built; a LoRA run's base's), for
    estimates. `field` is the request field that named it, for errors."""
    d = model_dir_for(session, settings, ref, field=field)
    try:
        d = architecture_dir(d)
    except FileNotFoundError as e:
        if ref.strip() in BUILDABLE_PRESETS:
            return _preset_config(ref.strip())
        raise InvalidInput(f"{field}: {e}") from None
    raw = _read_config(d)
    if raw is None:
        raise InvalidInput(f"{field}: cannot read {d}/config.json")
    try:
        return ErnieConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{field}: {d}/config.json: {e}") from None


def is_ocr_model(ref: str, directory: str | Path) -> bool:
    """Whether model `ref` living in `directory` is a PaddleOCR-VL model (a LoRA run: its base; a preset:
    even before it is built)."""
    if ref.strip() in OCR_PRESETS:
        return True
    try:
        return is_paddleocr_vl_dir(architecture_dir(directory))
    except FileNotFoundError:
        return False


MODEL_REFS = (
    "a name /api/v1/models lists (a preset such as 'tiny', a local model, 'run:<id>') or a model directory"
)


def model_dir_for(session: Session, settings: Settings, ref: str, *, field: str = "base_model") -> Path:
    """Where model `ref` lives: any name `list_models` gives (a preset, an official size, a local model's
    name, `run:<id>`) or a directory under home or a model root; may not exist yet for a tiny preset. The
    one resolver for every request that names a model; errors name `field`, the parameter that named it."""
    ref = (ref or "").strip()
    if not ref:
        raise InvalidInput(f"{field}: empty; give {MODEL_REFS}")
    if len(ref) > 4096 or any(len(part.encode()) > 255 for part in ref.split("/")):
        # the file system would refuse it (ENAMETOOLONG), and no model can be named so
        raise InvalidInput(
            f"{field}: {ref[:60]!r}... is too long for a model name or path; give {MODEL_REFS}"
        )
    if ref in BUILDABLE_PRESETS:
        return settings.models_dir / ref
    if ref.startswith("run:"):
        return _run_model_dir(session, settings, ref, field)
    if ref in OFFICIAL:
        return _official_model_dir(settings, ref, field)
    local = local_models(settings)
    if ref in local:
        return confine(settings, local[ref], field=field, roots=settings.extra_model_roots)
    if "/" not in ref and not (settings.home / ref).exists():  # a name, not a path under home
        raise InvalidInput(
            f"{field}: no model is named {ref!r}; give {MODEL_REFS}. Model directories are looked up in "
            f"{', '.join(map(str, model_roots(settings)))} (add folders with ERNIE_STUDIO_MODEL_ROOTS)"
        )
    d = confine(settings, ref, field=field, roots=settings.extra_model_roots)
    if not (d / "config.json").is_file() and not is_lora_dir(d):
        raise InvalidInput(f"{field}: {d} has no config.json; point at a model directory")
    return d


def _run_model_dir(session: Session, settings: Settings, ref: str, field: str) -> Path:
    """The model a succeeded run produced, for `run:<id>`."""
    try:
        run_id = int(ref[4:])
    except ValueError:
        raise InvalidInput(f"{field}: {ref!r} is not 'run:<number>'") from None
    if not 1 <= run_id <= MAX_ID:
        raise InvalidInput(f"{field}: {ref!r} names no run (run ids are between 1 and {MAX_ID})")
    run = get_or_404(session, Run, run_id, "run", field=field)
    if run.status != RunStatus.SUCCEEDED or not run.model_dir:
        raise InvalidInput(f"{field}: run {run_id} has not produced a model (status {run.status})")
    return confine(settings, run.model_dir, field=field)


def _official_model_dir(settings: Settings, name: str, field: str) -> Path:
    """An official size, which must have been downloaded to home/models/<name>."""
    d = settings.models_dir / name
    if not (d / "config.json").exists():
        raise InvalidInput(
            f"{field}: {name} is not on this machine; download it to {d} (`ernie-studio download {name}`; "
            "the studio never downloads at run time) or pick the 'tiny' preset"
        )
    return d


def ensure_model_dir(session: Session, settings: Settings, ref: str, *, field: str = "base_model") -> Path:
    """`model_dir_for`, building a tiny preset with init-model the first time it is used."""
    d = model_dir_for(session, settings, ref, field=field)
    if ref.strip() in BUILDABLE_PRESETS:
        build_preset(settings, ref.strip())
    return d


def build_preset(settings: Settings, preset: str) -> Path:
    """Build `preset` under home/models once with `ernie-studio init-model`, in a child process (Paddle's
    execution mode is per thread, so building in an API thread is not safe) under a file lock, so the API
    and several workers racing for it all see one complete directory."""
    target = settings.models_dir / preset
    if (target / "config.json").exists():
        return target
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock, open(settings.models_dir / f".{preset}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=settings.models_dir))
        try:
            cmd = [
                sys.executable,
                "-m",
                "engine",
                "init-model",
                "--preset",
                preset,
                "--out",
                str(tmp / "model"),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"ernie-studio init-model --preset {preset} failed: {done.stderr[-2000:]}")
            os.rename(tmp / "model", target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built preset %s at %s", preset, target)
    return target
