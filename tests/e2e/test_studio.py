"""The studio in a real browser: data -> training -> live curves -> compare -> deploy -> streamed chat.

One long scenario (the steps depend on each other) against ``ernie-studio up`` with a tiny model.
Screenshots of each step go to test-artifacts/e2e/; the README's come from here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from gradio_page import StudioPage, plot_series_points, reply_streams
from playwright.sync_api import expect
from trainer_hold import hold_after_steps, trainer_in

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "data" / "sft_demo.jsonl"
MAX_STEPS = 24


def first_record() -> dict:
    return json.loads(DEMO.read_text(encoding="utf-8").splitlines()[0])


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def api(studio: str, path: str) -> dict | list:
    r = httpx.get(f"{studio}/api/v1{path}", timeout=10)
    r.raise_for_status()
    return r.json()


def test_malformed_upload_lists_problems_by_line(page, studio, artifacts, tmp_path):
    ui = StudioPage(page, studio, artifacts / "validation")
    bad = tmp_path / "broken_sft.jsonl"
    bad.write_text(
        '{"src": ["hi"], "tgt": ["hello"]}\n'
        '{"src": ["two questions", "second"], "tgt": ["one answer"]}\n'
        "{not json at all\n",
        encoding="utf-8",
    )
    ui.open()
    page.set_input_files("#ds-upload input[type=file]", str(bad))
    ui.click("ds-upload-btn")
    ui.expect_text("ds-upload-result", "was not added", timeout=60_000)
    # Each bad line is its own row with its line number, next to the upload (not in a log).
    ui.expect_text("ds-problems", re.compile(r"\b2\s+src has 2 turns but tgt has 1"))
    ui.expect_text("ds-problems", re.compile(r"\b3\s+invalid JSON"))
    assert "\n1\n" not in ui.el("ds-problems").inner_text()  # the valid first line is not listed
    ui.shot("validation-error")
    assert api(studio, "/datasets") == [] or all(d["name"] != "broken_sft" for d in api(studio, "/datasets"))


def test_upload_train_compare_deploy_chat(page, studio, artifacts, browser):
    ui = StudioPage(page, studio, artifacts / "flow")
    ui.open()

    # 1. Upload the demo dataset: detected format, first record previewed raw and rendered.
    page.set_input_files("#ds-upload input[type=file]", str(DEMO))
    ui.click("ds-upload-btn")
    ui.expect_text("ds-upload-result", "detected format erniekit", timeout=60_000)
    record = first_record()
    ui.expect_text("ds-position", "record 1 of 400")
    ui.expect_text("ds-rendered", record["src"][0], timeout=60_000)
    ui.expect_text("ds-rendered", record["tgt"][-1])
    ui.click("ds-stats-btn")
    ui.expect_text("ds-stats", "longer than max_seq_len", timeout=60_000)
    ui.shot("dataset-preview")
    page.click("button[role=tab][data-tab-id=raw]")
    ui.expect_text("ds-raw", record["src"][0])

    # 2. A tiny LoRA run from the Train tab; the YAML shows what will run.
    ui.tab("train")
    ui.choose("tr-datasets", "sft_demo")
    ui.fill("tr-run-name", "lr-1e-3")
    ui.fill("tr-max-steps", str(MAX_STEPS))
    ui.fill("tr-learning-rate", "0.001")
    ui.fill("tr-warmup-steps", "5")
    ui.fill("tr-save-steps", "8")
    ui.expect_text("tr-yaml", "learning_rate: 0.001")
    ui.expect_text("tr-yaml", f"max_steps: {MAX_STEPS}")
    ui.click("tr-estimate-btn")
    ui.expect_text("tr-estimate", "trainable parameters")
    ui.click("tr-launch")
    ui.expect_text("tr-launch-status", "queued")
    run1 = api(studio, "/runs")[0]
    assert run1["config"]["learning_rate"] == 0.001 and run1["fine_tuning"] == "LoRA"

    # The trainer is held (SIGSTOP) at its second step until the page has been refreshed, so the refresh
    # lands mid-run however fast the machine. (Packed 2048-token rows stood in for that before, and kept a
    # core busy through both runs beside the rest of the suite.) It is looked for before the screenshot: on
    # an idle machine the 24 steps take ~5 s, less than a full-page shot of the Train form.
    output = Path(run1["output_dir"])
    trainer = wait_until(lambda: trainer_in(output.parent), 120, "the first run's trainer", interval=0.05)
    hold_after_steps(trainer, output / "metrics.jsonl", 2)
    try:
        ui.shot("train-form")
        # 3. Runs tab: the live loss curve gains points while the run trains.
        ui.tab("runs")
        ui.expect_text("runs-status", f"#{run1['id']} lr-1e-3", timeout=10_000)
        wait_until(lambda: sum(plot_series_points(page, "runs-loss")) >= 2, 120, "the first loss points")
        before = sum(plot_series_points(page, "runs-loss"))
        assert api(studio, f"/runs/{run1['id']}")["status"] == "running"
        ui.shot("run-live")

        # 4. A refresh mid-run reopens the same run (URL + browser state) and the curve keeps growing.
        assert f"run={run1['id']}" in page.url
        page.reload()
        page.wait_for_selector("#studio-tabs")
        ui.expect_text("runs-status", f"#{run1['id']} lr-1e-3 — running", timeout=20_000)
    finally:
        os.kill(trainer, signal.SIGCONT)
    wait_until(
        lambda: sum(plot_series_points(page, "runs-loss")) > before, 60, "more loss points after refresh"
    )
    ui.expect_text("runs-status", "succeeded", timeout=120_000)
    wait_until(lambda: sum(plot_series_points(page, "runs-loss")) == MAX_STEPS, 20, "all loss points")
    ui.expect_text("runs-checkpoints", f"checkpoint-{MAX_STEPS}")
    ui.shot("run-finished")

    # 5. Clone into the Train tab, change only the learning rate, launch the second run.
    ui.click("runs-clone")
    train_tab = page.locator("button[role=tab][data-tab-id=train]")
    expect(train_tab).to_have_attribute("aria-selected", "true", timeout=30_000)
    ui.fill("tr-learning-rate", "0.0001")
    ui.fill("tr-run-name", "lr-1e-4")
    ui.expect_text("tr-yaml", "learning_rate: 0.0001")
    ui.click("tr-launch")
    ui.expect_text("tr-launch-status", "queued")
    run2 = api(studio, "/runs")[0]
    assert run2["id"] != run1["id"] and run2["config"]["learning_rate"] == 0.0001
    assert run2["config"]["max_steps"] == MAX_STEPS

    # 6. While it trains: deploy the first run (LoRA, merged by the worker) and chat; the reply streams in.
    ui.tab("runs")
    # The launch selects its run in the Runs tab (an event chain without a progress overlay, which `idle`
    # cannot see): on a slow host it landed after the choice below and the second run was deployed.
    ui.expect_text("runs-status", f"#{run2['id']} lr-1e-4")
    ui.choose("runs-select", "lr-1e-3")
    ui.expect_text("runs-status", f"#{run1['id']} lr-1e-3")
    ui.click("runs-deploy")
    deploy_tab = page.locator("button[role=tab][data-tab-id=deploy]")
    expect(deploy_tab).to_have_attribute("aria-selected", "true", timeout=30_000)
    ui.expect_text("dep-status", "lr-1e-3 — running", timeout=120_000)  # not another deployment's line
    ui.fill("dep-system", "You are a concise assistant.")
    # A 24-step tiny model often ends its answer after a token or two: the reply is asked to ignore
    # end-of-sentence and run long, so there is something to watch stream; Stop ends it once it has.
    lengths = reply_streams(ui, "What is 13 - 1?")
    assert lengths == sorted(lengths), lengths
    expect(ui.el("dep-chat").locator("[data-testid=bot]").last).not_to_be_empty()
    ui.shot("chat")

    # 7. One click on the Deploy tab deploys the second run once it has finished.
    wait_until(lambda: api(studio, f"/runs/{run2['id']}")["status"] == "succeeded", 120, "the second run")
    ui.tab("deploy")
    ui.choose("dep-run", "lr-1e-4")
    ui.click("dep-btn")
    # ids depend on what other e2e modules made in the shared studio before this one
    ui.expect_text("dep-status", re.compile(r"#\d+ lr-1e-4"))

    # 8. Meanwhile, export the first run with weight-only int8 PTQ: perplexity before and after is reported.
    ui.tab("runs")
    ui.choose("runs-select", "lr-1e-3")
    page.get_by_text("Export", exact=True).click()
    ui.choose("runs-export-kind", "PTQ wint8")
    ui.click("runs-export-btn")
    ui.expect_text("runs-action", "queued")
    ui.expect_text("runs-exports", "succeeded", timeout=120_000)
    ui.expect_text("runs-exports", "relative_change")
    exported = api(studio, "/models")
    assert any(m["name"] == f"run-{run1['id']}-paddle-wint8" for m in exported), [m["name"] for m in exported]
    ui.shot("export")

    # 9. Compare: two curves aligned by step, the learning rate is the only differing hyperparameter, and
    # A/B chat sends one prompt to both deployments.
    # this test's two deployments (other e2e modules leave stopped ones in the shared studio)
    ours = ("lr-1e-3", "lr-1e-4")
    wait_until(
        lambda: [d["status"] for d in api(studio, "/deployments") if d["name"] in ours] == ["running"] * 2,
        120,
        "deployments",
    )
    # A link naming a run opens Deploy & Chat on that run's deployment, in a browser that never saw it.
    fresh = browser.new_context(viewport={"width": 1400, "height": 1000}, locale="en-US")
    try:
        linked = StudioPage(fresh.new_page(), studio, artifacts / "flow")
        linked.open(f"?tab=deploy&run={run1['id']}")
        expect(linked.el("dep-select").locator("input")).to_have_value(re.compile(r"lr-1e-3"), timeout=20_000)
        linked.expect_text("dep-status", "lr-1e-3 — running")
    finally:
        fresh.close()
    ui.tab("compare")
    ui.choose("cmp-runs", "lr-1e-3")
    ui.choose("cmp-runs", "lr-1e-4")
    ui.click("cmp-btn")
    wait_until(
        lambda: plot_series_points(page, "cmp-curves") == [MAX_STEPS, MAX_STEPS], 30, "two full curves"
    )
    ui.expect_text("cmp-diff", re.compile(r"learning_rate\s+0\.001\s+0\.0001"))
    diff_text = ui.el("cmp-diff").inner_text()
    assert "max_steps" not in diff_text and "lora_rank" not in diff_text, diff_text
    ui.expect_text("cmp-final", "loss")
    ui.expect_text("cmp-legend", "lr-1e-4")
    ui.shot("compare")
    # A reload keeps the compared runs (in the URL) and compares them again.
    assert f"runs={run1['id']}%2C{run2['id']}" in page.url or f"runs={run1['id']},{run2['id']}" in page.url
    page.reload()
    page.wait_for_selector("#studio-tabs")
    wait_until(
        lambda: plot_series_points(page, "cmp-curves") == [MAX_STEPS, MAX_STEPS],
        30,
        "the curves after a reload",
    )
    ui.expect_text("cmp-diff", re.compile(r"learning_rate\s+0\.001\s+0\.0001"))
    expect(ui.el("cmp-runs")).to_contain_text("lr-1e-3")
    expect(ui.el("cmp-runs")).to_contain_text("lr-1e-4")
    ui.choose("cmp-dep-a", "lr-1e-3")
    ui.choose("cmp-dep-b", "lr-1e-4")
    ui.fill("cmp-temperature", "1")
    page.locator("#cmp-ignore-eos input[type=checkbox]").check()
    ui.el("cmp-prompt").locator("textarea, input").first.fill("Count from 1 to 5.")
    # No wait for navigations after this click: a loaded fresh-clone run once hung 30 s in Playwright's
    # "waiting for scheduled navigations" although the page does not navigate; idle() waits for the replies.
    ui.el("cmp-send").click(no_wait_after=True)
    ui.idle(timeout=120_000)
    for side in ("cmp-chat-a", "cmp-chat-b"):
        expect(ui.el(side).locator("[data-testid=user]")).to_contain_text("Count from 1 to 5.")
        reply = ui.el(side).locator("[data-testid=bot]").last.inner_text()
        assert reply.strip(), f"{side} got no reply"
    ui.shot("ab-chat")

    # 10. The language switch relabels the UI and survives a refresh.
    page.locator("#lang-switch label", has_text="中文").click()
    expect(page.locator("button[role=tab][data-tab-id=datasets]")).to_have_text("数据集")
    # The relabelled tabs keep the shown one: they went back to the one last sent (Datasets), whose select
    # then stopped the shown tab's timer and put tab=datasets in the address (a reload opened Datasets).
    page.wait_for_timeout(3_000)
    assert re.search(r"tab=compare", page.url), page.url
    page.reload()
    page.wait_for_selector("#studio-tabs")
    # (the restore relabels ~250 components, then reruns ~15 followers: 11-25 s on a box at load 5-10)
    expect(page.locator("button[role=tab][data-tab-id=train]")).to_have_text("训练", timeout=45_000)
    ui.shot("chinese")
    assert re.search(r"tab=compare", page.url)
