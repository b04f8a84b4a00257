"""Recipes and templates on the Train tab in a real browser: an ERNIEKit recipe fills the form and shows the
planner's verdict; the form, changed, is saved as a template; after a reload the template fills the form again
(a non-default option included) and the run launched from it has those values (read back through REST)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from gradio_page import StudioPage
from playwright.sync_api import expect

pytestmark = pytest.mark.e2e

DEMO = Path(__file__).resolve().parents[2] / "examples" / "data" / "sft_demo.jsonl"
VERDICT = re.compile(r"Fits|Not as written|Does not fit|No node has reported|cannot plan")


def _open_start_box(ui: StudioPage) -> None:
    ui.el("tr-start").locator("button").first.click()


def test_a_recipe_fills_the_form_is_saved_as_a_template_and_launches_from_it(page, studio, artifacts):
    ui = StudioPage(page, studio, artifacts / "train-templates")
    with DEMO.open("rb") as f:
        r = httpx.post(f"{studio}/api/v1/datasets", files={"file": ("template_demo.jsonl", f)}, timeout=60)
    r.raise_for_status()
    ui.open()
    ui.tab("train")
    _open_start_box(ui)
    ui.choose("tr-recipe", "21b-a3b-fc-lora")
    ui.expect_text("tr-recipe-verdict", "run_fc_lora_8k.yaml")
    expect(ui.el("tr-recipe-verdict")).to_contain_text(VERDICT, timeout=30_000)
    ui.click("tr-recipe-load")
    ui.expect_text("tr-start-status", "function-call-train.jsonl")  # ERNIEKit's data: listed as missing
    expect(ui.el("tr-lora-rank").locator("input")).to_have_value("32")
    expect(ui.el("tr-learning-rate").locator("input")).to_have_value("0.0003")
    ui.shot("recipe-loaded")

    # the person's own model, data and a short run; then the form saved under a name
    ui.choose("tr-base-model", "tiny")
    ui.choose("tr-datasets", "template_demo")
    ui.fill("tr-max-steps", "2")
    ui.fill("tr-run-name", "from-template")
    ui.idle()
    expect(ui.el("tr-launch")).to_be_enabled(timeout=30_000)
    ui.fill("tr-template-name", "e2e fc lora")
    ui.click("tr-template-save")
    ui.expect_text("tr-start-status", "Saved template")
    saved = httpx.get(f"{studio}/api/v1/templates", timeout=10).json()
    assert [t["name"] for t in saved] == ["e2e fc lora"]

    # a fresh page: the template fills the form again
    ui.open()
    ui.tab("train")
    _open_start_box(ui)
    expect(ui.el("tr-lora-rank").locator("input")).to_have_value("8")  # the engine's default again
    ui.choose("tr-template", "e2e fc lora")
    ui.click("tr-template-load")
    ui.expect_text("tr-start-status", "e2e fc lora")
    expect(ui.el("tr-lora-rank").locator("input")).to_have_value("32")
    expect(ui.el("tr-max-steps").locator("input")).to_have_value("2")
    ui.expect_text("tr-datasets", "template_demo")
    ui.shot("template-loaded")

    run = ui.launch()
    cfg = run["config"]
    assert run["name"] == "from-template" and run["base_model"] == "tiny"
    assert (cfg["stage"], cfg["fine_tuning"], cfg["lora_rank"], cfg["recompute"]) == ("SFT", "LoRA", 32, True)
    assert (cfg["learning_rate"], cfg["max_steps"], cfg["max_seq_len"]) == (3e-4, 2, 8192)
