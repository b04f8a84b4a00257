"""The API process (`ernie-studio up --no-worker`) starts without Paddle, and a Paddle imported later, in
any thread, leaves its graceful SIGTERM handling in place (Paddle's import installs C handlers that abort)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

LATE_IMPORT = """
import os, signal, sys, threading, time
from studio.processes import keep_signal_handlers_when_paddle_is_imported
if sys.argv[1] == "guarded":
    keep_signal_handlers_when_paddle_is_imported()
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
t = threading.Thread(target=lambda: __import__("paddle"))
t.start()
t.join()
assert "paddle" in sys.modules
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("handled" if got else "lost", flush=True)
"""


def test_paddle_imported_late_in_a_thread_keeps_the_python_sigterm_handler():
    guarded = subprocess.run(
        [sys.executable, "-c", LATE_IMPORT, "guarded"], capture_output=True, text=True, timeout=120
    )
    assert guarded.returncode == 0 and guarded.stdout.strip() == "handled", guarded.stdout + guarded.stderr
    # the same without the guard: Paddle's handler takes SIGTERM and the process dies by it
    plain = subprocess.run(
        [sys.executable, "-c", LATE_IMPORT, "plain"], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode != 0 and "handled" not in plain.stdout, plain.stdout + plain.stderr


def test_the_api_starts_without_paddle_and_stops_gracefully(studio_factory):
    studio = studio_factory()
    studio.start_api()  # `ernie-studio up --no-worker --no-ui`, waited for until /health answers
    api = studio.procs["api"]
    assert "libpaddle" not in Path(f"/proc/{api.pid}/maps").read_text()
    api.send_signal(signal.SIGTERM)
    assert api.wait(30) == 0, studio.log("api")[-3000:]
