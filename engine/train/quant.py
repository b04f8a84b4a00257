"""Quantization: FP8 QAT (fake-quantized weights and activations), weight-only int8/int4 bases, and PTQ.

- ``compute_type: fp8``: every decoder linear becomes ``FP8Linear``: tensor-wise e4m3 fake quantization of
  its weight and input with straight-through gradients, optionally after a block Hadamard rotation of the
  input dimension (block 32) that spreads outliers; the activation scale starts from the first batch's
  absolute maximum and then follows an EMA (rate 0.01).
- ``compute_type: wint8 | wint4/8``: linears become ``WeightOnlyLinear`` (frozen int8 / int4 values with
  per-channel or group-wise scales; int4 for expert FFNs in wint4/8), with LoRA trained on top.
- PTQ at export (``quantize_for_export``): weight-only int8, group-wise int4, or FP8, with a perplexity
  report before and after; the quantized tensors are written with their scales and a
  ``quantization_config`` in config.json, which ``load_quantized_model`` reads back.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8 e4m3fn value
DECODER_LINEARS = ("qkv_proj", "o_proj", "up_gate_proj", "down_proj")
QUANT_METHODS = {"wint8": "weight_only_int8", "wint4": "weight_only_int4", "fp8": "fp8"}


# ---- FP8 fake quantization ----------------------------------------------------------------------------


def fp8_round(x: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    """x -> nearest e4m3 value of x/scale, times scale (saturating), in x's dtype."""
    y = paddle.clip(x.astype("float32") / scale, -FP8_MAX, FP8_MAX)
    return (y.astype(paddle.float8_e4m3fn).astype("float32") * scale).astype(x.dtype)


