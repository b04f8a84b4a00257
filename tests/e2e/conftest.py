"""Browser tests: a real ``ernie-studio up`` (own home, free port) driven by Debian's headless Chromium."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from engine.serve.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# An assertion waits up to 15 s for the page to get there (Playwright's default is 5 s): on a slow host (the
# suite's machine at twice its usual time, session 7) an event's update came later than 5 s after the status
# line it follows. Only a failing check waits the whole time; the actions' own timeout is the page's 30 s.
expect.set_options(timeout=15_000)
ARTIFACTS = REPO / "test-artifacts" / "e2e"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def studio(tmp_path_factory, artifacts) -> Iterator[str]:
    """Base URL of a studio started with ``ernie-studio up`` (web + local training and serving workers)."""
    home = tmp_path_factory.mktemp("studio-home")
    port = free_port()
    # A sweep's driver looks at its trials every second (5 s by default): the sweep test waits for two.
    env = {
        **os.environ,
        "ERNIE_STUDIO_HOME": str(home),
        "PYTHONUNBUFFERED": "1",
        "ERNIE_STUDIO_SWEEP_POLL_S": "1",
    }
    env.pop("ERNIE_STUDIO_DATABASE_URL", None)
    env.pop("ERNIE_STUDIO_BROKER_URL", None)
    log = open(artifacts / "studio.log", "w")  # noqa: SIM115 - closed after the process ends
    cmd = [
        str(Path(sys.executable).parent / "ernie-studio"),
        "up",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"ernie-studio up exited with {proc.returncode}; see {artifacts / 'studio.log'}"
                )
            try:
                if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"studio did not answer on {url} within 120 s; see {artifacts / 'studio.log'}"
                )
            time.sleep(0.5)
        yield url
    finally:
        # up stops its workers on SIGTERM; the group kill is the fallback for anything left behind.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


# Module scope: Playwright's sync API keeps an asyncio loop running in the main thread until it stops,
# which would break every later test that calls asyncio.run().
@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.call_failed = report.failed


@pytest.fixture
def page(request, browser, studio, artifacts):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, locale="en-US")
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    yield pg
    if getattr(request.node, "call_failed", False):
        pg.screenshot(path=artifacts / f"FAILED-{request.node.name}.png", full_page=True)
    context.close()
