"""Paddle's first import, wrapped: every process of the studio imports Paddle lazily (a command, a task or a
request that needs it), and what should happen around that import is installed here once.

``collection_paused`` is what every entry point installs (``engine.cli.main``): Paddle's import makes a few
hundred thousand objects that live as long as the process, and the garbage collector, which starts a
collection every 700 allocations and a full one as the survivors pile up, walked them again and again
while they arrived (about 0.2 s of a 1.4 s import on an AMD EPYC; docs/benchmarks.md, start-up). With
collection paused during the import and its objects frozen after it (out of every later collection's
walk, as ``studio.processes.freeze_startup_heap`` does for the web process), the import does no collecting
and no later collection walks them. The studio adds its own context (``studio.processes``: Paddle's signal
handlers put back) to the same guard.

``end_rank`` is the other end of a launched rank's life: it leaves without the C++ static destructors,
which race the TCP store's daemon thread in rank 0 (see its docstring).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import ModuleType
from typing import NoReturn

Context = Callable[[], AbstractContextManager]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection inside; everything alive at the end is frozen out of later collections."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


class _PaddleImportGuard(importlib.abc.MetaPathFinder):
    """Finds `paddle` once, and runs its module's execution inside every registered context."""

    def __init__(self) -> None:
        self.contexts: list[Context] = []

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "paddle":
            return None
        sys.meta_path.remove(self)  # the first import only; the returned spec ends the finders' loop
        spec = importlib.util.find_spec("paddle")
        if spec is None or spec.loader is None:
            return spec
        execute, contexts = spec.loader.exec_module, list(self.contexts)

        def exec_module(module: ModuleType) -> None:
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context())
                execute(module)

        spec.loader.exec_module = exec_module
        return spec


_guard = _PaddleImportGuard()


def around_paddle_import(context: Context) -> bool:
    """Run Paddle's first import, in whatever thread it comes, inside ``context()`` (a context manager
    factory; each one once, in the order given). False when Paddle is imported already."""
    if "paddle" in sys.modules:
        return False
    if _guard not in sys.meta_path:
        sys.meta_path.insert(0, _guard)
    if context not in _guard.contexts:
        _guard.contexts.append(context)
    return True


def launched_rank() -> bool:
    """This process is one rank of several under ``paddle.distributed.launch``, with Paddle loaded."""
    return "paddle" in sys.modules and int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1) > 1


def end_rank(code: int) -> NoReturn:
    """End a rank of a multi-rank job with ``code`` after Python's own shutdown, but without the C++ one.

    Rank 0 hosts the job's TCP store, whose libuv daemon thread (Paddle's ``LibUVMasterDaemon``) serves the
    other ranks until the process is gone; nothing in Paddle's Python API stops it. A plain exit runs the
    shared libraries' static destructors (oneDNN's pass registry, glog...) while that thread still runs.
    When another rank's connection closes in that window, the thread's read callback
    (``LibUVClient::readCallback``, which logs through glog on EOF) aborts the process: rank 0 of a job that
    had finished and saved everything exited with SIGABRT or SIGSEGV (launcher exit code 250 or 245), in 3 of
    41 two-node runs on an AMD EPYC (2026-11-30; cores in /tmp with gdb showed both threads) and once in CI;
    in none of 80 such runs through this.

    So: wait for the threads Python would wait for, run every ``atexit`` function (Paddle's process-group
    teardown, logging's flush and close...) as the interpreter would, flush the standard streams, and
    ``os._exit``. The native teardown is skipped; the kernel closes the sockets and files.
    """
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
