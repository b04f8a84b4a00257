"""The decoder's per-row fp32 ops as threaded C loops (``cpu_ops.c``), built here once per machine and called
with ``ctypes`` on the tensors' memory, as ``onednn`` calls oneDNN.

Paddle 3.3.1's CPU elementwise ops run on one thread, and RMSNorm and the rotary embedding are eight or nine
of them per call. ``cpu_ops.c`` does each in one OpenMP loop over rows (docs/internals.md, "Native CPU ops").

Building: ``build()`` compiles the one source file with the machine's C compiler (``CC``, else ``cc``) at
``-O3 -march=native`` into ``ERNIE_STUDIO_NATIVE_HOME`` (default ``~/.cache/ernie-studio/native``), named by a
hash of the source, the flags, the compiler's version and the CPU's flags, so a new source or another CPU
gets its own library and two processes never load a half-written one (written aside, then renamed).
``make`` builds it before the tests and the studio; a process that finds none builds it on first use (well
under a second), and where no compiler exists the paths are off and ``kernels`` says why. The library links
the OpenMP runtime Paddle's wheel bundles (``libiomp5``), so its loops run on the thread team that
``onednn.set_threads`` sizes, beside oneDNN's, instead of a second runtime's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import paddle
from paddle.autograd import PyLayer

from engine.cpuinfo import this_cpu
from engine.models import onednn
from engine.models.plain_ops import ATTENTION_BLOCK

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
HOME_ENV = "ERNIE_STUDIO_NATIVE_HOME"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math")
VERSION = 2  # ernie_cpu_ops_version() of the source this module speaks to


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "ernie-studio" / "native")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _openmp_link() -> list[str]:
    """Link Paddle's bundled Intel OpenMP where the wheel has it (one runtime in the process), else GNU's."""
    iomp = onednn._libs_dir() / "libiomp5.so"
    if iomp.exists():
        return [str(iomp), f"-Wl,-rpath,{iomp.parent}"]
    return []


def library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join(CFLAGS).encode(),
        version.encode(),
        " ".join(sorted(this_cpu()[1])).encode(),
    ):
        key.update(part)
        key.update(b"\0")
    key.update(" ".join(_openmp_link()).encode())
    return home() / f"libernie_cpu_ops-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The library for this source, compiler and CPU, compiled if it is not there yet. Raises ``RuntimeError``
    naming the problem when there is no compiler or the compile fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc) to build engine/models/cpu_ops.c")
    out = library_path(cc)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [cc, *CFLAGS, "-o", str(partial), str(SOURCE), *_openmp_link(), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"building {SOURCE.name} failed: {' '.join(cmd)}\n{done.stderr.strip()[-2000:]}"
            )
        os.replace(partial, out)
    log.info("built %s", out)
    return out


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.ernie_cpu_ops_version.restype = ctypes.c_int
    lib.ernie_rms_norm_forward.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32]
    lib.ernie_rms_norm_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
    lib.ernie_rope.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, f32]
    lib.ernie_sum_squares.argtypes, lib.ernie_sum_squares.restype = [ptr, i64], ctypes.c_double
    lib.ernie_scale.argtypes = [ptr, i64, f32]
    for fn in (lib.ernie_rms_norm_forward, lib.ernie_rms_norm_backward, lib.ernie_rope, lib.ernie_scale):
        fn.restype = None
    # q, k, v, mask, mask batch stride, key starts, their block (``_attention_args``)
    lead = [ptr, ptr, ptr, ptr, i64, ptr, i64]
    dims = [i64, i64, i64, i64, i64, f32, ptr]  # batch, time, heads, kv heads, head dim, scale, sgemm
    lib.ernie_attention_forward.argtypes = [*lead, ptr, ptr, *dims]  # out, lse
    lib.ernie_attention_backward.argtypes = [*lead, *[ptr] * 6, *dims]  # out, lse, dout, dq, dk, dv
    lib.ernie_attention_forward.restype = lib.ernie_attention_backward.restype = ctypes.c_int
    return lib


def available() -> str | None:
    """None when the library builds (or is built) and loads here, else why not."""
    try:
        found = _lib().ernie_cpu_ops_version()
    except (OSError, RuntimeError) as exc:
        return str(exc).splitlines()[0][:300]
    if found != VERSION:
        return f"{SOURCE.name} says version {found}, this module speaks {VERSION}"
    return None


def _ptr(t: paddle.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32_rows(t: paddle.Tensor) -> paddle.Tensor:
    if t.dtype != paddle.float32:
        raise TypeError(f"native CPU ops take float32 tensors, got {t.dtype}")
    return onednn._contiguous(t.reshape([-1, t.shape[-1]]))


def rms_norm_forward(x: paddle.Tensor, w: paddle.Tensor, eps: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last axis, and the per-row ``rsqrt`` (for backward)."""
    x2 = _fp32_rows(x)
    rows, cols = x2.shape
    y = paddle.empty(x2.shape, dtype="float32")
    rstd = paddle.empty([rows], dtype="float32")
    onednn._set_team()
    _lib().ernie_rms_norm_forward(
        x2.data_ptr(), _fp32_rows(w).data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, cols, eps
    )
    return y.reshape(x.shape), rstd


