"""Forward + backward throughput of our ERNIE 4.5 model against PaddleFormers, and MoE routing overhead.

Run with ``make bench`` or ``.venv-bench/bin/python bench/bench_model.py`` (PaddleFormers lives in
.venv-bench because its pins clash with the studio's). Both models get the same config and the same
weights, and the script checks their logits agree before timing. Steps of the compared models are
interleaved so that load from other processes on the machine hits both alike; the median is reported.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import paddle

from engine.models import ErnieConfig, ErnieForCausalLM
from engine.models.initialize import init_weights
from engine.models.presets import preset_fields

log = logging.getLogger("bench_model")

# Shapes from engine/models/presets.py; the same dicts configure PaddleFormers for the comparison.
DENSE = preset_fields("bench-dense")
MOE = preset_fields("bench-moe")


def our_model(cfg: dict, seed: int = 0) -> ErnieForCausalLM:
    model = ErnieForCausalLM(ErnieConfig(**cfg))
    init_weights(model, seed=seed, std=0.02)
    return model


def paddleformers_model(cfg: dict, ours: ErnieForCausalLM):
    """PaddleFormers' dense ERNIE 4.5 with our weights copied in (its fused qkv is grouped by KV head)."""
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    pf_cfg = Ernie4_5Config(
        **{k: v for k, v in cfg.items() if k != "dtype"},
        fuse_rms_norm=False,  # the fused kernel is GPU-only
        apply_rope_fusion=False,  # fused_rotary_position_embedding has no CPU kernel
        use_flash_attention=False,
        dtype="float32",
    )
    model = Ernie4_5ForCausalLM(pf_cfg)
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    group = nq // nkv
    state = {}
    for name, value in ours.state_dict().items():
        arr = value.numpy()
        if name.endswith("qkv_proj.weight"):
            h = arr.shape[0]
            q = arr[:, : nq * hd].reshape(h, nkv, group * hd)
            k = arr[:, nq * hd : (nq + nkv) * hd].reshape(h, nkv, hd)
            v = arr[:, (nq + nkv) * hd :].reshape(h, nkv, hd)
            arr = np.concatenate([q, k, v], axis=-1).reshape(h, -1)
        state[name.replace("ernie.", "model.", 1)] = paddle.to_tensor(arr)
    if cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.set_state_dict(state)
    if missing or unexpected:
        raise RuntimeError(f"weight copy to PaddleFormers failed: missing {missing}, unexpected {unexpected}")
    return model


def train_step(model, ids: paddle.Tensor) -> Callable[[], float]:
    def step() -> float:
        out = model(ids, labels=ids)
        loss = out.loss if hasattr(out, "loss") else out[0]
        loss.backward()
        model.clear_gradients()
        return float(loss)

    return step


def time_interleaved(steps: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """One warm-up call each, then ``repeats`` rounds calling every step once per round."""
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def component_choices(batch: int, seq: int, repeats: int) -> list[tuple[str, str, float]]:
    """Forward + backward time of the alternatives we chose between, at the benchmark's shapes."""
    import paddle.nn.functional as F

    from engine.models import layers, plain_ops

    h, vocab = DENSE["hidden_size"], DENSE["vocab_size"]
    nq, nkv, hd = DENSE["num_attention_heads"], DENSE["num_key_value_heads"], DENSE["head_dim"]

    def leaf(*shape):
        t = paddle.randn(list(shape))
        t.stop_gradient = False
        return t

    q, k, v = leaf(batch, seq, nq, hd), leaf(batch, seq, nkv, hd), leaf(batch, seq, nkv, hd)
    x, emb = leaf(batch, seq, h), leaf(vocab, h)

    def square(q, k, v):
        block, plain_ops.ATTENTION_BLOCK = plain_ops.ATTENTION_BLOCK, 1 << 30
        try:
            return layers.attention(q, k, v, None)
        finally:
            plain_ops.ATTENTION_BLOCK = block

    def sdpa(q, k, v):
        g = nq // nkv
        kk, vv = paddle.repeat_interleave(k, g, axis=2), paddle.repeat_interleave(v, g, axis=2)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    from engine.models.ernie import packed_causal_mask, packed_key_starts

    # Packed rows: 2 rows of 1024 tokens, each 8 samples of 128 (block-diagonal causal mask).
    pq, pk, pv = leaf(2, 1024, nq, hd), leaf(2, 1024, nkv, hd), leaf(2, 1024, nkv, hd)
    seg = paddle.to_tensor(np.repeat(np.arange(8), 128)[None].repeat(2, 0))
    pmask, starts = packed_causal_mask(seg), packed_key_starts(seg)

    norm_weight = paddle.ones([h])

    def norm_with_casts(x):
        hh = x.astype("float32")
        return norm_weight * (hh * paddle.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-5)).astype(x.dtype)

    groups = {
        "attention": {
            "matmuls, full masked square": (square, (q, k, v)),
            "matmuls, causal 128-row blocks (ours)": (
                lambda q, k, v: layers.attention(q, k, v, None),
                (q, k, v),
            ),
            "F.scaled_dot_product_attention": (sdpa, (q, k, v)),
        },
        "packed attention, 2 x 1024 (8 samples of 128)": {
            "full masked square": (lambda q, k, v: layers.attention(q, k, v, pmask, False), (pq, pk, pv)),
            "causal 128-row blocks": (lambda q, k, v: layers.attention(q, k, v, pmask, True), (pq, pk, pv)),
            "blocks from the earliest sample's start (ours)": (
                lambda q, k, v: layers.attention(q, k, v, pmask, starts),
                (pq, pk, pv),
            ),
        },
        "tied LM head": {
            "3-D matmul(x, E, transpose_y)": (lambda x, e: paddle.matmul(x, e, transpose_y=True), (x, emb)),
            "2-D linear(x, E.T)": (
                lambda x, e: F.linear(x.reshape([-1, h]), e.T).reshape([batch, seq, vocab]),
                (x, emb),
            ),
            "2-D matmul(x, E, transpose_y) (ours)": (
                lambda x, e: paddle.matmul(x.reshape([-1, h]), e, transpose_y=True).reshape(
                    [batch, seq, vocab]
                ),
                (x, emb),
            ),
        },
        "RMSNorm": {
            "with fp32 casts": (norm_with_casts, (x,)),
            "no casts in fp32 (ours)": (layers.RMSNorm(h), (x,)),
        },
    }
    rows = []
    for group, variants in groups.items():
        steps = {}
        for name, (fn, inputs) in variants.items():

            def step(fn=fn, inputs=inputs) -> float:
                out = fn(*inputs)
                (out * out).mean().backward()
                for t in inputs:
                    t.clear_gradient()
                return 0.0

            steps[name] = step
        times = time_interleaved(steps, repeats)
        rows += [(group, name, statistics.median(ts)) for name, ts in times.items()]
    return rows


