"""The native CPU ops (engine/models/cpu_ops.c): built once per source and machine, refused loudly without a
compiler, and equal to the plain ops at the model's sizes (the probes and kernel self-tests use tiny ones)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from engine.models import kernels, native, onednn
from engine.models.ernie import packed_key_starts
from engine.models.plain_ops import apply_rotary_plain, attention_plain, packed_causal_mask, rms_norm_plain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_library_is_built_once_per_source_and_a_changed_source_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv(native.HOME_ENV, str(tmp_path / "native"))
    first = native.build()
    built_at = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == built_at  # found, not compiled again
    changed = tmp_path / "cpu_ops.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* another source */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    second = native.build()
    assert second != first and second.exists()
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == sorted([first.name, second.name])


def test_without_a_working_compiler_the_paths_are_off_and_say_why(tmp_path):
    code = (
        "from engine.models import kernels\n"
        "for name in ('cpu_rms_norm', 'cpu_rope', 'cpu_attention'):\n"
        "    p = kernels.capabilities()[name]\n"
        "    print(name, p.on, p.reason)\n"
    )
    env = {**os.environ, "CC": "/bin/false", native.HOME_ENV: str(tmp_path / "empty")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("cpu_")]
    assert len(lines) == 3, out
    for line in lines:
        assert " False the native CPU ops are not available: building cpu_ops.c failed" in line, line
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").glob("*.so"))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _with_grads(fn, *inputs):
    leaves = [t.detach() for t in inputs]
    for t in leaves:
        t.stop_gradient = False
    out = fn(*leaves)
    (out * out).sum().backward()
    return [out.numpy(), *(t.grad.numpy() for t in leaves)]


def test_rms_norm_equals_the_plain_op_at_the_models_width():
    """Measured 2026-11-29 over three seeds: output 5.5e-7, dx 2.3e-6, dw 4.1e-7 relative (bound 1e-5)."""
    paddle.seed(1)
    x, w = paddle.randn([2, 300, 1024]) * 3, paddle.rand([1024]) + 0.5
    fast = _with_grads(lambda x, w: native.rms_norm(x, w, 1e-6), x, w)
    plain = _with_grads(lambda x, w: rms_norm_plain(x, w, 1e-6), x, w)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-5


def test_rope_equals_the_plain_rotation_and_its_backward_turns_back():
    """Measured 2026-11-29 over three seeds: at most 1.9e-7 relative (bound 1e-6); the backward is the
    rotation by the opposite angle, and turning there and back returns x within 2e-7 (bound 1e-6)."""
    paddle.seed(2)
    angles = paddle.rand([2, 300, 1, 64]) * 100
    cos, sin = angles.cos(), angles.sin()
    x = paddle.randn([2, 300, 18, 128])
    fast = _with_grads(lambda x: kernels.rope_native(x, cos, sin), x)
    plain = _with_grads(lambda x: apply_rotary_plain(x, cos, sin), x)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-6
    back = native.rotate(native.rotate(x, cos, sin), cos, sin, -1.0)
    assert _rel(back.numpy(), x.numpy()) < 1e-6
    assert not native.fits_rope(x, cos[:, :1])  # one angle per row and pair, or the plain path


def _qkv(batch: int, t: int, spread: float = 1.0) -> list[paddle.Tensor]:
    """The 0.3B model's attention shape: 16 query heads over 2 KV heads of 128."""
    return [paddle.randn([batch, t, n, 128]) * spread for n in (16, 2, 2)]


