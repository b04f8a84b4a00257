"""Merging a PaddleOCR-VL LoRA run (upstream ERNIE issue #1405: ERNIEKit's merge fails for it): the merged
export, in either config.json form, gives the adapter model's logits, and transformers' own from_pretrained
reads it to the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
import yaml

import engine
from engine.cli import main
from engine.data.paddleocr_vl_processor import (
    OCRProcessorSettings,
    expand_image_placeholders,
    preprocess_images,
    task_messages,
)
from engine.models.lora import apply_lora, load_adapter_weights, lora_layers
from engine.train.config_load import load_export_config
from engine.train.export import run_export
from tests.engine.test_paddleocr_vl import reference_python

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "data" / "ocr_demo"
# The merged weights are W + A @ B * scale summed in fp32, the adapter model adds x @ A @ B * scale to
# x @ W: the same up to fp32 rounding (measured 5.7e-7 here, both forms and the run dir read merged;
# transformers reading the exports: 6.6e-7 from our adapter model's logits).
MERGE_ATOL = 1e-5
TRANSFORMERS_ATOL = 1e-4
# every kind of linear the model has: the decoder's fused ones, the encoder's and the projector's
TARGETS = "qkv_proj,o_proj,up_gate_proj,down_proj,vision,projector"


def _write(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.fixture(scope="module")
def lora_run(tiny_ocr_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ocr_lora")
    out = root / "run"
    config = {
        "model_name_or_path": str(tiny_ocr_model_dir),
        "stage": "OCR-VL-SFT",
        "fine_tuning": "LoRA",
        "lora_rank": 8,
        "lora_target_modules": TARGETS,
        "train_dataset_path": str(DEMO / "lines_train.jsonl"),
        "max_seq_len": 96,
        "batch_size": 2,
        "max_steps": 3,
        "learning_rate": 1e-2,
        "save_steps": 1000,
        "output_dir": str(out),
        "report_to": "none",
    }
    assert main(["train", str(_write(root / "run.yaml", config))]) == 0
    return out


def _inputs(model_dir: Path) -> dict:
    """One image prompt as the model's processor and template make it."""
    tok = engine.load_tokenizer(str(model_dir))
    settings = OCRProcessorSettings.from_model_dir(model_dir)
    pixels, grids = preprocess_images(
        [DEMO / "images" / "line_000.png", DEMO / "images" / "line_030.png"], settings
    )
    prompt = tok.apply_chat_template(task_messages("ocr", images=2), add_generation_prompt=True)
    ids = tok.encode(expand_image_placeholders(prompt, grids, settings.merge_size))
    return {"input_ids": np.asarray([ids], np.int64), "pixel_values": pixels, "image_grid_thw": grids}


def _logits(model, inputs: dict) -> np.ndarray:
    with paddle.no_grad():
        return model(
            paddle.to_tensor(inputs["input_ids"]),
            pixel_values=paddle.to_tensor(inputs["pixel_values"]),
            grid_thw=inputs["image_grid_thw"].tolist(),
        ).logits.numpy()


def adapter_model(run: Path):
    """The run's model as it trained: the base with its LoRA layers beside the frozen linears, unmerged."""
    cfg = json.loads((run / "adapter_config.json").read_text())
    model = engine.load_model(cfg["base_model"])
    apply_lora(model, cfg["r"], cfg["lora_alpha"], cfg["rslora"], cfg["target_modules"])
    load_adapter_weights(model, run)
    model.eval()
    return model


