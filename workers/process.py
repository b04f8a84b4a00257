"""Child processes in their own process group that die with their worker, stopping them, and the one
supervisor every job kind's child runs under (`supervise`)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session

from engine.priority import nice_own_session
from studio.config import Settings
from studio.processes import die_with_parent

log = logging.getLogger(__name__)

# Set when the Celery worker begins a warm shutdown (workers.tasks connects it).
SHUTTING_DOWN = threading.Event()
POLL_S = 0.5


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
    are signalled too, in their own groups, so cancelling a multi-device run stops every rank. SIGCONT follows
    the SIGTERM (as systemd does): a stopped process (Ctrl-Z, a debugger, a frozen cgroup) acts on it at once
    instead of waiting out the grace, during which the job's heartbeat is silent and another worker's
    reconciler could take the job for a dead worker's."""
    groups = {proc.pid, *(_group_of(pid) for pid in descendants(proc.pid))} - {None}
    _signal_groups(groups, signal.SIGTERM)
    _signal_groups(groups, signal.SIGCONT)
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


class MetricsTail:
    """Reads complete new lines of metrics.jsonl from a byte offset (a partly written line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # the trainer rewrote the file on resume (dropping a torn line)
            self.offset = 0
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        points = []
        for line in data[: end + 1].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                points.append(row)
        return points


def log_line(log_file: Path, text: str) -> None:
    """A `=== <time> <text> ===` line in a job's log, between its child's own output."""
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(f"=== {datetime.now(UTC).isoformat(timespec='seconds')} {text} ===\n")


@dataclass(frozen=True)
class Stop:
    """A kind ended its job itself (`Supervised.watch`); `status` is what `supervise` returns."""

    status: str | None


class Supervised(Protocol):
    """What one job kind gives the supervisor; the rest (the loop, cancel, warm shutdown, loss) is shared."""

    def collect(self, session: Session) -> None:
        """Store what the child wrote since the last call (metrics, samples, bytes on disk) as progress."""

    def state(self, session: Session) -> str:
        """The heartbeat: "ok", "cancel" (a person asked to stop) or "lost" (the job is no longer this
        worker's: requeued elsewhere or deleted)."""

    def watch(self, session: Session, proc: subprocess.Popen, cancelled: bool) -> Stop | None:
        """A kind's own reason to end early (the other nodes of a gang lost a rank): a `Stop` ends the
        supervision with its status, None goes on."""

    def stop(self, settings: Settings, proc: subprocess.Popen) -> None:
        """Stop the child and everything it started (`stop_group`, or a server's own shutdown first)."""

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        """The worker is stopping gracefully and the child is stopped: give the job back (requeue or fail)."""

    def finish(self, session: Session, code: int, cancelled: bool) -> str:
        """The child exited with `code`: record what "done" means for the kind; returns the status."""

    def wait(self) -> None:
        """Wait before the next poll (a kind with a heartbeat thread wakes as soon as its state changes)."""


def supervise(session: Session, settings: Settings, proc: subprocess.Popen, job: Supervised) -> str | None:
    """Follow the started child `proc` to its end: collect its output on every poll, stop it on cancel (and
    record the end the kind reads from its exit), on loss (None: the job is another worker's now) and on a
    warm shutdown (the job is given back; None). Every job kind with a child runs under this loop."""
    cancelled = False
    while True:
        code = proc.poll()
        job.collect(session)
        if code is not None:
            return job.finish(session, code, cancelled)
        state = job.state(session)
        if state == "lost":  # two children must never write one job's directory
            log.warning("%s is no longer this worker's; stopping its child %d", job, proc.pid)
            job.stop(settings, proc)
            return None
        if SHUTTING_DOWN.is_set() and not cancelled:
            log.info("%s: worker shutting down, stopping child %d and giving the job back", job, proc.pid)
            job.stop(settings, proc)
            job.collect(session)
            job.release(session, proc)
            return None
        if state == "cancel" and not cancelled:
            cancelled = True
            log.info("%s: cancel requested, stopping process group %d", job, proc.pid)
            job.stop(settings, proc)
            continue
        stop = job.watch(session, proc, cancelled)
        if stop is not None:
            return stop.status
        job.wait()


class SupervisedJob:
    """Defaults for a `Supervised` kind: nothing to collect, no early end, a plain wait on the child."""

    proc: subprocess.Popen | None = None

    def collect(self, session: Session) -> None:
        return None

    def watch(self, session: Session, proc: subprocess.Popen, cancelled: bool) -> Stop | None:
        return None

    def stop(self, settings: Settings, proc: subprocess.Popen) -> None:
        stop_group(proc, settings.kill_grace_s)

    def wait(self) -> None:
        if self.proc is None:
            time.sleep(POLL_S)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(POLL_S)
