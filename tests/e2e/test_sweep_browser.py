"""A sweep in the browser (issue 33): set it up in the Train tab's Sweep box (a bad range first, refused with
its key named and nothing queued), watch the Sweeps tab's leaderboard fill, promote the best trial, and chat
with it in Deploy & Chat."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from gradio_page import StudioPage
from playwright.sync_api import expect
from test_studio import api, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "data" / "sft_demo.jsonl"
TRIALS = 2
STEPS = 4


def _upload(studio: str, name: str, lines: list[str], tmp_path: Path) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with path.open("rb") as f:
        r = httpx.post(f"{studio}/api/v1/datasets", files={"file": (path.name, f)}, timeout=60)
    assert r.status_code == 201, r.text


def test_sweep_from_the_train_tab_to_a_chat(page, studio, artifacts, tmp_path):
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    _upload(studio, "sweep_train", lines[:32], tmp_path)
    _upload(studio, "sweep_eval", lines[32:40], tmp_path)
    ui = StudioPage(page, studio, artifacts / "sweep")
    ui.open("?tab=train")
    ui.choose("tr-datasets", "sweep_train")
    ui.choose("tr-eval-dataset-ids", "sweep_eval")
    ui.fill("tr-run-name", "swept")
    ui.fill("tr-max-steps", str(STEPS))
    ui.expect_text("tr-yaml", f"max_steps: {STEPS}")
    page.get_by_text("Sweep: search hyperparameters with Optuna").click()
    # The box's fields mount when it opens and then show their starting values: a range typed before that
    # was put back to the starting one, and a valid sweep was queued (two fresh clones of 100s of runs).
    expect(ui.el("sw-high-0").locator("input")).to_have_value("0.001")

    # An empty range is refused beside the box, naming the key; nothing is queued.
    before = len(api(studio, "/sweeps"))
    ui.fill("sw-high-0", "0.00001")
    ui.click("sw-launch")
    ui.expect_text("sw-status", "learning_rate: the range is empty")
    assert len(api(studio, "/sweeps")) == before

    ui.fill("sw-high-0", "0.01")
    ui.fill("sw-n-trials", str(TRIALS))
    ui.click("sw-estimate-btn")
    ui.expect_text("sw-status", re.compile(rf"{TRIALS} trials.*at most {TRIALS * STEPS} steps", re.S))
    ui.click("sw-launch")
    ui.expect_text("sw-status", "queued")
    sweep = api(studio, "/sweeps")[0]
    assert sweep["name"] == "swept-sweep" and sweep["settings"]["n_trials"] == TRIALS
    assert sweep["parameters"] == {"learning_rate": {"type": "float", "low": 1e-5, "high": 0.01, "log": True}}
    assert sweep["spec"]["eval_dataset_ids"], sweep["spec"]

    # The Sweeps tab shows the launched sweep; its leaderboard fills as the trials end.
    ui.tab("sweeps")
    ui.expect_text("swp-summary", f"#{sweep['id']} swept-sweep")
    wait_until(
        lambda: api(studio, f"/sweeps/{sweep['id']}")["status"] in ("succeeded", "failed"), 180, "the sweep"
    )
    done = api(studio, f"/sweeps/{sweep['id']}")
    assert done["status"] == "succeeded", done
    board = done["leaderboard"]
    assert len(done["trials"]) == TRIALS and board
    # a trial's run ends a moment before the driver tells Optuna: the page catches up at its next tick
    shown = wait_until(
        lambda: (lambda t: t if t.count("complete") == TRIALS else None)(
            ui.el("swp-leaderboard").inner_text()
        ),
        20,
        "every trial complete on the page",
    )
    for trial in done["trials"]:
        assert f"#{trial['run_id']} succeeded" in shown, shown
    # best first: its run is named before the other's
    assert shown.index(f"#{board[0]['run_id']} ") < shown.index(f"#{board[-1]['run_id']} ") or len(board) == 1
    # two trials of one sweep draw different learning rates (each driver step used to reseed its sampler alike)
    assert len({t["params"]["learning_rate"] for t in done["trials"]}) == TRIALS, done["trials"]
    ui.expect_text("swp-summary", f"Best: trial {board[0]['number']}")
    assert f"sweep={sweep['id']}" in page.url  # a refresh or a shared link shows this sweep
    ui.shot("sweep-leaderboard")

    # Promote the best: Deploy & Chat opens on its run, and it answers.
    ui.click("swp-promote")
    deploy_tab = page.locator("button[role=tab][data-tab-id=deploy]")
    expect(deploy_tab).to_have_attribute("aria-selected", "true", timeout=30_000)
    # The status line names the promoted run's deployment once it runs: "running" alone also matched the line of
    # the deployment the tab showed before (an earlier test's), and the message sent then was refused ("deployment
    # 9 is starting; chat once it is running", a fresh clone's run).
    deps = wait_until(
        lambda: [d for d in api(studio, "/deployments") if d.get("run_id") == board[0]["run_id"]],
        30,
        "the promoted run's deployment",
    )
    ui.expect_text("dep-status", re.compile(rf"#{deps[0]['id']} .*— running"), timeout=120_000)
    ui.idle(timeout=60_000)  # the promote's Deploy refresh lands before the message is typed
    ui.el("dep-message").locator("textarea").fill("What is 2 + 2?")
    expect(ui.el("dep-message").locator("textarea")).to_have_value("What is 2 + 2?")
    ui.click("dep-send")
    # (the chat shows no progress overlay: its turn is waited for, on a loaded box seconds after the click)
    expect(ui.el("dep-chat").locator("[data-testid=user]")).to_contain_text("What is 2 + 2?", timeout=60_000)
    expect(ui.el("dep-chat").locator("[data-testid=bot]").last).not_to_be_empty(timeout=60_000)
    ui.shot("sweep-chat")
