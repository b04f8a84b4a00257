"""oneDNN's GEMMs, called through the ``libdnnl`` that Paddle's CPU wheel bundles, for the linears and the head.

Paddle 3.3.1's eager CPU ``matmul`` has no bfloat16 kernel, so a bf16 run on a CPU upcast every weight to fp32
per call. The same wheel ships oneDNN 3 (``paddle/libs/libdnnl.so.3``) with its C API exported, and that
library has ``dnnl_gemm_bf16bf16f32``: bf16 inputs, fp32 accumulation and output, on the CPU's
``avx512_bf16`` / AMX instructions where it has them. Its ``dnnl_sgemm`` is oneDNN's own JIT fp32 GEMM, which
on an AMD EPYC with AVX-512 ran 1.6-2x the GFLOP/s of Paddle's ``matmul`` (MKL) on the model's shapes
(docs/benchmarks.md, CPU training step). Nothing is compiled: the functions are called with ``ctypes`` on the
tensors' memory, and ``kernels`` decides once per process whether each path is on (``onednn_matmul``,
``onednn_bf16_matmul``) after a probe against the plain op.

Both GEMMs are row-major, ``C = op(A) @ op(B)``, on 2-D contiguous tensors; ``OneDnnMatmul`` gives them a
backward. ``ctypes`` releases the GIL for the call. oneDNN runs on the calling thread's OpenMP team, and in
this process its OpenMP calls resolve to Paddle's ``libiomp5``: a thread that Paddle did not set up (a
server's worker thread) has a team of ``OMP_NUM_THREADS``, which importing Paddle sets to 1. So each calling
thread's team is set once to ``kernels.CPU_THREADS`` (``set_threads``) before its first GEMM.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import paddle
from paddle.autograd import PyLayer

LIBRARY = "libdnnl.so.3"
_GEMM_ARGS = [
    ctypes.c_char,  # transa
    ctypes.c_char,  # transb
    ctypes.c_int64,  # M
    ctypes.c_int64,  # N
    ctypes.c_int64,  # K
    ctypes.c_float,  # alpha
    ctypes.c_void_p,  # A
    ctypes.c_int64,  # lda
    ctypes.c_void_p,  # B
    ctypes.c_int64,  # ldb
    ctypes.c_float,  # beta
    ctypes.c_void_p,  # C
    ctypes.c_int64,  # ldc
]
FUNCTIONS = {"float32": "dnnl_sgemm", "bfloat16": "dnnl_gemm_bf16bf16f32"}
# The OpenMP runtimes oneDNN may resolve to here: Paddle's Intel runtime (loaded first, it provides the GNU
# entry points too) and the GNU one libdnnl names.
OPENMP_RUNTIMES = ("libiomp5.so", "libgomp.so.1")
_threads = 1
_team = threading.local()


def set_threads(n: int) -> None:
    """The OpenMP team size every thread's GEMMs run on (``kernels.set_cpu_threads`` calls this)."""
    global _threads
    _threads = n


@functools.cache
def _openmp() -> list[ctypes.CDLL]:
    found = []
    for name in OPENMP_RUNTIMES:
        bundled = Path(paddle.__file__).parent / "libs" / name
        try:
            found.append(ctypes.CDLL(str(bundled) if bundled.exists() else name))
        except OSError:
            continue
    return found


def team_size() -> list[int]:
    """This thread's OpenMP team size in each runtime (what its next GEMM runs on)."""
    return [lib.omp_get_max_threads() for lib in _openmp()]


def _set_team() -> None:
    if getattr(_team, "threads", None) != _threads:
        for lib in _openmp():
            lib.omp_set_num_threads(_threads)
        _team.threads = _threads


def library_path() -> Path:
    return Path(paddle.__file__).parent / "libs" / LIBRARY


@functools.cache
def _functions() -> dict[str, ctypes._CFuncPtr]:
    """The two GEMMs, by input dtype; raises ``OSError`` / ``AttributeError`` when the library or a symbol
    is missing (a Paddle build without oneDNN)."""
    lib = ctypes.CDLL(str(library_path()))
    found = {}
    for dtype, name in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _GEMM_ARGS, ctypes.c_int
        found[dtype] = fn
    return found


