"""Where a command's CPU goes, by kind of process: every process it starts (trainers, studio workers,
chromium's renderers, llama-server, PostgreSQL's backends...) is counted by the kernel's process accounting
(acct(2), as root), and each Python process names itself through a sitecustomize on PYTHONPATH. Prints a
table of CPU seconds per kind against the command's wall time on this machine's cores (issue 28: the suite
is CPU-bound, so its time is the CPU its processes spend). A process still running when the command ends (a
service started before it) is not counted.

    .venv/bin/python bench/suite_cpu.py -- .venv/bin/python -m pytest -q -n 2
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# struct acct_v3 (linux/acct.h): 64 bytes; times are comp_t (3-bit base-8 exponent, 13-bit mantissa) in
# AHZ ticks (100 per second on Linux).
RECORD = 64
AHZ = 100
NAMER = """import os, sys
try:
    with open(os.path.join({folder!r}, str(os.getpid())), "w") as f:
        f.write(open("/proc/self/cmdline").read().replace("\\0", " "))
except OSError:
    pass
"""


def _comp(value: int) -> int:
    return (value & 0x1FFF) << (3 * ((value >> 13) & 7))


def read_records(path: Path) -> list[dict]:
    """(pid, comm, CPU seconds) of each process that ended while accounting was on."""
    data = path.read_bytes()
    out = []
    for i in range(0, len(data) - len(data) % RECORD, RECORD):
        rec = data[i : i + RECORD]
        if rec[1] != 3:  # ac_version: only v3 records are laid out as read here
            continue
        pid, ppid = struct.unpack_from("<II", rec, 16)
        utime, stime = struct.unpack_from("<2H", rec, 32)
        comm = rec[48:64].split(b"\0")[0].decode(errors="replace")
        out.append({"pid": pid, "ppid": ppid, "comm": comm, "cpu": (_comp(utime) + _comp(stime)) / AHZ})
    return out


def kind(cmdline: str | None, comm: str) -> str:
    """A short name for a process: `ernie-studio train`, `-m celery worker`, `python script.py`, `chromium`."""
    if cmdline is None:
        return comm
    words = cmdline.split()
    if "-m" in words:
        i = words.index("-m")
        return "-m " + " ".join(w for w in words[i + 1 : i + 3] if not w.startswith(("/", "-")))
    entry = next((i for i, w in enumerate(words[:2]) if w.endswith("/ernie-studio")), None)
    if entry is not None:  # the console script, run directly or by the venv's python
        return "ernie-studio " + (words[entry + 1] if len(words) > entry + 1 else "")
    if "-c" in words[1:3]:  # python [-u] -c ...
        return "python -c (pytest-xdist processes and inline scripts)"
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return f"python {Path(script).name}" if script else Path(words[0]).name


def acct(path: Path | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(path).encode() if path else None) != 0:
        err = ctypes.get_errno()
        raise SystemExit(f"acct(2) failed: {os.strerror(err)} (process accounting needs root, CAP_SYS_PACCT)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=25, help="kinds to show (the rest are summed)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = ap.parse_args()
    command = [c for c in args.command if c != "--"] or [sys.executable, "-m", "pytest", "-q", "-n", "2"]

    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        tmp_path = Path(tmp)
        names = tmp_path / "names"
        names.mkdir()
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(NAMER.format(folder=str(names)))
        records = tmp_path / "pacct"
        records.touch()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])
            ),
        }
        acct(records)
        start = time.monotonic()
        try:
            rc = subprocess.call(command, env=env)
        finally:
            wall = time.monotonic() - start
            acct(None)
        cmdlines = {int(p.name): p.read_text() for p in names.iterdir()}
        rows = read_records(records)

    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        g = groups[kind(cmdlines.get(r["pid"]), r["comm"])]
        g[0] += 1
        g[1] += r["cpu"]
    total = sum(g[1] for g in groups.values())
    cores = os.cpu_count() or 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    shown, rest = ranked[: args.rows], ranked[args.rows :]
    print(f"\n{'CPU s':>8} {'share':>6} {'procs':>6} {'s/proc':>7}  kind")
    for name, (n, cpu) in shown:
        print(f"{cpu:8.1f} {cpu / total:6.1%} {n:6d} {cpu / n:7.2f}  {name}")
    if rest:
        cpu = sum(g[1] for _, g in rest)
        print(
            f"{cpu:8.1f} {cpu / total:6.1%} {sum(g[0] for _, g in rest):6d} {'':7}  ({len(rest)} other kinds)"
        )
    print(
        f"\ntotal {total:.0f} CPU-s in {len(rows)} processes; wall {wall:.0f} s on {cores} cores "
        f"(the baseline: {wall * cores:.0f} CPU-s if every core were busy throughout, {total / (wall * cores):.0%} used); "
        f"exit {rc}"
    )
    sys.exit(rc)


if __name__ == "__main__":
    main()
