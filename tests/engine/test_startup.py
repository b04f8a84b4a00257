"""Paddle's first import, as every entry point wraps it (engine.startup): no garbage collection while it runs,
and the objects it made frozen out of later collections. Each case is a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, json, sys, threading
guarded = sys.argv[1] == "guarded"
if guarded:
    from engine.startup import around_paddle_import, collection_paused
    around_paddle_import(collection_paused)
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
t = threading.Thread(target=lambda: __import__("paddle"))  # the first import, in another thread
t.start()
t.join()
during = len(collections)
print(json.dumps({"during": during, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "again": "paddle" in sys.modules and not any(type(f).__name__ == "_PaddleImportGuard"
                                                                for f in sys.meta_path)}))
"""


def child(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_paddles_import_runs_no_collection_and_freezes_what_it_made():
    plain, guarded = child("plain"), child("guarded")
    print(f"collections during import paddle: plain {plain['during']}, guarded {guarded['during']}")
    # Measured (Intel Xeon with AMX, 2026-11-29): a plain import ran 296 collections
    assert plain["during"] > 29 and plain["frozen"] == 0
    assert guarded["during"] == 0
    # Paddle's objects (hundreds of thousands) frozen, collection back on, and the guard gone once used
    assert guarded["frozen"] > 100_000 and guarded["enabled"] and guarded["again"]


def test_the_cli_installs_the_guard_before_any_command_imports_paddle():
    probe = (
        "import sys\nfrom engine import cli, startup\n"
        "try:\n    cli.main(['--no-such-flag'])\nexcept SystemExit:\n    pass\n"
        "print(startup._guard in sys.meta_path, startup.collection_paused in startup._guard.contexts, "
        "'paddle' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "False"], out.stdout + out.stderr


RANK_CHILD = """
import atexit, ctypes, os, sys, threading, time
from engine import cli
import paddle
# a native exit handler, as the shared libraries' static destructors are: abort() in a plain exit
libc = ctypes.CDLL(None)
libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
atexit.register(lambda: print("atexit ran", flush=True))  # registered before the command runs
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
sys.stdout.write("unflushed tail ")
cli.run(["init-model", "--preset", "tiny", "--out", sys.argv[1]])  # a non-empty --out: code 2
"""


def test_a_launched_rank_ends_after_pythons_shutdown_but_skips_the_native_one(tmp_path):
    """Rank 0's TCP store thread aborted the process in the shared libraries' static destructors (engine.startup
    .end_rank: 3 of 41 two-node runs before). A rank of a multi-rank job runs Python's whole shutdown (threads
    joined, atexit functions, streams flushed) and then leaves before any native exit handler; a plain process
    still runs them, which here aborts it."""
    (tmp_path / "taken").write_text("x")

    def run(**env: str) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_TRAINER")}
        return subprocess.run(
            [sys.executable, "-c", RANK_CHILD, str(tmp_path)],
            cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    rank = run(PADDLE_TRAINERS_NUM="2", PADDLE_TRAINER_ID="0")
    assert rank.returncode == 2, rank.stderr[-2000:]
    assert "directory is not empty" in rank.stderr
    for line in ("unflushed tail", "thread finished", "atexit ran"):
        assert line in rank.stdout, rank.stdout
    plain = run()
    assert plain.returncode == -signal.SIGABRT, plain.returncode
    assert "atexit ran" in plain.stdout
