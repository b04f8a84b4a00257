"""Recompute covers MoE decoder layers: the same losses, router losses, gradients and aux-free bias moves as
without it, the MoE blocks really replayed in backward, and less memory held for backward."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from engine.models.loading import load_plain_model
from engine.models.moe import MoELayer
from engine.train import moe_balance

STEPS = 3
LR = 0.05


def _steps(model_dir, recompute: bool, vision: bool, granularity: str = "full"):
    """A few plain SGD steps with every router loss weighted and aux-free balancing after each step;
    returns per-step losses, router losses, gradients, correction biases and MoE forward calls."""
    model = load_plain_model(model_dir)
    model.config.moe_aux_loss_lambda = 0.01
    model.config.moe_z_loss_lambda = 0.001
    model.config.moe_orthogonal_loss_lambda = 0.01
    for layer in model.ernie.layers:
        layer.hidden_dropout = 0.1  # recompute must replay the dropout masks too
    model.ernie.gradient_checkpointing = recompute
    model.ernie.recompute_granularity = granularity
    model.train()
    calls = [0]
    moes = moe_balance.moe_layers(model)
    hooks = [m.register_forward_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in moes]
    rng = np.random.default_rng(0)
    paddle.seed(0)
    out = {"loss": [], "router": [], "grads": [], "bias": [], "counts": []}
    for _ in range(STEPS):
        ids = paddle.to_tensor(rng.integers(3, model.config.vocab_size, size=(2, 48)))
        kw = {}
        if vision:  # both modality groups routed (text experts and vision experts)
            kw["token_type_ids"] = paddle.to_tensor(rng.integers(0, 2, size=(2, 48)))
        res = model(ids, labels=ids, **kw)
        res.loss.backward()
        out["loss"].append(float(res.loss))
        out["router"].append({k: float(v) for k, v in res.router_losses.items()})
        params = dict(model.named_parameters())
        out["grads"].append({n: p.grad.numpy().copy() for n, p in params.items() if p.grad is not None})
        groups = model.config.expert_counts
        present = list(range(len(groups))) if vision else [0]
        counts = moe_balance.expert_counts(res.router_stats, groups, present)
        out["counts"].append(counts)
        with paddle.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p.set_value(p - LR * p.grad)
        model.clear_gradients()
        moe_balance.update_correction_biases(model, counts, rate=0.01)
        out["bias"].append([m.moe_statics.e_score_correction_bias.numpy().copy() for m in moes])
    for h in hooks:
        h.remove()
    out["calls"] = calls[0]
    out["moe_layers"] = len(moes)
    return out


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-vl"])
def test_recompute_of_moe_layers_changes_no_number(preset, tiny_moe_model_dir, tiny_vl_model_dir):
    model_dir = tiny_moe_model_dir if preset == "tiny-moe" else tiny_vl_model_dir
    plain = _steps(model_dir, recompute=False, vision=preset == "tiny-vl")
    again = _steps(model_dir, recompute=True, vision=preset == "tiny-vl")
    # every MoE block ran once per step without recompute, and once more (its replay) with it
    assert plain["calls"] == STEPS * plain["moe_layers"]
    assert again["calls"] == 2 * STEPS * again["moe_layers"]
    np.testing.assert_allclose(again["loss"], plain["loss"], atol=1e-6)
    for a, b in zip(again["router"], plain["router"], strict=True):
        assert a.keys() == b.keys() == {"aux_loss", "z_loss", "orthogonal_loss"}
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    for a, b in zip(again["grads"], plain["grads"], strict=True):
        assert a.keys() == b.keys()
        assert any(".mlp.gate.weight" in n for n in a)  # the router losses reach the gates
        for n in a:
            np.testing.assert_allclose(a[n], b[n], atol=1e-6, err_msg=n)
    # expert loads counted once per step (not doubled by the replay), so the bias moved the same way
    for a, b in zip(again["counts"], plain["counts"], strict=True):
        for la, lb in zip(a, b, strict=True):
            for ca, cb in zip(la, lb, strict=True):
                np.testing.assert_array_equal(ca, cb)
    assert (
        sum(int(c.sum()) for c in plain["counts"][0][0]) == 2 * 48 * load_plain_model(model_dir).config.moe_k
    )
    for a, b in zip(again["bias"], plain["bias"], strict=True):
        for ba, bb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ba, bb)
    assert np.abs(plain["bias"][-1][0]).max() > 0  # the aux-free update did move the bias


def _peak_bytes(model, ids) -> int:
    """Peak of Paddle's host allocator over one forward + backward, above what was allocated before."""
    from paddle.base import core

    model.clear_gradients()
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    model(ids, labels=ids).loss.backward()
    peak = core.host_memory_stat_peak_value("Allocated", 0) - base
    model.clear_gradients()
    return peak


