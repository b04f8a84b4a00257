"""``ernie-studio init-model`` through the real console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize(
    ("preset", "model_type", "experts"),
    [("tiny", "ernie4_5", None), ("tiny-moe", "ernie4_5_moe", 8), ("tiny-vl", "ernie4_5_moe_vl", [8, 8])],
)
def test_init_model_writes_a_loadable_model_dir(
    tmp_path: Path, preset: str, model_type: str, experts
) -> None:
    out = tmp_path / preset
    r = _cli("init-model", "--preset", preset, "--out", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert f"wrote {preset} model to {out}" in r.stdout
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg.get("moe_num_experts") == experts
    model = engine.load_model(str(out))
    tok = engine.load_tokenizer(str(out))
    assert model.config.vocab_size >= tok.vocab_size
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    logits = model(paddle.to_tensor([ids])).logits
    assert list(logits.shape) == [1, len(ids), model.config.vocab_size]
    assert np.isfinite(logits.numpy()).all() and logits.numpy().std() > 1e-3
    if preset == "tiny-vl":
        assert cfg["im_patch_id"] == tok.convert_tokens_to_ids("<|IMAGE_PLACEHOLDER|>")


def test_init_model_is_deterministic_and_refuses_a_non_empty_dir(tmp_path: Path) -> None:
    from engine.models.initialize import init_model

    a, b = init_model("tiny", tmp_path / "a", seed=5), init_model("tiny", tmp_path / "b", seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    r = _cli("init-model", "--preset", "tiny", "--out", str(a))
    assert r.returncode == 2
    assert "directory is not empty" in r.stderr and str(a) in r.stderr
    r = _cli("init-model", "--preset", "huge", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "invalid choice: 'huge'" in r.stderr
