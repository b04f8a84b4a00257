"""Child processes in their own process group that die with their worker, and stopping them."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.priority import nice_own_session
from studio.processes import die_with_parent

log = logging.getLogger(__name__)


def engine_command(*args: str) -> list[str]:
    """`ernie-studio <args>` from the worker's own environment."""
    script = Path(sys.executable).parent / "ernie-studio"
    if script.exists():
        return [str(script), *args]
    found = shutil.which("ernie-studio")
    return [found, *args] if found else [sys.executable, "-m", "engine", *args]


def spawn(
    cmd: list[str], log_file: Path, *, cwd: Path | None = None, env: dict | None = None, niceness: int = 0
) -> subprocess.Popen:
    """Start `cmd` in a new process group with stdout and stderr appended to `log_file`; `niceness` > 0
    starts it at a lower CPU priority (batch work: training, exports)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    linux = sys.platform.startswith("linux")
    with open(log_file, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=full_env,
            start_new_session=True,
            preexec_fn=functools.partial(_child_setup, niceness) if linux else None,
        )


def _child_setup(niceness: int) -> None:
    die_with_parent()
    if niceness > 0:
        os.nice(niceness)
        # The child leads a new session, hence a new autogroup: without the group's own nice value the
        # trainer would still share the CPU with the API as an equal (engine/priority.py).
        nice_own_session()


def stop_group(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`; returns the exit code.

    Descendants that left the group (the ranks `paddle.distributed.launch` starts in sessions of their own)
    are signalled too, in their own groups, so cancelling a multi-device run stops every rank."""
    groups = {proc.pid, *(_group_of(pid) for pid in descendants(proc.pid))} - {None}
    _signal_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_group_alive(g) for g in groups - {proc.pid}):
            break
        time.sleep(0.05)
    _signal_groups(groups, signal.SIGKILL)  # also reaps grandchildren left in the groups
    return proc.wait()


def _signal_groups(groups: set[int], sig: int) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, their children, ...), read from /proc (empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields after the last ")" are fixed
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_stale_group(pid: int | None, marker: str) -> None:
    """Kill the process group of a child a dead worker left on this node (checked by its command line,
    since the pid may have been reused)."""
    if not pid:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return
    if marker not in cmdline:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
        log.warning("killed leftover process group %d", pid)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, max_bytes: int = 4000) -> str:
    """The end of a log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
