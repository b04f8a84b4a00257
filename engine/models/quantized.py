"""Linears held in fewer bits than they compute in: weight-only int8 / int4, FP8 (e4m3, tensor-wise), and
bf16 / fp16 storage on devices without low-precision kernels.

The quantized ones keep their weight and scales as buffers and dequantize per call. They live beside the
model because loading needs them (a PTQ export, a LoRA adapter trained on a weight-only base); FP8 QAT and
the PTQ pass that writes them stay with the training stages. The low-precision ones
(``hold_in_low_precision``) keep trainable bf16 / fp16 parameters under the usual names and upcast them per
call: that is how ``compute_type: bf16`` trains on a CPU, where Paddle has no bf16 matmul.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from engine.models import kernels, master_grads, onednn

FP8_MAX = 448.0  # largest finite float8 e4m3fn value
DECODER_LINEARS = ("qkv_proj", "o_proj", "up_gate_proj", "down_proj")
# compute_type / export ``quantization`` -> ``quantization_config.quant_method`` in config.json
QUANT_METHODS = {"wint8": "weight_only_int8", "wint4": "weight_only_int4", "fp8": "fp8"}


def quantize_weight(w: np.ndarray, bits: int, group_size: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric weight-only quantization of w [in, out] -> (int8 values, fp32 scales [groups, out]).

    ``group_size`` -1 means one scale per output channel; otherwise one per group of input rows.
    """
    qmax = 2 ** (bits - 1) - 1
    n_in, n_out = w.shape
    g = n_in if group_size <= 0 or n_in % group_size else group_size
    blocks = w.reshape(n_in // g, g, n_out).astype(np.float32, copy=False)
    scale = np.maximum(np.abs(blocks).max(axis=1) / qmax, 1e-12).astype(np.float32)  # [G, out]
    # one fp32 temporary, rounded and clipped in place (a large weight's copies add up while loading)
    t = blocks / scale[:, None, :]
    np.rint(t, out=t)
    np.clip(t, -qmax - 1, qmax, out=t)
    return t.astype(np.int8).reshape(n_in, n_out), scale


def dequantize_weight(q: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    n_in, n_out = q.shape
    groups = scale.shape[0]
    w = q.astype("float32").reshape([groups, n_in // groups, n_out]) * scale.unsqueeze(1)
    return w.reshape([n_in, n_out])


# A weight larger than this many elements (a 100k-token embedding used as the head) is upcast in blocks
# of output columns, so its fp32 copy never exists whole: 2**24 elements are 64 MiB in fp32.
UPCAST_BLOCK_ELEMENTS = 2**24


class UpcastMatmul(PyLayer):
    """``x @ upcast(stored)`` that keeps only ``stored`` (bf16, or int8 values) for backward and upcasts it
    again there. Autograd through a plain ``astype`` would keep the fp32 copy of every weight alive from
    forward to backward: more memory than an fp32 model, the opposite of holding weights in fewer bits.
    With ``block`` the weight is upcast that many output columns at a time."""

    @staticmethod
    def forward(ctx, x, stored, upcast, transpose_y, block):
        ctx.upcast, ctx.transpose_y, ctx.block = upcast, transpose_y, block
        # decided here: under non-reentrant recompute the saved ``stored`` comes back as a copy with
        # stop_gradient set (see onednn.OneDnnMatmul)
        ctx.weight_trains = not stored.stop_gradient
        ctx.master = master_grads.master_of(stored) if ctx.weight_trains else None
        ctx.save_for_backward(x, stored)
        outs = [kernels.matmul_nograd(x, upcast(w), transpose_y) for w in _blocks(stored, transpose_y, block)]
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=-1)

    @staticmethod
    def backward(ctx, dy):
        x, stored = ctx.saved_tensor()
        x2 = x.reshape([-1, x.shape[-1]])
        dx, dws, start = None, [], 0
        for w in _blocks(stored, ctx.transpose_y, ctx.block):
            n = w.shape[0 if ctx.transpose_y else 1]
            g = dy[..., start : start + n] if ctx.block else dy
            start += n
            part = kernels.matmul_nograd(g, ctx.upcast(w), not ctx.transpose_y)
            dx = part if dx is None else dx + part
            if ctx.weight_trains:
                g2 = g.reshape([-1, n])
                dw = kernels.matmul_at_b(g2, x2) if ctx.transpose_y else kernels.matmul_at_b(x2, g2)
                if ctx.master is not None:  # fp32, onto the master's gradient (engine.models.master_grads)
                    axis = (0 if ctx.transpose_y else 1) if ctx.block else None
                    master_grads.accumulate(ctx.master, dw, axis, start - n)
                else:
                    dws.append(kernels.cast(dw, onednn.dtype_name(stored)))
        if not ctx.weight_trains or ctx.master is not None:
            return dx, None
        return dx, dws[0] if len(dws) == 1 else paddle.concat(dws, axis=0 if ctx.transpose_y else 1)


def _blocks(stored: paddle.Tensor, transpose_y: bool, block: int | None) -> list[paddle.Tensor]:
    """The weight in blocks of ``block`` output columns (rows of a transposed weight), or whole."""
    if not block:
        return [stored]
    n = stored.shape[0 if transpose_y else 1]
    return [stored[a : a + block] if transpose_y else stored[:, a : a + block] for a in range(0, n, block)]


def upcast_matmul(
    x: paddle.Tensor, stored: paddle.Tensor, upcast=None, transpose_y: bool = False
) -> paddle.Tensor:
    """``x @ stored`` computed in x's dtype, for weights held in fewer bits (``UpcastMatmul``). A custom
    ``upcast`` (dequantization) gets the whole stored tensor; the default cast goes block by block."""
    block = None
    if upcast is None:
        compute = onednn.dtype_name(x)
        upcast = lambda w: kernels.cast(w, compute)  # noqa: E731  (oneDNN's reorder where it is on)
        n_in = stored.shape[1 if transpose_y else 0]
        if int(stored.numel()) > UPCAST_BLOCK_ELEMENTS:
            block = max(1, UPCAST_BLOCK_ELEMENTS // n_in)
    return UpcastMatmul.apply(x, stored, upcast, transpose_y, block)


def low_precision_matmul(x: paddle.Tensor, stored: paddle.Tensor, transpose_y: bool = False) -> paddle.Tensor:
    """``x @ stored`` for an fp32 ``x`` and a weight held in bf16: oneDNN's bf16 GEMM where it pays
    (``kernels.bf16_gemm_takes``), else the fp32 upcast (``upcast_matmul``)."""
    if stored.dtype == paddle.bfloat16 and kernels.bf16_gemm_takes(math.prod(x.shape[:-1])):
        return onednn.matmul(x, stored, transpose_y, "bfloat16", cast=kernels.cast)
    return upcast_matmul(x, stored, transpose_y=transpose_y)


class WeightOnlyLinear(nn.Layer):
    """A frozen linear held as int8 values (int4 range for ``bits=4``) plus scales; dequantized per call."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, bits: int, bias: paddle.Tensor | None = None):
        super().__init__()
        self.bits = bits
        self.in_features, self.out_features = int(q.shape[0]), int(q.shape[1])
        self.register_buffer("weight_quant", paddle.to_tensor(q, dtype="int8"), persistable=True)
        self.register_buffer("weight_scale", paddle.to_tensor(scale, dtype="float32"), persistable=True)
        self.bias = bias
        if bias is not None:
            bias.stop_gradient = True

    @classmethod
    def from_linear(cls, base: nn.Linear, bits: int, group_size: int = -1) -> WeightOnlyLinear:
        q, scale = quantize_weight(base.weight.astype("float32").numpy(), bits, group_size)
        return cls(q, scale, bits, base.bias)

    def dequantized(self) -> paddle.Tensor:
        return dequantize_weight(self.weight_quant, self.weight_scale)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        fast = kernels.weight_only_linear(self, x)  # Paddle's weight-only GEMM where the device has it
        if fast is not None:
            return fast
        scale = self.weight_scale
        y = upcast_matmul(x, self.weight_quant, lambda q: dequantize_weight(q, scale).astype(x.dtype))
        return y + self.bias.astype(y.dtype) if self.bias is not None else y


class FP8WeightLinear(nn.Layer):
    """PTQ FP8: weight stored as e4m3 values with one tensor-wise scale; dequantized per call."""

    def __init__(self, w_fp8: paddle.Tensor, scale: float, bias: paddle.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = int(w_fp8.shape[0]), int(w_fp8.shape[1])
        self.register_buffer("weight_quant", w_fp8, persistable=True)
        self.register_buffer("weight_scale", paddle.to_tensor([scale], dtype="float32"), persistable=True)
        self.bias = bias

    @classmethod
    def from_linear(cls, base: nn.Linear) -> FP8WeightLinear:
        w = base.weight.astype("float32")
        scale = max(float(paddle.max(paddle.abs(w))) / FP8_MAX, 1e-12)
        return cls((w / scale).astype(paddle.float8_e4m3fn), scale, base.bias)

    def dequantized(self) -> paddle.Tensor:
        return self.weight_quant.astype("float32") * self.weight_scale

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.linear(x, self.dequantized().astype(x.dtype), self.bias)


def dequantized_linear(layer: nn.Layer) -> nn.Linear:
    """A plain nn.Linear with the (dequantized) weight of any linear kind."""
    if isinstance(layer, nn.Linear):
        return layer
    lin = nn.Linear(layer.in_features, layer.out_features, bias_attr=layer.bias is not None and None)
    w = layer.dequantized() if hasattr(layer, "dequantized") else layer.weight
    lin.weight.set_value(w.astype("float32"))
    if layer.bias is not None:
        lin.bias.set_value(layer.bias)
    return lin


def decoder_linears(model: nn.Layer, targets=DECODER_LINEARS):
    """(parent, attribute, full name) of every plain linear of the decoder (the vision encoder is left out)."""
    for name, layer in list(model.named_sublayers(include_self=True)):
        if name.startswith(("vision_model", "resampler_model")):
            continue
        for attr in targets:
            child = getattr(layer, attr, None)
            if isinstance(child, nn.Linear):
                yield layer, attr, f"{name}.{attr}"


def bits_for(name: str, compute_type: str) -> int:
    """wint4/8: int4 for expert FFNs (the bulk of an MoE's weights), int8 for everything else."""
    if compute_type == "wint4/8" and ".experts." in name:
        return 4
    if compute_type == "wint4":
        return 4
    return 8


def apply_weight_only(model: nn.Layer, compute_type: str, group_size: int = -1) -> dict[str, int]:
    """Replace decoder linears with frozen weight-only int8/int4 linears. Returns counts per bit width."""
    counts = {4: 0, 8: 0}
    for parent, attr, name in decoder_linears(model):
        bits = bits_for(name, compute_type)
        setattr(parent, attr, WeightOnlyLinear.from_linear(getattr(parent, attr), bits, group_size))
        counts[bits] += 1
    return counts


class LowPrecisionLinear(nn.Layer):
    """A linear whose weight (and bias) is held in bf16 / fp16 and upcast to the input's dtype per call.

    The output is rounded to the storage dtype and back, as a bf16 matmul on a GPU would write it, so the
    numerics on a CPU follow those of a GPU run rather than of fp32. Gradients flow back through the casts
    into low-precision gradients of the weight.
    """

    def __init__(self, weight: paddle.Tensor, bias: paddle.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = int(weight.shape[0]), int(weight.shape[1])
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_linear(cls, base: nn.Linear, dtype: str) -> LowPrecisionLinear:
        # the same Parameter objects, cast in place: names, stop_gradient and LoRA wrapping carry over
        base._to_impl(dtype=dtype, include_sublayers=False, floating_only=True)
        return cls(base.weight, base.bias)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if x.dtype == self.weight.dtype:  # a device with low-precision kernels: nothing to emulate
            return F.linear(x, self.weight, self.bias)
        y = low_precision_matmul(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.astype(x.dtype)
        return round_through(y, onednn.dtype_name(self.weight))


class RoundThrough(PyLayer):
    """``y`` rounded to ``dtype`` and back, its gradient rounded the same way: what ``y.astype(dtype).astype(
    y.dtype)`` computes, forward and backward, with both conversions through ``kernels.cast``."""

    @staticmethod
    def forward(ctx, y, dtype):
        ctx.dtype, ctx.y_dtype = dtype, onednn.dtype_name(y)
        return kernels.cast(kernels.cast(y, dtype), ctx.y_dtype)

    @staticmethod
    def backward(ctx, dy):
        return kernels.cast(kernels.cast(dy, ctx.dtype), ctx.y_dtype)


def round_through(y: paddle.Tensor, dtype: str) -> paddle.Tensor:
    """``y`` rounded to ``dtype`` (a low-precision matmul's output) and back to its own dtype."""
    if kernels.enabled("onednn_cast") and {onednn.dtype_name(y), dtype} == {"float32", "bfloat16"}:
        return RoundThrough.apply(y, dtype)
    return y.astype(dtype).astype(y.dtype)


class LowPrecisionEmbedding(nn.Layer):
    """A token embedding held in bf16 / fp16 whose rows come out in ``compute_dtype`` (exact: an upcast)."""

    def __init__(self, weight: paddle.Tensor, compute_dtype: str = "float32"):
        super().__init__()
        self.weight = weight
        self.compute_dtype = compute_dtype

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return F.embedding(ids, self.weight).astype(self.compute_dtype)


def hold_in_low_precision(model: nn.Layer, dtype: str, compute_dtype: str = "float32") -> dict[str, int]:
    """Hold the decoder's linears, token embedding and untied head in ``dtype``, computing in fp32.

    Norms, MoE router gates and correction biases stay fp32 (ERNIE routes in fp32), and so does a VL
    model's vision encoder and resampler. Returns how many tensors of each kind were converted.
    """
    counts = {"linears": 0, "embeddings": 0, "heads": 0}
    for parent, attr, _ in list(decoder_linears(model)):
        setattr(parent, attr, LowPrecisionLinear.from_linear(getattr(parent, attr), dtype))
        counts["linears"] += 1
    embed = model.ernie.embed_tokens
    embed._to_impl(dtype=dtype, include_sublayers=False, floating_only=True)
    model.ernie.embed_tokens = LowPrecisionEmbedding(embed.weight, compute_dtype)
    counts["embeddings"] += 1
    if not model.config.tie_word_embeddings:
        model.lm_head._to_impl(dtype=dtype, include_sublayers=False, floating_only=True)
        counts["heads"] += 1
    return counts


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], [in, out] with even ``in`` -> uint8 [in / 2, out], two's-complement nibbles."""
    if q.shape[0] % 2:
        raise ValueError(f"int4 packing needs an even input dimension, got {q.shape[0]}")
    nib = (q.astype(np.int16) & 0xF).astype(np.uint8)
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_int4``."""
    packed = packed.astype(np.uint8)
    lo, hi = (packed & 0xF).astype(np.int8), (packed >> 4).astype(np.int8)
    lo, hi = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
    out = np.empty((packed.shape[0] * 2, packed.shape[1]), np.int8)
    out[0::2], out[1::2] = lo, hi
    return out