def test_recompute_lowers_peak_memory_of_moe_layers(tiny_moe_model_dir):
    """A longer sequence on tiny-moe, where the MoE blocks' activations dominate: recompute keeps each
    block's input only, so the peak of a forward + backward drops (measured by Paddle's host allocator)."""
    model = load_plain_model(tiny_moe_model_dir)
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, model.config.vocab_size, size=(1, 1024)))
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.ernie.layers[1:])
    model.ernie.gradient_checkpointing = False
    plain = _peak_bytes(model, ids)
    model.ernie.gradient_checkpointing = True
    for layer in model.ernie.layers:  # MoE blocks left out of recompute: what main did
        layer.recompute_moe = False
    moe_kept = _peak_bytes(model, ids)
    for layer in model.ernie.layers:
        layer.recompute_moe = True
    full = _peak_bytes(model, ids)
    print(f"peak MiB: plain {plain / 2**20:.1f}, MoE kept {moe_kept / 2**20:.1f}, all {full / 2**20:.1f}")
    assert full < 0.8 * moe_kept
    assert full < 0.6 * plain


@pytest.mark.parametrize("granularity", ["full_attn", "core_attn"])
def test_partial_granularities_change_no_number(granularity, tiny_moe_model_dir):
    """recompute_granularity full_attn / core_attn rebuild less than full; the MoE blocks are still
    replayed (use_recompute_moe) and every number stays that of the run without recompute."""
    plain = _steps(tiny_moe_model_dir, recompute=False, vision=False)
    again = _steps(tiny_moe_model_dir, recompute=True, vision=False, granularity=granularity)
    assert again["calls"] == 2 * STEPS * again["moe_layers"]
    np.testing.assert_allclose(again["loss"], plain["loss"], atol=1e-6)
    for a, b in zip(again["grads"], plain["grads"], strict=True):
        for n in a:
            np.testing.assert_allclose(a[n], b[n], atol=1e-6, err_msg=n)
    for a, b in zip(again["bias"], plain["bias"], strict=True):
        for ba, bb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ba, bb)


def test_granularities_hold_less_than_no_recompute(tiny_moe_model_dir):
    """Each granularity keeps less for backward than no recompute, with the MoE blocks kept as they are
    (use_recompute_moe false), so what is measured is the attention's own share. With the plain attention
    (the GPU's without flash, or the CPU's with cpu_attention off) core_attn drops its scores and
    probabilities; the CPU's native attention keeps none of them in the first place, so without recompute it
    holds what core_attn holds (measured 2026-11-30 at 768 tokens: 53.5 MiB plain, 35.0 native, 34.9
    core_attn)."""
    from engine.models import kernels

    model = load_plain_model(tiny_moe_model_dir)
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(1).integers(3, model.config.vocab_size, size=(1, 768)))
    with kernels.forced(cpu_attention=False):
        model.ernie.gradient_checkpointing = False
        plain = _peak_bytes(model, ids)
        model.ernie.gradient_checkpointing = True
        for layer in model.ernie.layers:
            layer.recompute_moe = False
        peaks = {}
        for g in ("full", "full_attn", "core_attn"):
            model.ernie.recompute_granularity = g
            peaks[g] = _peak_bytes(model, ids)
    print("peak MiB:", {k: round(v / 2**20, 1) for k, v in {"none": plain, **peaks}.items()})
    assert peaks["core_attn"] < 0.9 * plain
    assert peaks["full_attn"] < peaks["core_attn"]
    assert peaks["full"] <= peaks["full_attn"]
    if kernels.enabled("cpu_attention"):
        model.ernie.gradient_checkpointing = False
        native = _peak_bytes(model, ids)
        assert native < 1.01 * peaks["core_attn"], (native, peaks["core_attn"])


def test_recompute_granularity_is_checked():
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict
    from engine.train.options import ConfigError

    with pytest.raises(ConfigError, match="recompute_granularity"):
        config_from_dict(
            TrainConfig,
            dict(model_name_or_path="m", train_dataset_path="x.jsonl", recompute_granularity="selective"),
        )


def test_the_trainer_sets_what_the_config_asks(tiny_moe_model_dir):
    from engine.train.build import build_model
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict

    base = dict(model_name_or_path=str(tiny_moe_model_dir), train_dataset_path="x.jsonl", recompute=True)
    model, _ = build_model(config_from_dict(TrainConfig, base))
    assert model.ernie.gradient_checkpointing and model.ernie.recompute_granularity == "full"
    assert all(layer.recompute_moe for layer in model.ernie.layers)
    cfg = config_from_dict(
        TrainConfig, base | dict(recompute_granularity="core_attn", use_recompute_moe=False)
    )
    model, _ = build_model(cfg)
    assert model.ernie.recompute_granularity == "core_attn"
    assert not any(layer.recompute_moe for layer in model.ernie.layers)
