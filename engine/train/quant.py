"""Quantization for training and export: FP8 QAT (fake-quantized weights and activations) and PTQ.

The quantized linears themselves (weight-only int8/int4, FP8 weights) and loading them are in
``engine.models.quantized`` / ``engine.models.loading``; this module applies them to a model.

- ``compute_type: fp8``: every decoder linear becomes ``FP8Linear``: tensor-wise e4m3 fake quantization of
  its weight and input with straight-through gradients, optionally after a block Hadamard rotation of the
  input dimension (block 32) that spreads outliers; the activation scale starts from the first batch's
  absolute maximum and then follows an EMA (rate 0.01).
- ``compute_type: wint8 | wint4/8``: linears become ``WeightOnlyLinear`` (``apply_weight_only``: frozen
  int8 / int4 values with per-channel or group-wise scales; int4 for expert FFNs in wint4/8), with LoRA
  trained on top.
- PTQ at export (``quantize_for_export``): weight-only int8, group-wise int4, or FP8, with a perplexity
  report before and after; the quantized tensors are written with their scales and a
  ``quantization_config`` in config.json, which ``engine.models.loading.load_quantized_model`` reads back.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import paddle
from paddle import nn

from engine.models.quantized import (
    DECODER_LINEARS,
    FP8_MAX,
    QUANT_METHODS,
    FP8WeightLinear,
    WeightOnlyLinear,
    decoder_linears,
    pack_int4,
    quantize_weight,
)

log = logging.getLogger(__name__)


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


# ---- swapping layers ----------------------------------------------------------------------------------


def apply_fp8_qat(model: nn.Layer, hadamard_block: int = 32, ema_rate: float = 0.01) -> int:
    """Swap decoder linears for FP8 fake-quantized ones (same parameter names). Returns how many."""
    n = 0
    for parent, attr, _ in decoder_linears(model):
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


# ---- PTQ at export -------------------------------------------------------------------------------------


def quantize_for_export(model: nn.Layer, method: str, group_size: int = 64) -> int:
    """PTQ in place: ``wint8`` (per channel), ``wint4`` (group-wise), ``fp8`` (tensor-wise e4m3)."""
    n = 0
    for parent, attr, _ in decoder_linears(model):
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
    write_quantized_config(model.config, d, method, group_size)
    write_tensors(quantized_state(model), d, "float32", max_shard_size)


def write_quantized_config(config, d: Path, method: str, group_size: int) -> None:
    cfg = config.to_dict()
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


class QuantizedTensors(Mapping):
    """PTQ tensor by tensor: ``save_quantized``'s tensors (same names, order, values) from a mapping of fp32
    weights read on access (``loading.TensorSource``), each linear quantized when its weight is asked for,
    so the model is never loaded. ``shapes`` / ``integer`` are what ``write_tensors_streamed`` needs."""

    def __init__(self, source, model: nn.Layer, method: str, group_size: int):
        if method not in ("wint8", "wint4", "fp8"):
            raise ValueError(f"quantization must be wint8, wint4 or fp8, not {method!r}")
        self.source, self.method, self.group_size = source, method, group_size
        linears = {name: tuple(lin.weight.shape) for lin, _, name in _linear_shapes(model)}
        self.shapes: dict[str, list[int]] = {}
        self.integer: dict[str, str] = {}
        for name, _ in model.named_sublayers():  # the order quantized_state writes them in
            if name not in linears:
                continue
            n_in, n_out = linears[name]
            self.shapes[f"{name}.weight"] = [n_in // 2 if method == "wint4" else n_in, n_out]
            self.integer[f"{name}.weight"] = "I8" if method == "wint8" else "U8"
            g = n_in if method != "wint4" or group_size <= 0 or n_in % group_size else group_size
            self.shapes[f"{name}.weight_scale"] = [1] if method == "fp8" else [n_in // g, n_out]
        for name, shape in source.shapes.items():
            if name.rsplit(".", 1)[0] not in linears or not name.endswith(".weight"):
                self.shapes[name] = shape
        self._scales: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self._scales:
            return self._scales.pop(key)
        if key not in self.integer:
            return self.source[key]
        lin = key[: -len(".weight")]
        w = np.asarray(self.source[key], dtype=np.float32)
        if self.method == "fp8":
            t = paddle.to_tensor(w)
            scale = max(float(paddle.max(paddle.abs(t))) / FP8_MAX, 1e-12)
            q = (t / scale).astype(paddle.float8_e4m3fn).view(paddle.uint8).numpy()
            self._scales[f"{lin}.weight_scale"] = paddle.to_tensor([scale], dtype="float32").numpy()
            return q
        bits = 8 if self.method == "wint8" else 4
        q, scale = quantize_weight(w, bits, -1 if bits == 8 else self.group_size)
        self._scales[f"{lin}.weight_scale"] = scale
        return q if bits == 8 else pack_int4(q)

    def __contains__(self, key: object) -> bool:
        return key in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _linear_shapes(model: nn.Layer):
    """(linear layer, parent, name) of every decoder linear PTQ quantizes."""
    for parent, attr, name in decoder_linears(model):
        yield getattr(parent, attr), parent, name


def save_quantized_streamed(
    source, directory: str | Path, method: str, group_size: int, max_shard_size: str
) -> None:
    """``save_quantized`` of the model ``source`` (a ``loading.TensorSource``) reads, one tensor at a time."""
    from engine.models.checkpoint import write_tensors_streamed
    from engine.models.streaming import lazy_model

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_quantized_config(source.config, d, method, group_size)
    tensors = QuantizedTensors(source, lazy_model(source.config), method, group_size)
    write_tensors_streamed(tensors, tensors.shapes, d, "float32", max_shard_size, integer=tensors.integer)
