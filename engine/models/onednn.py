"""oneDNN's GEMMs, called through the ``libdnnl`` that Paddle's CPU wheel bundles, for the linears and the head.

Paddle 3.3.1's eager CPU ``matmul`` has no bfloat16 kernel, so a bf16 run on a CPU upcast every weight to fp32
per call. The same wheel ships oneDNN 3 (``paddle/libs/libdnnl.so.3``) with its C API exported, and that
library has ``dnnl_gemm_bf16bf16f32``: bf16 inputs, fp32 accumulation and output, on the CPU's
``avx512_bf16`` / AMX instructions where it has them. Its ``dnnl_sgemm`` is oneDNN's own JIT fp32 GEMM, which
on an AMD EPYC with AVX-512 ran 1.6-2x the GFLOP/s of Paddle's ``matmul`` (MKL) on the model's shapes
(docs/benchmarks.md, CPU training step). Nothing is compiled: the functions are called with ``ctypes`` on the
tensors' memory, and ``kernels`` decides once per process whether each path is on (``onednn_matmul``,
``onednn_bf16_matmul``, and ``onednn_cast`` for the reorders between fp32 and bf16, ``convert``) after a
probe against the plain op. Every pointer handed over is a contiguous tensor whose size and dtype were
checked against the call.

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

from engine.models import master_grads

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
        bundled = _libs_dir() / name
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


def _libs_dir() -> Path:
    """Where Paddle's wheel keeps the native libraries it bundles (oneDNN, Intel's OpenMP, MKL)."""
    return Path(paddle.__file__).parent / "libs"


def library_path() -> Path:
    return _libs_dir() / LIBRARY


@functools.cache
def _lib() -> ctypes.CDLL:
    return ctypes.CDLL(str(library_path()))


@functools.cache
def _functions() -> dict[str, ctypes._CFuncPtr]:
    """The two GEMMs, by input dtype; raises ``OSError`` / ``AttributeError`` when the library or a symbol
    is missing (a Paddle build without oneDNN)."""
    lib = _lib()
    found = {}
    for dtype, name in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _GEMM_ARGS, ctypes.c_int
        found[dtype] = fn
    return found


REORDER_FUNCTIONS = (
    "dnnl_engine_create",
    "dnnl_stream_create",
    "dnnl_stream_wait",
    "dnnl_memory_desc_create_with_tag",
    "dnnl_memory_desc_destroy",
    "dnnl_reorder_primitive_desc_create",
    "dnnl_primitive_desc_destroy",
    "dnnl_primitive_create",
    "dnnl_primitive_destroy",
    "dnnl_primitive_execute",
    "dnnl_memory_create",
    "dnnl_memory_destroy",
    "dnnl_memory_set_data_handle",
)


def available() -> str | None:
    """None when the GEMMs and the reorder's functions can be called here, else why not."""
    try:
        _functions()
        for name in REORDER_FUNCTIONS:
            getattr(_lib(), name)
    except (OSError, AttributeError) as exc:
        return f"oneDNN's GEMMs are not callable from {library_path()}: {exc}"
    return None


# ---- conversions: oneDNN's reorder between float32 and bfloat16 -----------------------------------------
# oneDNN 3.x C API constants (oneapi/dnnl/dnnl_common_types.h and dnnl_types.h; the wheel ships only the
# top-level shims of those headers): data types, the plain 1-D layout tag, the CPU engine kind, an in-order
# stream, and the reorder's argument slots.
DATA_TYPES = {"bfloat16": 2, "float32": 3}
_TAG_A, _CPU_ENGINE, _STREAM_IN_ORDER, _ARG_FROM, _ARG_TO = 2, 1, 1, 1, 17
# distinct tensor sizes whose reorder primitive a thread keeps (a model has a few dozen)
REORDER_CACHE = 128


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"oneDNN {what} returned status {status}")


@functools.cache
def _engine() -> ctypes.c_void_p:
    engine = ctypes.c_void_p()
    _check(_lib().dnnl_engine_create(ctypes.byref(engine), _CPU_ENGINE, ctypes.c_size_t(0)), "engine_create")
    return engine


