"""How long the Train tab takes to open in a real browser, for this tree and, as a baseline, other trees.

Run with ``.venv/bin/python tools/time_train_tab.py [--rounds 5] [OTHER_TREE ...]``, e.g. a ``git archive
main`` unpacked in /tmp. Each tree gets its own ``ernie-studio up`` (own home, free port, its code first on
``PYTHONPATH``); one headless Chromium (Debian's) opens each studio on the Datasets tab, waits until it is idle,
clicks Train and times until the learning rate and every option group are visible. Rounds alternate the trees
so they share the machine's load; the table shows medians and minimums. (A tool, not a `bench/` script: it
needs the dev extra's Playwright, which `make bench`'s venv does not have.)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
IDLE_JS = "() => !document.querySelector('.wrap.default.full:not(.hide), .eta-bar')"


def start_studio(tree: Path) -> tuple[subprocess.Popen, str]:
    """``ernie-studio up`` from ``tree`` in a fresh home; returns the process and its URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = Path(tempfile.mkdtemp(prefix="bench-train-tab-"))
    env = {**os.environ, "ERNIE_STUDIO_HOME": str(home), "PYTHONPATH": str(tree)}
    env.pop("ERNIE_STUDIO_DATABASE_URL", None)
    env.pop("ERNIE_STUDIO_BROKER_URL", None)
    cmd = [
        str(Path(sys.executable).parent / "ernie-studio"),
        "up",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = (home / "studio.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(f"{tree}: the studio did not answer within 180 s; see {home / 'studio.log'}")


def open_seconds(page, url: str) -> tuple[float, int]:
    """Seconds from the click on the Train tab until its groups are visible, and how many groups."""
    from playwright.sync_api import expect

    page.goto(f"{url}/?tab=datasets")
    page.wait_for_selector("#studio-tabs")
    page.wait_for_function(IDLE_JS, timeout=60_000)
    time.sleep(1.5)
    started = time.monotonic()
    page.click("button[role=tab][data-tab-id=train]")
    expect(page.locator("#tr-learning-rate")).to_be_visible(timeout=60_000)
    groups = page.locator("[id^=tr-group-]:not([id$=-more])")
    for i in range(groups.count()):
        expect(groups.nth(i)).to_be_visible(timeout=60_000)
    return time.monotonic() - started, groups.count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("trees", nargs="*", type=Path, help="other source trees to time as baselines")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    trees = [ROOT, *(t.resolve() for t in args.trees)]
    studios = [start_studio(tree) for tree in trees]
    times: dict[Path, list[float]] = {tree: [] for tree in trees}
    groups: dict[Path, int] = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for _ in range(args.rounds):
                for tree, (_, url) in zip(trees, studios, strict=True):
                    seconds, groups[tree] = open_seconds(page, url)
                    times[tree].append(seconds)
            browser.close()
    finally:
        for proc, _ in studios:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in studios:
            proc.wait(timeout=30)
    print(f"| tree | groups | median s | min s | rounds: {args.rounds} |")
    print("|---|---:|---:|---:|---|")
    for tree in trees:
        shown = " ".join(f"{t:.2f}" for t in times[tree])
        print(
            f"| {tree} | {groups[tree]} | {statistics.median(times[tree]):.2f} | {min(times[tree]):.2f} | {shown} |"
        )


if __name__ == "__main__":
    main()
