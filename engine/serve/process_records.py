"""The processes a server starts, recorded while they run and ended together: pid and start time (a
reused pid is never killed), read from /proc."""

import contextlib
import json
import os
import signal
import time
from pathlib import Path

# ---- the processes FastDeploy starts -----------------------------------------------------------------------
# FastDeploy starts its GPU workers and cache managers with setsid: they leave the api_server's process group,
# so a signal to that group misses them, and a SIGKILLed api_server never runs its own shutdown (which kills
# them). Every process of the tree is therefore recorded while it runs (pid + start time, so a reused pid is
# never killed), and a stop ends with all of them.


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) not in (None, "Z")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields after the last ")" are fixed
    return stat[stat.rindex(")") + 2 :].split()


def _proc_state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), which tells a reused pid from the one recorded."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and (fields := _stat_fields(int(entry))):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def read_records(path: Path) -> list[dict[str, int]]:
    try:
        return list(json.loads(path.read_text()).get("processes", []))
    except (OSError, ValueError, AttributeError):
        return []


def record_processes(path: Path, root: int) -> list[dict[str, int]]:
    """Add the live processes of ``root``'s tree to the records in ``path`` (written atomically)."""
    records = {r["pid"]: r for r in read_records(path)}
    for pid in process_tree(root):
        start = process_start(pid)
        if start is not None and records.get(pid, {}).get("start") != start:
            records[pid] = {"pid": pid, "start": start}
    out = sorted(records.values(), key=lambda r: r["pid"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"root": root, "processes": out}) + "\n")
    tmp.replace(path)
    return out


def recorded_alive(path: Path) -> list[int]:
    """The recorded processes still running (same pid and start time)."""
    return [
        r["pid"] for r in read_records(path) if _pid_alive(r["pid"]) and process_start(r["pid"]) == r["start"]
    ]


def kill_recorded(path: Path, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every recorded process still running (and the process group it leads); returns their pids."""
    hit = recorded_alive(path)
    for pid in hit:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            os.kill(pid, sig)
    return hit


def wait_gone(path: Path, timeout: float) -> list[int]:
    """Wait until no recorded process runs (a SIGKILL lands asynchronously); returns those still running."""
    deadline = time.monotonic() + timeout
    while (alive := recorded_alive(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
