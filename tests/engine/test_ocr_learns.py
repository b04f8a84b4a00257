"""On the generated document lines (examples/data/ocr_demo), LoRA on a CPU with the tiny PaddleOCR-VL through
`ernie-studio train`: the held-out loss falls, and the held-out character error rate falls and exact match
rises from the starting model's (engine.eval.ocr, base against fine-tuned). The tiny random model cannot
read; what it can learn in 100 steps is which of six short lines an image of a given shape shows, so its
readings go from babble to the right line for many of the held-out renderings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.cli import main
from engine.eval.items import EvalDataError
from engine.eval.ocr import (
    character_error_rate,
    compare_ocr,
    edit_distance,
    read_ocr_set,
    score_readings,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "data" / "ocr_demo"
# what the run below measured (tiny-ocr-vl, seed 0; docs/training.md): held-out loss 6.895 -> 4.565,
# CER 4.793 -> 0.429, exact match 0 -> 0.5. The bounds leave room for other CPUs' rounding.
LOSS_DROP = 1.0
CER_RATIO = 0.5


def test_edit_distance_and_the_scores():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == edit_distance("abc", "") == 3
    assert edit_distance("发票号码", "发票码") == 1
    assert character_error_rate("TOTAL 12.5O", "TOTAL 12.50") == pytest.approx(1 / 11)
    scores = score_readings(["TOTAL 12.50", "Thank yu!", ""], ["TOTAL 12.50", "Thank you!", "Paid"])
    assert scores == {"cer": pytest.approx((0 + 1 + 4) / (11 + 10 + 4)), "exact_match": pytest.approx(1 / 3)}


def test_a_held_out_set_is_read_with_every_problem_by_line(tmp_path, tiny_ocr_model_dir):
    import engine

    tok = engine.load_tokenizer(str(tiny_ocr_model_dir))
    items = read_ocr_set(DEMO / "lines_eval.jsonl", tok)
    assert len(items) == 12 and items[0].reference == "TOTAL 12.50" and items[0].images[0].is_file()
    texts = [{"text": "OCR:", "tag": "mask"}, {"text": "a", "tag": "no_mask"}]
    records = [
        {"image_info": [{"matched_text_index": 0, "image_url": "nope.png"}], "text_info": texts},
        {"text_info": texts},
    ]
    bad = tmp_path / "eval.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(EvalDataError) as e:
        read_ocr_set(bad, tok)
    assert e.value.problems[0].startswith(f"{bad}:1: image_info[0]: image 'nope.png' not found")
    assert e.value.problems[1] == f"{bad}:2: the record has no image; an OCR set pairs images with text"


def _run(tmp_path: Path, model: Path, name: str, **values) -> Path:
    out = tmp_path / name
    cfg = {
        "model_name_or_path": str(model),
        "stage": "OCR-VL-SFT",
        "fine_tuning": "LoRA",
        "lora_rank": 16,
        "train_dataset_path": str(DEMO / "lines_train.jsonl"),
        "eval_dataset_path": str(DEMO / "lines_eval.jsonl"),
        "max_seq_len": 96,
        "batch_size": 4,
        "learning_rate": 5e-3,
        "warmup_steps": 5,
        "max_steps": 100,
        "eval_steps": 50,
        "logging_steps": 10,
        "save_steps": 1000,
        "seed": 42,
        "output_dir": str(out),
        "report_to": "none",
        **values,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 0
    return out


def _eval_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_lora_learns_to_read_the_generated_lines(tiny_ocr_model_dir, tmp_path):
    (base_loss,) = _eval_losses(_run(tmp_path, tiny_ocr_model_dir, "base", do_train=False))
    run = _run(tmp_path, tiny_ocr_model_dir, "lora")
    tuned_loss = _eval_losses(run)[-1]
    assert tuned_loss < base_loss - LOSS_DROP, (base_loss, tuned_loss)
    report = compare_ocr(tiny_ocr_model_dir, run, DEMO / "lines_eval.jsonl", max_new_tokens=32)
    base, tuned = report["base"], report["tuned"]
    print(
        f"held-out loss {base_loss:.3f} -> {tuned_loss:.3f}; CER {base['cer']:.3f} -> {tuned['cer']:.3f}; "
        f"exact match {base['exact_match']:.3f} -> {tuned['exact_match']:.3f}"
    )
    assert tuned["cer"] < CER_RATIO * base["cer"], (base["cer"], tuned["cer"])
    assert tuned["exact_match"] > base["exact_match"]
    assert len(report["rows"]) == 12 and {"reference", "base", "tuned", "base_cer", "tuned_cer"} <= set(
        report["rows"][0]
    )