def fake_quant_fp8(x: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    """FP8 rounding in the forward pass, identity gradient in the backward pass (straight-through)."""
    return x + (fp8_round(x, scale) - x).detach()


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix of size n (a power of two)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


class FP8Linear(nn.Layer):
    """A linear whose weight and input pass through tensor-wise e4m3 fake quantization (QAT)."""

    def __init__(self, base: nn.Linear, hadamard_block: int = 32, ema_rate: float = 0.01):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.in_features, self.out_features = int(base.weight.shape[0]), int(base.weight.shape[1])
        self.ema_rate = ema_rate
        self.block = hadamard_block if hadamard_block and self.in_features % hadamard_block == 0 else 0
        if self.block:
            self.register_buffer("hadamard", paddle.to_tensor(hadamard(self.block)), persistable=False)
        # 0 means "not seen a batch yet"; persistable so a resumed run continues the same EMA.
        self.register_buffer("act_scale", paddle.zeros([1], dtype="float32"), persistable=True)
        # The EMA moves once per optimiser step (``next_step``), however many forwards the step makes
        # (micro-batches, the re-forward of recomputation).
        self.step, self._ema_step = 0, -1

    def rotate(self, x: paddle.Tensor, axis_first: bool = False) -> paddle.Tensor:
        """Multiply the input dimension by the block-diagonal Hadamard matrix (orthonormal, so x W = xH HᵀW)."""
        if axis_first:  # weight [in, out]: Hᵀ applied per block of rows
            w = x.reshape([self.in_features // self.block, self.block, -1])
            return paddle.matmul(self.hadamard, w, transpose_x=True).reshape(x.shape)
        shape = x.shape
        xb = x.reshape([*shape[:-1], self.in_features // self.block, self.block])
        return paddle.matmul(xb, self.hadamard).reshape(shape)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        w = self.weight
        if self.block:
            x, w = self.rotate(x), self.rotate(w, axis_first=True)
        amax = paddle.max(paddle.abs(x.detach().astype("float32"))).reshape([1])
        current = paddle.clip(amax / FP8_MAX, min=1e-12)
        seen = float(self.act_scale.numpy()[0]) > 0.0
        if self.training and self._ema_step != self.step:
            self._ema_step = self.step
            with paddle.no_grad():
                new = (1 - self.ema_rate) * self.act_scale + self.ema_rate * current if seen else current
                self.act_scale.set_value(new)
        scale = self.act_scale if seen or self.training else current
        w_scale = paddle.clip(paddle.max(paddle.abs(w.detach().astype("float32"))) / FP8_MAX, min=1e-12)
        xq = fake_quant_fp8(x, scale)
        wq = fake_quant_fp8(w, w_scale)
        out = paddle.matmul(xq, wq)
        return out if self.bias is None else out + self.bias


# ---- weight-only int8 / int4 ---------------------------------------------------------------------------


def quantize_weight(w: np.ndarray, bits: int, group_size: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric weight-only quantization of w [in, out] -> (int8 values, fp32 scales [groups, out]).

    ``group_size`` -1 means one scale per output channel; otherwise one per group of input rows.
    """
    qmax = 2 ** (bits - 1) - 1
    n_in, n_out = w.shape
    g = n_in if group_size <= 0 or n_in % group_size else group_size
    blocks = w.reshape(n_in // g, g, n_out).astype(np.float32)
    scale = np.maximum(np.abs(blocks).max(axis=1) / qmax, 1e-12).astype(np.float32)  # [G, out]
    q = np.clip(np.rint(blocks / scale[:, None, :]), -qmax - 1, qmax).astype(np.int8)
    return q.reshape(n_in, n_out), scale


def dequantize_weight(q: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    n_in, n_out = q.shape
    groups = scale.shape[0]
    w = q.astype("float32").reshape([groups, n_in // groups, n_out]) * scale.unsqueeze(1)
    return w.reshape([n_in, n_out])


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
        return F.linear(x, self.dequantized().astype(x.dtype), self.bias)


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


# ---- swapping layers ----------------------------------------------------------------------------------


def _decoder_linears(model: nn.Layer, targets=DECODER_LINEARS):
    for name, layer in list(model.named_sublayers(include_self=True)):
        if name.startswith(("vision_model", "resampler_model")):
            continue
        for attr in targets:
            child = getattr(layer, attr, None)
            if isinstance(child, nn.Linear):
                yield layer, attr, f"{name}.{attr}"


def apply_fp8_qat(model: nn.Layer, hadamard_block: int = 32, ema_rate: float = 0.01) -> int:
    """Swap decoder linears for FP8 fake-quantized ones (same parameter names). Returns how many."""
    n = 0
    for parent, attr, _ in _decoder_linears(model):
        setattr(parent, attr, FP8Linear(getattr(parent, attr), hadamard_block, ema_rate))
        n += 1
    return n


def next_step(model: nn.Layer) -> None:
    """Tell the FP8 layers an optimiser step has passed, so their activation-scale EMA moves once."""
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, FP8Linear):
            layer.step += 1


def unwrap_fp8(model: nn.Layer) -> None:
    """Back to plain linears (same weight parameters) for saving the trained model."""
    for name, layer in list(model.named_sublayers(include_self=True)):
        for attr in DECODER_LINEARS:
            child = getattr(layer, attr, None)
            if isinstance(child, FP8Linear):
                lin = nn.Linear(
                    child.in_features, child.out_features, bias_attr=child.bias is not None and None
                )
                lin.weight = child.weight
                if child.bias is not None:
                    lin.bias = child.bias
                setattr(layer, attr, lin)
        del name


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
    for parent, attr, name in _decoder_linears(model):
        bits = bits_for(name, compute_type)
        setattr(parent, attr, WeightOnlyLinear.from_linear(getattr(parent, attr), bits, group_size))
        counts[bits] += 1
    return counts


# ---- PTQ at export -------------------------------------------------------------------------------------


def quantize_for_export(model: nn.Layer, method: str, group_size: int = 64) -> int:
    """PTQ in place: ``wint8`` (per channel), ``wint4`` (group-wise), ``fp8`` (tensor-wise e4m3)."""
    n = 0
    for parent, attr, _ in _decoder_linears(model):
        base = getattr(parent, attr)
        if method == "wint8":
            new = WeightOnlyLinear.from_linear(base, 8, -1)
        elif method == "wint4":
            new = WeightOnlyLinear.from_linear(base, 4, group_size)
        elif method == "fp8":
            new = FP8WeightLinear.from_linear(base)
        else:
            raise ValueError(f"quantization must be wint8, wint4 or fp8, not {method!r}")
        setattr(parent, attr, new)
        n += 1
    return n


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


def quantized_state(model: nn.Layer) -> dict[str, np.ndarray]:
    """Weights for saving: quantized linears as ``<name>.weight`` (int8 or e4m3 bytes) + ``weight_scale``."""
    out: dict[str, np.ndarray] = {}
    quant_prefixes = set()
    for name, layer in model.named_sublayers():
        if isinstance(layer, WeightOnlyLinear | FP8WeightLinear):
            quant_prefixes.add(name)
            if isinstance(layer, FP8WeightLinear):
                out[f"{name}.weight"] = layer.weight_quant.view(paddle.uint8).numpy()
            elif layer.bits == 4:
                out[f"{name}.weight"] = pack_int4(layer.weight_quant.numpy())
            else:
                out[f"{name}.weight"] = layer.weight_quant.numpy()
            out[f"{name}.weight_scale"] = layer.weight_scale.numpy()
    for key, value in model.state_dict().items():
        prefix = key.rsplit(".", 1)[0]
        if prefix in quant_prefixes and key.endswith((".weight_quant", ".weight_scale")):
            continue
        out[key] = value.astype("float32").numpy() if value.dtype != paddle.float32 else value.numpy()
    return out


def save_quantized(
    model: nn.Layer, directory: str | Path, method: str, group_size: int, max_shard_size: str
) -> None:
    """config.json with ``quantization_config`` + safetensors holding the quantized tensors and scales."""
    from engine.models.checkpoint import write_tensors

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["dtype"] = "float32"
    cfg["quantization_config"] = {
        "quant_method": QUANT_METHODS[method],
        "bits": {"wint8": 8, "wint4": 4, "fp8": 8}[method],
        "group_size": group_size if method == "wint4" else -1,
        "storage": "int4 values in int8"
        if method == "wint4"
        else ("float8_e4m3fn bits" if method == "fp8" else "int8"),
        "modules": list(DECODER_LINEARS),
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tensors(quantized_state(model), d, "float32", max_shard_size)


def load_quantized_model(directory: str | Path) -> nn.Layer:
    """Read a PTQ export back: quantized linears stay quantized (dequantized per call)."""
    from engine.models.checkpoint import TensorStore
    from engine.models.config import ErnieConfig
    from engine.models.ernie import ErnieForCausalLM

    d = Path(directory)
    raw = json.loads((d / "config.json").read_text())
    qc = raw["quantization_config"]
    method = {v: k for k, v in QUANT_METHODS.items()}.get(qc.get("quant_method"))
    if method is None:
        raise ValueError(
            f"{d}/config.json: unsupported quantization_config.quant_method {qc.get('quant_method')!r}"
        )
    model = ErnieForCausalLM(ErnieConfig.from_dict(raw))
    store = TensorStore(d)
    for parent, attr, name in list(_decoder_linears(model)):
        base = getattr(parent, attr)
        bias = base.bias
        q = store.get(f"{name}.weight")
        scale = store.get(f"{name}.weight_scale")
        if method == "fp8":
            w8 = paddle.to_tensor(q.astype(np.uint8)).view(paddle.float8_e4m3fn)
            new = FP8WeightLinear(w8, float(scale.reshape(-1)[0]), bias)
        elif qc.get("bits", 8) == 4:
            new = WeightOnlyLinear(unpack_int4(q), scale.astype(np.float32), 4, bias)
        else:
            new = WeightOnlyLinear(q.astype(np.int8), scale.astype(np.float32), 8, bias)
        setattr(parent, attr, new)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name not in store:
            raise ValueError(f"{d}: quantized checkpoint lacks tensor {name}")
        p.set_value(paddle.to_tensor(store.get(name), dtype=p.dtype))
    model.eval()
    return model


def is_quantized_dir(directory: str | Path) -> bool:
    cfg = Path(directory) / "config.json"
    if not cfg.exists():
        return False
    try:
        return "quantization_config" in json.loads(cfg.read_text())
    except json.JSONDecodeError:
        return False
