"""Mixture of experts against hand computations in numpy: routing, experts, router losses, VL isolation."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from engine.models import ErnieConfig, ErnieForCausalLM
from engine.models.ernie import token_loss
from engine.models.initialize import init_weights
from engine.models.moe import (
    MoELayer,
    aux_loss,
    orthogonal_loss,
    route,
    update_correction_bias,
    z_loss,
)
from engine.models.presets import preset_config
from engine.models.vision import vision_token_count

RNG = np.random.default_rng(1)


@pytest.fixture(autouse=True)
def _own_draws():
    """Every test draws the same numbers whatever ran before it: with one module-wide generator, a test's
    data depended on the order (a random order once left test_token_balanced_loss_by_hand's two weightings
    4.7e-4 apart, under its 1e-3 bound)."""
    global RNG
    RNG = np.random.default_rng(1)


def _t(a) -> paddle.Tensor:
    return paddle.to_tensor(a)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def test_route_selects_by_biased_prob_and_weights_by_unbiased_prob() -> None:
    logits = np.array([[2.0, 1.9, 0.0, -1.0], [0.0, 0.0, 0.0, 3.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.5, 0.0], np.float32)
    probs, selected, weights = route(_t(logits), _t(bias), k=2, norm_min=1e-12)
    p = _softmax(logits)
    # Row 0: probs ~[.48, .43, .06, .02]; bias +0.5 lifts expert 2 above expert 1 but not above expert 0.
    assert sorted(selected.numpy()[0].tolist()) == [0, 2]
    # Row 1: expert 3 (p ~.87) then expert 2 (p ~.04 + .5).
    assert sorted(selected.numpy()[1].tolist()) == [2, 3]
    w0 = np.array([p[0, 0], p[0, 2]]) / (p[0, 0] + p[0, 2])
    got0 = dict(zip(selected.numpy()[0].tolist(), weights.numpy()[0].tolist(), strict=True))
    assert got0[0] == pytest.approx(w0[0], rel=1e-5) and got0[2] == pytest.approx(w0[1], rel=1e-5)
    np.testing.assert_allclose(probs.numpy(), p, rtol=1e-6)


def test_route_norm_min_clamps_the_denominator() -> None:
    logits = np.array([[0.0, -30.0, -30.0, 30.0]], np.float32)
    _, selected, weights = route(
        _t(logits), _t(np.array([0.0, 5.0, 5.0, 0.0], np.float32)), k=2, norm_min=0.5
    )
    p = _softmax(logits)
    assert sorted(selected.numpy()[0].tolist()) == [1, 2]  # both near-zero-probability experts, by bias
    np.testing.assert_allclose(np.sort(weights.numpy()[0]), np.sort(p[0, [1, 2]] / 0.5), rtol=1e-5)


def _moe_config(**kw) -> ErnieConfig:
    base = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_intermediate_size=8,
        moe_layer_start_index=1,
        dtype="float32",
    )
    base.update(kw)
    return ErnieConfig(**base)


def _mlp_numpy(mlp, x: np.ndarray) -> np.ndarray:
    w, wd = mlp.up_gate_proj.weight.numpy(), mlp.down_proj.weight.numpy()
    i = w.shape[1] // 2
    return (_silu(x @ w[:, :i]) * (x @ w[:, i:])) @ wd


def test_moe_layer_equals_token_by_token_loop() -> None:
    paddle.seed(0)
    layer = MoELayer(_moe_config())
    for p in layer.parameters():
        if not p.stop_gradient:
            p.set_value(_t(RNG.normal(scale=0.3, size=p.shape).astype(np.float32)))
    bias = RNG.normal(scale=0.05, size=(1, 4)).astype(np.float32)
    layer.moe_statics.e_score_correction_bias.set_value(_t(bias))
    x = RNG.normal(size=(2, 5, 16)).astype(np.float32)
    got, stats = layer(_t(x))
    gate = layer.gate.weight.numpy()
    expected = np.zeros((10, 16), np.float32)
    for n, tok in enumerate(x.reshape(10, 16)):
        p = _softmax(tok @ gate)
        chosen = np.argsort(-(p + bias[0]))[:2]
        w = p[chosen] / max(p[chosen].sum(), 1e-12)
        for e, we in zip(chosen, w, strict=True):
            expected[n] += we * _mlp_numpy(layer.experts[int(e)], tok)
        expected[n] += _mlp_numpy(layer.shared_experts, tok)
    np.testing.assert_allclose(got.numpy().reshape(10, 16), expected, rtol=1e-4, atol=1e-5)
    assert sum(c.sum() for c in stats.expert_counts()) == 10 * 2


def test_moe_layer_rule() -> None:
    cfg = _moe_config(
        num_hidden_layers=8, moe_layer_start_index=1, moe_layer_end_index=6, moe_layer_interval=2
    )
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [1, 3, 5]
    assert [i for i in range(28) if preset_config("ernie-4.5-21b-a3b").is_moe_layer(i)] == list(range(1, 28))
    assert not preset_config("ernie-4.5-300b-a47b").is_moe_layer(2)
    assert preset_config("ernie-4.5-300b-a47b").is_moe_layer(3)
    assert not preset_config("ernie-4.5-0.3b").is_moe_layer(5)


def test_aux_loss_by_hand() -> None:
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]], np.float32)
    selected = np.array([[0, 1], [1, 2], [0, 1], [2, 0]])
    me = probs.mean(0)  # [0.375, 0.3125, 0.3125]
    ce = np.array([3, 3, 2]) / 8  # assignments per expert / all assignments
    expected = 3 * (me * ce).sum()
    got = aux_loss(_t(probs), _t(selected))
    assert float(got) == pytest.approx(expected, rel=1e-6)
    # Perfect balance gives exactly 1.
    uniform = np.full((6, 3), 1 / 3, np.float32)
    assert float(aux_loss(_t(uniform), _t(np.array([[0], [1], [2], [0], [1], [2]])))) == pytest.approx(1.0)


def test_aux_loss_gradient_reaches_probs_only_through_me() -> None:
    probs = _t(np.array([[0.7, 0.3], [0.4, 0.6]], np.float32))
    probs.stop_gradient = False
    aux_loss(probs, _t(np.array([[0], [0]]))).backward()
    # d/dp[n, e] of E * sum_e mean_n(p) * ce_e = E * ce_e / N with ce = [1, 0]
    np.testing.assert_allclose(probs.grad.numpy(), [[1.0, 0.0], [1.0, 0.0]], rtol=1e-6)


def test_z_loss_by_hand() -> None:
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(z_loss(_t(logits))) == pytest.approx(float((lse**2).mean()), rel=1e-6)


def test_orthogonal_loss_by_hand() -> None:
    gate = np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]], np.float32)  # [H=2, E=3]
    rows = gate.T / np.linalg.norm(gate.T, axis=1, keepdims=True)
    expected = ((rows @ rows.T - np.eye(3)) ** 2).sum() / 9
    assert float(orthogonal_loss(_t(gate))) == pytest.approx(expected, rel=1e-6)
    assert float(orthogonal_loss(_t(np.eye(3, dtype=np.float32)))) == pytest.approx(0.0, abs=1e-7)


def test_aux_free_bias_update_by_hand() -> None:
    bias = np.array([0.0, 0.1, -0.1, 0.0], np.float32)
    counts = np.array([10, 2, 6, 6])  # mean 6: expert 0 over-loaded, 1 under-loaded, 2 and 3 balanced
    got = update_correction_bias(bias, counts, rate=0.01)
    np.testing.assert_allclose(got, [-0.01, 0.11, -0.1, 0.0], rtol=1e-6)
    assert got.dtype == np.float32


def test_aux_free_update_balances_routing() -> None:
    """Repeated updates from the layer's own expert counts make a skewed router's load more even."""
    paddle.seed(0)
    rng = np.random.default_rng(11)  # its own draws: the module's RNG state depends on which tests ran first
    layer = MoELayer(_moe_config(moe_num_experts=4, moe_k=1))
    gate = rng.normal(scale=0.1, size=(16, 4)).astype(np.float32)
    gate[:, 0] += 0.6  # expert 0 favoured
    layer.gate.weight.set_value(_t(gate))
    x = _t(rng.normal(size=(1, 256, 16)).astype(np.float32))
    with paddle.no_grad():
        before = layer(x)[1].expert_counts()[0]
        for _ in range(60):
            counts = layer(x)[1].expert_counts()[0]
            b = layer.moe_statics.e_score_correction_bias
            b.set_value(_t(update_correction_bias(b.numpy()[0], counts, rate=0.01)[None]))
        after = layer(x)[1].expert_counts()[0]
    assert before.max() - before.min() > 80, before
    assert after.max() - after.min() < (before.max() - before.min()) / 3, (before, after)


def test_token_balanced_loss_by_hand() -> None:
    logits = RNG.normal(size=(2, 4, 5)).astype(np.float32)
    labels = np.array([[1, 2, -100, -100], [0, 4, 3, 1]])
    logits[0, 0, 1] += 4.0  # sample 0 predicts its labels well: its tokens' loss is far below sample 1's,
    logits[0, 1, 2] += 4.0  # so weighting by token and by sample differ by about (ce1 - ce0) / 6
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = [-logp[b, t, labels[b, t]] for b in range(2) for t in range(4) if labels[b, t] != -100]
    expected = sum(ce) / 6  # every labelled token counts once: sample 1 weighs twice sample 0
    per_sample_mean = (np.mean(ce[:2]) + np.mean(ce[2:])) / 2
    got = float(token_loss(_t(logits), _t(labels)))
    assert got == pytest.approx(expected, rel=1e-5)
    assert abs(expected - per_sample_mean) > 0.1


def test_router_losses_enter_the_loss_with_their_lambdas() -> None:
    paddle.seed(0)
    cfg = _moe_config(moe_aux_loss_lambda=0.1, moe_z_loss_lambda=0.01, moe_orthogonal_loss_lambda=0.5)
    model = ErnieForCausalLM(cfg)
    init_weights(model, seed=2, std=0.2)
    ids = _t(RNG.integers(3, 64, size=(2, 6)))
    out = model(ids, labels=ids)
    r = {k: float(v) for k, v in out.router_losses.items()}
    assert float(out.loss) == pytest.approx(
        float(out.lm_loss) + 0.1 * r["aux_loss"] + 0.01 * r["z_loss"] + 0.5 * r["orthogonal_loss"], rel=1e-5
    )
    out.loss.backward()
    assert np.abs(model.ernie.layers[1].mlp.gate.weight.grad.numpy()).sum() > 0


def _image(grid: tuple[int, int, int]) -> paddle.Tensor:
    """Random patches for a (t, h, w) grid of the tiny VL model (3 x 14 x 14 values per patch)."""
    return paddle.rand([grid[0] * grid[1] * grid[2], 3 * 14 * 14])


def test_vl_mixed_tokens_forward_backward_with_modality_isolation(tiny_vl_model_dir) -> None:
    import engine

    model = engine.load_model(str(tiny_vl_model_dir))
    model.train()
    cfg = model.config
    grid = (1, 4, 6)  # 4 x 6 patches = 2 x 3 merged tokens
    n_img = vision_token_count(grid, cfg.vision_config)
    text = RNG.integers(cfg.video_end_token_id + 1, 200, size=20)  # past the image and video tokens (13-18)
    image = [cfg.image_start_token_id, *([cfg.im_patch_id] * n_img), cfg.image_end_token_id]
    ids = np.concatenate([text[:5], image, text[5:]])[None]
    labels = np.where(np.isin(ids, image), -100, ids)
    out = model(_t(ids), pixel_values=_image(grid), grid_thw=[grid], labels=_t(labels))
    out.loss.backward()
    vision_pos = np.flatnonzero(np.isin(ids[0], image))  # start / end tokens route with the image
    text_pos = np.flatnonzero(~np.isin(ids[0], image))
    n_text_experts, n_vision_experts = cfg.expert_counts
    for stats in out.router_stats:
        text_idx, image_idx = (i.numpy() for i in stats.token_index)
        np.testing.assert_array_equal(text_idx, text_pos)  # only text tokens were routed by the text gate
        np.testing.assert_array_equal(image_idx, vision_pos)
        text_counts, vision_counts = stats.expert_counts()
        assert len(text_counts) == n_text_experts and len(vision_counts) == n_vision_experts
        assert text_counts.sum() == len(text_pos) * cfg.moe_k
        assert vision_counts.sum() == len(vision_pos) * cfg.moe_k
    mlp = model.ernie.layers[1].mlp
    # Each group has its own gate, both trained; the vision encoder gets a gradient through the image tokens.
    assert mlp.gate.weight.grad is not None and mlp.gate.weight_1.grad is not None
    assert list(mlp.gate.weight_1.shape) == [cfg.hidden_size, n_vision_experts]
    assert np.abs(model.vision_model.patch_embed.proj.weight.grad.numpy()).sum() > 0
    assert np.abs(model.ernie.resampler_model.mlp.weight.grad.numpy()).sum() > 0
    assert mlp.shared_experts.down_proj.weight.grad is not None
    assert np.isfinite(float(out.loss))


def test_text_only_batch_never_uses_vision_experts(tiny_vl_model_dir) -> None:
    import engine

    model = engine.load_model(str(tiny_vl_model_dir))
    model.train()
    # above the image and video tokens (13-18: patch, image start/end, video placeholder, video start/end);
    # its own generator, so the draw does not depend on which tests ran before (seed 825234 drew a 16)
    low = 1 + max(
        getattr(model.config, k) for k in ("im_patch_id", "image_end_token_id", "video_end_token_id")
    )
    ids = _t(np.random.default_rng(0).integers(low, 200, size=(2, 12)))
    out = model(ids, labels=ids)
    out.loss.backward()
    n_text = model.config.expert_counts[0]
    for layer in model.ernie.layers:
        if not layer.is_moe:
            continue
        for e, expert in enumerate(layer.mlp.experts):
            g = expert.down_proj.weight.grad
            used = g is not None and float(paddle.abs(g).sum()) > 0
            if e >= n_text:
                assert not used, f"vision expert {e} got a gradient from text tokens"


def test_vl_inputs_that_do_not_fit_are_clear_errors(tiny_vl_model_dir) -> None:
    import engine

    model = engine.load_model(str(tiny_vl_model_dir))
    cfg = model.config
    ids = np.array([[20, cfg.image_start_token_id, *([cfg.im_patch_id] * 6), cfg.image_end_token_id, 22]])
    with paddle.no_grad():
        out = model(_t(ids), pixel_values=_image((1, 4, 6)), grid_thw=[(1, 4, 6)])
    assert np.isfinite(out.logits.numpy()).all()
    with pytest.raises(
        ValueError, match="an image of grid \\(1, 4, 4\\) gives 4 tokens but the prompt has 6"
    ):
        model(_t(ids), pixel_values=_image((1, 4, 4)), grid_thw=[(1, 4, 4)])
    with pytest.raises(ValueError, match="does not divide into 2x2 merge windows"):
        model(_t(ids), pixel_values=_image((1, 3, 8)), grid_thw=[(1, 3, 8)])
    with pytest.raises(ValueError, match="the grids hold 24 patches but pixel_values has 20"):
        model(_t(ids), pixel_values=paddle.rand([20, 588]), grid_thw=[(1, 4, 6)])
    with pytest.raises(ValueError, match="pixel_values must be \\[patches, 588\\]"):
        model(_t(ids), pixel_values=paddle.rand([24, 3, 14, 14]), grid_thw=[(1, 4, 6)])


# ---- the grouped expert path against the per-expert loop ------------------------------------------------


def _layer_outputs_and_grads(layer: MoELayer, x: paddle.Tensor, types, grouped: bool):
    from engine.models import kernels

    layer.clear_gradients(set_to_zero=False)
    x.clear_gradient(set_to_zero=False)
    with kernels.forced(grouped_moe=grouped):
        y, stats = layer(x, types)
        (y * y).mean().backward()
    grads = {n: p.grad.numpy() for n, p in layer.named_parameters() if p.grad is not None}
    return y.numpy(), grads, x.grad.numpy(), [c.copy() for c in stats.expert_counts()]


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-vl"])
def test_grouped_experts_equal_the_loop_forward_and_gradients(preset: str) -> None:
    """Output, input gradient, gate gradients and every expert's gradient agree within 1e-5, and experts
    that get no tokens get no gradient (None) in both paths, so an optimizer skips them alike."""
    from engine.models.moe import can_group

    cfg = preset_config(preset, vocab_size=64)
    paddle.seed(0)
    layer = MoELayer(cfg)
    n_group0 = cfg.expert_counts[0]
    assert can_group(layer.experts[:n_group0]) and can_group(layer.experts[n_group0:] or layer.experts)
    bias = np.zeros(layer.moe_statics.e_score_correction_bias.shape, np.float32)
    bias[:, [0, 5]] = -10.0  # experts 0 and 5 of every group are never chosen
    layer.moe_statics.e_score_correction_bias.set_value(_t(bias))
    x = _t(RNG.normal(size=(2, 48, cfg.hidden_size)).astype(np.float32))
    x.stop_gradient = False
    types = None
    if len(cfg.expert_counts) > 1:  # two modality groups with different expert widths (96 and 48)
        types = _t((RNG.random((2, 48)) < 0.3).astype(np.int64))
    y_loop, g_loop, gx_loop, counts = _layer_outputs_and_grads(layer, x, types, grouped=False)
    y_grp, g_grp, gx_grp, counts_grp = _layer_outputs_and_grads(layer, x, types, grouped=True)
    assert all(c[[0, 5]].sum() == 0 for c in counts)  # zero-token experts are part of the check
    np.testing.assert_array_equal(np.concatenate(counts), np.concatenate(counts_grp))
    np.testing.assert_allclose(y_grp, y_loop, atol=1e-5)
    np.testing.assert_allclose(gx_grp, gx_loop, atol=1e-5)
    assert g_grp.keys() == g_loop.keys()
    assert any(k.startswith("gate.") for k in g_loop)
    for e in (0, 5, n_group0, n_group0 + 5)[: 2 * len(cfg.expert_counts)]:
        assert f"experts.{e}.up_gate_proj.weight" not in g_grp
    for name in g_loop:
        np.testing.assert_allclose(g_grp[name], g_loop[name], atol=1e-5, err_msg=name)


def test_wrapped_or_large_experts_take_the_loop() -> None:
    """LoRA, weight-only and QAT wrappers change what an expert's linear computes: the loop runs them as
    layers. Experts too large for one stacked copy (``kernels.GROUPED_MOE_MAX_BYTES``) take it too."""
    from engine.models.lora import apply_lora
    from engine.models.moe import can_group
    from engine.models.quantized import apply_weight_only

    cfg = preset_config("tiny-moe", vocab_size=64)
    paddle.seed(0)
    for wrap in (lambda m: apply_lora(m, rank=2, alpha=4), lambda m: apply_weight_only(m, "wint8")):
        model = ErnieForCausalLM(cfg)
        assert can_group(model.ernie.layers[1].mlp.experts)
        wrap(model)
        assert not can_group(model.ernie.layers[1].mlp.experts)
    big = MoELayer(preset_config("bench-moe"))  # 16 experts of 512 at hidden 512: 48 MB of fp32 weights
    assert not can_group(big.experts)


def test_lora_on_experts_gives_the_same_result_whatever_the_switch() -> None:
    from engine.models import kernels
    from engine.models.lora import apply_lora

    cfg = preset_config("tiny-moe", vocab_size=64)
    paddle.seed(0)
    model = ErnieForCausalLM(cfg)
    init_weights(model, seed=1, std=0.05)
    apply_lora(model, rank=2, alpha=4)
    for _, m in model.named_sublayers():
        if hasattr(m, "lora_B"):
            m.lora_B.set_value(_t(RNG.normal(scale=0.1, size=m.lora_B.shape).astype(np.float32)))
    ids = _t(RNG.integers(3, 64, size=(2, 16)))
    outs = []
    for grouped in (False, True):
        with kernels.forced(grouped_moe=grouped), paddle.no_grad():
            outs.append(model(ids).logits.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