def test_attention_is_as_exact_as_the_plain_attention_at_the_models_shape():
    """Both paths against the plain attention in float64, 512 causal tokens, output and q / k / v gradients.
    Measured 2026-11-30 (Intel Xeon, AVX-512), seeds 3-5: native 1.4e-6 to 3.1e-6 relative (plain 0.7e-6 to
    1.2e-6; bound 1e-5). With scores spread 8x wider (softmax rows near one-hot, where fp32 itself loses
    digits) both paths are 7.5e-5 to 1.0e-4 off float64 and the native path's error is at most 1.26x the plain
    path's (bound 2x)."""
    paddle.seed(3)
    for spread in (1.0, 8.0):
        qkv = _qkv(1, 512, spread)
        exact = _with_grads(
            lambda q, k, v: attention_plain(q, k, v, None), *(t.astype("float64") for t in qkv)
        )
        fast = _with_grads(lambda q, k, v: native.attention(q, k, v, None), *qkv)
        plain = _with_grads(lambda q, k, v: attention_plain(q, k, v, None), *qkv)
        fast_err = max(_rel(f, e) for f, e in zip(fast, exact, strict=True))
        plain_err = max(_rel(p, e) for p, e in zip(plain, exact, strict=True))
        if spread == 1.0:
            assert fast_err < 1e-5
        assert fast_err < 2 * plain_err, (spread, fast_err, plain_err)


def test_attention_over_many_blocks_on_two_threads():
    """1,024 tokens (8 blocks of queries, products big enough for oneDNN to thread) on a team of two threads
    (the suite runs one per process): a first version that ran two sgemm calls at once from an OpenMP team was
    off by 0.3 here. Measured 2026-11-30: 2.4e-6 relative (bound 1e-5)."""
    paddle.seed(6)
    qkv = _qkv(1, 1024)
    onednn.set_threads(2)
    try:
        fast = _with_grads(lambda q, k, v: native.attention(q, k, v, None), *qkv)
    finally:
        onednn.set_threads(kernels.CPU_THREADS)
    plain = _with_grads(lambda q, k, v: attention_plain(q, k, v, None), *qkv)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-5


def test_attention_of_packed_rows_skips_earlier_samples_and_equals_the_plain_path():
    """Two rows of uneven packed samples and trailing padding, with the mask per row and with one mask for both
    rows; the key starts from ``packed_key_starts``. Measured 2026-11-30: 2.7e-6 and 2.8e-6 relative (bound 1e-5)."""
    paddle.seed(4)
    t = 300  # not a whole number of query blocks
    seg = np.full((2, t), -1)
    seg[0, :70], seg[0, 70:200], seg[0, 200:290] = 0, 1, 2
    seg[1, :100], seg[1, 100:260], seg[1, 260:299] = 0, 1, 2
    segments = paddle.to_tensor(seg)
    mask, starts = packed_causal_mask(segments), packed_key_starts(segments)
    assert tuple(starts) == (0, 70, 100)  # the path under test skips keys, not only masks them
    qkv = _qkv(2, t)
    fast = _with_grads(lambda q, k, v: native.attention(q, k, v, mask, starts), *qkv)
    plain = _with_grads(lambda q, k, v: attention_plain(q, k, v, mask, starts), *qkv)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-5
    one = mask[:1]  # [1, 1, T, T]: row 0's samples in both rows
    fast = _with_grads(lambda q, k, v: native.attention(q, k, v, one, None), *qkv)
    plain = _with_grads(lambda q, k, v: attention_plain(q, k, v, one, True), *qkv)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-5


def test_attention_gradients_repeat_bit_for_bit():
    """Every block of queries adds into the keys' gradients; the sgemm calls run one after another, so the adds
    keep one order (oneDNN threads each call inside)."""
    paddle.seed(5)
    qkv = _qkv(1, 320)
    first = _with_grads(lambda q, k, v: native.attention(q, k, v, None), *qkv)
    second = _with_grads(lambda q, k, v: native.attention(q, k, v, None), *qkv)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a, b)


def test_attention_refuses_what_it_does_not_take():
    q, k, v = _qkv(1, 8)
    assert native.fits_attention(q, k, None)
    assert not native.fits_attention(q, paddle.concat([k, k], axis=1), None)  # decoding against a cache
    assert not native.fits_attention(q.astype("bfloat16"), k.astype("bfloat16"), None)
    assert not native.fits_attention(q, k, paddle.zeros([1, 1, 8, 16]))
    with pytest.raises(ValueError, match="one entry per 128 queries"):  # C would read past the starts
        native.attention(q, k, v, paddle.zeros([1, 1, 8, 8]), (0, 0))
