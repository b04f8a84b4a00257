"""The CPU training step's parts (issue 20): gradient clipping, the thread count, and what bf16 can use on
this CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from engine.models import kernels
from engine.train.precision import cpu_bf16_matmul, resolve_precision
from engine.train.step import clip_grad_norm

HAS_GPU = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def test_clip_grad_norm_matches_paddles_clip_grad_norm():
    rng = np.random.default_rng(0)
    values = [rng.normal(size=s).astype(np.float32) for s in ([64, 32], [32], [10, 3])]
    norms, grads = [], []
    for clip in (clip_grad_norm, paddle.nn.utils.clip_grad_norm_):
        params = []
        for v in values:
            p = paddle.create_parameter(list(v.shape), "float32")
            p.set_value(v)
            params.append(p)
        for i, p in enumerate(params):
            ((p * p).sum() * (i + 1)).backward()
        norms.append(float(clip(params, 0.5)))
        grads.append([p.grad.numpy() for p in params])
    assert abs(norms[0] - norms[1]) < 1e-4 * norms[1] and norms[1] > 0.5
    for a, b in zip(*grads, strict=True):
        assert np.abs(a - b).max() < 1e-7
    total = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads[0]))
    assert abs(total - 0.5) < 1e-5  # clipped to max_norm


def test_clip_grad_norm_is_exact_on_a_gradient_as_large_as_an_embedding():
    """A gradient of 2**24 small values (the 0.3B model's embedding has 106M): sequential float32 sums
    drift from the true norm (a BLAS dot product was 4% off on the embedding); the tree reduction holds."""
    values = (np.random.default_rng(1).normal(size=1 << 24) * 0.01).astype(np.float32)
    p = paddle.create_parameter([1 << 24], "float32")
    p.set_value(values)
    (p * paddle.to_tensor(values)).sum().backward()  # grad = values
    total = float(np.sqrt((values.astype(np.float64) ** 2).sum()))
    assert abs(clip_grad_norm([p], 1e9) - total) < 1e-6 * total


def test_cpu_threads_come_from_the_setting_or_the_cores(monkeypatch):
    monkeypatch.setenv(kernels.THREADS_ENV, "3")
    assert kernels.cpu_threads() == 3
    monkeypatch.setenv(kernels.THREADS_ENV, "two")
    with pytest.raises(ValueError, match="ERNIE_STUDIO_CPU_THREADS='two'"):
        kernels.cpu_threads()
    monkeypatch.delenv(kernels.THREADS_ENV)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    cores = len(os.sched_getaffinity(0))
    assert kernels.cpu_threads() == max(cores // 2, 1)


@pytest.mark.skipif(HAS_GPU, reason="the CPU's bf16 path (a GPU trains bf16 through paddle.amp)")
def test_bf16_on_this_cpu_runs_onednn_gemms_where_it_has_bf16_instructions_and_says_which():
    # Paddle 3.3.1's CPU build has no bf16 matmul; when a Paddle upgrade brings one, this fails and the
    # CPU bf16 path (engine/train/precision.py) should be revisited.
    assert cpu_bf16_matmul() is False
    features = kernels.cpu_bf16_features()
    precision = resolve_precision("bf16")
    if (
        kernels.bf16_gemm_refusal() is None
    ):  # this CPU: oneDNN's bf16 GEMM, and the line names the instructions
        assert precision.matmuls == "bfloat16", precision
        assert "oneDNN's bf16 GEMM" in precision.reason
        assert all(f in precision.reason for f in features)
    else:
        assert precision.matmuls == "float32" and "upcast" in precision.reason, precision
    with kernels.forced(onednn_bf16_matmul=False):
        precision = resolve_precision("bf16")
    assert precision.matmuls == "float32" and "upcast" in precision.reason
    for feature in features:
        assert feature in precision.reason and "no bfloat16 matmul kernel" in precision.reason


def _faults_of_elementwise_ops(malloc: str) -> int:
    """Minor page faults of 50 multiplies of two 512 x 1024 fp32 tensors in a fresh engine process."""
    code = (
        "import resource, paddle, engine.models.kernels as k; x = paddle.randn([512, 1024]); y = x * x;"
        "del y; f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(50): y = x * x; del y\n"
        "print(k.CPU_MALLOC, '|', resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)"
    )
    env = {**os.environ, kernels.MALLOC_ENV: malloc, kernels.THREADS_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said, faults = out.stdout.rsplit("|", 1)
    assert said.strip().startswith("freed memory kept" if malloc == "tuned" else "glibc defaults"), said
    return int(faults)


def test_freed_tensor_memory_is_reused_without_page_faults():
    """With glibc's defaults each 2 MiB output was fresh memory the kernel zero-fills page by page (512
    faults per op: 25,650 for the 50 ops); tuned, the heap keeps it and the ops reuse it (measured 0 to
    ~1,000: the heap grows once or twice)."""
    assert _faults_of_elementwise_ops("tuned") < 50 * 512 // 10
    assert _faults_of_elementwise_ops("default") > 50 * 256


def test_a_bad_malloc_setting_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.MALLOC_ENV, "fast")
    with pytest.raises(ValueError, match="ERNIE_STUDIO_CPU_MALLOC='fast'"):
        kernels.tune_cpu_malloc()
