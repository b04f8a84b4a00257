"""Evaluate after training in the browser: upload -> train with "evaluate after training" (a held-out
split) -> the Evaluate tab shows the base and the result side by side -> the sample browser opens a sample
the two answer differently. The task is tests/workers/test_eval_jobs.py's (an animal's sound), learnt in a
few seconds of training, so the result answers where the random base does not. On the way: a C-Eval CSV
uploads as a benchmark and is scored by the Evaluate tab, and the judge box refuses a judge mode without a
judge."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from gradio_page import StudioPage
from playwright.sync_api import expect
from test_studio import api, wait_until

pytestmark = pytest.mark.e2e

RUN_NAME = "eval-after"
HOLDOUT = 8
SOUNDS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack"}
CEVAL = Path(__file__).resolve().parents[2] / "examples" / "eval" / "ceval_style.csv"


def write_animals(path):
    numbers = random.Random(1).sample(range(100, 1000), 72)
    path.write_text(
        "".join(
            json.dumps({"src": [f"Item {k}: what does the {a} say?"], "tgt": [SOUNDS[a]]}) + "\n"
            for k, a in zip(numbers, (list(SOUNDS)[i % 4] for i in range(72)), strict=True)
        )
    )
    return path


def test_train_with_evaluate_after_then_browse_where_base_and_result_differ(
    page, studio, artifacts, tmp_path
):
    ui = StudioPage(page, studio, artifacts / "evaluate")
    ui.open()
    page.set_input_files("#ds-upload input[type=file]", str(write_animals(tmp_path / "animals.jsonl")))
    ui.click("ds-upload-btn")
    ui.expect_text("ds-upload-result", "detected format erniekit", timeout=60_000)
    # A benchmark file: detected, and scored from the Evaluate tab (the base model; before the run, on the
    # same worker).
    page.set_input_files("#ds-upload input[type=file]", str(CEVAL))
    ui.click("ds-upload-btn")
    ui.expect_text(
        "ds-upload-result", "detected format multiple_choice (benchmark), 3 records", timeout=60_000
    )
    ui.tab("evaluate")
    ui.choose("ev-models", "tiny [")
    ui.choose("ev-datasets", "ceval_style")
    ui.click("ev-launch")
    ui.expect_text("ev-launch-status", "queued")
    bench_id = int(re.search(r"#(\d+)", ui.el("ev-launch-status").inner_text()).group(1))

    # Full fine-tuning at a high learning rate, short sequences: a few seconds on the tiny model.
    ui.tab("train")
    ui.choose("tr-datasets", "animals")
    ui.fill("tr-run-name", RUN_NAME)
    page.locator("#tr-fine-tuning label", has_text="Full").click()
    # The click sets Full's learning rate in the page some 0.3-0.5 s later (measured): typed before that,
    # 0.003 was overwritten and the run trained at 1e-5 (CI seed 703238 and 1 run in 3 here).
    expect(ui.el("tr-learning-rate").locator("input")).to_have_value("0.00001")
    ui.fill("tr-max-steps", "40")
    ui.fill("tr-learning-rate", "0.003")
    ui.fill("tr-max-seq-len", "48")
    ui.fill("tr-per-device-train-batch-size", "8")
    ui.fill("tr-save-steps", "1000")
    page.locator("#tr-eval-after-box").get_by_text("Evaluate after training").click()
    page.locator("#tr-eval-after input[type=checkbox]").check()
    ui.fill("tr-eval-holdout", str(HOLDOUT))
    ui.fill("tr-eval-max-new-tokens", "8")
    ui.expect_text("tr-yaml", "max_steps: 40")
    ui.shot("train-evaluate-after")
    ui.click("tr-launch")
    ui.expect_text("tr-launch-status", "queued")
    run = wait_until(
        lambda: next((r for r in api(studio, "/runs") if r["name"] == RUN_NAME), None), 10, "the run"
    )
    assert run["fine_tuning"] == "Full" and run["config"]["train_dataset_path"].endswith(
        "animals.train.jsonl"
    )

    def evals() -> dict[str, dict]:
        return {e["role"]: e for e in api(studio, f"/evals?run_id={run['id']}")}

    done = wait_until(
        lambda: (e := evals()) and len(e) == 2 and all(v["status"] == "succeeded" for v in e.values()) and e,
        300,
        "the base and result evals",
        interval=1,
    )
    base, result = done["base"], done["result"]
    assert base["samples_done"] == result["samples_done"] == HOLDOUT
    key = "animals.holdout/exact_match"
    assert result["metrics"][key] > base["metrics"][key], (base["metrics"], result["metrics"])

    # The Evaluate tab opens on the newest pair: result and base side by side.
    ui.tab("evaluate")
    ui.expect_text("ev-results", f"#{result['id']} {RUN_NAME} · result", timeout=30_000)
    ui.expect_text("ev-results", f"#{base['id']} {RUN_NAME} · base")
    ui.expect_text("ev-results", "exact_match")
    ui.expect_text("ev-summary", "shared samples differently")

    # The sample browser lists the samples where they differ first; open one.
    expect(ui.el("ev-samples")).to_contain_text("≠", timeout=30_000)
    ui.el("ev-samples").get_by_text("animals.holdout.jsonl:2", exact=True).click()
    ui.idle()
    ui.expect_text("ev-sample", "animals.holdout.jsonl:2")
    ui.expect_text("ev-sample", "the predictions differ")
    a = ui.el("ev-sample").locator(".ev-prediction-a").inner_text()
    b = ui.el("ev-sample").locator(".ev-prediction-b").inner_text()
    assert a != b, (a, b)
    expect(ui.el("ev-sample").locator(".ev-diff")).to_be_visible()
    ui.shot("evaluate-samples")

    bench = api(studio, f"/evals/{bench_id}")
    assert bench["status"] == "succeeded" and bench["samples_done"] == 3, bench
    assert (
        0 <= bench["metrics"]["ceval_style/acc"] <= 1
        and bench["config"]["eval_dataset_type"] == "multiple_choice"
    )
    # The judge box: a judge mode without a judge is refused, not dropped; finished evals are the baselines.
    ui.el("ev-judge-box").get_by_text("LLM as judge").click()
    page.locator("#ev-judge-mode label", has_text="pairwise").click()
    queued = len(api(studio, "/evals"))
    ui.click("ev-launch")
    expect(page.locator(".toast-body").last).to_contain_text("Pick a judge", timeout=15_000)
    ui.el("ev-judge-baseline").locator("input").first.click()
    expect(
        ui.el("ev-judge-baseline").locator("ul[role=listbox] li", has_text=f"#{base['id']} ")
    ).to_be_visible()
    assert len(api(studio, "/evals")) == queued  # nothing was queued by the refused launch
