"""The Nodes tab shows the studio's local training worker with the doctor it ran at start."""

from __future__ import annotations

import re

import pytest
from gradio_page import StudioPage
from playwright.sync_api import expect
from test_studio import api, wait_until

pytestmark = pytest.mark.e2e


def test_nodes_tab_shows_the_local_worker_and_its_doctor(page, studio, artifacts):
    ready = wait_until(
        lambda: next(
            (n for n in api(studio, "/nodes") if n["name"].startswith("train@") and n["state"] == "ready"),
            None,
        ),
        180,  # the studio may have just started: its workers check their node first
        "the local training worker to pass its doctor",
    )
    ui = StudioPage(page, studio, artifacts / "nodes")
    ui.open("?tab=nodes")
    table = ui.el("nodes-table")
    name = re.escape(ready["name"])
    # The worker's row: its state, then its doctor's verdict (cells follow each other in the table's text).
    # The tables fill from the page's load event, which waits in Gradio's queue behind other sessions' events
    # (a loaded fresh-clone run showed the header alone after expect's default 5 s): wait up to 30 s.
    expect(table).to_contain_text(re.compile(rf"{name}.*ready.*\d+/\d+ passed", re.S), timeout=30_000)
    checks = ui.el("nodes-checks")
    expect(checks).to_contain_text(
        re.compile(rf"{name}.*training_probe.*pass.*loss [\d.]+ -> [\d.]+", re.S), timeout=30_000
    )
    expect(checks).to_contain_text(re.compile(rf"{name}.*throughput.*pass.*tokens/s", re.S), timeout=30_000)
    ui.click("nodes-refresh")
    ui.idle()
    expect(table).to_contain_text(ready["name"])
    ui.shot("nodes")
