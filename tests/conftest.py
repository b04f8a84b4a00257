"""Shared fixtures: tiny model directories built once per session with ``ernie-studio init-model``."""

from __future__ import annotations

import gc
import os
import random
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("FLAGS_call_stack_level", "0")
# The suite runs two pytest workers on two cores (and trainer children of its own): one CPU thread per
# process, or their kernels would wait on each other's cores (engine.models.kernels.cpu_threads).
os.environ.setdefault("ERNIE_STUDIO_CPU_THREADS", "1")
# Trainers at the default nice 10 give way to everything else (engine/priority.py: their session's group
# too); in the suite, "everything else" is the other pytest worker's tests, and a full run took 2 minutes
# longer waiting on it. Tests of the niceness itself pass it explicitly.
os.environ.setdefault("ERNIE_STUDIO_BATCH_NICENESS", "0")
# `make test` builds llama.cpp, so `--backend auto` would serve every CPU deployment of a text model with it
# (engine.llamacpp.cpu_serving). The suite's deployments test the built-in server unless a test asks for
# llama.cpp; tests/workers/test_cpu_serving.py holds the default (a studio without this setting).
os.environ.setdefault("ERNIE_STUDIO_CPU_SERVING", "paddle")


def pytest_configure(config):
    """Import Paddle in the main thread before any test. Paddle turns dynamic (eager) mode on only in the
    thread that first imports it: a request handled in a TestClient's worker thread that imported it first left
    the main thread in static mode, where a model built by a later test held graph values (init_model:
    "'pir.Value' object has no attribute 'set_value'"). A hook rather than a module import, so the suite's
    own tests of these hooks (tests/structure/test_skip_policy.py) start pytest runs without Paddle. An xdist
    controller runs no test and skips it."""
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        return
    import paddle  # noqa: F401


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _init(models_dir: Path, preset: str) -> Path:
    from engine.models.initialize import init_model

    out = models_dir / preset
    if not (out / "config.json").exists():
        init_model(preset, out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny-moe")


@pytest.fixture(scope="session")
def tiny_vl_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny-vl")


@pytest.fixture(scope="session")
def tiny_ocr_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny-ocr-vl")


# `make test` runs the suite on two pytest-xdist processes. Each file's tests stay in one process, so module
# fixtures (a trained model, a server) are built once, and the browser tests, which share one studio, form one
# unit. (xdist's own `loadgroup` marks did not group anything with this pytest: the scheduler below says what
# a unit is instead.) xdist hands the units out by their number of tests, most first; among units of one
# size, the files that start real workers, servers and browsers go first. Measured on the quiet 2-core
# machine, 2026-11-27: this took 742 s; the longest files first, with the browser files spread over both
# processes (one studio each), took 863 s: the long tests then overlap each other and each waits longer.
SLOW_FIRST = ("tests/workers/", "tests/e2e/")


# ---- random order: the files, and the tests inside each file, run in an order drawn from a seed ---------
# A test that passes only after another one (shared data, a server a previous test started) shows up as a
# failure under some seed. `make test` draws a new seed each run and prints it; `--order-seed N` repeats an
# order, `--order-seed none` keeps the files' own. Every xdist process must collect the same order, so the
# controller draws the seed and hands it to its workers.


def pytest_addoption(parser):
    parser.addoption(
        "--order-seed",
        default=None,
        help="seed of the test order (random files, random tests inside each file); 'none' keeps the files' "
        "order; default: a new seed each run, printed at the start and the end",
    )


def order_seed(config) -> int | None:
    """The run's order seed: the controller's (given or drawn once), which xdist workers receive."""
    if hasattr(config, "workerinput"):
        return config.workerinput.get("order_seed")
    if not hasattr(config, "_order_seed"):
        given = config.getoption("--order-seed", default=None)  # None too where the option is not added
        if given is None:
            config._order_seed = random.SystemRandom().randrange(1, 1_000_000)
        elif given.lower() == "none":
            config._order_seed = None
        else:
            config._order_seed = int(given)
    return config._order_seed


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["order_seed"] = order_seed(node.config)


def pytest_report_header(config):
    seed = order_seed(config)
    return f"test order: {'the files own' if seed is None else f'--order-seed {seed}'}"


def shuffled(items: list, seed: int) -> list:
    """``items`` with their files in a random order and each file's tests in a random order."""
    rng = random.Random(seed)
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = list(files)
    rng.shuffle(order)
    out = []
    for name in order:
        group = files[name]
        rng.shuffle(group)
        out.extend(group)
    return out


@pytest.hookimpl(tryfirst=True)  # before pytest's own reordering, which groups parametrized fixtures' setups
def pytest_collection_modifyitems(config, items):
    seed = order_seed(config)
    if seed is not None:
        items[:] = shuffled(items, seed)
    items.sort(key=lambda item: not item.nodeid.startswith(SLOW_FIRST))  # stable: random within each part


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/e2e/" if path.startswith("tests/e2e/") else path

    return FileScheduling(config, log)


# ---- garbage collection in the test processes ------------------------------------------------------------
# A test process holds Paddle, Gradio, FastAPI and the studio (~490k objects once the tests are imported),
# and every full collection walked them all: 7-9 s of each xdist process's 35-43 s of CPU in tests/studio.
# After collection they are frozen (never walked again), and collections start 20,000 allocations apart
# instead of 700. FastAPI's callable caches (4,096 entries each, fastapi.dependencies.models) kept the routes
# of the last ~16 apps a test built alive, ~32k objects per studio app; they are emptied after each test.
# Measured on tests/studio, -n 2, one order seed (2026-11-29, Zen 4): 77.8 CPU-s -> 66-70 CPU-s, 57 s -> 49-51 s.
GC_THRESHOLD = (20_000, 10, 10)
FASTAPI_CALL_CACHES = (
    "_is_gen_callable_cached",
    "_is_async_gen_callable_cached",
    "_is_coroutine_callable_cached",
)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def pytest_runtest_teardown(item, nextitem):
    models = sys.modules.get("fastapi.dependencies.models")
    for name in FASTAPI_CALL_CACHES:
        cached = getattr(models, name, None)
        if cached is not None:
            cached.cache_clear()


# ---- skips: only for hardware this machine lacks ---------------------------------------------------------
# CI must fail, never pass, when a layer the suite tests (Redis, PostgreSQL, chromium, llama.cpp, the
# reference environment) is missing. A skip is allowed only when its reason names a GPU (CUDA, FastDeploy's
# GPU build) or the CPU's bf16 instructions (avx512_bf16 / amx_bf16, which oneDNN's bf16 GEMM path needs):
# everything else a test needs is something CI provides. The run ends with every skip reason, and one that
# is not allowed turns a green run red.
ALLOWED_SKIP = ("GPU", "CUDA", "no bf16 instructions")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def unexpected_skips(reports) -> list[tuple[str, str]]:
    """(test id, reason) of every skip whose reason names no hardware this machine may lack."""
    found = []
    for report in reports:
        reason = _skip_reason(report)
        if not any(word in reason for word in ALLOWED_SKIP):
            found.append((report.nodeid, reason))
    return found


# ---- the time budget: the whole suite within 10 minutes of pytest on a loaded 2-core machine (issue 28) ------
# `make test` prints the suite's time against it and says loudly when a whole-suite run (no file, -k, -m or
# --lf picked) went over. ERNIE_STUDIO_SUITE_BUDGET_FAIL=1 makes that a failure. It does not fail by default
# yet: on 2026-11-28 the suite took 553-560 s on the quiet Intel Xeon but CI's machine has taken 630-750 s,
# and a red CI refuses every change; the default flips once the suite fits there with room.
# ERNIE_STUDIO_SUITE_BUDGET_S moves the budget (0: print nothing).
SUITE_BUDGET_S = 600.0


def suite_budget() -> float:
    return float(os.environ.get("ERNIE_STUDIO_SUITE_BUDGET_S", SUITE_BUDGET_S))


def budget_fails() -> bool:
    return os.environ.get("ERNIE_STUDIO_SUITE_BUDGET_FAIL", "") == "1"


def whole_suite(config) -> bool:
    """Did this run collect the whole suite (the configured test paths, nothing picked out)?"""
    picked = (
        config.getoption("keyword", default="")
        or config.getoption("markexpr", default="")
        or config.getoption("lf", default=False)
        or config.getoption("deselect", default=None)
    )
    paths = [(config.invocation_params.dir / a.split("::", 1)[0]).resolve() for a in config.args]
    tests = (config.rootpath / "tests").resolve()
    return not picked and all(p == tests for p in paths)


def pytest_sessionstart(session):
    session.config._suite_started = time.monotonic()


def suite_seconds(config) -> float | None:
    """How long this whole-suite run took, taken once when the session finishes (so the time printed is the
    time judged); None on an xdist worker or for a run of picked tests."""
    started = getattr(config, "_suite_started", None)
    if started is None or hasattr(config, "workerinput") or not whole_suite(config):
        return None
    if not hasattr(config, "_suite_seconds"):
        config._suite_seconds = time.monotonic() - started
    return config._suite_seconds


def over_budget(config) -> bool:
    took, budget = suite_seconds(config), suite_budget()
    return took is not None and bool(budget) and took > budget


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not hasattr(config, "workerinput"):
        took = suite_seconds(config)
        if took is not None:
            terminalreporter.write_line(f"suite time: {took:.0f} s of pytest (budget {suite_budget():.0f} s)")
        if over_budget(config):
            terminalreporter.write_line(
                f"{'FAILED' if budget_fails() else 'OVER BUDGET'}: the suite took {took:.0f} s, over its "
                f"{suite_budget():.0f} s budget; `--durations=25` names the slowest tests",
                red=True,
            )
        seed = order_seed(config)
        if seed is not None:
            terminalreporter.write_line(
                f"test order: --order-seed {seed} (PYTEST_ARGS='--order-seed {seed}' repeats it)"
            )
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or hasattr(config, "workerinput"):
        return
    terminalreporter.section("skip reasons")
    reasons: dict[str, int] = {}
    for report in skipped:
        reasons[_skip_reason(report)] = reasons.get(_skip_reason(report), 0) + 1
    for reason, n in sorted(reasons.items()):
        terminalreporter.write_line(f"{n:4d}  {reason}")
    bad = unexpected_skips(skipped)
    if bad:
        terminalreporter.write_line("")
        terminalreporter.write_line(
            f"FAILED: {len(bad)} test(s) skipped for a reason other than missing GPU hardware; CI provides "
            "every other layer (run .ci/run, which starts or installs them, or fix the environment):",
            red=True,
        )
        for nodeid, reason in bad:
            terminalreporter.write_line(f"  {nodeid}: {reason}", red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skips = reporter is not None and unexpected_skips(reporter.stats.get("skipped", []))
    if (skips or (budget_fails() and over_budget(session.config))) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
