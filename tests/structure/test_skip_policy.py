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
