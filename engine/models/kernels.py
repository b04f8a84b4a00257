"""Which fast paths (fused and grouped kernels) this device runs, decided once per process, and their self-tests.

Every fast path has a plain counterpart in ``layers.py`` / ``moe.py`` that stays the reference. The model
asks ``enabled(name)`` at each call site and nothing else decides; ``capabilities()`` makes the decision
once (device, compute capability, whether the kernel exists in this Paddle build and agrees with the plain
op on a small probe) and logs it once, with the reason for every path that is off.
``ERNIE_STUDIO_DISABLE_FAST_PATHS=name,name`` (or ``all``) switches paths off by hand.

The self-tests that compare each fast path with the plain path on a tiny model build whole models, so they
live above the models in ``kernel_self_tests``; this module imports no model module.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from engine.cpuinfo import this_cpu
from engine.models import native, onednn
from engine.models.plain_ops import apply_rotary_plain, attention_plain, packed_causal_mask, rms_norm_plain

log = logging.getLogger(__name__)

DISABLE_ENV = "ERNIE_STUDIO_DISABLE_FAST_PATHS"

# name -> what it replaces; the order is the order of the log line and of the self-tests.
FAST_PATHS = {
    "grouped_moe": "MoE experts as one gather + batched matmuls instead of a loop over experts",
    "swiglu": "F.swiglu (one kernel) instead of silu(gate) * up",
    "flash_attention": "FlashAttention-2 for causal rows (bf16 / fp16)",
    "flash_attention_varlen": "FlashAttention-2 varlen (flash_attn_unpadded) for packed rows",
    "fused_rms_norm": "paddle.incubate fused_rms_norm",
    "fused_rope": "paddle.incubate fused_rotary_position_embedding (interleaved pairs)",
    "weight_only_linear": "paddle.nn.quant.weight_only_linear for wint8 / wint4 frozen bases",
    "rms_norm_backward": "fp32 RMSNorm as one PyLayer with its backward written out (the weight's gradient as "
    "one GEMV) instead of autograd over its five ops",
    "rope_backward": "fp32 rotary embedding as one PyLayer whose backward is the rotation by the opposite angle "
    "instead of autograd over its unbind, products and stack",
    "cpu_rms_norm": "fp32 RMSNorm forward and backward as one threaded C loop each (engine/models/cpu_ops.c) "
    "instead of Paddle's one-thread elementwise ops",
    "cpu_rope": "fp32 rotary embedding forward and backward as one threaded C loop each (engine/models/cpu_ops.c)",
    "cpu_grad_clip": "the gradients' global norm (sum of squares in float64) and their clipping (in-place scaling) "
    "as threaded C loops (engine/models/cpu_ops.c) instead of one-thread squared_l2_norm and scale",
    "cpu_attention": "fp32 causal attention forward and backward as one threaded C pass each (engine/models/cpu_ops.c: "
    "oneDNN sgemm per block of queries, the softmax in place, only the log-sum-exp kept) instead of Paddle's batched "
    "matmuls, transposes and softmax",
    "onednn_matmul": "fp32 linears and LM head as oneDNN sgemm (Paddle's bundled libdnnl) instead of paddle.matmul",
    "onednn_cast": "float32 <-> bfloat16 conversions of the bf16 path as oneDNN reorders (threaded, vectorised) "
    "instead of Paddle's scalar cast",
    "onednn_bf16_matmul": "bf16-held linears and head as oneDNN bf16 GEMMs with fp32 accumulation instead of an "
    "fp32 upcast of each weight",
}
GPU_ONLY = {
    "flash_attention": "needs a CUDA GPU (no CPU kernel in Paddle; fp16 / bf16 only)",
    "flash_attention_varlen": "needs a CUDA GPU (flash_attn_unpadded has no CPU kernel)",
    # The CPU build registers an AVX-512 forward only: no backward, and SIGILL on CPUs without AVX-512.
    "fused_rms_norm": "needs a CUDA GPU (the CPU kernel is forward-only and needs AVX-512)",
    "fused_rope": "needs a CUDA GPU (fused_rotary_position_embedding has no CPU kernel)",
    "weight_only_linear": "needs a CUDA GPU (weight_quantize / weight_only_linear have no CPU kernel)",
}
# CPU paths: what a GPU process does instead.
CPU_ONLY = {
    "rms_norm_backward": "a CPU path (a GPU takes fused_rms_norm)",
    "rope_backward": "a CPU path (a GPU takes fused_rope)",
    "cpu_rms_norm": "a CPU path (a GPU takes fused_rms_norm)",
    "cpu_rope": "a CPU path (a GPU takes fused_rope)",
    "cpu_grad_clip": "a CPU path (a GPU's squared_l2_norm and scale are already parallel)",
    "cpu_attention": "a CPU path (a GPU takes FlashAttention, or its batched matmuls)",
    "onednn_matmul": "a CPU path (a GPU's paddle.matmul runs cuBLAS)",
    "onednn_bf16_matmul": "a CPU path (a GPU trains bf16 through paddle.amp)",
    "onednn_cast": "a CPU path (a GPU's cast kernel is already parallel)",
}
MIN_COMPUTE_CAPABILITY = {
    "flash_attention": 80,
    "flash_attention_varlen": 80,
    "weight_only_linear": 70,
}
HALF_DTYPES = (paddle.float16, paddle.bfloat16)
THREADS_ENV = "ERNIE_STUDIO_CPU_THREADS"


def cpu_threads() -> int:
    """Threads for Paddle's CPU kernels (MKL and OpenMP): ``ERNIE_STUDIO_CPU_THREADS``, else the cores this
    process may use shared out among the ranks on this node. ``OMP_NUM_THREADS`` is not read: importing
    Paddle sets it to 1 when unset, and child processes inherit that."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{THREADS_ENV}={value!r}: expected a whole number of threads (1 or more)")
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = int(os.environ.get("PADDLE_LOCAL_SIZE") or os.environ.get("PADDLE_TRAINERS_NUM") or 1)
    return max(cores // max(ranks, 1), 1)


def set_cpu_threads() -> int:
    """Paddle runs its CPU kernels on one thread unless told otherwise (its ``paddle_num_threads`` flag
    defaults to 1), so a 2-core machine trained at half speed; this sets the count once per process, at
    the import of this module, before any model runs (docs/benchmarks.md, CPU training step)."""
    n = cpu_threads()
    if not paddle.is_compiled_with_cuda():
        paddle.base.core.set_num_threads(n)
    onednn.set_threads(n)
    return n


CPU_THREADS = set_cpu_threads()

MALLOC_ENV = "ERNIE_STUDIO_CPU_MALLOC"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
# The free memory at the top of the heap kept for reuse before any is handed back to the system.
TRIM_THRESHOLD = 1 << 30


def tune_cpu_malloc() -> str:
    """Keep freed tensor memory for reuse instead of handing it back to the system; returns what was done.

    Paddle's CPU kernels allocate every output with malloc, and glibc serves blocks above its mmap threshold
    (128 KiB at first, 32 MiB at most) with fresh mappings, unmapped again when freed, and returns the top
    of its heap beyond its trim threshold: each activation, gradient and logits tensor of a training step
    was new memory that the kernel zero-filled page by page on first touch (~215,000-460,000 page faults
    and 2-3 s of system time per step of the 0.3B shape). Here every block comes from the heap (no mmap)
    and up to 1 GiB of free heap is kept: an elementwise multiply of two 512 x 1024 fp32 tensors 1.02 ->
    0.042 ms, the 0.3B step 10.45 -> 8.50 s at the same peak RSS (docs/benchmarks.md, CPU training step).
    The price: memory freed after a peak stays with the process (reused by it, not returned).
    ``ERNIE_STUDIO_CPU_MALLOC=default`` leaves glibc's defaults."""
    value = os.environ.get(MALLOC_ENV, "tuned").strip() or "tuned"
    if value not in ("tuned", "default"):
        raise ValueError(f"{MALLOC_ENV}={value!r}: expected 'tuned' (the default) or 'default'")
    if value == "default":
        return f"glibc defaults ({MALLOC_ENV}=default)"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others have no such settings)
    except (OSError, AttributeError):
        return "glibc defaults (not a glibc process)"
    # mmap stays glibc's fallback when the heap cannot grow; the threshold is set too, which also stops
    # glibc from moving it (its dynamic threshold).
    if not (
        mallopt(_M_MMAP_MAX, 0)
        and mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return "glibc defaults (mallopt refused the settings)"
    return f"freed memory kept for reuse (heap only, no mmap; trim threshold {TRIM_THRESHOLD >> 20} MiB)"


CPU_MALLOC = tune_cpu_malloc()
# The grouped MoE path copies a group's expert weights into one stack per call (and the gradient back out).
# On CPU that copy outweighs the saved per-expert dispatch beyond a couple of MB (bench/bench_moe.py
# --sweep: 1.2x faster at 1.1 MB, 0.9x at 6 MB, 0.5x at 48 MB); on a GPU the copy is cheap but lives
# until the backward, so it is bounded by memory instead (the official MoE sizes keep the loop).
GROUPED_MOE_MAX_BYTES = {"cpu": 2 << 20, "gpu": 256 << 20}


@dataclass(frozen=True)
class FastPath:
    name: str
    on: bool
    reason: str  # why it is on or off, one line


# ---- the decision ----------------------------------------------------------------------------------

_forced: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("fast_paths", default=None)


def enabled(name: str) -> bool:
    """Whether the model takes fast path ``name`` here (``forced`` overrides, e.g. in the self-tests)."""
    forced = _forced.get()
    if forced is not None and name in forced:
        return forced[name]
    return capabilities()[name].on


@contextlib.contextmanager
def forced(**paths: bool) -> Iterator[None]:
    """Switch fast paths on or off inside the block (the plain path of a comparison, the bench baseline).

    Forcing on a path the device lacks makes its kernel fail, so callers force on only paths
    ``capabilities`` reports available.
    """
    unknown = set(paths) - set(FAST_PATHS)
    if unknown:
        raise ValueError(f"unknown fast paths {sorted(unknown)}; known: {', '.join(FAST_PATHS)}")
    token = _forced.set({**(_forced.get() or {}), **paths})
    try:
        yield
    finally:
        _forced.reset(token)


@functools.cache
def capabilities() -> dict[str, FastPath]:
    """Decide every fast path for this process's device, once, and log the decision."""
    disabled = {p.strip() for p in os.environ.get(DISABLE_ENV, "").split(",") if p.strip()}
    if "all" in disabled:
        disabled = set(FAST_PATHS)
    gpu, cc, device_reason = _gpu()
    decided = {}
    for name in FAST_PATHS:
        if name in disabled:
            decided[name] = FastPath(name, False, f"switched off by {DISABLE_ENV}")
        elif name in CPU_ONLY:
            decided[name] = _decide_cpu_path(name, gpu)
        elif name not in GPU_ONLY:
            decided[name] = FastPath(name, True, _ALWAYS_ON[name])
        elif not gpu:
            decided[name] = FastPath(name, False, f"{GPU_ONLY[name]}; {device_reason}")
        elif cc < MIN_COMPUTE_CAPABILITY.get(name, 0):
            need = MIN_COMPUTE_CAPABILITY[name]
            decided[name] = FastPath(
                name,
                False,
                f"needs compute capability {need // 10}.{need % 10}, this GPU has {cc // 10}.{cc % 10}",
            )
        else:
            decided[name] = _probe(name)
    on = [p.name for p in decided.values() if p.on]
    log.info("fast paths on: %s", ", ".join(on) or "none")
    log.info("CPU: %d threads, %s", CPU_THREADS, CPU_MALLOC)
    for p in decided.values():
        if not p.on:
            log.info("fast path %s off: %s", p.name, p.reason)
    return decided


_ALWAYS_ON = {
    "grouped_moe": "plain Paddle ops, every device; for groups of small experts (GROUPED_MOE_MAX_BYTES)",
    "swiglu": "CPU and GPU kernel; faster than silu * up (docs/benchmarks.md)",
}


def _gpu() -> tuple[bool, int, str]:
    """(GPU in use, compute capability as major*10+minor, why not when not)."""
    if not paddle.is_compiled_with_cuda():
        return False, 0, "this Paddle build has no CUDA (paddlepaddle, not paddlepaddle-gpu)"
    if paddle.device.cuda.device_count() == 0:
        return False, 0, "no CUDA device is visible"
    if not paddle.get_device().startswith("gpu"):
        return False, 0, f"the current device is {paddle.get_device()}"
    major, minor = paddle.device.cuda.get_device_capability()
    return True, major * 10 + minor, ""


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(vendor_id, flags) of this CPU (engine.cpuinfo); the tests answer it as another CPU would."""
    return this_cpu()


def cpu_bf16_features() -> list[str]:
    """The bf16 instructions this CPU has (``avx512_bf16``, ``amx_bf16``), from /proc/cpuinfo."""
    flags = _cpuinfo()[1]
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


# Measured with bench/bench_cpu_peak.py on an Intel Xeon (family 6 model 207, AVX512_BF16 and AVX512_FP16,
# AMX not exposed): one core issues 171 GFLOP/s of fp32 FMAs and 81 GFLOP/s of VDPBF16PS, and oneDNN's bf16
# GEMM ran the 0.3B model's shapes at 0.6x its sgemm (docs/benchmarks.md). On AMD's Zen 4 and Zen 5 the bf16
# GEMM ran 2x the sgemm; AMX tiles outrun both.
INTEL_AVX512_BF16_ONLY = (
    "on an Intel CPU without AMX, AVX512_BF16's dot product runs at half the rate of fp32 FMAs, so oneDNN's "
    "bf16 GEMM is slower than its sgemm here; training upcasts bf16-held weights by oneDNN's reorder and runs "
    "the fp32 GEMM (decoding's few rows keep the bf16 GEMM: they are memory-bound)"
)


def bf16_gemm_refusal() -> str | None:
    """Why oneDNN's bf16 GEMM does not pay on this CPU, or None where it does (AMX, or AVX512_BF16 on AMD)."""
    features = cpu_bf16_features()
    if not features:
        # oneDNN would run its bf16 GEMM by converting to fp32: slower than the fp32 upcast path.
        return "the CPU has no bf16 instructions (avx512_bf16 / amx_bf16)"
    if "amx_bf16" not in features and _cpuinfo()[0] == "GenuineIntel":
        return INTEL_AVX512_BF16_ONLY
    return None


# oneDNN's float32 <-> bfloat16 conversion is JIT code for AVX-512 only (its x64 reorder converts with
# jit_avx512_core_bf16cvt); elsewhere the reorder falls back to its scalar reference loop. On an AVX2-only
# AMD EPYC (Zen 3) that took 1,234 ms for 16M values against Paddle's cast's 66 ms, and a bf16 step of the
# 0.3B shape 67 s against 11 s in fp32 (docs/benchmarks.md).
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def bf16_reorder_refusal() -> str | None:
    """Why oneDNN's float32 <-> bfloat16 reorder is slower than Paddle's cast on this CPU, or None."""
    missing = [f for f in AVX512_CORE if f not in _cpuinfo()[1]]
    if not missing:
        return None
    return (
        f"oneDNN converts float32 <-> bfloat16 with vector code only on AVX-512 (this CPU lacks "
        f"{', '.join(missing)}); its fallback is a scalar loop ~19x slower than Paddle's cast"
    )


def _decide_cpu_path(name: str, gpu: bool) -> FastPath:
    if gpu:
        return FastPath(name, False, CPU_ONLY[name])
    if name in ("rms_norm_backward", "rope_backward"):
        return _probe(name)
    if name in ("cpu_rms_norm", "cpu_rope", "cpu_grad_clip", "cpu_attention"):
        if why := native.available():
            return FastPath(name, False, f"the native CPU ops are not available: {why}")
        if name != "cpu_attention":  # the attention's products are oneDNN's sgemm: checked below
            return _probe(name)
    if name == "onednn_bf16_matmul" and (refusal := bf16_gemm_refusal()):
        return FastPath(name, False, refusal)
    if name == "onednn_cast" and (refusal := bf16_reorder_refusal()):
        return FastPath(name, False, refusal)
    why = onednn.available()
    return FastPath(name, False, why) if why else _probe(name)


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Paddle's random generators as they were before the block: the probes run when the first model is built,
    after a run has seeded Paddle, and their random inputs must not shift what the run draws next (two runs
    of one seed must stay equal whichever of them decided the paths)."""
    cpu = paddle.get_rng_state()
    gpu = paddle.get_cuda_rng_state() if paddle.is_compiled_with_cuda() else None
    try:
        yield
    finally:
        paddle.set_rng_state(cpu)
        if gpu is not None:
            paddle.set_cuda_rng_state(gpu)


def _probe(name: str) -> FastPath:
    """Run the kernel once on small inputs against the plain op: present in this build and agreeing."""
    try:
        with paddle.enable_grad(), _random_state_kept():  # a model may be built under no_grad (serving)
            diff, tol = _PROBES[name]()
    except Exception as exc:  # a missing kernel raises NotFound / RuntimeError, an unsupported shape others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return FastPath(name, False, f"the kernel failed on a probe: {first[:200]}")
    if not diff <= tol:
        return FastPath(
            name, False, f"the kernel disagrees with the plain op on a probe ({diff:.2e} > {tol:.0e})"
        )
    where = "CPU" if name in CPU_ONLY else "GPU"
    return FastPath(name, True, f"{where} kernel present and agrees with the plain op ({diff:.1e})")


def _agreement(fast: Callable, plain: Callable, *inputs: paddle.Tensor, backward: bool = True) -> float:
    """Largest difference of outputs and (with ``backward``, which must then exist too) input gradients,
    relative to the plain op's largest |value|."""
    worst = 0.0
    results = []
    for fn in (fast, plain):
        leaves = [t.detach() for t in inputs]
        for t in leaves:
            t.stop_gradient = not backward
        out = fn(*leaves)
        if backward:
            out.astype("float32").pow(2).sum().backward()
        results.append([out, *(t.grad for t in leaves)] if backward else [out])
    for f, p in zip(*results, strict=True):
        f, p = f.astype("float32").numpy(), p.astype("float32").numpy()
        worst = max(worst, float(np.abs(f - p).max()) / max(float(np.abs(p).max()), 1e-12))
    return worst


def _probe_rms_norm() -> tuple[float, float]:
    w = paddle.rand([64]) + 0.5
    return _agreement(
        lambda x: rms_norm_fused(x, w, 1e-5), lambda x: rms_norm_plain(x, w, 1e-5), paddle.randn([4, 64])
    ), 1e-4


def _probe_rms_norm_backward() -> tuple[float, float]:
    w = paddle.rand([64]) + 0.5
    return _agreement(
        lambda x, w: rms_norm_written(x, w, 1e-5),
        lambda x, w: rms_norm_plain(x, w, 1e-5),
        paddle.randn([3, 5, 64]),
        w,
    ), 1e-5


def _probe_rotation(rotate: Callable, tolerance: float) -> tuple[float, float]:
    """``rotate(x, cos, sin)`` against ``apply_rotary_plain`` on random angles, forward and backward."""
    angles = paddle.rand([2, 5, 1, 8]) * 10
    cos, sin = angles.cos(), angles.sin()
    return _agreement(
        lambda x: rotate(x, cos, sin),
        lambda x: apply_rotary_plain(x, cos, sin),
        paddle.randn([2, 5, 3, 16]),
    ), tolerance


def _probe_cpu_rms_norm() -> tuple[float, float]:
    w = paddle.rand([64]) + 0.5
    return _agreement(
        lambda x, w: native.rms_norm(x, w, 1e-5),
        lambda x, w: rms_norm_plain(x, w, 1e-5),
        paddle.randn([3, 5, 64]),
        w,
    ), 1e-5


def _probe_grad_clip() -> tuple[float, float]:
    """The square sum against Paddle's (relative), and the scaling against ``scale_`` (bit for bit)."""
    g = paddle.randn([3, 5000]) * 2
    with forced(cpu_grad_clip=False):
        want = float(square_sum(g))
    got = float(native.sum_squares(g))
    scaled = g.clone()
    native.scale_(scaled, 0.37)
    same = np.array_equal(scaled.numpy(), g.scale_(0.37).numpy())
    return abs(got - want) / want + (0.0 if same else 1.0), 1e-6


def _probe_rope_backward() -> tuple[float, float]:
    return _probe_rotation(rope_written, 1e-6)


def _probe_rope() -> tuple[float, float]:
    return _probe_rotation(rope_fused, 1e-4)


def _qkv(batch: int) -> list[paddle.Tensor]:
    return [paddle.randn([batch, 16, n, 32]).astype("bfloat16") for n in (4, 2, 2)]  # GQA, 2 groups


def _probe_flash() -> tuple[float, float]:
    return _agreement(flash_causal, lambda q, k, v: attention_plain(q, k, v, None), *_qkv(2)), 3e-2


def _probe_flash_varlen() -> tuple[float, float]:
    mask = packed_causal_mask(paddle.to_tensor([[0] * 6 + [1] * 10]))
    cu = paddle.to_tensor([0, 6, 16], dtype="int32")
    return _agreement(
        lambda q, k, v: flash_varlen(q, k, v, cu, 10),
        lambda q, k, v: attention_plain(q, k, v, mask),
        *_qkv(1),
    ), 3e-2


def _probe_cpu_attention() -> tuple[float, float]:
    """Causal rows (no mask) and packed rows (mask and key starts), GQA, over two blocks of queries."""
    qkv = [paddle.randn([2, 150, n, 16]) for n in (4, 2, 2)]
    seg = np.full((2, 150), -1)
    seg[0, :40], seg[0, 40:146], seg[1, :90], seg[1, 90:149] = 0, 1, 0, 1
    mask = packed_causal_mask(paddle.to_tensor(seg))
    starts = (0, 40)  # per ATTENTION_BLOCK (128) queries: row 0's second sample starts at 40, row 1's at 90
    plain = _agreement(
        lambda q, k, v: native.attention(q, k, v, None), lambda q, k, v: attention_plain(q, k, v, None), *qkv
    )
    packed = _agreement(
        lambda q, k, v: native.attention(q, k, v, mask, starts),
        lambda q, k, v: attention_plain(q, k, v, mask, True),
        *qkv,
    )
    return max(plain, packed), 1e-5


def _probe_weight_only() -> tuple[float, float]:
    """Forward only: serving needs no backward, and Paddle has ``weight_only_linear_grad`` on a few
    architectures only; where a call needs gradients, ``weight_only_refusal`` decides per call."""
    w = paddle.randn([64, 128]).astype("float16")
    q, scale = paddle.nn.quant.weight_quantize(w, algo="weight_only_int8")

    def fast(x):
        return paddle.nn.quant.weight_only_linear(x, q, weight_scale=scale, weight_dtype="int8")

    # Against the unquantized weight: the int8 grid's rounding is part of the difference.
    x = paddle.randn([3, 64]).astype("float16")
    return _agreement(fast, lambda x: paddle.matmul(x, w), x, backward=False), 3e-2


def _probe_onednn_cast() -> tuple[float, float]:
    """Both directions against Paddle's cast, bit for bit (as fp32 values), on normal, huge, infinite, zero
    and halfway values. fp32 subnormals (below 1.2e-38) may become zero on the way down (AVX512_BF16's
    conversion treats them as zero; Paddle keeps bf16's subnormals): a difference no training step sees."""
    x = paddle.concat([paddle.randn([1000]) * 3, paddle.to_tensor(CAST_PROBE_VALUES)])
    x = x.astype("float32")
    want = x.astype("bfloat16").astype("float32").numpy()
    down = onednn.convert(x, "bfloat16").astype("float32").numpy()
    tiny = np.abs(x.numpy()) < np.finfo(np.float32).tiny
    same = np.array_equal(down[~tiny], want[~tiny]) and bool(
        np.all((down[tiny] == 0) | (down[tiny] == want[tiny]))
    )
    up = onednn.convert(x.astype("bfloat16"), "float32").numpy()
    same = same and np.array_equal(up, want)
    return (0.0 if same else 1.0), 0.0


CAST_PROBE_VALUES = [1e38, -3e38, 3.4e38, 1e-40, -1e-41, float("inf"), -float("inf"), 0.0, -0.0]
CAST_PROBE_VALUES += [1.00390625, 1.01171875, 3.0000002]  # halfway (ties to even) and near-halfway


def _probe_onednn(compute: str) -> tuple[float, float]:
    """Forward and both gradients of ``x @ w`` and ``x @ w^T`` against paddle.matmul; for bf16 against the
    matmul of the bf16-rounded inputs in fp32 (the output's gradient is rounded too: 2^-8 relative)."""
    worst = 0.0
    for transpose in (False, True):
        w = paddle.randn([40, 24] if transpose else [24, 40]) * 0.1
        w = w.astype(compute)

        def plain(x, w, transpose=transpose):
            if compute == "bfloat16":
                x = x.astype(compute).astype("float32")
            return paddle.matmul(x, w.astype("float32"), transpose_y=transpose)

        fast = functools.partial(onednn.matmul, transpose_w=transpose, compute=compute)
        worst = max(worst, _agreement(fast, plain, paddle.randn([2, 3, 24]), w))
    return worst, (2e-2 if compute == "bfloat16" else 1e-5)


_PROBES: dict[str, Callable[[], tuple[float, float]]] = {
    "rms_norm_backward": _probe_rms_norm_backward,
    "rope_backward": _probe_rope_backward,
    "cpu_rms_norm": _probe_cpu_rms_norm,
    "cpu_rope": lambda: _probe_rotation(rope_native, 1e-6),
    "cpu_grad_clip": _probe_grad_clip,
    "cpu_attention": _probe_cpu_attention,
    "onednn_matmul": functools.partial(_probe_onednn, "float32"),
    "onednn_bf16_matmul": functools.partial(_probe_onednn, "bfloat16"),
    "onednn_cast": _probe_onednn_cast,
    "fused_rms_norm": _probe_rms_norm,
    "fused_rope": _probe_rope,
    "flash_attention": _probe_flash,
    "flash_attention_varlen": _probe_flash_varlen,
    "weight_only_linear": _probe_weight_only,
}


def cast(x: paddle.Tensor, dtype: str) -> paddle.Tensor:
    """``x.astype(dtype)`` (``x`` itself if already ``dtype``); between float32 and bfloat16 through oneDNN's
    reorder where ``onednn_cast`` is on. Not differentiable on that path: for PyLayers and optimizer code."""
    src = onednn.dtype_name(x)
    if src == dtype:
        return x
    if {src, dtype} == {"float32", "bfloat16"} and enabled("onednn_cast"):
        return onednn.convert(x, dtype)
    return x.astype(dtype)


@paddle.no_grad()
def cast_into(src: paddle.Tensor, dst: paddle.Tensor) -> None:
    """Write ``src``'s values into ``dst`` in ``dst``'s dtype (a master weight into its bf16 parameter):
    straight into ``dst``'s memory through oneDNN where ``onednn_cast`` is on, else ``set_value``."""
    pair = {onednn.dtype_name(src), onednn.dtype_name(dst)}
    if pair == {"float32", "bfloat16"} and dst.is_contiguous() and enabled("onednn_cast"):
        onednn.convert(src, onednn.dtype_name(dst), out=dst)
    else:
        dst.set_value(src.astype(dst.dtype))


# oneDNN's sgemm with a transposed weight (the tied [V, H] head) ran slower than paddle.matmul for 4 to 128
# rows (0.4-0.9x: decoding a few streams, short prompts) and faster for one row (1.3x) and from 256 rows
# (1.2-1.5x; a training step has 512+): bench in docs/benchmarks.md, "oneDNN's GEMMs".
TRANSPOSED_SGEMM_MIN_ROWS = 256


def matmul(x: paddle.Tensor, w: paddle.Tensor, transpose_w: bool = False) -> paddle.Tensor:
    """``x @ w`` (or ``x @ w^T``) over x's last axis for a linear or the LM head: oneDNN's sgemm where
    ``onednn_matmul`` is on and both are fp32 (a transposed weight only for 1 or ``TRANSPOSED_SGEMM_MIN_ROWS``+
    rows), else ``paddle.matmul``."""
    if _sgemm_takes(x, w, transpose_w):
        return onednn.matmul(x, w, transpose_w, "float32")
    return paddle.matmul(x, w, transpose_y=transpose_w)


# Few rows are memory-bound: the bf16 GEMM reads half the weight's bytes and upcasts nothing, so it wins even
# where its arithmetic is slow. Intel Xeon without AMX (bench/bench_onednn.py): 1 row 0.51 ms against 3.80 ms
# for the reorder + sgemm, 64 rows 7.1 against 7.5, 512 rows 46 against 30.
BF16_GEMM_FEW_ROWS = 64


def bf16_gemm_takes(rows: int) -> bool:
    """Whether a bf16-held weight's product over ``rows`` rows runs oneDNN's bf16 GEMM: wherever
    ``onednn_bf16_matmul`` is on, and where it is off only because the CPU's bf16 arithmetic is slow
    (``INTEL_AVX512_BF16_ONLY``), for inference (no gradient recorded) over at most ``BF16_GEMM_FEW_ROWS``
    rows: decoding. A training step keeps one path for all its products, the one its precision line names."""
    forced = (_forced.get() or {}).get("onednn_bf16_matmul")
    if forced is not None:
        return forced
    if capabilities()["onednn_bf16_matmul"].on:
        return True
    return (
        rows <= BF16_GEMM_FEW_ROWS
        and not paddle.is_grad_enabled()
        and capabilities()["onednn_bf16_matmul"].reason == INTEL_AVX512_BF16_ONLY
    )


def _sgemm_takes(x: paddle.Tensor, w: paddle.Tensor, transpose_w: bool) -> bool:
    if not (x.dtype == w.dtype == paddle.float32 and enabled("onednn_matmul")):
        return False
    rows = math.prod(x.shape[:-1])
    return not transpose_w or rows == 1 or rows >= TRANSPOSED_SGEMM_MIN_ROWS


def matmul_nograd(x: paddle.Tensor, w: paddle.Tensor, transpose_w: bool = False) -> paddle.Tensor:
    """``matmul`` for PyLayers' own forward and backward: the same choice of kernel, no autograd node."""
    if _sgemm_takes(x, w, transpose_w):
        y = onednn.gemm(x.reshape([-1, x.shape[-1]]), w, trans_b=transpose_w)
        return y.reshape([*x.shape[:-1], y.shape[-1]])
    return paddle.matmul(x, w, transpose_y=transpose_w)


def matmul_at_b(a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
    """``a^T @ b`` of two 2-D tensors (a weight's gradient) without an autograd node: oneDNN's sgemm where
    ``onednn_matmul`` is on and both are fp32, else ``paddle.matmul``."""
    if a.dtype == b.dtype == paddle.float32 and enabled("onednn_matmul"):
        return onednn.gemm(a, b, trans_a=True)
    return paddle.matmul(a, b, transpose_x=True)


def _clip_natively(g: paddle.Tensor) -> bool:
    """Whether the gradient clip's C loops take ``g`` (a contiguous fp32 CPU tensor, ``cpu_grad_clip`` on)."""
    return (
        g.dtype == paddle.float32
        and g.place.is_cpu_place()
        and g.is_contiguous()
        and enabled("cpu_grad_clip")
    )


def square_sum(g: paddle.Tensor) -> paddle.Tensor:
    """sum(g^2) of one gradient as a float64 scalar: threaded over float64 partial sums (``cpu_grad_clip``) for
    a contiguous fp32 CPU tensor, else Paddle's ``squared_l2_norm`` (a tree reduction in g's dtype)."""
    if _clip_natively(g):
        return paddle.to_tensor(native.sum_squares(g), dtype="float64")
    return paddle._C_ops.squared_l2_norm(g).reshape([]).astype("float64")


def scale_grad_(g: paddle.Tensor, factor: float) -> None:
    """g *= factor in place (the gradient clip's scaling)."""
    if _clip_natively(g):
        native.scale_(g, factor)
    else:
        g.scale_(factor)


def grouped_moe_fits(stacked_bytes: int, on_gpu: bool) -> bool:
    """Whether a group of experts whose stacked weights take ``stacked_bytes`` runs grouped here."""
    return stacked_bytes <= GROUPED_MOE_MAX_BYTES["gpu" if on_gpu else "cpu"]


# ---- the kernels, as the model calls them ------------------------------------------------------------


class RMSNormWritten(PyLayer):
    """fp32 RMSNorm, ``x * rsqrt(mean(x^2) + eps) * w``, with its backward written out. Autograd over the
    plain form runs five ops and a broadcast multiply's gradient whose reduction over the rows of the
    weight's gradient is one slow loop on the CPU (``multiply_grad``, 0.5 s of the 0.3B step); here the
    weight's gradient is one GEMV and dx is ``r * (g - n * mean(g * n))`` with g = dy * w.
    fp32 only (the plain form upcasts other dtypes)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        r = paddle.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        n = x * r
        # which inputs want a gradient, decided here (a frozen norm of a LoRA run, an input that needs none;
        # under recompute the saved copies all say stop_gradient): Paddle wants None for those
        ctx.wants = (not x.stop_gradient, not w.stop_gradient)
        ctx.save_for_backward(n, r, w)
        return n * w

    @staticmethod
    def backward(ctx, dy):
        n, r, w = ctx.saved_tensor()
        dx = dw = None
        if ctx.wants[0]:
            g = dy * w
            dx = r * (g - n * (g * n).mean(-1, keepdim=True))
        if ctx.wants[1]:
            rows = (dy * n).reshape([-1, n.shape[-1]])
            # paddle.matmul, not ``matmul``: this runs in a probe, while the paths are being decided
            dw = paddle.matmul(paddle.ones([1, rows.shape[0]], dtype=rows.dtype), rows).reshape(w.shape)
        return dx, dw


def rms_norm_written(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """RMSNorm through ``RMSNormWritten`` (fp32 ``x`` and weight)."""
    return RMSNormWritten.apply(x, weight, eps)


def _rotate_plain(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, sign: float = 1.0
) -> paddle.Tensor:
    return apply_rotary_plain(x, cos, sin if sign > 0 else -sin)


class RopeWritten(PyLayer):
    """fp32 interleaved rotary embedding with its backward written out: the rotation is orthogonal, so the
    input's gradient is the output's gradient rotated by the opposite angle (``sin`` negated). Autograd over
    the plain form saves its pieces and runs a gradient op for each of its nine (unbind, four products, two
    sums, stack, reshape); this keeps nothing but the angles and rotates once more.
    ``turn(x, cos, sin, sign)`` rotates by the angle (sign 1) or its opposite (-1): the plain form
    (``rope_backward``) or cpu_ops.c's loop (``cpu_rope``). ``cos`` / ``sin`` take no gradient (they come
    from positions)."""

    @staticmethod
    def forward(ctx, x, cos, sin, turn):
        ctx.save_for_backward(cos, sin)
        ctx.turn = turn
        return turn(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensor()
        return ctx.turn(dy, cos, sin, -1.0), None, None


def rope_written(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """The rotation through ``RopeWritten`` on the plain form (fp32 ``x``)."""
    return RopeWritten.apply(x, cos, sin, _rotate_plain)


def rope_native(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """The rotation through ``RopeWritten`` on cpu_ops.c's loop (fp32 ``x``, ``native.fits_rope``)."""
    return RopeWritten.apply(x, cos, sin, native.rotate)


def rms_norm_fused(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """RMSNorm over the last axis in one kernel (statistics in fp32 inside the kernel)."""
    out = paddle.incubate.nn.functional.fused_rms_norm(
        x, weight.astype(x.dtype), None, eps, begin_norm_axis=x.ndim - 1
    )
    return out[0] if isinstance(out, tuple | list) else out


def rope_fused(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """The interleaved rotation of ``plain_ops.apply_rotary_plain`` in one kernel. x [B, T, H, D].

    Paddle's ``use_neox_rotary_style=True`` is the one that rotates adjacent (even, odd) pairs, ERNIE's
    layout; its sin / cos hold one value per element, so each pair's angle is repeated. Positions may
    differ per row (packing, 3-D RoPE), so the table is [1, B*T, 1, D] and each row looks its own up.
    """
    b, t, _, d = x.shape
    table = [paddle.stack([c, c], axis=-1).reshape([1, b * t, 1, d]).astype(x.dtype) for c in (cos, sin)]
    positions = paddle.arange(b * t, dtype="int64").reshape([b, t])
    out, _, _ = paddle.incubate.nn.functional.fused_rotary_position_embedding(
        x, None, None, sin=table[1], cos=table[0], position_ids=positions, use_neox_rotary_style=True
    )
    return out


def flash_causal(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
    """Causal attention, q [B, T, H, D], k / v [B, T, Hkv, D] (GQA served by the kernel), fp16 / bf16."""
    # training=True with no dropout: the same math, and Paddle refuses training=False under
    # FLAGS_flash_attn_version=3 (paddle/nn/functional/flash_attention.py ``flash_attention``).
    out, _ = F.flash_attention.flash_attention(q, k, v, dropout=0.0, causal=True, training=True)
    return out


def flash_varlen(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, cu_seqlens: paddle.Tensor, max_seqlen: int
) -> paddle.Tensor:
    """Causal attention inside each packed sample: the rows laid end to end, samples cut at ``cu_seqlens``."""
    b, t, nq, hd = q.shape
    flat = [a.reshape([b * t, a.shape[2], hd]) for a in (q, k, v)]
    out, _ = F.flash_attention.flash_attn_unpadded(
        *flat,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        1.0 / math.sqrt(hd),
        causal=True,
        training=False,
    )
    return out.reshape([b, t, nq, hd])


def swiglu_plain(x: paddle.Tensor) -> paddle.Tensor:
    gate, up = paddle.chunk(x, 2, axis=-1)
    return F.silu(gate) * up


def swiglu(x: paddle.Tensor) -> paddle.Tensor:
    """silu(first half) * second half of the last axis."""
    return F.swiglu(x) if enabled("swiglu") else swiglu_plain(x)


# Paddle 3.3.1's weight_only_linear_grad InferMeta: "Currently weightonly linear grad only support arch =
# 80, 86, 90 or 100" and "... only support per-channel mode" (strings of libphi_core.so).
WEIGHT_ONLY_GRAD_ARCHS = (80, 86, 90, 100)


def weight_only_refusal(group_size: int, needs_grad: bool, compute_capability: int) -> str | None:
    """Why Paddle's weight-only GEMM must not serve a call, or None when it may.

    Only per-channel scales: Paddle 3.3.1's GPU ``weight_quantize`` quantizes per channel whatever
    ``group_size`` says (``weight_quant_gpu`` in phi/kernels/impl/weight_quantize_kernel_gpu_impl.h takes
    none) while shaping its scales [k / g, n], so ``weight_only_linear(group_size=g)`` would read group
    scales that were never written. Group-wise layers dequantize instead (``quantized.dequantize_weight``).
    A call that needs gradients also needs ``weight_only_linear_grad``: per channel, sm80/86/90/100 only.
    """
    if group_size != -1:
        return (
            f"group size {group_size}: Paddle's GPU weight_quantize writes per-channel scales only, and "
            "weight_only_linear would read group scales it never wrote"
        )
    if needs_grad and compute_capability not in WEIGHT_ONLY_GRAD_ARCHS:
        major, minor = divmod(compute_capability, 10)
        return f"no weight_only_linear_grad for compute capability {major}.{minor} (sm80/86/90/100 only)"
    return None


@functools.cache
def compute_capability() -> int:
    """This GPU's compute capability as major*10+minor (0 without a GPU in use)."""
    return _gpu()[1]


def weight_only_linear(layer, x: paddle.Tensor) -> paddle.Tensor | None:
    """``layer`` (a ``quantized.WeightOnlyLinear``) through Paddle's weight-only GEMM, or None when that
    path is off or does not fit (fp32 activations, group-wise scales, gradients without a grad kernel:
    ``weight_only_refusal``).

    The kernel wants its own weight layout, made by ``weight_quantize`` from the dequantized weight on
    first use and kept on the layer; requantizing reproduces the stored integers, since every channel's
    largest value sits exactly on the grid's end.
    """
    if not enabled("weight_only_linear") or x.dtype not in HALF_DTYPES:
        return None
    groups = int(layer.weight_scale.shape[0])
    group_size = -1 if groups == 1 else layer.in_features // groups
    needs_grad = paddle.is_grad_enabled() and not x.stop_gradient
    if weight_only_refusal(group_size, needs_grad, compute_capability()) is not None:
        return None
    cached = getattr(layer, "_kernel_weight", None)
    if cached is None or cached[0] != x.dtype:
        algo = "weight_only_int4" if layer.bits == 4 else "weight_only_int8"
        q, scale = paddle.nn.quant.weight_quantize(layer.dequantized().astype(x.dtype), algo=algo)
        cached = (x.dtype, q, scale)
        layer._kernel_weight = cached
    _, q, scale = cached
    bias = None if layer.bias is None else layer.bias.astype(x.dtype)
    return paddle.nn.quant.weight_only_linear(
        x, q, bias=bias, weight_scale=scale, weight_dtype="int4" if layer.bits == 4 else "int8"
    )