def _reorder(n: int, src: str, dst: str) -> tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]:
    """This thread's reorder of ``n`` elements from ``src`` to ``dst``: (primitive, source memory, destination
    memory), the memories' data pointers set per call."""
    cache = _team.__dict__.setdefault("reorders", {})
    key = (n, src, dst)
    if key in cache:
        return cache[key]
    lib, engine = _lib(), _engine()
    dims = (ctypes.c_int64 * 12)(n)
    descs = []
    for dtype in (src, dst):
        md = ctypes.c_void_p()
        _check(
            lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), 1, dims, DATA_TYPES[dtype], _TAG_A), "md"
        )
        descs.append(md)
    pd, prim = ctypes.c_void_p(), ctypes.c_void_p()
    _check(
        lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), descs[0], engine, descs[1], engine, None),
        "pd",
    )
    _check(lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive_create")
    memories = []
    for md in descs:
        mem = ctypes.c_void_p()
        _check(lib.dnnl_memory_create(ctypes.byref(mem), md, engine, None), "memory_create")
        memories.append(mem)
    lib.dnnl_primitive_desc_destroy(pd)
    for md in descs:
        lib.dnnl_memory_desc_destroy(md)
    if len(cache) >= REORDER_CACHE:  # drop the oldest size
        old = cache.pop(next(iter(cache)))
        lib.dnnl_primitive_destroy(old[0])
        for mem in old[1:]:
            lib.dnnl_memory_destroy(mem)
    cache[key] = (prim, *memories)
    return cache[key]


def _stream() -> ctypes.c_void_p:
    stream = getattr(_team, "stream", None)
    if stream is None:
        stream = ctypes.c_void_p()
        _check(
            _lib().dnnl_stream_create(ctypes.byref(stream), _engine(), ctypes.c_uint(_STREAM_IN_ORDER)),
            "stream",
        )
        _team.stream = stream
    return stream


def convert(x: paddle.Tensor, dtype: str, out: paddle.Tensor | None = None) -> paddle.Tensor:
    """``x`` (float32 or bfloat16) in ``dtype`` through oneDNN's reorder: the values Paddle's ``astype``
    gives (round to nearest even), on the thread's OpenMP team and vectorised, where Paddle's CPU cast to
    bf16 is one scalar loop (16.8 -> 2.3 ms for 16M values here). ``out`` (contiguous, x's size, ``dtype``)
    receives the values in place, e.g. a parameter's own memory."""
    src = dtype_name(x)
    if src not in DATA_TYPES or dtype not in DATA_TYPES:
        raise TypeError(f"oneDNN convert goes between float32 and bfloat16, not {src} -> {dtype}")
    x = _contiguous(x)
    if out is None:
        out = paddle.empty(x.shape, dtype=dtype)
    elif dtype_name(out) != dtype or int(out.numel()) != int(x.numel()) or not out.is_contiguous():
        raise ValueError(
            f"oneDNN convert: out must be a contiguous {dtype} tensor of {int(x.numel())} values"
        )
    n = int(x.numel())
    if n == 0:
        return out
    _set_team()
    prim, src_mem, dst_mem = _reorder(n, src, dtype)
    lib = _lib()
    lib.dnnl_memory_set_data_handle(src_mem, ctypes.c_void_p(x.data_ptr()))
    lib.dnnl_memory_set_data_handle(dst_mem, ctypes.c_void_p(out.data_ptr()))
    args = (_ExecArg * 2)(_ExecArg(_ARG_FROM, src_mem), _ExecArg(_ARG_TO, dst_mem))
    stream = _stream()
    _check(lib.dnnl_primitive_execute(prim, stream, 2, args), "reorder")
    _check(lib.dnnl_stream_wait(stream), "stream_wait")
    return out


def _contiguous(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def gemm(a: paddle.Tensor, b: paddle.Tensor, trans_a: bool = False, trans_b: bool = False) -> paddle.Tensor:
    """``op(a) @ op(b)`` in float32 for 2-D CPU tensors of one dtype: float32 (``dnnl_sgemm``) or bfloat16
    (``dnnl_gemm_bf16bf16f32``, fp32 accumulation)."""
    if a.dtype != b.dtype or dtype_name(a) not in FUNCTIONS:
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
    fn = _functions()[dtype_name(a)]
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


def dtype_name(t: paddle.Tensor) -> str:
    """``float32``, ``bfloat16``...: a tensor's dtype as the names here spell it."""
    return str(t.dtype).split(".")[-1]


def astype(x: paddle.Tensor, dtype: str) -> paddle.Tensor:
    """``x.astype(dtype)``, and ``x`` itself when it is already ``dtype``."""
    return x if dtype_name(x) == dtype else x.astype(dtype)


class OneDnnMatmul(PyLayer):
    """``x @ w`` (``w`` [in, out], or [out, in] with ``transpose_w``) through oneDNN, with its backward.

    ``compute`` is the GEMMs' input dtype. For ``bfloat16`` the activations and the output's gradient are
    rounded to bf16 as a GPU's bf16 matmul takes them, products accumulate in fp32, and only the bf16 copy
    of ``x`` is kept for backward (half the fp32 activation). The weight's gradient comes back in the
    weight's dtype, or in fp32 onto its master where ``master_grads`` has one. ``cast(t, dtype)`` does the
    conversions (``astype``, or ``kernels.cast``).
    """

    @staticmethod
    def forward(ctx, x, w, transpose_w, compute, cast):
        x2 = cast(x.reshape([-1, x.shape[-1]]), compute)
        y = gemm(x2, cast(w, compute), trans_b=transpose_w)
        ctx.transpose_w, ctx.compute, ctx.cast, ctx.x_shape = transpose_w, compute, cast, x.shape
        # decided here: under non-reentrant recompute the saved ``w`` comes back as a copy that has
        # stop_gradient set, and reading the flag off it in backward dropped every weight's gradient
        ctx.x_dtype, ctx.weight_trains = dtype_name(x), not w.stop_gradient
        ctx.master = master_grads.master_of(w) if ctx.weight_trains else None
        ctx.save_for_backward(x2, w)
        return y.reshape([*x.shape[:-1], y.shape[-1]])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensor()
        cast = ctx.cast
        dy2 = cast(dy.reshape([-1, dy.shape[-1]]), ctx.compute)
        # x @ w: dx = dy @ w^T, dw = x^T @ dy.  x @ w^T: dx = dy @ w, dw = dy^T @ x.
        dx = cast(gemm(dy2, cast(w, ctx.compute), trans_b=not ctx.transpose_w), ctx.x_dtype).reshape(
            ctx.x_shape
        )
        if not ctx.weight_trains:
            return dx, None
        dw = gemm(dy2, x2, trans_a=True) if ctx.transpose_w else gemm(x2, dy2, trans_a=True)
        if ctx.master is not None:  # fp32, onto the master weight's gradient (engine.models.master_grads)
            master_grads.accumulate(ctx.master, dw)
            return dx, None
        return dx, cast(dw, dtype_name(w))


def matmul(
    x: paddle.Tensor, w: paddle.Tensor, transpose_w: bool = False, compute: str = "float32", cast=astype
) -> paddle.Tensor:
    """``x @ w`` (or ``x @ w^T``) over x's last axis through oneDNN, in ``compute`` (float32 or bfloat16)."""
    return OneDnnMatmul.apply(x, w, transpose_w, compute, cast)
