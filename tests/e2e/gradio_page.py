"""Small helpers for driving Gradio components by their ``elem_id`` in Playwright."""

from __future__ import annotations

import re
import time
from pathlib import Path

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


def streamed_lengths(page: Page, timeout_s: float = 120.0, settle_s: float = 1.0) -> list[int]:
    """The positive reply lengths `watch_reply_lengths` recorded, once at least two different ones were seen
    and none was added for ``settle_s`` (the reply is done), or whatever was recorded at ``timeout_s``.

    Gradio's idle state is not a sign that a streamed reply is on the page: the chat shows no progress
    overlay, so waiting for `StudioPage.idle` and reading once can see only the first update."""
    stop_at = time.monotonic() + timeout_s
    seen: list[int] = []
    changed_at = time.monotonic()
    while time.monotonic() < stop_at:
        now = [n for n in reply_lengths(page) if n > 0]
        if now != seen:
            seen, changed_at = now, time.monotonic()
        elif len(set(seen)) >= 2 and time.monotonic() - changed_at >= settle_s:
            break
        time.sleep(0.1)
    return seen


def plot_series_points(page: Page, elem_id: str) -> list[int]:
    """Number of drawn points of each line in a Gradio LinePlot (Vega renders one SVG path per series)."""
    return page.evaluate(PLOT_POINTS_JS, elem_id)
