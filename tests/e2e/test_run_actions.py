"""Cancel, resume and delete a run from the Runs tab, checked in the browser and through the REST API.

Also checks that the Runs table's column headers follow the 中文 switch and keep it across a refresh.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest
from gradio_page import StudioPage
from playwright.sync_api import expect
from test_studio import api, wait_until
from trainer_hold import hold_after_steps, pid_alive, trainer_in

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "data" / "sft_demo.jsonl"
RUN_NAME = "cancel-me"
MAX_STEPS = 200  # far more than the test lets it train: it is held and cancelled twice on the way
SAVE_STEPS = 3
# The trainer's own log line when it picks up a checkpoint, e.g. "resuming from …/checkpoint-6 (step 6)".
RESUMED = re.compile(r"resuming from \S*checkpoint-(\d+) \(step (\d+)\)")


def run_by_name(studio: str, name: str) -> dict | None:
    return next((r for r in api(studio, "/runs") if r["name"] == name), None)


def newest_checkpoint_step(studio: str, run_id: int) -> int:
    return max((c["step"] for c in api(studio, f"/runs/{run_id}/checkpoints")), default=0)


def shown_step(ui: StudioPage) -> int:
    """The step the Runs tab's status line shows for the selected run (0 before the first one)."""
    m = re.search(rf"step (\d+) / {MAX_STEPS}", ui.el("runs-status").inner_text())
    return int(m.group(1)) if m else 0


def log_tail(ui: StudioPage) -> str:
    """The Runs tab's log tail (a textarea's value, which text matchers do not see)."""
    return ui.el("runs-logs").locator("textarea").input_value()


