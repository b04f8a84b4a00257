"""How busy the studio page keeps the browser while nobody touches it, per tab, for this tree and baselines.

Run with ``.venv/bin/python tools/page_idle_cost.py [--seconds 20] [OTHER_TREE ...]``, e.g. a ``git archive``
of an earlier commit unpacked in /tmp. Each tree gets its own ``ernie-studio up`` (tools/time_train_tab.py's
``start_studio``: own home, free port); one headless Chromium opens it, shows each tab, waits until it is
idle, then reads the renderer's busy time (CDP ``Performance.getMetrics``: TaskDuration, ScriptDuration)
over ``--seconds`` and counts the events the page sent (``/queue/join``). The Runs and Deploy tabs poll every
2 s; the others send nothing while idle. (A tool, not a `bench/` script: it needs the dev extra's Playwright.)
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from time_train_tab import CHROMIUM, IDLE_JS, ROOT, start_studio

TABS = ("datasets", "train", "runs", "deploy")


def idle_cost(page, url: str, seconds: float) -> dict[str, tuple[float, float, int]]:
    """Per tab: (busy share of the renderer, script seconds, events sent) over ``seconds`` of idling."""
    joins: list[str] = []
    page.on("request", lambda r: joins.append(r.url) if "/queue/join" in r.url else None)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")
    page.goto(f"{url}/?tab=datasets")
    page.wait_for_selector("#studio-tabs")
    page.wait_for_function(IDLE_JS, timeout=60_000)
    out = {}
    for tab in TABS:
        page.click(f"button[role=tab][data-tab-id={tab}]")
        page.wait_for_function(IDLE_JS, timeout=60_000)
        time.sleep(3)
        before = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        joins.clear()
        time.sleep(seconds)
        after = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        busy = (after["TaskDuration"] - before["TaskDuration"]) / seconds
        out[tab] = (busy, after["ScriptDuration"] - before["ScriptDuration"], len(joins))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("trees", nargs="*", type=Path, help="other source trees to measure as baselines")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    trees = [ROOT, *(t.resolve() for t in args.trees)]
    results = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        for tree in trees:  # one studio at a time: an idle studio still answers the other page's polls
            proc, url = start_studio(tree)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                results[tree] = idle_cost(page, url, args.seconds)
                page.close()
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
        browser.close()
    print(f"| tree | tab | renderer busy | script s | events | over {args.seconds:g} s |")
    print("|---|---|---:|---:|---:|---|")
    for tree in trees:
        for tab, (busy, script, events) in results[tree].items():
            print(f"| {tree} | {tab} | {busy:.0%} | {script:.2f} | {events} | |")


if __name__ == "__main__":
    main()
