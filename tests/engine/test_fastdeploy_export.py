"""Serving exports: every kind of deployment (Full, LoRA merged, PTQ, MoE, VL) written in the form FastDeploy
loads, checked on disk against what its loader reads (fastdeploy/config.py ModelConfig.read_model_config,
model_executor/layers/quantization/__init__.py parse_quant_config, models/ernie4_5_moe.py weight names,
input/ernie4_5_vl_processor AdaptiveImageProcessor), and read back by our own loader to the same logits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.models.checkpoint import TensorStore
from engine.models.lora import apply_lora
from engine.train.export import run_export
from engine.train.export_config import ExportConfig
from engine.train.lora import save_adapter
from engine.train.serving_export import (
    FLOAT32_TENSORS,
    VL_CHAT_TEMPLATE,
    _config_problems,
    export_for_serving,
    fastdeploy_moe_layers,
    serving_problems,
)

GOLDEN_VL_PADDLE = Path(__file__).parent / "golden" / "vl_moe" / "paddle"
TARGETS = ["qkv_proj", "o_proj", "up_gate_proj", "down_proj"]
# The exported model's logits (our loader, fp32 compute on the stored bf16 weights, ids [[1, 5, 9, 23, 42,
# 7]], logits up to ~1.3 in size) against two references. ROUNDED: the source model with its weights rounded
# to bf16 by hand (rounded_logits); measured 0.0, bit-identical, for Full, LoRA merged and MoE. BF16_COST: the
# fp32 source (or the PTQ export) itself, what rounding to bf16 costs; measured 5.2e-3 (Full), 3.9e-3 (LoRA
# merged), 3.3e-3 (MoE), 2.9e-3 to 3.8e-3 (PTQ). Bounds: float32 noise, and 2x the largest cost.
ROUNDED = 1e-6
BF16_COST = 0.01


def pattern(key: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", key)


def check_fastdeploy_form(out: Path, *, dense_of: Path | None = None) -> dict:
    """What FastDeploy's loader needs: one dtype key (`dtype`, bf16, no transformers_version: the Paddle
    layout), `ernie.*` tensors in bf16 but the router's fp32 ones, [in, out] shapes matching the config."""
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and "torch_dtype" not in cfg and "transformers_version" not in cfg
    assert cfg["architectures"][0] in {
        "Ernie4_5_ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5_VLMoeForConditionalGeneration",
    }
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert key in cfg
    store = TensorStore(out)
    for key in store:
        want = "F32" if key.endswith(FLOAT32_TENSORS) else "BF16"
        assert store.dtype(key) == want, key
    h, hd = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    assert store.shape("ernie.layers.0.self_attn.qkv_proj.weight") == [h, qkv]
    assert store.shape("ernie.layers.0.self_attn.o_proj.weight") == [cfg["num_attention_heads"] * hd, h]
    assert store.shape("ernie.embed_tokens.weight") == [cfg["vocab_size"], h]
    assert serving_problems(out) == []
    assert (out / "tokenizer.model").exists()
    return cfg


