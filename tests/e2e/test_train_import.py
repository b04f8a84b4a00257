"""Importing an ERNIEKit LoRA YAML into the Train form in a real browser: the upload fills the fields and lists
the dataset the studio does not have; once that file is uploaded, pasting the YAML again maps it by name, and
the run launched from the form has the file's values (read back through the REST API)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gradio_page import StudioPage
from playwright.sync_api import expect

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "data" / "sft_demo.jsonl"
# ERNIEKit's LoRA SFT config shape (run_sft_lora_8k.yaml), its paths a person's own.
LORA_YAML = """\
model_name_or_path: /home/someone/models/tiny
stage: SFT
fine_tuning: LoRA
lora_rank: 16
lora_alpha: 64
train_dataset_type: erniekit
train_dataset_path: /home/someone/data/import_demo.jsonl
train_dataset_prob: "1.0"
max_seq_len: 256
learning_rate: 3.0e-4
max_steps: 2
warmup_steps: 1
save_steps: 100
fuse_rope: True
tensor_parallel_degree: 1
output_dir: ./output
"""


def test_an_erniekit_lora_yaml_fills_the_form_lists_its_missing_dataset_and_launches(
    page, studio, artifacts, tmp_path
):
    ui = StudioPage(page, studio, artifacts / "train-import")
    config = tmp_path / "run_sft_lora.yaml"
    config.write_text(LORA_YAML)
    ui.open()
    ui.tab("train")
    ui.el("tr-import").locator("button").first.click()
    page.set_input_files("#tr-import-file input[type=file]", str(config))
    ui.expect_text("tr-import-status", "Missing datasets (1)")
    ui.expect_text("tr-import-status", "import_demo.jsonl")
    ui.expect_text("tr-import-status", "fuse_rope")  # announced: a fused kernel, no effect here
    expect(ui.el("tr-lora-rank").locator("input")).to_have_value("16")
    expect(ui.el("tr-learning-rate").locator("input")).to_have_value("0.0003")
    expect(ui.el("tr-launch")).to_be_disabled()  # no training data yet
    ui.shot("imported-missing-dataset")

    # The missing file uploaded under its name; importing the same YAML again (pasted) maps it.
    with DEMO.open("rb") as f:
        r = httpx.post(f"{studio}/api/v1/datasets", files={"file": ("import_demo.jsonl", f)}, timeout=60)
    r.raise_for_status()
    dataset = r.json()
    editor = ui.el("tr-import-text").locator(".cm-content")
    editor.click()
    page.keyboard.insert_text(LORA_YAML)
    ui.click("tr-import-btn")
    ui.expect_text("tr-import-status", f"→ #{dataset['id']} import_demo")
    expect(ui.el("tr-import-status")).not_to_contain_text("Missing datasets")
    ui.expect_text("tr-datasets", "import_demo")
    ui.fill("tr-run-name", "imported-lora")
    ui.idle()
    ui.shot("imported-mapped")

    run = ui.launch()
    cfg = run["config"]
    assert run["name"] == "imported-lora" and run["base_model"] == "tiny"
    assert (cfg["stage"], cfg["fine_tuning"], cfg["lora_rank"], cfg["lora_alpha"]) == ("SFT", "LoRA", 16, 64)
    assert (cfg["learning_rate"], cfg["max_steps"], cfg["max_seq_len"]) == (3e-4, 2, 256)
    assert cfg["train_dataset_path"].endswith("/import_demo.jsonl") and "someone" not in str(cfg)
    assert "fuse_rope" not in cfg and "tensor_parallel_degree" not in cfg