def rms_norm_backward(
    x: paddle.Tensor, w: paddle.Tensor, rstd: paddle.Tensor, dy: paddle.Tensor, want_dx: bool, want_dw: bool
) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
    x2, dy2 = _fp32_rows(x), _fp32_rows(dy)
    rows, cols = x2.shape
    dx = paddle.empty(x2.shape, dtype="float32") if want_dx else None
    dw = paddle.empty([cols], dtype="float32") if want_dw else None
    onednn._set_team()
    _lib().ernie_rms_norm_backward(
        x2.data_ptr(),
        _fp32_rows(w).data_ptr(),
        rstd.data_ptr(),
        dy2.data_ptr(),
        _ptr(dx),
        _ptr(dw),
        rows,
        cols,
    )
    return (dx.reshape(x.shape) if dx is not None else None), (
        dw.reshape(w.shape) if dw is not None else None
    )


class RMSNormNative(PyLayer):
    """fp32 RMSNorm (``plain_ops.rms_norm_plain``) forward and backward through ``cpu_ops.c``; keeps the input
    and one value per row."""

    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = rms_norm_forward(x, w, eps)
        # decided here (recompute's saved copies all say stop_gradient; Paddle wants None for those)
        ctx.wants = (not x.stop_gradient, not w.stop_gradient)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensor()
        return rms_norm_backward(x, w, rstd, dy, *ctx.wants)


def rms_norm(x: paddle.Tensor, w: paddle.Tensor, eps: float) -> paddle.Tensor:
    return RMSNormNative.apply(x, w, eps)


