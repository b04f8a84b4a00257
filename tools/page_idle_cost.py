"""How busy the studio page keeps the browser while nobody touches it, per tab, for this tree and baselines.

Run with ``.venv/bin/python tools/page_idle_cost.py [--seconds 20] [OTHER_TREE ...]``, e.g. a ``git archive``
of an earlier commit unpacked in /tmp. Each tree gets its own ``ernie-studio up`` (tools/time_train_tab.py's
``start_studio``: own home, free port); one headless Chromium opens it, shows each tab, waits until it is
idle, then reads the renderer's busy time (CDP ``Performance.getMetrics``: TaskDuration, ScriptDuration)
over ``--seconds``, the CPU of every Chromium process (renderer threads, GPU process, browser: /proc), the
animation frames the page asked for per second and by which script, and counts the events the page sent
(``/queue/join``). A page that nobody touches should ask for no frame: each one makes Chromium draw. The
Runs and Deploy tabs poll every 2 s; the others send nothing while idle. (A tool, not a `bench/` script: it
needs the dev extra's Playwright.)
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from page_load_cost import chromium_cpu_s
from time_train_tab import CHROMIUM, IDLE_JS, ROOT, start_studio

TABS = ("datasets", "train", "runs", "deploy")


# Counts requestAnimationFrame calls by the script line that made them (installed before the page's scripts).
COUNT_FRAMES_JS = """(() => {
  const raf = window.requestAnimationFrame.bind(window);
  window.__frames = {};
  window.requestAnimationFrame = cb => {
    const at = ((new Error().stack || '').split('\\n')[2] || '').trim().replace(/https?:[/][/][^/]+/, '');
    window.__frames[at] = (window.__frames[at] || 0) + 1;
    return raf(cb);
  };
})()"""


def idle_cost(page, url: str, seconds: float) -> dict[str, tuple[float, float, int, float, float, str]]:
    """Per tab, over ``seconds`` of idling: (busy share of the renderer, script seconds, events sent, share of
    a core all of Chromium used, animation frames asked for per second, the script asking for most)."""
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
        page.evaluate("() => { window.__frames = {} }")
        cpu = chromium_cpu_s()
        time.sleep(seconds)
        cpu = chromium_cpu_s() - cpu
        frames = page.evaluate("() => window.__frames")
        after = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        busy = (after["TaskDuration"] - before["TaskDuration"]) / seconds
        top = max(frames, key=frames.get).removeprefix("at ") if frames else ""
        out[tab] = (
            busy,
            after["ScriptDuration"] - before["ScriptDuration"],
            len(joins),
            cpu / seconds,
            sum(frames.values()) / seconds,
            top,
        )
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
                page.add_init_script(COUNT_FRAMES_JS)
                results[tree] = idle_cost(page, url, args.seconds)
                page.close()
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
        browser.close()
    print(
        f"| tree | tab | renderer busy | script s | events | all of Chromium, share of a core | frames / s "
        f"| most frames asked by | over {args.seconds:g} s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for tree in trees:
        for tab, (busy, script, events, cpu, fps, top) in results[tree].items():
            print(
                f"| {tree} | {tab} | {busy:.0%} | {script:.2f} | {events} | {cpu:.0%} | {fps:.0f} | {top} | |"
            )


if __name__ == "__main__":
    main()