def logits_gap(a, b, ids: paddle.Tensor) -> float:
    a.eval()
    b.eval()
    with paddle.no_grad():
        la = a(ids).logits.numpy()
        lb = b(ids).logits.numpy()
    a.train()
    b.train()
    return float(np.abs(la - lb).max())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--skip-paddleformers", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paddle.seed(0)
    tokens = args.batch * args.seq
    ids = paddle.randint(3, DENSE["vocab_size"], [args.batch, args.seq])
    rows = []

    ours = our_model(DENSE)
    ours.train()
    steps = {"ours dense": train_step(ours, ids)}
    gap = None
    if not args.skip_paddleformers:
        pf = paddleformers_model(DENSE, ours)
        pf.train()
        gap = logits_gap(ours, pf, ids[:1, :64])
        if gap > 1e-3:
            raise RuntimeError(f"PaddleFormers and our logits differ by {gap:.2e}: not the same computation")
        steps["PaddleFormers dense"] = train_step(pf, ids)
    times = time_interleaved(steps, args.repeats)
    base = statistics.median(times.get("PaddleFormers dense", times["ours dense"]))
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append((name, med, tokens / med, base / med))

    choices = component_choices(args.batch, args.seq, max(args.repeats, 3))

    moe = our_model(MOE)
    moe.train()
    dense = our_model(DENSE)
    dense.train()
    times = time_interleaved(
        {
            "ours MoE 16x512 top-2 + shared": train_step(moe, ids),
            "ours dense (equal active)": train_step(dense, ids),
        },
        args.repeats,
    )
    moe_t = statistics.median(times["ours MoE 16x512 top-2 + shared"])
    dense_t = statistics.median(times["ours dense (equal active)"])

    print()
    print(
        f"## forward + backward, hidden 512, 8 layers, batch {args.batch} x seq {args.seq}, fp32, "
        f"{paddle.get_device()}, {os.cpu_count()} cores, paddle {paddle.__version__}"
    )
    if gap is not None:
        print(f"logits max |ours - PaddleFormers| on the same weights: {gap:.2e}")
    print()
    print("| model | step s (median) | tokens/s | speed vs PaddleFormers |")
    print("|---|---|---|---|")
    for name, med, tps, rel in rows:
        print(f"| {name} | {med:.2f} | {tps:.0f} | {rel:.2f}x |")
    print()
    print("| model | step s (median) | tokens/s | routing overhead |")
    print("|---|---|---|---|")
    print(f"| ours dense (FFN 1536) | {dense_t:.2f} | {tokens / dense_t:.0f} | - |")
    print(
        f"| ours MoE (16 experts x 512, top-2, 1 shared) | {moe_t:.2f} | {tokens / moe_t:.0f} | "
        f"{(moe_t / dense_t - 1) * 100:+.0f}% |"
    )
    print()
    print("| component (fwd + bwd, same shapes) | variant | ms (median) |")
    print("|---|---|---|")
    for group, name, t in choices:
        print(f"| {group} | {name} | {t * 1000:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
