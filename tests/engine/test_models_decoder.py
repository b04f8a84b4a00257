"""The decoder's parts against numpy written out by hand: RMSNorm, interleaved RoPE, GQA, SwiGLU, masks, cache."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from engine.models import DynamicCache, ErnieConfig, ErnieForCausalLM
from engine.models.initialize import init_weights
from engine.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding, apply_rotary

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _own_draws():
    """Every test draws the same numbers whatever ran before it (as in test_moe.py)."""
    global RNG
    RNG = np.random.default_rng(0)


def _t(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(a)


def _small_config(**kw) -> ErnieConfig:
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        dtype="float32",
    )
    base.update(kw)
    return ErnieConfig(**base)


def _model(**kw) -> ErnieForCausalLM:
    paddle.seed(0)
    model = ErnieForCausalLM(_small_config(**kw))
    init_weights(model, seed=1, std=0.1)
    model.eval()
    return model


def test_rmsnorm_matches_formula() -> None:
    x = RNG.normal(size=(2, 3, 8)).astype(np.float32)
    w = RNG.normal(size=8).astype(np.float32)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.set_value(_t(w))
    expected = w * x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(norm(_t(x)).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_rope_rotates_even_odd_pairs() -> None:
    d, theta = 8, 10000.0
    x = RNG.normal(size=(1, 3, 2, d)).astype(np.float32)
    pos = np.array([[0, 1, 5]])
    cos, sin = RotaryEmbedding(d, theta)(_t(pos))
    got = apply_rotary(_t(x), cos, sin).numpy()
    expected = np.empty_like(x)
    for t in range(3):
        for i in range(d // 2):
            angle = pos[0, t] / theta ** (2 * i / d)
            a, b = x[0, t, :, 2 * i], x[0, t, :, 2 * i + 1]
            expected[0, t, :, 2 * i] = a * np.cos(angle) - b * np.sin(angle)
            expected[0, t, :, 2 * i + 1] = b * np.cos(angle) + a * np.sin(angle)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[0, 0], x[0, 0])  # position 0 is the identity


def test_gqa_attention_matches_numpy() -> None:
    cfg = _small_config()
    attn = Attention(cfg)
    h, nq, nkv, hd, t = 32, 4, 2, 8, 5
    wqkv = RNG.normal(scale=0.2, size=(h, (nq + 2 * nkv) * hd)).astype(np.float32)
    wo = RNG.normal(scale=0.2, size=(nq * hd, h)).astype(np.float32)
    attn.qkv_proj.weight.set_value(_t(wqkv))
    attn.o_proj.weight.set_value(_t(wo))
    x = RNG.normal(size=(1, t, h)).astype(np.float32)
    pos = np.arange(t)[None]
    cos, sin = RotaryEmbedding(hd, 10000.0)(_t(pos))
    got = attn(_t(x), cos, sin, None).numpy()

    qkv = x[0] @ wqkv
    q = qkv[:, : nq * hd].reshape(t, nq, hd)
    k = qkv[:, nq * hd : (nq + nkv) * hd].reshape(t, nkv, hd)
    v = qkv[:, (nq + nkv) * hd :].reshape(t, nkv, hd)

    def rope(z):
        out = z.copy()
        for p in range(t):
            for i in range(hd // 2):
                ang = p / 10000.0 ** (2 * i / hd)
                a, b = z[p, :, 2 * i], z[p, :, 2 * i + 1]
                out[p, :, 2 * i], out[p, :, 2 * i + 1] = (
                    a * np.cos(ang) - b * np.sin(ang),
                    b * np.cos(ang) + a * np.sin(ang),
                )
        return out

    q, k = rope(q), rope(k)
    heads = []
    for head in range(nq):
        kv = head // (nq // nkv)  # query heads 0,1 share KV head 0; 2,3 share KV head 1
        s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
        s = s + np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        heads.append(p @ v[:, kv])
    expected = np.concatenate(heads, axis=-1) @ wo
    np.testing.assert_allclose(got[0], expected, rtol=1e-4, atol=1e-5)


def test_swiglu_mlp_gate_half_first() -> None:
    mlp = MLP(6, 4)
    w = RNG.normal(size=(6, 8)).astype(np.float32)
    wd = RNG.normal(size=(4, 6)).astype(np.float32)
    mlp.up_gate_proj.weight.set_value(_t(w))
    mlp.down_proj.weight.set_value(_t(wd))
    x = RNG.normal(size=(3, 6)).astype(np.float32)
    gate, up = x @ w[:, :4], x @ w[:, 4:]
    expected = (gate / (1 + np.exp(-gate)) * up) @ wd
    np.testing.assert_allclose(mlp(_t(x)).numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_output_head_tied_or_untied(tied: bool) -> None:
    model = _model(tie_word_embeddings=tied)
    ids = _t(RNG.integers(0, 96, size=(2, 7)))
    out = model(ids)
    w = model.ernie.embed_tokens.weight.numpy().T if tied else model.lm_head.weight.numpy()
    np.testing.assert_allclose(out.logits.numpy(), out.hidden_states.numpy() @ w, rtol=1e-4, atol=1e-5)
    assert hasattr(model, "lm_head") is (not tied)


def test_left_padding_equals_unpadded_run() -> None:
    model = _model()
    ids = RNG.integers(3, 96, size=(1, 6))
    padded = np.concatenate([np.zeros((1, 3), np.int64), ids], axis=1)
    mask = np.concatenate([np.zeros((1, 3)), np.ones((1, 6))], axis=1).astype(np.int64)
    pos = np.concatenate([np.zeros((1, 3)), np.arange(6)[None]], axis=1).astype(np.int64)
    ref = model(_t(ids)).logits.numpy()
    got = model(_t(padded), attention_mask=_t(mask), position_ids=_t(pos)).logits.numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:, 3:], ref, rtol=1e-4, atol=1e-5)


def test_packed_segments_equal_separate_runs() -> None:
    model = _model()
    a, b = RNG.integers(3, 96, size=(1, 5)), RNG.integers(3, 96, size=(1, 4))
    packed = np.concatenate([a, b, [[0]]], axis=1)
    seg = np.array([[0] * 5 + [1] * 4 + [-1]])
    pos = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    got = model(_t(packed), segment_ids=_t(seg), position_ids=_t(pos)).logits.numpy()
    np.testing.assert_allclose(got[:, :5], model(_t(a)).logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[:, 5:9], model(_t(b)).logits.numpy(), rtol=1e-4, atol=1e-5)


def test_kv_cache_decoding_equals_full_forward() -> None:
    model = _model()
    ids = RNG.integers(3, 96, size=(2, 8))
    full = model(_t(ids)).logits.numpy()
    cache = DynamicCache(model.config.num_hidden_layers)
    out = model(_t(ids[:, :5]), past_key_values=cache, use_cache=True)
    steps = [out.logits.numpy()]
    for i in range(5, 8):
        out = model(_t(ids[:, i : i + 1]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        steps.append(out.logits.numpy())
    assert cache.get_seq_length() == 8
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-5)


def test_recompute_gives_the_same_loss_and_gradients() -> None:
    model = _model()
    model.train()
    ids = _t(RNG.integers(3, 96, size=(2, 300)))  # long enough for block attention, 3 packed samples
    seg = _t(np.repeat([0, 1, 2], 100)[None].repeat(2, 0))
    pos = _t(np.tile(np.arange(100), 3)[None].repeat(2, 0))
    grads = []
    for flag in (False, True):
        model.ernie.gradient_checkpointing = flag
        model.clear_gradients()
        loss = model(ids, segment_ids=seg, position_ids=pos, labels=ids).loss
        loss.backward()
        grads.append((float(loss), model.ernie.layers[0].self_attn.qkv_proj.weight.grad.numpy().copy()))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    np.testing.assert_allclose(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)


def test_blocked_causal_attention_equals_full_square() -> None:
    """Beyond ATTENTION_BLOCK tokens causal attention runs in query blocks; same values as the masked square."""
    from engine.models.layers import attention
    from engine.models.plain_ops import ATTENTION_BLOCK

    t = 2 * ATTENTION_BLOCK + 37
    q = _t(RNG.normal(size=(2, t, 4, 8)).astype(np.float32))
    k = _t(RNG.normal(size=(2, t, 2, 8)).astype(np.float32))
    v = _t(RNG.normal(size=(2, t, 2, 8)).astype(np.float32))
    square = np.triu(np.full((t, t), -np.inf, np.float32), 1)[None, None]
    full = attention(q, k, v, _t(np.broadcast_to(square, (2, 1, t, t)).copy()), causal=False).numpy()
    np.testing.assert_allclose(attention(q, k, v, None).numpy(), full, rtol=1e-5, atol=1e-6)
    # and the same gradients (the blocks are split and concatenated, keys of a block span several)
    grads = []
    for mask in (None, _t(np.broadcast_to(square, (2, 1, t, t)).copy())):
        leaves = [paddle.to_tensor(x.numpy(), stop_gradient=False) for x in (q, k, v)]
        (attention(*leaves, mask, causal=False) ** 2).sum().backward()
        grads.append([x.grad.numpy() for x in leaves])
    for blocked, square_grad in zip(*grads, strict=True):
        np.testing.assert_allclose(blocked, square_grad, rtol=1e-4, atol=1e-5)
    seg = np.array([[0] * 100 + [1] * (t - 100)] * 2)
    from engine.models.plain_ops import packed_causal_mask

    mask = packed_causal_mask(_t(seg))
    np.testing.assert_allclose(
        attention(q, k, v, mask, causal=True).numpy(),
        attention(q, k, v, mask, causal=False).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_long_packed_rows_equal_separate_runs_and_skip_earlier_samples() -> None:
    """Rows longer than one attention block: key blocks before a query block's earliest sample are skipped."""
    from engine.models.ernie import packed_key_starts

    model = _model()
    lengths = [150, 90, 200, 50]
    samples = [RNG.integers(3, 96, size=(1, n)) for n in lengths]
    packed = np.concatenate([*samples, [[0] * 10]], axis=1)
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(10, -1)])[None]
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(10, np.int64)])[None]
    assert packed_key_starts(_t(seg), block=128) == (0, 0, 240, 240)
    got = model(_t(packed), segment_ids=_t(seg), position_ids=_t(pos)).logits.numpy()
    start = 0
    for sample, n in zip(samples, lengths, strict=True):
        np.testing.assert_allclose(
            got[:, start : start + n], model(_t(sample)).logits.numpy(), rtol=1e-4, atol=1e-5
        )
        start += n
    assert np.isfinite(got).all()