def test_the_merged_export_gives_the_adapter_models_logits(lora_run, tmp_path, capsys):
    model = adapter_model(lora_run)
    wrapped = {name.split(".")[0] for name, _ in lora_layers(model)}
    assert wrapped == {"ernie", "visual", "projector"}
    assert all(float(paddle.abs(m.lora_B).max()) > 0 for _, m in lora_layers(model))  # they trained
    inputs = _inputs(lora_run)
    want = _logits(model, inputs)
    base = _logits(
        engine.load_model(json.loads((lora_run / "adapter_config.json").read_text())["base_model"]), inputs
    )
    assert np.abs(want - base).max() > 1e-3
    gaps = {
        "run dir (merged as read)": float(
            np.abs(_logits(engine.load_model(str(lora_run)), inputs) - want).max()
        )
    }
    for layout in ("hf", "paddle"):
        export = tmp_path / layout
        config = {"output_dir": str(lora_run), "lora": True, "layout": layout, "export_dir": str(export)}
        assert main(["export", str(_write(tmp_path / f"{layout}.yaml", config))]) == 0
        raw = json.loads((export / "config.json").read_text())
        assert raw["model_type"] == "paddleocr_vl" and ("text_config" in raw) == (layout == "hf")
        for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.model"):
            assert (export / name).is_file(), name
        assert json.loads((export / "export_summary.json").read_text())["merged_lora"] is True
        gaps[layout] = float(np.abs(_logits(engine.load_model(str(export)), inputs) - want).max())
    with capsys.disabled():
        print(f"\nmerged LoRA logits vs the adapter model's: {gaps}")
    assert max(gaps.values()) <= MERGE_ATOL, gaps
    np.savez(tmp_path / "expected.npz", logits=want, **inputs)


def test_transformers_reads_the_merged_export(lora_run, tmp_path, capsys):
    inputs = _inputs(lora_run)
    np.savez(tmp_path / "expected.npz", logits=_logits(adapter_model(lora_run), inputs), **inputs)
    for layout in ("hf", "paddle"):
        config = {
            "output_dir": str(lora_run),
            "lora": True,
            "layout": layout,
            "export_dir": str(tmp_path / layout),
        }
        assert main(["export", str(_write(tmp_path / f"{layout}.yaml", config))]) == 0
    done = subprocess.run(
        [
            reference_python(),
            str(ROOT / "tools" / "check_ocr_vl_export.py"),
            "--expected",
            str(tmp_path / "expected.npz"),
            str(tmp_path / "hf"),
            str(tmp_path / "paddle"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    with capsys.disabled():
        sys.stdout.write("\ntransformers on the merged exports:\n" + done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    gaps = {
        form: float(gap) for form, case, gap in (line.split() for line in done.stdout.strip().splitlines())
    }
    assert sorted(gaps) == ["hf", "paddle"] and max(gaps.values()) <= TRANSFORMERS_ATOL


def test_a_paddleocr_vl_export_refuses_what_it_cannot_write(lora_run, tmp_path):
    for extra, fragment in (
        ({"quantization": "wint8"}, "quantization wint8: post-training quantization of PaddleOCR-VL"),
        ({"export_format": "gguf"}, "export_format gguf: PaddleOCR-VL exports as safetensors only"),
    ):
        config = {"output_dir": str(lora_run), "lora": True, "export_dir": str(tmp_path / "x"), **extra}
        with pytest.raises(ValueError, match=fragment):
            run_export(load_export_config(_write(tmp_path / "x.yaml", config)))
        assert not (tmp_path / "x").exists()


def test_the_merged_export_serves_an_image_chat(lora_run, tmp_path):
    """`ernie-studio serve` on the merged export answers an image chat (the official openai client) with the
    greedy reading the OCR evaluation makes of the same image with the adapter model (the run as it
    trained): the merge is what serves."""
    import openai
    from serve_support import running_server
    from test_serve_ocr import data_url, ocr_chat

    from engine.eval.ocr import read_ocr_set, read_set

    export = tmp_path / "paddle"
    config = {"output_dir": str(lora_run), "lora": True, "layout": "paddle", "export_dir": str(export)}
    assert main(["export", str(_write(tmp_path / "export.yaml", config))]) == 0
    tok = engine.load_tokenizer(str(export))
    items = read_ocr_set(DEMO / "lines_eval.jsonl", tok, max_samples=1)
    settings = OCRProcessorSettings.from_model_dir(export)
    expected = read_set(adapter_model(lora_run), tok, settings, items, max_new_tokens=8)
    base = json.loads((lora_run / "adapter_config.json").read_text())["base_model"]
    assert read_set(engine.load_model(base), tok, settings, items, max_new_tokens=8) != expected  # it trained
    with running_server(export, "--max-num-seqs", "1", "--max-model-len", "512") as (base, _):
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="default",
            messages=ocr_chat(data_url(items[0].images[0].read_bytes())),
            max_tokens=8,
            temperature=0,
        )
    assert reply.choices[0].message.content == expected[0] and expected[0]
