"""A studio page that nobody touches asks the browser for no animation frames.

Gradio 6.31's page-level "Loading..." status tracker is removed while its elapsed-time loop is running, and
the loop went on re-arming requestAnimationFrame: 60 frames a second on every tab, for as long as the page
stayed open (docs/benchmarks.md, "a page nobody touches asks for 60 frames a second"; 17-18% of a core on a
tab with no event). studio.ui.STATUS_TIMER_JS, put first in the page by studio.api.page_script, turns the
trackers' frames into 10-a-second timeouts."""

from __future__ import annotations

import time

import pytest
from gradio_page import StudioPage

pytestmark = pytest.mark.e2e

# Installed before any of the page's scripts: counts every frame asked of the browser itself.
COUNT_FRAMES_JS = """(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.__frames = 0;
  window.__by = {};  // who asked, for the failure message
  window.requestAnimationFrame = (callback) => {
    const at = (new Error().stack || "").split("\\n").slice(2, 5).join(" < ");
    window.__frames += 1;
    window.__by[at] = (window.__by[at] || 0) + 1;
    return frame(callback);
  };
})()"""


def test_an_idle_page_comes_to_rest_and_status_timers_run_on_timeouts(page, studio, artifacts):
    page.add_init_script(COUNT_FRAMES_JS)
    ui = StudioPage(page, studio, artifacts / "at-rest")
    ui.open("?tab=train")
    first = page.evaluate("() => document.head.querySelector('script').textContent")
    assert "/statustracker-" in first, first[:200]
    # After the load, Svelte's transitions ask for frames for a few seconds (~6 s on a slow host); then the
    # page must come to rest: two seconds in a row with no frame asked for. Before the fix, every second
    # had ~60 (the leaked loop), so it never did.
    counts: list[int] = []
    while len(counts) < 30 and counts[-2:] != [0, 0]:
        page.evaluate("() => { window.__frames = 0; window.__by = {} }")
        time.sleep(1)
        counts.append(page.evaluate("() => window.__frames"))
    assert counts[-2:] == [0, 0], (
        f"frames asked per second: {counts}; by: {page.evaluate('() => window.__by')}"
    )
    # A status tracker's loop still runs, on timeouts: a loop from a script named like Gradio's tracker
    # re-arms 5 times, each call gets a timestamp, and the browser is asked for no frame.
    ran = page.evaluate(
        """() => new Promise((done) => {
          window.__frames = 0;
          const probe = new Function("done", `
            const stamps = [];
            let cancelled = "not run";
            const dropped = requestAnimationFrame(() => { cancelled = "ran"; });
            cancelAnimationFrame(dropped);
            const step = (t) => {
              stamps.push(t);
              if (stamps.length < 5) requestAnimationFrame(step);
              else setTimeout(() => done({stamps, handle: dropped, cancelled}), 300);
            };
            requestAnimationFrame(step);
            //# sourceURL=${location.origin}/assets/statustracker-probe.js`);
          probe((out) => done({...out, frames: window.__frames}));
        })"""
    )
    assert len(ran["stamps"]) == 5 and all(isinstance(t, (int, float)) for t in ran["stamps"]), ran
    assert ran["frames"] == 0, ran
    # A tracker's handle is negative, so cancelling it never cancels someone else's frame, and it holds.
    assert ran["handle"] < 0 and ran["cancelled"] == "not run", ran
    # Every other caller still gets real frames.
    assert (
        page.evaluate("() => new Promise((done) => requestAnimationFrame((t) => done(window.__frames)))") >= 1
    )
