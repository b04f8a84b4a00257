"""Reusing a node's recent passing doctor report: a worker that restarts (a crash loop, a redeploy, several
workers starting on one node) skips the self-tests when nothing they depend on has changed since they
passed. The key holds the node's stable facts (host, Paddle build, devices and their total memory, cores,
RAM, FastDeploy, the installed llama-server), the operator's floors, the doctor's form and the engine's source files, so a new driver,
GPU, floor or release runs the checks again; a failed report is never reused."""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import engine
from engine.doctor.facts import node_facts
from engine.doctor.report import Check, DoctorFloors, DoctorReport
from engine.llamacpp import find_tool

# Facts that move while nothing about the node changes; they are not part of the key.
_VOLATILE = ("free_memory_bytes", "available_bytes")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ernie-studio/doctor`` (``~/.cache/...``): the doctor describes the machine, so its
    reports live with the machine, not with one studio's home."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ernie-studio" / "doctor"


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in sorted(value.items()) if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _engine_stamp() -> list[tuple[str, int, int]]:
    root = Path(engine.__file__).parent
    return sorted(
        (str(p.relative_to(root)), (st := p.stat()).st_size, st.st_mtime_ns) for p in root.rglob("*.py")
    )


def _llama_server_stamp() -> list[Any] | None:
    """The llama-server the `llamacpp` check looks at (installed, replaced or gone changes the key)."""
    path = find_tool("llama-server")
    if path is None:
        return None
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def report_key(facts: dict[str, Any], floors: dict[str, Any], full: bool) -> str:
    """What a passing report vouches for, as a hex digest."""
    blob = json.dumps(
        {
            "facts": _stable(facts),
            "floors": floors,
            "full": full,
            "engine": _engine_stamp(),
            "llama_server": _llama_server_stamp(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load_recent(cache_dir: Path, key: str, max_age_s: float) -> dict[str, Any] | None:
    """The cached passing report for ``key`` when it is at most ``max_age_s`` old, else None."""
    path = cache_dir / f"{key}.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    age = time.time() - float(saved.get("saved_at", 0))
    if not saved.get("report", {}).get("passed") or not 0 <= age <= max_age_s:
        return None
    return saved


def save(cache_dir: Path, key: str, report: dict[str, Any]) -> None:
    """Keep a passing report under ``key`` (written whole, then renamed: a reader never sees half)."""
    if not report.get("passed"):
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"saved_at": time.time(), "report": report}))
        tmp.replace(cache_dir / f"{key}.json")
    except OSError:
        pass  # a read-only cache only costs the next start its self-tests


def reused_report(
    floors: DoctorFloors | None = None,
    reuse_s: float = 0.0,
    cache_dir: Path | None = None,
    full: bool = False,
) -> DoctorReport | None:
    """The passing report `run_doctor` would reuse now (same node facts, floors, form and engine, at most
    ``reuse_s`` old), or None: the lookup alone, no self-test."""
    if reuse_s <= 0:
        return None
    start = time.perf_counter()
    floors = floors or DoctorFloors()
    facts = node_facts()
    key = report_key(facts, floors.model_dump(), full)
    return reused(key, facts, floors, full, reuse_s, cache_dir or default_cache_dir(), start)


def reused(
    key: str, facts: dict, floors: DoctorFloors, full: bool, reuse_s: float, cache_dir: Path, start: float
) -> DoctorReport | None:
    """The saved passing report under ``key`` as a report of ``facts`` now, or None (`run_doctor` and
    `reused_report` both end here)."""
    saved = load_recent(cache_dir, key, reuse_s)
    if saved is None:
        return None
    return DoctorReport(
        full=full,
        facts=facts,
        checks=[Check(**c) for c in saved["report"]["checks"]],
        floors=floors.model_dump(),
        duration_s=time.perf_counter() - start,
        reused_from=datetime.fromtimestamp(saved["saved_at"], UTC).isoformat(timespec="seconds"),
    )
