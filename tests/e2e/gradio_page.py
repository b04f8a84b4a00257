"""Small helpers for driving Gradio components by their ``elem_id`` in Playwright."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect


class StudioPage:
    """The studio in one browser tab, with screenshots numbered in the order they are taken."""

    def __init__(self, page: Page, base_url: str, shots: Path):
        self.page = page
        self.base_url = base_url
        self.shots = shots
        self.shots.mkdir(parents=True, exist_ok=True)
        self._n = 0

    def open(self, query: str = "") -> None:
        self.page.goto(f"{self.base_url}/{query}")
        self.page.wait_for_selector("#studio-tabs")
        self.idle()

    def idle(self, timeout: float = 30_000) -> None:
        """Wait until Gradio shows no pending event (its progress overlays are gone)."""
        self.page.wait_for_function(
            "() => !document.querySelector('.wrap.default.full:not(.hide), .eta-bar')", timeout=timeout
        )

    def shot(self, name: str) -> Path:
        self._n += 1
        path = self.shots / f"{self._n:02d}-{name}.png"
        self.page.screenshot(path=path, full_page=True)
        return path

    def tab(self, tab_id: str) -> None:
        self.page.click(f"button[role=tab][data-tab-id={tab_id}]")
        self.idle()

    def el(self, elem_id: str):
        return self.page.locator(f"#{elem_id}")

    def click(self, elem_id: str) -> None:
        self.el(elem_id).click()

    def fill(self, elem_id: str, value: str) -> None:
        box = self.el(elem_id).locator("input, textarea").first
        box.fill(value)
        if box.evaluate("e => e.tagName") == "INPUT":
            box.press("Enter")  # Gradio's submit; textareas would get a newline instead
        box.blur()

    def launch(self) -> dict:
        """Click the Train tab's Launch once it is enabled; the run it queued (read back over REST)."""
        api = f"{self.base_url}/api/v1/runs"
        before = {r["id"] for r in httpx.get(api, timeout=10).json()}
        expect(self.el("tr-launch")).to_be_enabled(timeout=30_000)
        self.click("tr-launch")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            new = [r for r in httpx.get(api, timeout=10).json() if r["id"] not in before]
            if new:
                return httpx.get(f"{api}/{new[0]['id']}", timeout=10).json()
            time.sleep(0.3)
        raise AssertionError("Launch queued no run")

    def choose(self, elem_id: str, option: str) -> None:
        """Pick the option whose label contains ``option`` in a (multi)select dropdown: type to filter, Enter."""
        box = self.el(elem_id).locator("input").first
        box.click()
        box.fill(option)
        # Scoped to this dropdown: another one's list may still be closing on the page.
        item = self.el(elem_id).locator("ul[role=listbox] li", has_text=option).first
        expect(item).to_be_visible()
        item.dispatch_event("mousedown")  # Gradio selects on mousedown; a click can race the list's re-render
        box.blur()
        self.idle()

    def expect_text(self, elem_id: str, text: str | re.Pattern, timeout: float = 30_000) -> None:
        expect(self.el(elem_id)).to_contain_text(text, timeout=timeout)


PLOT_POINTS_JS = """(id) => {
  const paths = [...document.querySelectorAll(`#${id} g.mark-line path`)];
  return paths.map(p => ((p.getAttribute('d') || '').match(/[ML]/g) || []).length);
}"""


def watch_reply_lengths(page: Page, chat_id: str) -> None:
    """Record the length of the last bot message of chat ``chat_id`` at every change of the chat, so a test
    can tell a streamed reply (several lengths) from one delivered whole (`reply_lengths`)."""
    page.evaluate(
        """(chatId) => {
      window.__replyLengths = [];
      const box = document.querySelector('#' + chatId);
      new MutationObserver(() => {
        const bots = box.querySelectorAll('[data-testid=bot]');
        const last = bots[bots.length - 1];
        if (last) window.__replyLengths.push(last.innerText.length);
      }).observe(box, {subtree: true, childList: true, characterData: true});
    }""",
        chat_id,
    )


def reply_lengths(page: Page) -> list[int]:
    """The lengths `watch_reply_lengths` recorded, in order."""
    return page.evaluate("() => window.__replyLengths")


# Tokens asked for when a test watches a reply stream: the reply must outlast a few of the chat's update pauses
# (0.2 s) on the fastest machine. 48 and then 96 tokens were once each delivered whole, in one render, on a
# fast CI machine; the long-reply test in test_vl_chat streams 1,000 on every machine seen.
STREAMED_REPLY_TOKENS = 1000


def reply_streams(ui: StudioPage, prompt: str, timeout_s: float = 120.0) -> list[int]:
    """Send ``prompt`` in the Deploy & Chat tab, asking for a reply of `STREAMED_REPLY_TOKENS` with
    end-of-sentence ignored, and return the reply's lengths as the page showed them once it showed two different
    ones (it streams); Stop then ends the reply and the chat is idle again. Fails when the reply never showed two
    lengths within ``timeout_s``.

    Gradio's idle state is not a sign that a streamed reply is on the page (the chat shows no progress overlay),
    so the lengths are recorded by a MutationObserver (`watch_reply_lengths`)."""
    page = ui.page
    ui.fill("dep-max-tokens", str(STREAMED_REPLY_TOKENS))
    advanced = page.get_by_text("Advanced", exact=True)
    if not page.locator("#dep-ignore-eos input[type=checkbox]").is_visible():
        advanced.click()
    page.locator("#dep-ignore-eos input[type=checkbox]").check()
    watch_reply_lengths(page, "dep-chat")
    ui.el("dep-message").locator("textarea, input").first.fill(prompt)
    ui.click("dep-send")
    stop_at = time.monotonic() + timeout_s
    seen: list[int] = []
    while time.monotonic() < stop_at and len(set(seen)) < 2:
        time.sleep(0.1)
        seen = [n for n in reply_lengths(page) if n > 0]
    assert len(set(seen)) >= 2, f"the reply did not stream (lengths seen: {seen})"
    ui.el("dep-stop-gen").click(no_wait_after=True)
    ui.idle(timeout=60_000)
    return seen


def plot_series_points(page: Page, elem_id: str) -> list[int]:
    """Number of drawn points of each line in a Gradio LinePlot (Vega renders one SVG path per series)."""
    return page.evaluate(PLOT_POINTS_JS, elem_id)
