"""PaddleOCR-VL training (stage OCR-VL-SFT): the model streams into the run's storage, Full and LoRA train
what they should (the vision encoder frozen unless asked), fp32 and emulated bf16 run through
`ernie-studio train`, and the stage and the model family must agree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
import yaml

import engine
from engine.cli import main
from engine.models.loading import load_model
from engine.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration
from engine.models.streaming import Storage, unmaterialized
from engine.train.config_load import load_config
from engine.train.options import ConfigError
from engine.train.parallel import DataParallel
from engine.train.trainer import setup_run

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "data" / "ocr_demo"


def _config(tmp_path: Path, model: Path, **values) -> Path:
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    cfg = {
        "model_name_or_path": str(model),
        "stage": "OCR-VL-SFT",
        "train_dataset_path": str(DEMO / "lines_train.jsonl"),
        "max_seq_len": 96,
        "batch_size": 2,
        "max_steps": 2,
        "save_steps": 1000,
        "output_dir": str(out),
        "report_to": "none",
        **values,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_training_load_streams_into_the_run_storage(tiny_ocr_model_dir):
    """Emulated bf16's storage: the decoder's linears, embedding and head are read straight into bf16 (the
    same values as the fp32 load, cast), the vision encoder and projector stay fp32; ``prepare`` sees the
    model before any weight has memory."""
    seen = {}

    def prepare(model):
        seen["lazy"] = len(unmaterialized(model))

    fp32 = load_model(str(tiny_ocr_model_dir))
    held = load_model(str(tiny_ocr_model_dir), storage=Storage("bfloat16", "decoder"), prepare=prepare)
    assert isinstance(held, PaddleOCRVLForConditionalGeneration)
    assert seen["lazy"] == len(list(held.parameters())) and unmaterialized(held) == []
    dtypes = {n: str(p.dtype).removeprefix("paddle.") for n, p in held.named_parameters()}
    low = {n for n, d in dtypes.items() if d == "bfloat16"}
    assert "ernie.embed_tokens.weight" in low and "lm_head.weight" in low
    assert all(n.startswith(("ernie.", "lm_head")) for n in low)
    assert {n for n in low if n.endswith("qkv_proj.weight")} == {
        f"ernie.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)
    }
    assert all(dtypes[n] == "float32" for n in dtypes if n.startswith(("visual.", "projector.")))
    ref = fp32.state_dict()
    for name, p in held.state_dict().items():
        want = ref[name].astype(p.dtype)
        assert np.array_equal(p.astype("float32").numpy(), want.astype("float32").numpy()), name


CASES = {
    # LoRA adapts the decoder's linears; the vision encoder and the projector only when named
    "lora": ({"fine_tuning": "LoRA"}, {"ernie"}, []),
    "lora+vision+projector": (
        {"fine_tuning": "LoRA", "lora_target_modules": "qkv_proj,vision,projector,resampler"},
        {"ernie", "visual", "projector"},
        ["lora_target_modules"],  # PaddleOCR-VL has no resampler
    ),
    # Full trains everything, as ERNIEKit's OCR-VL-SFT does; freeze_vision keeps the encoder frozen
    "full": ({"fine_tuning": "Full"}, {"ernie", "lm_head", "visual", "projector"}, []),
    "full+freeze_vision": (
        {"fine_tuning": "Full", "freeze_config": "freeze_vision"},
        {"ernie", "lm_head", "projector"},
        [],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_trains(tiny_ocr_model_dir, tmp_path, case):
    values, parts, notices = CASES[case]
    cfg = load_config(_config(tmp_path, tiny_ocr_model_dir, **values))
    run = setup_run(cfg, DataParallel(), Path(cfg.output_dir), lambda event: None)
    assert {n.split(".")[0] for n in run.trainable} == parts
    if cfg.lora:
        assert all(n.endswith(("lora_A", "lora_B")) for n in run.trainable)
    assert sorted(n.key for n in run.notices) == notices


def _logits(model, tok, image: Path):
    from engine.data.paddleocr_vl_processor import (
        OCRProcessorSettings,
        expand_image_placeholders,
        preprocess_images,
        task_messages,
    )

    settings = OCRProcessorSettings(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    pix, grids = preprocess_images([image], settings)
    prompt = tok.apply_chat_template(task_messages("ocr"), add_generation_prompt=True)
    ids = tok.encode(expand_image_placeholders(prompt, grids))
    with paddle.no_grad():
        out = model(paddle.to_tensor([ids]), pixel_values=paddle.to_tensor(pix), grid_thw=grids.tolist())
    return out.logits.numpy()


@pytest.mark.parametrize(
    ("fine_tuning", "compute_type", "save_to_hf"),
    [("LoRA", "bf16", False), ("Full", "fp32", True)],
)
def test_runs_through_the_cli(tiny_ocr_model_dir, tmp_path, fine_tuning, compute_type, save_to_hf):
    path = _config(
        tmp_path,
        tiny_ocr_model_dir,
        fine_tuning=fine_tuning,
        compute_type=compute_type,
        save_to_hf=save_to_hf,
        learning_rate=5e-3,
        max_pixels=28 * 28 * 16,
        eval_dataset_path=str(DEMO / "lines_eval.jsonl"),
        max_evaluate_steps=1,
    )
    assert main(["train", str(path)]) == 0
    out = tmp_path / "run"
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["stage"] == "OCR-VL-SFT"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and np.isfinite(rows[-1]["loss"]) and "eval_loss" in rows[-1]
    # the image processor it trained with goes with the model (the run's max_pixels)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["size"]["longest_edge"] == 28 * 28 * 16
    if fine_tuning == "Full":
        raw = json.loads((out / "config.json").read_text())
        assert raw["model_type"] == "paddleocr_vl" and ("text_config" in raw) == save_to_hf
    tok = engine.load_tokenizer(str(out))
    base, tuned = engine.load_model(str(tiny_ocr_model_dir)), engine.load_model(str(out))
    assert isinstance(tuned, PaddleOCRVLForConditionalGeneration)
    image = DEMO / "images" / "line_000.png"
    assert np.abs(_logits(tuned, tok, image) - _logits(base, tok, image)).max() > 1e-4


def test_the_stage_and_the_model_family_must_agree(tiny_ocr_model_dir, tiny_model_dir, tmp_path):
    ocr_on_ernie = load_config(_config(tmp_path, tiny_model_dir))
    with pytest.raises(ConfigError, match=r"stage OCR-VL-SFT fine-tunes PaddleOCR-VL, and .* is not one"):
        setup_run(ocr_on_ernie, DataParallel(), tmp_path / "run", lambda event: None)
    for stage in ("SFT", "VL-SFT"):
        cfg = load_config(_config(tmp_path, tiny_ocr_model_dir, stage=stage))
        with pytest.raises(
            ConfigError, match=rf"is PaddleOCR-VL, which trains with stage OCR-VL-SFT .* not {stage}"
        ):
            setup_run(cfg, DataParallel(), tmp_path / "run", lambda event: None)
    # ERNIEKit's earlier stage name reads as OCR-VL-SFT, said once
    cfg = load_config(_config(tmp_path, tiny_ocr_model_dir, stage="OCR-SFT"))
    assert cfg.stage == "OCR-VL-SFT"
    assert [n.message for n in cfg.notices if n.key == "stage"] == [
        "OCR-SFT is ERNIEKit's earlier name of OCR-VL-SFT; trained as that"
    ]
    for values, fragment in (
        (
            {"compute_type": "fp8", "fine_tuning": "Full"},
            "compute_type fp8: PaddleOCR-VL trains in fp32, bf16",
        ),
        ({"compute_type": "wint8"}, "compute_type wint8: PaddleOCR-VL trains in fp32, bf16"),
        ({"gpas": True, "fine_tuning": "Full"}, "gpas: PaddleOCR-VL's decoder takes no GPAS gates"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            load_config(_config(tmp_path, tiny_ocr_model_dir, **values))


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny_ocr_model_dir, tmp_path):
    """Checkpoints hold the model, AdamW (bf16's fp32 master weights) and the data position, images
    included: 2 steps then a resume to 4 give the 4-step run's final weights."""
    from safetensors.numpy import load_file

    def final(name: str, *overrides: str) -> dict:
        root = tmp_path / name
        root.mkdir()
        # a constant learning rate: max_steps=2 would otherwise decay it over 2 steps, not 4
        values = {
            "fine_tuning": "Full",
            "compute_type": "bf16",
            "save_steps": 1,
            "lr_scheduler_type": "constant",
        }
        path = _config(root, tiny_ocr_model_dir, **values)
        for o in overrides or ("max_steps=4",):
            assert main(["train", str(path), o]) == 0
        return load_file(root / "run" / "model.safetensors")

    straight, resumed = final("straight"), final("resumed", "max_steps=2", "max_steps=4")
    assert sorted(straight) == sorted(resumed)
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight)
