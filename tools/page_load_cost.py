"""What one load of the studio page costs headless Chromium, for this tree and, as a baseline, other trees.

Run with ``.venv/bin/python tools/page_load_cost.py [--rounds 5] [OTHER_TREE ...]``, e.g. a ``git archive`` of an
earlier commit unpacked in /tmp. Each tree gets its own ``ernie-studio up`` (``time_train_tab.start_studio``);
each round opens every studio's page in a new browser context (as each browser test does) and measures, until
the page is idle: the CPU time of all of Chromium's processes (browser, renderer, GPU and utility processes,
read from /proc), the wall time, and the HTML document's size. Rounds alternate the trees so they share the
machine's load; the table shows medians.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

import httpx
from time_train_tab import CHROMIUM, IDLE_JS, ROOT, start_studio


def chromium_cpu_s() -> float:
    """User + system CPU seconds of every live Chromium process."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            if b"chromium" not in cmd and not cmd.startswith(b"/proc/self/exe"):
                continue
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def load_cost(browser, url: str) -> tuple[float, float]:
    """(Chromium CPU seconds, wall seconds) of one page load in a new context, until the page is idle."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, locale="en-US")
    page = context.new_page()
    cpu, wall = chromium_cpu_s(), time.monotonic()
    page.goto(f"{url}/")
    page.wait_for_selector("#studio-tabs")
    page.wait_for_function(IDLE_JS, timeout=60_000)
    out = (chromium_cpu_s() - cpu, time.monotonic() - wall)
    context.close()
    return out


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("trees", nargs="*", type=Path, help="other source trees to compare with this one")
    args = parser.parse_args()
    trees = [ROOT, *[t.resolve() for t in args.trees]]
    studios = [start_studio(t) for t in trees]
    costs: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
    try:
        urls = {t: url for t, (_, url) in zip(trees, studios, strict=True)}
        sizes = {t: len(httpx.get(f"{url}/", timeout=30).content) for t, url in urls.items()}
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            for url in urls.values():
                load_cost(browser, url)  # warm each server's caches once, unmeasured
            for _ in range(args.rounds):
                for tree, url in urls.items():
                    costs[tree].append(load_cost(browser, url))
            browser.close()
    finally:
        for proc, _ in studios:
            os.killpg(proc.pid, signal.SIGTERM)
    print("| tree | page | Chromium CPU per load (median) | load to idle (median) | loads |")
    print("|---|---:|---:|---:|---:|")
    for tree in trees:
        cpu = statistics.median(c for c, _ in costs[tree])
        wall = statistics.median(w for _, w in costs[tree])
        name = "this tree" if tree == ROOT else str(tree)
        print(f"| {name} | {sizes[tree] / 1e6:.2f} MB | {cpu:.2f} s | {wall:.2f} s | {len(costs[tree])} |")


if __name__ == "__main__":
    main()