def available() -> str | None:
    """None when both GEMMs can be called here, else why not."""
    try:
        _functions()
    except (OSError, AttributeError) as exc:
        return f"oneDNN's GEMMs are not callable from {library_path()}: {exc}"
    return None


def _contiguous(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def gemm(a: paddle.Tensor, b: paddle.Tensor, trans_a: bool = False, trans_b: bool = False) -> paddle.Tensor:
    """``op(a) @ op(b)`` in float32 for 2-D CPU tensors of one dtype: float32 (``dnnl_sgemm``) or bfloat16
    (``dnnl_gemm_bf16bf16f32``, fp32 accumulation)."""
    if a.dtype != b.dtype or str(a.dtype).split(".")[-1] not in FUNCTIONS:
        raise TypeError(
            f"oneDNN gemm takes two float32 or two bfloat16 matrices, got {a.dtype} and {b.dtype}"
        )
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"oneDNN gemm takes 2-D matrices, got shapes {a.shape} and {b.shape}")
    a, b = _contiguous(a), _contiguous(b)
    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    if k != k_b:
        raise ValueError(
            f"oneDNN gemm: inner sizes differ ({m}x{k} @ {k_b}x{n}; trans_a={trans_a}, trans_b={trans_b})"
        )
    if m * n == 0 or k == 0:
        return paddle.zeros([m, n], dtype="float32")
    out = paddle.empty([m, n], dtype="float32")
    _set_team()
    fn = _functions()[str(a.dtype).split(".")[-1]]
    status = fn(
        b"T" if trans_a else b"N",
        b"T" if trans_b else b"N",
        m,
        n,
        k,
        1.0,
        a.data_ptr(),
        a.shape[1],
        b.data_ptr(),
        b.shape[1],
        0.0,
        out.data_ptr(),
        n,
    )
    if status != 0:
        raise RuntimeError(f"oneDNN {fn.__name__} returned status {status} for {m}x{k} @ {k}x{n}")
    return out


class OneDnnMatmul(PyLayer):
    """``x @ w`` (``w`` [in, out], or [out, in] with ``transpose_w``) through oneDNN, with its backward.

    ``compute`` is the GEMMs' input dtype. For ``bfloat16`` the activations and the output's gradient are
    rounded to bf16 as a GPU's bf16 matmul takes them, products accumulate in fp32, and only the bf16 copy
    of ``x`` is kept for backward (half the fp32 activation). The weight's gradient comes back in the
    weight's dtype.
    """

    @staticmethod
    def forward(ctx, x, w, transpose_w, compute):
        k = x.shape[-1]
        x2 = x.reshape([-1, k])
        x2 = x2 if x2.dtype == w.dtype == compute else x2.astype(compute)
        wc = w if str(w.dtype).split(".")[-1] == compute else w.astype(compute)
        y = gemm(x2, wc, trans_b=transpose_w)
        ctx.transpose_w, ctx.compute, ctx.x_shape, ctx.x_dtype = transpose_w, compute, x.shape, x.dtype
        ctx.save_for_backward(x2, w)
        return y.reshape([*x.shape[:-1], y.shape[-1]])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensor()
        dy2 = dy.reshape([-1, dy.shape[-1]])
        dy2 = dy2 if str(dy2.dtype).split(".")[-1] == ctx.compute else dy2.astype(ctx.compute)
        wc = w if str(w.dtype).split(".")[-1] == ctx.compute else w.astype(ctx.compute)
        # x @ w: dx = dy @ w^T, dw = x^T @ dy.  x @ w^T: dx = dy @ w, dw = dy^T @ x.
        dx = gemm(dy2, wc, trans_b=not ctx.transpose_w).reshape(ctx.x_shape)
        dx = dx if dx.dtype == ctx.x_dtype else dx.astype(ctx.x_dtype)
        if w.stop_gradient:
            return dx, None
        dw = gemm(dy2, x2, trans_a=True) if ctx.transpose_w else gemm(x2, dy2, trans_a=True)
        return dx, dw if dw.dtype == w.dtype else dw.astype(w.dtype)


def matmul(
    x: paddle.Tensor, w: paddle.Tensor, transpose_w: bool = False, compute: str = "float32"
) -> paddle.Tensor:
    """``x @ w`` (or ``x @ w^T``) over x's last axis through oneDNN, in ``compute`` (float32 or bfloat16)."""
    return OneDnnMatmul.apply(x, w, transpose_w, compute)