def logits(model_dir: Path) -> np.ndarray:
    ids = paddle.to_tensor([[1, 5, 9, 23, 42, 7]], dtype="int64")
    with paddle.no_grad():
        return engine.load_model(str(model_dir)).eval()(ids).logits.numpy()


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """bf16 rounding done by hand (round to nearest, ties to even, on the fp32 bits), not by Paddle's cast."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def rounded_logits(model_dir: Path) -> np.ndarray:
    """The independent reference for a serving export: the source model (a LoRA run merged by our loader)
    in fp32, each weight rounded to bf16 here, except the router's gate and correction bias, which FastDeploy
    reads in fp32. The export must compute exactly this model, whatever ``serving_problems`` says."""
    model = engine.load_model(str(model_dir)).eval()
    for name, p in model.named_parameters():
        if not name.endswith(("mlp.gate.weight", "mlp.gate.weight_1", "e_score_correction_bias")):
            p.set_value(paddle.to_tensor(round_to_bf16(p.numpy())))
    ids = paddle.to_tensor([[1, 5, 9, 23, 42, 7]], dtype="int64")
    with paddle.no_grad():
        return model(ids).logits.numpy()


def test_full_model_export(tiny_model_dir, tmp_path):
    """A Full run's fp32 weights: rewritten in bf16; our loader gives the bf16-rounded model's logits (measured:
    bit-identical to the weights rounded by hand, 5.2e-3 from the fp32 model's)."""
    assert "dtype 'float32'" in " ".join(serving_problems(tiny_model_dir))
    out = export_for_serving(tiny_model_dir, tmp_path / "serve")
    assert out == tmp_path / "serve"
    cfg = check_fastdeploy_form(out)
    assert "quantization_config" not in cfg
    served = logits(out)
    np.testing.assert_allclose(served, rounded_logits(tiny_model_dir), rtol=0, atol=ROUNDED)
    np.testing.assert_allclose(served, logits(tiny_model_dir), rtol=0, atol=BF16_COST)
    # a directory already in that form is served as it is
    assert export_for_serving(out, tmp_path / "again") == out and not (tmp_path / "again").exists()


def test_lora_run_merged(tiny_model_dir, tmp_path):
    model = engine.load_model(str(tiny_model_dir))
    apply_lora(model, 4, 8, targets=TARGETS)
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            p.set_value(paddle.full(p.shape, 0.01, dtype=p.dtype))
    run = tmp_path / "lora-run"
    save_adapter(
        model, run, {"base_model": str(tiny_model_dir), "r": 4, "lora_alpha": 8, "target_modules": TARGETS}
    )
    out = export_for_serving(run, tmp_path / "serve")
    check_fastdeploy_form(out)
    assert not (out / "adapter_config.json").exists()
    merged = logits(run)  # our loader merges the adapter
    assert not np.allclose(merged, logits(tiny_model_dir), atol=1e-3)  # the adapter changes the model
    served = logits(out)
    np.testing.assert_allclose(served, rounded_logits(run), rtol=0, atol=ROUNDED)
    np.testing.assert_allclose(served, merged, rtol=0, atol=BF16_COST)


@pytest.mark.parametrize(
    ("method", "fastdeploy"), [("wint8", "wint8"), ("wint4", "wint4"), ("fp8", "block_wise_fp8")]
)
def test_ptq_export(tiny_model_dir, tmp_path, method, fastdeploy):
    """A PTQ export: its dequantized weights in bf16 with `quantization_config` in FastDeploy's shape
    (parse_quant_config raises without `quantization`; `is_quantized: false` quantizes at load)."""
    ptq = tmp_path / "ptq"
    run_export(ExportConfig(model_name_or_path=str(tiny_model_dir), export_dir=str(ptq), quantization=method))
    assert "quantization_config without FastDeploy's `quantization` key" in serving_problems(ptq)
    out = export_for_serving(ptq, tmp_path / "serve")
    cfg = check_fastdeploy_form(out)
    assert cfg["quantization_config"] == {"quantization": fastdeploy, "is_quantized": False}
    # measured 2.9e-3 (wint8), 3.8e-3 (wint4), 3.6e-3 (fp8): the dequantized weights rounded to bf16
    np.testing.assert_allclose(logits(out), logits(ptq), rtol=0, atol=BF16_COST)


def test_moe_export_keeps_router_in_float32(tiny_moe_model_dir, tmp_path):
    out = export_for_serving(tiny_moe_model_dir, tmp_path / "serve")
    cfg = check_fastdeploy_form(out)
    store = TensorStore(out)
    e, h = cfg["moe_num_experts"], cfg["hidden_size"]
    start = cfg["moe_layer_start_index"]
    assert store.shape(f"ernie.layers.{start}.mlp.gate.weight") == [h, e]
    assert store.dtype(f"ernie.layers.{start}.mlp.gate.weight") == "F32"
    assert store.dtype(f"ernie.layers.{start}.mlp.moe_statics.e_score_correction_bias") == "F32"
    inter = cfg["moe_intermediate_size"]
    assert store.shape(f"ernie.layers.{start}.mlp.experts.0.up_gate_proj.weight") == [h, 2 * inter]
    assert store.shape(f"ernie.layers.{start}.mlp.experts.{e - 1}.down_proj.weight") == [inter, h]
    served = logits(out)
    np.testing.assert_allclose(served, rounded_logits(tiny_moe_model_dir), rtol=0, atol=ROUNDED)
    np.testing.assert_allclose(served, logits(tiny_moe_model_dir), rtol=0, atol=BF16_COST)


def test_wint4_moe_export_is_fastdeploys_mix_quant(tiny_moe_model_dir, tmp_path):
    """FastDeploy turns `--quantization wint4` on ERNIE into mix_quant (parse_quant_config): dense layers
    wint8, experts wint4. The MoE serving export writes that, not a plain wint4."""
    out = export_for_serving(tiny_moe_model_dir, tmp_path / "serve", quantization="wint4")
    cfg = check_fastdeploy_form(out)
    assert cfg["quantization_config"] == {
        "quantization": "mix_quant",
        "dense_quant_type": "wint8",
        "moe_quant_type": "wint4",
        "is_quantized": False,
    }


def test_moe_layers_fastdeploy_would_misread_are_refused(tiny_moe_model_dir, tiny_vl_model_dir, tmp_path):
    """FastDeploy's text MoE builds every layer from moe_layer_start_index on as MoE (end, interval and
    mlp_layer_types unread); its VL model honours start and end. A config it would build otherwise is refused."""
    from engine.models.config import ErnieConfig
    from engine.models.ernie import ErnieForCausalLM
    from engine.models.saving import save_model
    from engine.tokenizer import copy_tokenizer_files

    text = json.loads((tiny_moe_model_dir / "config.json").read_text())
    vl = json.loads((tiny_vl_model_dir / "config.json").read_text())
    assert fastdeploy_moe_layers(text) == [1, 2] and not any("MoE" in p for p in _config_problems(text))
    assert fastdeploy_moe_layers(vl) == [1, 2] and not any("MoE" in p for p in _config_problems(vl))
    for bad, theirs in (
        ({**text, "moe_layer_interval": 2}, [1, 2]),  # ours: layer 1 only
        ({**text, "moe_layer_end_index": 1}, [1, 2]),  # ours: layer 1 only
        ({**text, "moe_layer_end_index": None, "mlp_layer_types": ["dense", "sparse", "dense"]}, [1, 2]),
        ({**vl, "moe_layer_interval": 2}, [1, 2]),
    ):
        found = [p for p in _config_problems(bad) if "FastDeploy would build MoE layers" in p]
        assert found and f"would build MoE layers {theirs}" in found[0] and "--backend paddle" in found[0]
    # the VL model reads the end: a VL config ending at layer 1 is served as it says
    assert fastdeploy_moe_layers({**vl, "moe_layer_end_index": [1, 1]}) == [1]
    assert not any("MoE" in p for p in _config_problems({**vl, "moe_layer_end_index": [1, 1]}))

    src = tmp_path / "interval-2"
    config = ErnieConfig.from_dict({**text, "moe_layer_interval": 2})
    save_model(ErnieForCausalLM(config), src, dtype="bfloat16")
    copy_tokenizer_files(tiny_moe_model_dir, src)
    with pytest.raises(ValueError, match=r"interval-2: FastDeploy cannot serve .*MoE layers \[1\]"):
        export_for_serving(src, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()


def test_vl_export(tiny_vl_model_dir, tmp_path):
    """VL: Baidu's -Paddle tensor names (the layout FastDeploy's ernie4_5_vl loader reads; the golden's),
    the config keys its vision tower and resampler read, the processor keys and a chat template that puts
    FastDeploy's image placeholder where the official template does."""
    out = export_for_serving(tiny_vl_model_dir, tmp_path / "serve")
    cfg = check_fastdeploy_form(out)
    vision = cfg["vision_config"]
    for key in ("depth", "embed_dim", "hidden_size", "num_heads", "mlp_ratio", "hidden_act", "patch_size"):
        assert key in vision, key
    assert vision["hidden_act"] == "quick_gelu" and cfg["pixel_hidden_size"] == vision["hidden_size"]
    for key in ("spatial_conv_size", "temporal_conv_size", "im_patch_id", "rope_3d", "freq_allocation"):
        assert key in cfg, key
    ours = {pattern(k) for k in TensorStore(out)}
    official = {pattern(k) for k in TensorStore(GOLDEN_VL_PADDLE)}
    assert ours == official
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert {"min_pixels", "max_pixels", "merge_size", "patch_size", "temporal_conv_size"} <= set(pre)
    assert pre["min_pixels"] < pre["max_pixels"] and pre["merge_size"] == 2
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["chat_template"] == VL_CHAT_TEMPLATE
    import jinja2

    prompt = (
        jinja2.Environment()
        .from_string(VL_CHAT_TEMPLATE)
        .render(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "data": "x"}, {"type": "text", "text": "what?"}],
                },
            ],
            cls_token="<|begin_of_sentence|>",
            sep_token="<|end_of_sentence|>",
        )
    )
    assert prompt == (
        "<|begin_of_sentence|>User: Picture 1:<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>what?\n"
        "Assistant: "
    )


