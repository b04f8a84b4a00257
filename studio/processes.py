"""Signal set-up shared by the web process (`ernie-studio up`) and the workers: children that die with
their parent, and Paddle's abort-on-SIGTERM handlers removed so the graceful ones decide."""

from __future__ import annotations

import ctypes
import gc
import signal

PR_SET_PDEATHSIG = 1


def quiet_paddle_signal_handlers() -> None:
    """Import Paddle now and remove the C signal handlers it installs on import (they abort the process on
    SIGTERM with a "FatalError"), so that the handlers Celery and uvicorn install afterwards decide how
    SIGTERM ends a worker or the API: warm shutdown, checkpoint and requeue."""
    import paddle

    paddle.disable_signal_handler()


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent dies (a `preexec_fn` for child processes)."""
    # If the worker is SIGKILLed the trainer must not live on and write into a directory a new attempt
    # will use; Linux delivers SIGKILL to the child when its parent thread dies.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def freeze_startup_heap() -> None:
    """Move every object alive now (the imported modules: Paddle's alone are hundreds of thousands, the app)
    out of the garbage collector's reach, for a server about to take requests.

    A full (generation 2) collection walks every tracked object and holds the GIL meanwhile: in the API
    process, with Paddle and Gradio imported, that was 140-225 ms, every few seconds while a run's metrics
    kept the caches churning, and every request in flight waited (the tail of `bench/bench_reads.py`).
    Objects made after this point are collected as usual; the frozen ones live as long as the process
    anyway."""
    gc.collect()
    gc.freeze()
