"""Quantization building blocks: FP8 fake quantization, Hadamard rotation, weight-only int8/int4."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from paddle import nn

import engine
from engine.models.loading import load_plain_model
from engine.models.lora import LoRALinear
from engine.models.quantized import (
    FP8_MAX,
    WeightOnlyLinear,
    apply_weight_only,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from engine.models.safetensors_io import SafetensorsFile
from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.quant import FP8Linear, fake_quant_fp8, fp8_round, hadamard, next_step


def test_fp8_round_is_e4m3_with_straight_through_gradient():
    x = paddle.to_tensor(np.linspace(-3, 3, 101, dtype=np.float32), stop_gradient=False)
    scale = paddle.to_tensor([3.0 / FP8_MAX])
    q = fp8_round(x, scale).numpy()
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values
    big = np.abs(x.numpy()) > 0.05
    assert np.all(np.abs(q[big] - x.numpy()[big]) <= np.abs(x.numpy()[big]) * 2**-4 + 1e-7)
    assert len(np.unique(q)) < 101  # it really rounds
    y = fake_quant_fp8(x, scale)
    np.testing.assert_array_equal(y.numpy(), q)
    (y * paddle.arange(101, dtype="float32")).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.arange(101, dtype=np.float32))  # identity gradient


def test_hadamard_rotation_is_orthonormal_and_preserves_the_product():
    h = hadamard(32)
    np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-6)
    paddle.seed(0)
    lin = nn.Linear(64, 16, bias_attr=False)
    qat = FP8Linear(lin, hadamard_block=32)
    x = paddle.randn([3, 64])
    np.testing.assert_allclose(
        paddle.matmul(qat.rotate(x), qat.rotate(lin.weight, axis_first=True)).numpy(),
        lin(x).numpy(),
        atol=1e-5,
    )


def test_fp8_linear_tracks_activation_scale_by_ema():
    paddle.seed(0)
    qat = FP8Linear(nn.Linear(32, 8, bias_attr=False), hadamard_block=0, ema_rate=0.01)
    qat.train()
    x1 = paddle.ones([2, 32]) * 4.0
    qat(x1)
    first = float(qat.act_scale.numpy()[0])
    assert first == pytest.approx(4.0 / FP8_MAX)  # estimated online from the first batch
    qat(x1 * 3)  # another forward of the same step (micro-batch, recomputation) leaves the EMA alone
    assert float(qat.act_scale.numpy()[0]) == first
    next_step(qat)
    qat(x1 * 2)
    assert float(qat.act_scale.numpy()[0]) == pytest.approx(0.99 * first + 0.01 * 8.0 / FP8_MAX)
    out = qat(x1)
    ref = paddle.matmul(x1, qat.weight)
    # fp8 keeps ~2 significant digits: the product is close but not equal
    err = np.abs(out.numpy() - ref.numpy()).max() / np.abs(ref.numpy()).max()
    assert 0 < err < 0.1


@pytest.mark.parametrize(("bits", "group", "tol"), [(8, -1, 1 / 127), (4, -1, 1 / 7), (4, 16, 1 / 7)])
def test_weight_only_quantization_error_is_bounded_by_half_a_step(bits, group, tol):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, size=(64, 24)).astype(np.float32)
    q, scale = quantize_weight(w, bits, group)
    assert q.dtype == np.int8 and q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    assert scale.shape == ((64 // group if group > 0 else 1), 24)
    lin = WeightOnlyLinear(q, scale, bits)
    deq = lin.dequantized().numpy()
    step = np.repeat(scale, 64 // scale.shape[0], axis=0)
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-8)
    assert np.abs(deq - w).max() <= np.abs(w).max() * tol
    x = paddle.to_tensor(rng.normal(size=(2, 64)).astype(np.float32))
    np.testing.assert_allclose(lin(x).numpy(), x.numpy() @ deq, rtol=1e-5, atol=1e-6)


def test_int4_packing_round_trips_and_halves_the_bytes():
    q = np.random.default_rng(0).integers(-8, 8, size=(64, 10)).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == (32, 10)
    np.testing.assert_array_equal(unpack_int4(packed), q)


def test_wint4_8_puts_experts_in_int4_and_the_rest_in_int8(tiny_moe_model_dir):
    model = load_plain_model(tiny_moe_model_dir)
    counts = apply_weight_only(model, "wint4/8")
    kinds = {n: m.bits for n, m in model.named_sublayers() if isinstance(m, WeightOnlyLinear)}
    assert counts[4] == sum(1 for n in kinds if ".experts." in n) > 0
    assert all(bits == (4 if ".experts." in n else 8) for n, bits in kinds.items())
    assert not [n for n, p in model.named_parameters() if n.endswith("proj.weight")]  # no fp32 copies left


def test_wint4_8_lora_run_on_the_moe_trains_expert_adapters_and_reloads(tiny_moe_model_dir, tmp_path):
    data = Path(__file__).resolve().parents[2] / "examples/data/sft_demo.jsonl"
    out = tmp_path / "w48"
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(tiny_moe_model_dir),
            train_dataset_path=str(data),
            fine_tuning="LoRA",
            compute_type="wint4/8",
            weight_quant_group_size=32,
            max_seq_len=128,
            batch_size=2,
            learning_rate=1e-2,
            max_steps=3,
            output_dir=str(out),
            disable_tqdm=True,
        ),
    )
    assert run_training(cfg).status == "succeeded"
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["compute_type"] == "wint4/8"
    keys = SafetensorsFile(out / "adapter_model.safetensors").keys()
    assert any(".mlp.experts.3.up_gate_proj.lora_B" in k for k in keys)  # experts carry adapters too
    assert any(".mlp.shared_experts.down_proj.lora_A" in k for k in keys)
    assert all(k.endswith(("lora_A", "lora_B")) for k in keys)
    merged = engine.load_model(out)  # int4/int8 base re-applied, adapter merged into it
    assert not [m for m in merged.sublayers() if isinstance(m, LoRALinear)]
    ids = paddle.to_tensor(np.arange(1, 17, dtype=np.int64).reshape(1, 16))
    with paddle.no_grad():
        assert np.isfinite(merged(ids).logits.numpy()).all()


@pytest.mark.parametrize("method", ["wint4", "fp8"])
def test_ptq_streams_into_the_files_of_the_quantized_model(tiny_moe_model_dir, tmp_path, method):
    """PTQ without an eval set quantizes each linear as its weight is read from the checkpoint and writes it
    (quant.save_quantized_streamed): the files of quantizing the loaded model, byte for byte."""
    from engine.models.loading import TensorSource
    from engine.train.quant import quantize_for_export, save_quantized, save_quantized_streamed

    save_quantized_streamed(TensorSource(tiny_moe_model_dir), tmp_path / "a", method, 64, "300KB")
    model = load_plain_model(tiny_moe_model_dir)
    quantize_for_export(model, method, 64)
    save_quantized(model, tmp_path / "b", method, 64, "300KB")
    files = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert len(files) > 2 and files == sorted(p.name for p in (tmp_path / "a").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