def test_cancel_resume_delete_from_the_runs_tab(page, studio, artifacts):
    ui = StudioPage(page, studio, artifacts / "run-actions")
    ui.open()

    # The demo dataset: the flow test may have uploaded it already (same studio), else upload it here.
    if not any(d["name"] == "sft_demo" for d in api(studio, "/datasets")):
        page.set_input_files("#ds-upload input[type=file]", str(DEMO))
        ui.click("ds-upload-btn")
        ui.expect_text("ds-upload-result", "detected format erniekit", timeout=60_000)

    # A tiny LoRA run far longer than the test lets it train: it checkpoints every few steps, and its trainer
    # is held (SIGSTOP) until each cancel's SIGTERM is pending, so both cancels land mid-run however fast the
    # machine. (Packed 2048-token rows, four a step, stood in for that before: they kept a core busy for the
    # whole test, beside the rest of the suite.)
    ui.tab("train")
    ui.choose("tr-datasets", "sft_demo")
    ui.fill("tr-run-name", RUN_NAME)
    ui.fill("tr-max-steps", str(MAX_STEPS))
    ui.fill("tr-save-steps", str(SAVE_STEPS))
    ui.fill("tr-logging-steps", "1")
    ui.expect_text("tr-yaml", f"max_steps: {MAX_STEPS}")
    ui.click("tr-launch")
    ui.expect_text("tr-launch-status", "queued")
    run = wait_until(lambda: run_by_name(studio, RUN_NAME), 10, "the launched run in GET /runs")
    rid = run["id"]
    assert run["fine_tuning"] == "LoRA" and run["config"]["max_steps"] == MAX_STEPS
    output = Path(run["output_dir"])
    metrics = output / "metrics.jsonl"
    trainer = wait_until(lambda: trainer_in(output.parent), 120, "the trainer's process", interval=0.05)
    hold_after_steps(trainer, metrics, SAVE_STEPS + 1)  # checkpoint-3 is written before step 4 is logged

    # 1. Cancel once a checkpoint exists: the UI and the API both say cancelled.
    ui.tab("runs")
    ui.expect_text("runs-status", f"#{rid} {RUN_NAME}", timeout=15_000)
    try:
        ui.expect_text("runs-status", "running", timeout=120_000)
        wait_until(lambda: newest_checkpoint_step(studio, rid) >= SAVE_STEPS, 120, "a first checkpoint")
        expect(ui.el("runs-cancel")).to_be_enabled(timeout=15_000)
        ui.click("runs-cancel")
        ui.expect_text("runs-action", f"Cancelling run #{rid}")
        wait_until(lambda: not pid_alive(trainer), 30, "the held trainer to end by the cancel", interval=0.05)
    finally:
        if pid_alive(trainer):
            os.kill(trainer, signal.SIGCONT)
    ui.expect_text("runs-status", f"#{rid} {RUN_NAME} — cancelled", timeout=30_000)
    assert api(studio, f"/runs/{rid}")["status"] == "cancelled"
    ui.expect_text("runs-table", re.compile(rf"{rid}\s+{RUN_NAME}.*cancelled", re.S))
    saved_before = newest_checkpoint_step(studio, rid)
    step_at_cancel = shown_step(ui)
    assert saved_before >= SAVE_STEPS and step_at_cancel < MAX_STEPS
    ui.shot("cancelled")

    # 2. Resume: running again, continuing from the newest checkpoint rather than from step 1. (Cancelling
    # may itself save one more checkpoint, so the step resumed from is read from what the run reports.)
    logged = metrics.read_text().count("\n")
    expect(ui.el("runs-resume")).to_be_enabled(timeout=15_000)
    ui.click("runs-resume")
    resumed = wait_until(
        lambda: (pid := trainer_in(output.parent)) != trainer and pid,
        120,
        "the resumed trainer",
        interval=0.05,
    )
    hold_after_steps(resumed, metrics, logged + 2)  # metrics.jsonl never repeats a step: two new ones
    try:
        ui.expect_text("runs-action", f"Resumed run #{rid}")
        ui.expect_text("runs-status", f"#{rid} {RUN_NAME} — running", timeout=120_000)
        assert api(studio, f"/runs/{rid}")["status"] == "running"
        marker = wait_until(
            lambda: RESUMED.search(log_tail(ui)), 60, "the trainer's resume line in the log tail"
        )
        tail = log_tail(ui)
        resume_from = int(marker.group(1))
        assert int(marker.group(2)) == resume_from and resume_from >= saved_before, tail
        events = [e["message"] for e in api(studio, f"/runs/{rid}/events")]
        assert f"resumed from checkpoint-{resume_from}" in events, events
        # Training restarts at the step after the checkpoint: the attempt's first logged step, never step 1.
        wait_until(lambda: shown_step(ui) > step_at_cancel, 120, "steps past the cancelled one")
        after = log_tail(ui).split(marker.group(0))[-1]
        first = re.search(rf"^step (\d+)/{MAX_STEPS}", after, re.M)
        assert first is not None and int(first.group(1)) == resume_from + 1, after
        ui.shot("resumed")

        # 3. Cancel again, then delete: gone from the Runs table and from GET /runs.
        expect(ui.el("runs-cancel")).to_be_enabled(timeout=15_000)
        ui.click("runs-cancel")
        wait_until(
            lambda: not pid_alive(resumed), 30, "the held trainer to end by the second cancel", interval=0.05
        )
    finally:
        if pid_alive(resumed):
            os.kill(resumed, signal.SIGCONT)
    ui.expect_text("runs-status", f"#{rid} {RUN_NAME} — cancelled", timeout=30_000)
    assert api(studio, f"/runs/{rid}")["status"] == "cancelled"
    ui.click("runs-delete")
    ui.expect_text("runs-action", f"Deleted run #{rid}")
    expect(ui.el("runs-table")).not_to_contain_text(RUN_NAME, timeout=15_000)
    assert all(r["id"] != rid for r in api(studio, "/runs"))
    assert httpx.get(f"{studio}/api/v1/runs/{rid}", timeout=10).status_code == 404
    ui.shot("deleted")


def test_table_headers_follow_the_language_switch(page, studio, artifacts):
    ui = StudioPage(page, studio, artifacts / "i18n-headers")
    ui.open("?tab=runs")
    headers = ui.el("runs-table").locator("thead")
    expect(headers).to_contain_text("status")
    page.locator("#lang-switch label", has_text="中文").click()
    expect(headers).to_contain_text("状态", timeout=15_000)
    expect(headers).not_to_contain_text("status")
    # The timer's refreshes keep the Chinese headers, and a refresh restores them.
    page.wait_for_timeout(2500)
    expect(headers).to_contain_text("进度")
    page.reload()
    page.wait_for_selector("#studio-tabs")
    expect(headers).to_contain_text("状态", timeout=15_000)
    ui.tab("datasets")
    expect(ui.el("ds-table").locator("thead")).to_contain_text("上传时间", timeout=15_000)
    ui.tab("deploy")
    expect(ui.el("dep-table").locator("thead")).to_contain_text("后端", timeout=15_000)
    ui.shot("chinese-headers")
    page.locator("#lang-switch label", has_text="English").click()
    ui.tab("runs")
    expect(headers).to_contain_text("status", timeout=15_000)