def test_vl_export_template_wins_over_a_copied_chat_template_jinja(tiny_vl_model_dir, tmp_path):
    """FastDeploy's tokenizer loader reads <model>/chat_template.jinja before tokenizer_config.json: a source
    shipping its own (text) chat_template.jinja must not override the VL template in the serving export."""
    import shutil

    src = tmp_path / "vl-src"
    shutil.copytree(tiny_vl_model_dir, src)
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    out = export_for_serving(src, tmp_path / "serve", quantization="wint8")
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == VL_CHAT_TEMPLATE
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == VL_CHAT_TEMPLATE


def test_hf_layout_export_keeps_one_dtype_key(tiny_model_dir, tmp_path):
    """FastDeploy refuses a config.json with both `dtype` and `torch_dtype`, and 2.3 reads one with `dtype`
    alone as the Paddle layout (ModelConfig.read_model_config; the transformers_version rule is later): our HF
    export is never served as it is, but rewritten in the Paddle layout."""
    run_export(
        ExportConfig(model_name_or_path=str(tiny_model_dir), export_dir=str(tmp_path / "hf"), layout="hf")
    )
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "torch_dtype" not in cfg and cfg["dtype"] == "float32"
    assert "not the Paddle layout (no ernie.* tensors)" in serving_problems(tmp_path / "hf")
    out = export_for_serving(tmp_path / "hf", tmp_path / "serve")  # served in the Paddle layout
    assert out == tmp_path / "serve"
    check_fastdeploy_form(out)
