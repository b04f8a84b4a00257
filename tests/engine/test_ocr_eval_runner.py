"""`ernie-studio eval` on OCR sets: a PaddleOCR-VL model's readings are scored by corpus character error rate
and exact match exactly as engine.eval.ocr scores them (the numbers the studio stores and compares); a text
model on an OCR set, a PaddleOCR-VL model on chat records and text-metric options for OCR are refused, each
naming the file or key and the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.eval import EvalDataError, run_eval
from engine.eval.config import eval_config_from_dict
from engine.eval.ocr import evaluate_ocr

ROOT = Path(__file__).resolve().parents[2]
LINES = ROOT / "examples" / "data" / "ocr_demo" / "lines_eval.jsonl"
QA = ROOT / "examples" / "eval" / "qa_eval.jsonl"


def _config(tmp_path: Path, model: Path, data: Path, **values):
    return eval_config_from_dict(
        {
            "model_name_or_path": str(model),
            "eval_dataset_path": str(data),
            "output_dir": str(tmp_path / "out"),
            "max_new_tokens": 32,
            "bootstrap_samples": 50,
            **values,
        }
    )


def test_ocr_sets_are_scored_by_cer_and_exact_match(tiny_ocr_model_dir, tmp_path):
    summary = run_eval(_config(tmp_path, tiny_ocr_model_dir, LINES))
    assert summary.status == "succeeded"
    assert set(summary.metrics) == {"lines_eval/cer", "lines_eval/exact_match"}
    reference = evaluate_ocr(tiny_ocr_model_dir, LINES, max_new_tokens=32)
    assert summary.metrics["lines_eval/cer"] == pytest.approx(reference.cer)
    assert summary.metrics["lines_eval/exact_match"] == pytest.approx(reference.exact_match)
    cer = summary.datasets["lines_eval.jsonl"]["metrics"]["cer"]
    assert cer["n"] == 12 and cer["ci_low"] <= cer["score"] <= cer["ci_high"]
    rows = [json.loads(x) for x in (tmp_path / "out" / "eval_samples.jsonl").read_text().splitlines()]
    by_line = {r["line"]: r for r in rows}
    assert [by_line[r["line"]]["prediction"] for r in reference.readings] == [
        r["prediction"] for r in reference.readings
    ]
    first = rows[0]
    assert first["task"] == "ocr" and first["images"][0].endswith(".png")
    assert first["scores"]["cer"] == pytest.approx(first["edits"] / first["reference_chars"])


def test_model_and_set_of_different_kinds_are_refused_naming_both(
    tiny_ocr_model_dir, tiny_model_dir, tmp_path
):
    with pytest.raises(EvalDataError) as e:
        run_eval(_config(tmp_path, tiny_model_dir, LINES))
    assert e.value.problems == [
        f"{LINES}: an OCR set (images with the text they show) is read by a PaddleOCR-VL model, and "
        f"{tiny_model_dir} is not one; evaluate a PaddleOCR-VL model (or a run fine-tuned from one) on it"
    ]
    with pytest.raises(EvalDataError) as e:
        run_eval(_config(tmp_path, tiny_ocr_model_dir, QA))
    assert e.value.problems[0].startswith(
        f"{QA}: holds chat or benchmark records, and {tiny_ocr_model_dir} is a PaddleOCR-VL model"
    )


def test_options_that_would_score_nothing_are_refused(tiny_ocr_model_dir, tiny_model_dir, tmp_path):
    with pytest.raises(EvalDataError) as e:
        run_eval(_config(tmp_path, tiny_ocr_model_dir, LINES, metrics="cer,rouge_l", normalize="lower"))
    assert e.value.problems == [
        "metrics: rouge_l is a text metric; a PaddleOCR-VL model's readings are scored by cer and "
        "exact_match: name only those, or leave metrics out",
        "normalize: it shapes text metrics, and a PaddleOCR-VL model's readings are compared with their "
        "references as read (cer counts every character); leave normalize out",
    ]
    with pytest.raises(EvalDataError) as e:
        run_eval(_config(tmp_path, tiny_model_dir, QA, metrics="cer"))
    assert e.value.problems[0].startswith("metrics: cer scores OCR sets read by a PaddleOCR-VL model")
    only_cer = run_eval(_config(tmp_path, tiny_ocr_model_dir, LINES, metrics="cer", max_samples=2))
    assert only_cer.status == "succeeded" and only_cer.datasets["lines_eval.jsonl"]["samples"] == 2
    assert set(only_cer.metrics) == {"lines_eval/cer"}


def test_erniekit_vl_records_are_read_as_the_same_ocr_set(tiny_ocr_model_dir, tmp_path):
    """ERNIEKit's image_info / text_info form of the same lines reads and scores as the OCR pairs do."""
    import shutil

    shutil.copytree(LINES.parent / "images", tmp_path / "images")
    records = [json.loads(x) for x in LINES.read_text(encoding="utf-8").splitlines()]
    vl = tmp_path / "lines_vl.jsonl"
    vl.write_text(
        "".join(
            json.dumps(
                {
                    "image_info": [{"matched_text_index": 0, "image_url": r["image"]}],
                    "text_info": [{"text": "OCR:", "tag": "mask"}, {"text": r["text"], "tag": "no_mask"}],
                }
            )
            + "\n"
            for r in records
        )
    )
    pairs = run_eval(_config(tmp_path / "pairs", tiny_ocr_model_dir, LINES))
    erniekit = run_eval(_config(tmp_path / "vl", tiny_ocr_model_dir, vl))
    assert erniekit.datasets["lines_vl.jsonl"]["type"] == "erniekit_vl"
    assert erniekit.metrics["lines_vl/cer"] == pytest.approx(pairs.metrics["lines_eval/cer"])
