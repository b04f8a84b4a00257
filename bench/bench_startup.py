"""Process start: the imports every studio process pays, with the venv's bytecode and without it.

Run with ``.venv/bin/python bench/bench_startup.py [--rounds 5]``. Each process the studio starts for a job
(every trainer, doctor, export and built-in server; no longer the API or a worker) imports Paddle, whose
~1,100 modules are
compiled from source on every start when no ``.pyc`` files can be read: ``make`` installs with
``uv sync --compile-bytecode`` and compiles the studio's own packages for that reason. The baseline, in the
same run, reads its bytecode from an empty ``PYTHONPYCACHEPREFIX`` with ``PYTHONDONTWRITEBYTECODE=1``: every
module compiled at every start, as in a venv without bytecode where writing it is disabled. Rounds alternate
the two, and the table shows medians.

``--collection`` prints only the CPU seconds of ``import paddle`` with the garbage collector paused around it
(``engine.startup``, what every entry point installs) against a plain import.

``--against DIR`` adds a second table: what a worker's start costs in this tree and in another checkout
``DIR`` (say ``git worktree add /tmp/before <commit>``), CPU seconds (user + system) and peak memory of
``import workers.tasks``, rounds alternating, medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = {
    "paddle": "import paddle",
    "worker (workers.tasks)": "import workers.tasks",
    "trainer (engine.train.trainer)": "import engine.train.trainer",
}


def started(code: str, env: dict[str, str]) -> float:
    """Seconds for a fresh interpreter to run ``code`` and exit."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def cost(code: str, cwd: Path) -> tuple[float, float]:
    """(CPU seconds, peak MiB) of a fresh interpreter running ``code`` in ``cwd`` (its packages first)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{code}\nimport resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
        ],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, int(out.stdout.split()[-1]) / 1024


def compare_trees(other: Path, rounds: int) -> None:
    """The worker's start here against ``other``'s."""
    code = IMPORTS["worker (workers.tasks)"]
    runs: dict[str, list[tuple[float, float]]] = {"this tree": [], str(other): []}
    cost(code, ROOT), cost(code, other)  # page cache warm for both
    for _ in range(rounds):
        for name, cwd in (("this tree", ROOT), (str(other), other)):
            runs[name].append(cost(code, cwd))
    print(f"\n{'worker start (import workers.tasks)':40} {'CPU s':>7} {'peak MiB':>9}")
    for name, rows in runs.items():
        cpu = statistics.median(r[0] for r in rows)
        mib = statistics.median(r[1] for r in rows)
        print(f"{name:40} {cpu:>7.2f} {mib:>9.0f}")


GUARDED = "from engine.startup import around_paddle_import, collection_paused\n"
GUARDED += "around_paddle_import(collection_paused)\n"


def compare_collection(rounds: int) -> None:
    """``import paddle`` as every entry point now imports it (``engine.startup``: no garbage collection while
    it runs, its objects frozen after) against a plain import, CPU seconds, rounds alternating."""
    variants = {
        "plain import paddle": "import paddle",
        "collection paused (engine.startup)": GUARDED + "import paddle",
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    cost("import paddle", ROOT)  # page cache warm
    for _ in range(rounds):
        for name, code in variants.items():
            runs[name].append(cost(code, ROOT)[0])
    base = statistics.median(runs["plain import paddle"])
    print(f"\n{'import paddle':40} {'CPU s':>7} {'fastest':>8} {'vs plain':>9}")
    for name, rows in runs.items():
        cpu = statistics.median(rows)
        print(f"{name:40} {cpu:>7.3f} {min(rows):>8.3f} {base / cpu:>8.2f}x")


def pyc_share(package: str) -> str:
    """How many of the package's modules have bytecode beside them (what the venv was installed with)."""
    spec = importlib.util.find_spec(package)
    root = Path(spec.origin).parent if spec and spec.origin else None
    if root is None:
        return "?"
    sources = list(root.rglob("*.py"))
    compiled = sum(1 for p in sources if any((p.parent / "__pycache__").glob(f"{p.stem}.*.pyc")))
    return f"{compiled:,} of {len(sources):,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout: compare a worker's start with it")
    parser.add_argument(
        "--collection", action="store_true", help="only: import paddle with collection paused against plain"
    )
    args = parser.parse_args()
    if args.collection:
        compare_collection(args.rounds)
        return
    print(f"bytecode present: paddle {pyc_share('paddle')}, engine {pyc_share('engine')} modules")
    with tempfile.TemporaryDirectory(prefix="ernie-bench-pycache-") as empty:
        cached = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        cached.pop("PYTHONPYCACHEPREFIX", None)
        source = {**cached, "PYTHONPYCACHEPREFIX": empty}
        times: dict[tuple[str, str], list[float]] = {}
        for name, code in IMPORTS.items():
            started(code, cached)  # page cache warm for both
            for _ in range(args.rounds):
                for variant, env in (("source", source), ("bytecode", cached)):
                    times.setdefault((name, variant), []).append(started(code, env))
    print(f"\n{'process imports':34} {'compiled each start':>20} {'with .pyc':>10} {'speed-up':>9}")
    for name in IMPORTS:
        slow = statistics.median(times[(name, "source")])
        fast = statistics.median(times[(name, "bytecode")])
        print(f"{name:34} {slow:>19.2f}s {fast:>9.2f}s {slow / fast:>8.2f}x")
    if args.against:
        compare_trees(args.against.resolve(), args.rounds)


if __name__ == "__main__":
    main()