def fits_rope(x: paddle.Tensor, cos: paddle.Tensor) -> bool:
    """Whether ``rope`` takes this x [B, T, H, D] and angle table (one angle per row and pair)."""
    b, t, _, d = x.shape
    return list(cos.shape) == [b, t, 1, d // 2]


def rotate(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, sign: float = 1.0) -> paddle.Tensor:
    """``plain_ops.apply_rotary_plain`` for fp32 x [B, T, H, D] and cos / sin [B, T, 1, D / 2]; ``sign`` -1
    turns by the opposite angle."""
    b, t, h, d = x.shape
    if not fits_rope(x, cos) or list(sin.shape) != list(cos.shape):
        raise ValueError(
            f"native rope takes cos / sin of [B, T, 1, D/2] = {[b, t, 1, d // 2]}, got {cos.shape}"
        )
    x2, c2, s2 = _fp32_rows(x), _fp32_rows(cos), _fp32_rows(sin)
    out = paddle.empty(x.shape, dtype="float32")
    onednn._set_team()
    _lib().ernie_rope(x2.data_ptr(), c2.data_ptr(), s2.data_ptr(), out.data_ptr(), b * t, h, d, sign)
    return out


def _fp32_flat(t: paddle.Tensor) -> paddle.Tensor:
    if t.dtype != paddle.float32 or not t.is_contiguous():
        raise TypeError(f"native CPU ops take contiguous float32 tensors, got {t.dtype}")
    return t


def sum_squares(t: paddle.Tensor) -> float:
    """sum(t^2) of a contiguous fp32 tensor, accumulated in float64 (fp32 within blocks of 4,096)."""
    t = _fp32_flat(t)
    onednn._set_team()
    return float(_lib().ernie_sum_squares(t.data_ptr(), int(t.numel())))


def scale_(t: paddle.Tensor, factor: float) -> None:
    """t *= factor in place (a contiguous fp32 tensor)."""
    t = _fp32_flat(t)
    onednn._set_team()
    _lib().ernie_scale(t.data_ptr(), int(t.numel()), factor)


def fits_attention(q: paddle.Tensor, k: paddle.Tensor, mask: paddle.Tensor | None) -> bool:
    """Whether ``attention`` takes these: fp32 q [B, T, H, D] and k [B, T, Hkv, D] (the square causal case) and a
    mask of [B or 1, 1, T, T] or none."""
    b, t, nq, _ = q.shape
    if q.dtype != paddle.float32 or k.shape[1] != t or k.shape[0] != b or nq % k.shape[2]:
        return False
    return mask is None or (
        len(mask.shape) == 4 and mask.shape[0] in (1, b) and list(mask.shape[1:]) == [1, t, t]
    )


def _attention_args(q, k, v, mask, starts) -> list:
    """The leading arguments of both calls: q, k, v, the fp32 contiguous mask (or none) and its batch stride,
    the int64 key starts (or none) and the queries each covers."""
    return [
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        _ptr(mask),
        0 if mask is None or mask.shape[0] == 1 else int(mask.shape[2] * mask.shape[3]),
        None if starts is None else starts.ctypes.data,
        ATTENTION_BLOCK,
    ]


def _attention_dims(q, k):
    b, t, nq, hd = q.shape
    sgemm = ctypes.cast(onednn._functions()["float32"], ctypes.c_void_p).value
    return [b, t, nq, k.shape[2], hd, 1.0 / math.sqrt(hd), sgemm]


def attention_forward(q, k, v, mask, starts) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(out [B, T, H, D], log-sum-exp [B, H, T]) of ``AttentionNative`` for contiguous q, k, v."""
    b, t, nq, _ = q.shape
    out = paddle.empty(q.shape, dtype="float32")
    lse = paddle.empty([b, nq, t], dtype="float32")
    onednn._set_team()
    args = _attention_args(q, k, v, mask, starts)
    if _lib().ernie_attention_forward(*args, out.data_ptr(), lse.data_ptr(), *_attention_dims(q, k)):
        raise RuntimeError("cpu_ops.c attention forward failed (out of memory, or an sgemm error)")
    return out, lse


def attention_backward(q, k, v, mask, starts, out, lse, dout) -> list[paddle.Tensor]:
    """[dq, dk, dv] of ``AttentionNative`` from the kept out and lse."""
    grads = [paddle.empty(t.shape, dtype="float32") for t in (q, k, v)]
    onednn._set_team()
    args = _attention_args(q, k, v, mask, starts)
    ptrs = [out.data_ptr(), lse.data_ptr(), dout.data_ptr(), *(g.data_ptr() for g in grads)]
    if _lib().ernie_attention_backward(*args, *ptrs, *_attention_dims(q, k)):
        raise RuntimeError("cpu_ops.c attention backward failed (out of memory, or an sgemm error)")
    return grads


class AttentionNative(PyLayer):
    """Causal softmax attention (``plain_ops.attention_plain`` with ``causal``) forward and backward through
    ``cpu_ops.c``; keeps q, k, v, the output and one log-sum-exp per query and head, not the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, mask, starts):
        q, k, v = (onednn._contiguous(t) for t in (q, k, v))
        out, lse = attention_forward(q, k, v, mask, starts)
        ctx.starts, ctx.mask = starts, mask
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        grads = attention_backward(q, k, v, ctx.mask, ctx.starts, out, lse, onednn._contiguous(dout))
        return tuple(grads) if ctx.mask is None else (*grads, None)


def attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor | None, key_starts=None
) -> paddle.Tensor:
    """Causal attention of fp32 q [B, T, H, D] over k / v [B, T, Hkv, D] (``fits_attention``), with an
    additive mask [B or 1, 1, T, T] or none, and ``key_starts`` (the first visible key per block of
    ``ATTENTION_BLOCK`` queries) or None."""
    if mask is not None:  # converted once, for forward and backward
        mask = onednn._contiguous(mask.detach().astype("float32"))
    starts = np.ascontiguousarray(key_starts, dtype=np.int64) if key_starts else None
    blocks = -(-q.shape[1] // ATTENTION_BLOCK)
    if starts is not None and starts.shape != (blocks,):  # C reads one per block of queries, no more
        raise ValueError(
            f"key_starts needs one entry per {ATTENTION_BLOCK} queries ({blocks}), got {starts.shape}"
        )
    return AttentionNative.apply(q, k, v, mask, starts)


if __name__ == "__main__":  # `make` builds the library ahead of the tests and the studio
    print(build())
