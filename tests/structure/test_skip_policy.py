"""The suite cannot pass by skipping: a skip whose reason names no missing GPU fails the run."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]


def test_a_skip_for_a_missing_service_fails_the_run_and_a_gpu_skip_does_not(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest(
        "from tests.conftest import pytest_sessionfinish, pytest_terminal_summary  # noqa: F401"
    )
    pytester.makepyfile(
        test_layers="""
        import pytest

        def test_needs_redis():
            pytest.skip("Redis on 127.0.0.1:6379 is unreachable")

        def test_needs_a_gpu():
            pytest.skip("needs a CUDA GPU")

        def test_runs():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist")
    result.stdout.fnmatch_lines(
        [
            "*skip reasons*",
            "*1  Redis on 127.0.0.1:6379 is unreachable",
            "*1 test(s) skipped for a reason other than missing GPU hardware*",
            "*test_needs_redis: Redis on 127.0.0.1:6379 is unreachable",
        ]
    )
    assert result.ret == 1


def test_gpu_skips_alone_keep_the_run_green(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest(
        "from tests.conftest import pytest_sessionfinish, pytest_terminal_summary  # noqa: F401"
    )
    pytester.makepyfile(
        test_gpu="""
        import pytest

        @pytest.mark.skipif(True, reason="paddle.amp O2 needs a CUDA build of Paddle and a GPU")
        def test_amp():
            pass

        def test_runs():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist")
    assert result.ret == 0, result.stdout.str()


ORDER_CONFTEST = (
    "from tests.conftest import (order_seed, pytest_addoption, pytest_collection_modifyitems,  # noqa: F401\n"
    "    pytest_configure_node, pytest_report_header, pytest_terminal_summary)\n"
)
ORDER_TESTS = {
    f"test_file{f}": "\n".join(f"def test_{t}():\n    pass\n" for t in "abcdefgh") for f in range(4)
}


def _order(result) -> list[str]:
    return [line.split(" ")[0] for line in result.stdout.lines if "::test_" in line and "PASSED" in line]


def test_the_order_is_drawn_from_a_printed_seed_and_a_seed_repeats_it(pytester, monkeypatch):
    """Files and the tests inside each file run in a random order; the seed is printed, and `--order-seed`
    repeats the order, so an order-dependent failure can be rerun."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest(ORDER_CONFTEST)
    pytester.makepyfile(**ORDER_TESTS)
    args = ("-p", "no:cacheprovider", "-p", "no:xdist", "-v")
    drawn = pytester.runpytest(*args)
    assert drawn.ret == 0
    seed = int(
        next(line for line in drawn.stdout.lines if "--order-seed" in line)
        .split("--order-seed ")[1]
        .split()[0]
    )
    again = pytester.runpytest(*args, "--order-seed", str(seed))
    assert _order(again) == _order(drawn) and len(_order(drawn)) == 32
    files = [nodeid.split("::")[0] for nodeid in _order(drawn)]
    assert all(len(set(files[i : i + 8])) == 1 for i in range(0, 32, 8)), "a file's tests run together"
    kept = _order(pytester.runpytest(*args, "--order-seed", "none"))
    assert kept == sorted(kept)  # the files' own order
    others = {tuple(_order(pytester.runpytest(*args, "--order-seed", str(s)))) for s in (1, 2, 3)}
    assert len(others | {tuple(kept)}) == 4, "three seeds, three orders, none the files' own"


def test_xdist_processes_run_the_controllers_order(pytester, monkeypatch):
    """Each xdist process collects on its own: they take the controller's seed (else xdist stops the run on
    differing collections, or each process shuffles its own way), so each process's tests run in the order
    one process runs under that seed."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this suite's own xdist process sets it
    pytester.makeconftest(
        ORDER_CONFTEST
        + "import os, pytest\n"
        + "@pytest.fixture(autouse=True)\n"
        + "def _record(request):\n"
        + "    with open(f'ran-{os.environ.get(\"PYTEST_XDIST_WORKER\", \"main\")}.txt', 'a') as f:\n"
        + "        f.write(request.node.nodeid + '\\n')\n"
    )
    pytester.makepyfile(**ORDER_TESTS)
    # -p no:langsmith_plugin as the suite's own addopts (pyproject.toml): 1.3 s of CPU per xdist process
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-n", "2")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*test order: --order-seed *", "*32 passed*"])
    seed = (
        next(line for line in result.stdout.lines if "--order-seed" in line)
        .split("--order-seed ")[1]
        .split()[0]
    )
    assert pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist", "--order-seed", seed).ret == 0
    one = (pytester.path / "ran-main.txt").read_text().split()
    assert one != sorted(one)
    for worker in ("gw0", "gw1"):
        ran = (pytester.path / f"ran-{worker}.txt").read_text().split()
        assert ran == [nodeid for nodeid in one if nodeid in ran], worker


def test_a_whole_suite_run_over_its_time_budget_fails(pytester, monkeypatch):
    """`make test` prints the suite's time against its budget (10 minutes); a whole-suite run over it says so,
    and fails where ERNIE_STUDIO_SUITE_BUDGET_FAIL=1; a run of picked tests (a file, -k) says nothing."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest(
        ORDER_CONFTEST.replace(
            "pytest_configure_node,", "pytest_configure_node, pytest_sessionstart, pytest_sessionfinish,"
        )
    )
    pytester.makepyfile(test_one="def test_a():\n    pass\n", test_two="def test_b():\n    pass\n")
    (pytester.path / "tests").mkdir()
    for name in ("test_one.py", "test_two.py"):
        (pytester.path / name).rename(pytester.path / "tests" / name)
    args = ("-p", "no:cacheprovider", "-p", "no:xdist")
    monkeypatch.setenv("ERNIE_STUDIO_SUITE_BUDGET_S", "600")
    within = pytester.runpytest(*args, "tests")
    assert within.ret == 0
    within.stdout.fnmatch_lines(["suite time: * s of pytest (budget 600 s)"])
    monkeypatch.setenv("ERNIE_STUDIO_SUITE_BUDGET_S", "0.0001")
    monkeypatch.delenv("ERNIE_STUDIO_SUITE_BUDGET_FAIL", raising=False)
    warned = pytester.runpytest(*args, "tests")
    assert warned.ret == 0
    warned.stdout.fnmatch_lines(["OVER BUDGET: the suite took * s, over its 0 s budget*"])
    monkeypatch.setenv("ERNIE_STUDIO_SUITE_BUDGET_FAIL", "1")
    late = pytester.runpytest(*args, "tests")
    assert late.ret == 1
    late.stdout.fnmatch_lines(["FAILED: the suite took * s, over its 0 s budget*", "*2 passed*"])
    for picked in (["tests/test_one.py"], ["tests", "-k", "test_a"]):
        result = pytester.runpytest(*args, *picked)
        assert result.ret == 0 and "suite time" not in result.stdout.str(), picked
