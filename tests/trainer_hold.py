"""Holding a trainer where a test needs it: SIGSTOP at a given step, so a cancel or a restart lands mid-run however fast
the machine is (the worker's stop continues a held child after its SIGTERM: the child then ends by it). Used by the
worker tests and the browser tests (both start real trainers)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def trainer_in(run_dir: Path) -> int | None:
    """The pid of the trainer working in ``run_dir`` (the worker starts it there), found in /proc: for tests
    that see the studio only through its API and pages."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if Path(os.readlink(proc / "cwd")) == run_dir and b"train" in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False


def hold_when(pid: int, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """SIGSTOP the process `pid` as soon as `ready()` holds (a tight poll, so a tiny model's trainer or
    exporter is held within a step or a file of that, however fast the machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            os.kill(pid, signal.SIGSTOP)
            return
        time.sleep(0.001)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def hold_after_steps(pid: int, metrics: Path, steps: int, timeout: float = 120) -> None:
    """SIGSTOP the trainer `pid` as soon as its metrics.jsonl holds `steps` steps."""
    hold_when(
        pid,
        lambda: metrics.exists() and metrics.read_text().count("\n") >= steps,
        f"{steps} steps in {metrics}",
        timeout,
    )
