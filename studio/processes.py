"""Signal set-up shared by the web process (`ernie-studio up`) and the workers: children that die with
their parent, and Paddle's abort-on-SIGTERM handlers removed so the graceful ones decide (the web process and the workers import
Paddle only if a request or a task needs it, their handlers kept by an import guard)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import signal
from collections.abc import Iterator

from engine.startup import around_paddle_import, collection_paused

PR_SET_PDEATHSIG = 1


def quiet_paddle_signal_handlers() -> None:
    """Import Paddle now and remove the C signal handlers it installs on import (they abort the process on
    SIGTERM with a "FatalError"), so that the handlers Celery and uvicorn install afterwards decide how
    SIGTERM ends a worker or the API: warm shutdown, checkpoint and requeue."""
    import paddle

    paddle.disable_signal_handler()


# The signals Paddle's import takes over (its C handler prints a stack and aborts; SIGTERM is among them).
_PADDLE_SIGNALS = (
    signal.SIGSEGV,
    signal.SIGILL,
    signal.SIGFPE,
    signal.SIGABRT,
    signal.SIGBUS,
    signal.SIGTERM,
    signal.SIGINT,
)
_SIGACTION_BYTES = 256  # glibc's struct sigaction is 152 bytes on x86_64 and aarch64; room to spare


def _sigactions() -> dict[int, bytes]:
    """Every watched signal's current disposition, as the raw `struct sigaction` (read from any thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    saved = {}
    for sig in _PADDLE_SIGNALS:
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(int(sig), None, buf) == 0:
            saved[int(sig)] = buf.raw
    return saved


def _restore_sigactions(saved: dict[int, bytes]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for sig, raw in saved.items():
        libc.sigaction(sig, ctypes.create_string_buffer(raw, _SIGACTION_BYTES), None)


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The watched signals' dispositions in place before (the graceful handlers uvicorn or Celery installed)
    are put back after."""
    saved = _sigactions()
    try:
        yield
    finally:
        _restore_sigactions(saved)


def keep_signal_handlers_when_paddle_is_imported() -> None:
    """For a process that may never need Paddle (the API and the workers: their requests and tasks import
    engine helpers lazily, and most import none): instead of importing Paddle at start to remove its handlers
    (`quiet_paddle_signal_handlers`, 1.3-2 s of CPU), the first import of Paddle, whenever and in whatever
    thread it comes, leaves the signal handlers as they were (and, as in every process, runs without the
    garbage collector and freezes what it made: `engine.startup`)."""
    if not around_paddle_import(_signal_handlers_kept):
        quiet_paddle_signal_handlers()
    around_paddle_import(collection_paused)


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
