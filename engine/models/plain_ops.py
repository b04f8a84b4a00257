"""The plain (unfused) forms of the ops that have fast paths: RMSNorm, the rotary rotation, softmax attention
and the packed-sample mask.

They are the reference: the layers run them whenever a fast path is off, ``kernels`` probes each kernel
against them, and the self-tests compare whole models with the paths off and on. They import nothing of the
model, so ``kernels`` can use them while the layers import ``kernels``.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F


def rms_norm_plain(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    # Normalise in fp32 as the reference implementations do, whatever the activation dtype. In fp32
    # the casts are skipped: each is a copy plus a backward node, and this runs 2 x layers times.
    if x.dtype == paddle.float32:
        return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight
    h = x.astype("float32")
    h = h * paddle.rsqrt((h * h).mean(-1, keepdim=True) + eps)
    return weight * h.astype(x.dtype)


def apply_rotary_plain(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    b, t, h, d = x.shape
    pairs = x.astype("float32").reshape([b, t, h, d // 2, 2])
    # unbind, not two slices: a slice's gradient is a zero-filled tensor of the whole input (profiled on
    # the CPU step), unbind's is one stack
    even, odd = paddle.unbind(pairs, axis=-1)
    out = paddle.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return out.reshape([b, t, h, d]).astype(x.dtype)


# Causal attention over long sequences runs in query blocks of this many rows, each against only the keys
# it can see: about 40% less score / softmax work at 512 tokens than masking a full T x S square.
ATTENTION_BLOCK = 128


def attention_plain(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    mask: paddle.Tensor | None,
    causal: bool | tuple[int, ...] = False,
) -> paddle.Tensor:
    """Softmax attention. q [B, T, H, D], k/v [B, S, Hkv, D]; mask additive fp32 [B|1, 1, T, S] or None.

    With mask None the attention is causal with the query block aligned to the end of the keys.
    ``causal=True`` promises that ``mask`` hides every key after the query (our padding and packing masks
    do), so key blocks after a query block are skipped instead of masked. A tuple also promises, per
    query block of ``ATTENTION_BLOCK`` rows, the first key any of its queries can see (packed samples):
    keys before it are skipped too.
    """
    b, t, nq, hd = q.shape
    s, nkv = k.shape[1], k.shape[2]
    group = nq // nkv
    # [B, Hkv, group, T, D] so that each KV head serves its group of query heads without copying K/V;
    # the 1/sqrt(D) scale goes on q, which is group*T*D elements instead of group*T*S scores.
    qh = (q * (1.0 / math.sqrt(hd))).reshape([b, t, nkv, group, hd]).transpose([0, 2, 3, 1, 4])
    kh = k.transpose([0, 2, 1, 3])  # [B, Hkv, S, D]
    vh = v.transpose([0, 2, 1, 3])
    if mask is not None:
        mask = mask.astype("float32").unsqueeze(2)  # [B|1, 1, 1, T, S]
    # Two blocks at least: below that the extra kernels cost more than the skipped keys save.
    if (mask is None or causal) and t == s and t >= 2 * ATTENTION_BLOCK:
        key_starts = causal if isinstance(causal, tuple) else None
        # Blocks by split and concat, not by slicing: each slice's gradient is a zero-filled tensor of the
        # whole q / k / v (profiled on the CPU step), split's is one concat.
        starts = list(range(0, t, ATTENTION_BLOCK))
        sizes = [min(ATTENTION_BLOCK, t - start) for start in starts]
        q_blocks = paddle.split(qh, sizes, axis=3)
        k_blocks = paddle.split(kh, sizes, axis=2)
        v_blocks = paddle.split(vh, sizes, axis=2)
        outs = []
        for i, start in enumerate(starts):
            end = start + sizes[i]
            k0 = key_starts[i] if key_starts else 0
            if mask is None:
                m = paddle.triu(
                    paddle.full([end - start, end], float("-inf"), dtype="float32"), diagonal=start + 1
                )
            else:
                m = mask[..., start:end, k0:end]
            keys, values = _key_span(k_blocks, k0, i), _key_span(v_blocks, k0, i)
            outs.append(_attend(q_blocks[i], keys, values, m))
        out = paddle.concat(outs, axis=3)
    else:
        if mask is None and t > 1:
            mask = paddle.triu(paddle.full([t, s], float("-inf"), dtype="float32"), diagonal=s - t + 1)
        out = _attend(qh, kh, vh, mask)
    return out.transpose([0, 3, 1, 2, 4]).reshape([b, t, nq, hd])


def _key_span(blocks: list[paddle.Tensor], k0: int, last: int) -> paddle.Tensor:
    """Keys k0 .. the end of block `last` from the [B, Hkv, block, D] blocks (only the first is sliced)."""
    first = k0 // ATTENTION_BLOCK
    head = blocks[first]
    if k0 > first * ATTENTION_BLOCK:
        head = head[:, :, k0 - first * ATTENTION_BLOCK :]
    parts = [head, *blocks[first + 1 : last + 1]]
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=2)


def _attend(
    qh: paddle.Tensor, kh: paddle.Tensor, vh: paddle.Tensor, mask: paddle.Tensor | None
) -> paddle.Tensor:
    """qh [B, Hkv, g, T, D] (already scaled), kh / vh [B, Hkv, S, D], additive mask -> [B, Hkv, g, T, D]."""
    b, nkv, g, t, hd = qh.shape
    s = kh.shape[2]
    scores = paddle.matmul(qh.reshape([b, nkv, g * t, hd]), kh, transpose_y=True).reshape([b, nkv, g, t, s])
    if scores.dtype != paddle.float32:
        scores = scores.astype("float32")
    if mask is not None:
        scores = scores + mask
    probs = F.softmax(scores, axis=-1).astype(qh.dtype).reshape([b, nkv, g * t, s])
    return paddle.matmul(probs, vh).reshape([b, nkv, g, t, hd])


def packed_causal_mask(segment_ids: paddle.Tensor) -> paddle.Tensor:
    """[B, T] sample index per position (-1 for padding) -> additive fp32 [B, 1, T, T].

    Tokens attend causally only inside their own packed sample; padding rows attend to themselves so the
    softmax never sees an all -inf row.
    """
    t = segment_ids.shape[1]
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    causal = paddle.tril(paddle.ones([t, t], dtype="bool")).unsqueeze(0)
    keep = (same & causal) | paddle.eye(t).astype("bool").unsqueeze(0)
    return paddle.where(keep, 0.0, float("-inf")).astype("float32").unsqueeze(1)
