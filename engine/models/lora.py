"""LoRA as a small wrapper of a linear layer (litgpt-style): ``y = base(x) + (x A B) * scale``.

The base can be a plain ``nn.Linear``, an FP8 fake-quantized linear (QAT) or a frozen weight-only int8/int4
linear (``engine.models.quantized``). Only ``lora_A`` / ``lora_B`` train. Adapter files hold just those
tensors, keyed by the wrapped layer's name, so the base checkpoint stays untouched. Wrapping, reading an
adapter and merging it live here because loading a LoRA run directory needs them; what only training
needs (LoRA+ groups, saving adapters, switching them off) stays with the training stages.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import paddle
from paddle import nn

from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES
from engine.models.paths import ADAPTER_CONFIG as ADAPTER_CONFIG  # where it was always imported from
from engine.models.quantized import bits_for, decoder_linears, dequantized_linear
from engine.models.safetensors_io import SafetensorsFile
from engine.models.streaming import Merge

ADAPTER_FILE = "adapter_model.safetensors"
DEFAULT_TARGETS = ["qkv_proj", "o_proj", "up_gate_proj", "down_proj"]
# VL target groups: where their layers live and the linears they mean, per model family (ERNIE 4.5 VL's
# ViT and resampler, PaddleOCR-VL's encoder and projector). ERNIEKit keeps the vision tower frozen in LoRA
# runs; naming a group puts adapters there too.
TARGET_GROUPS = {
    "vision": (
        ("vision_model", ("qkv", "proj", "fc1", "fc2")),
        ("visual", ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")),
    ),
    "resampler": (("ernie.resampler_model", ("0", "2", "mlp")),),
    "projector": (("projector", ("linear_1", "linear_2")),),
}


class LoRALinear(nn.Layer):
    """A frozen base linear plus a trainable low-rank update; B starts at zero so training starts at base."""

    def __init__(
        self, base: nn.Layer, in_features: int, out_features: int, rank: int, alpha: float, rslora: bool
    ):
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.enabled = True
        # Kaiming-uniform A (as in the LoRA paper's reference code), zero B.
        bound = 1.0 / math.sqrt(in_features)
        self.lora_A = self.create_parameter(
            [in_features, rank], default_initializer=nn.initializer.Uniform(-bound, bound)
        )
        self.lora_B = self.create_parameter(
            [rank, out_features], default_initializer=nn.initializer.Constant(0.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.base(x)
        if not self.enabled:
            return out
        return out + paddle.matmul(paddle.matmul(x, self.lora_A), self.lora_B) * self.scale

    def delta_weight(self) -> paddle.Tensor:
        """The update in the base weight's [in, out] layout."""
        return paddle.matmul(self.lora_A, self.lora_B) * self.scale


def linear_shape(layer: nn.Layer) -> tuple[int, int]:
    """(in, out) of a linear-like layer: nn.Linear or one of the quantized linears."""
    if hasattr(layer, "in_features"):
        return int(layer.in_features), int(layer.out_features)
    w = layer.weight
    return int(w.shape[0]), int(w.shape[1])


def _attrs_for(name: str, targets: list[str]) -> list[str]:
    """The target attribute names that apply inside the layer called ``name``."""
    for group, places in TARGET_GROUPS.items():
        for prefix, attrs in places:
            if name == prefix or name.startswith(prefix + "."):
                return list(attrs) if group in targets else []
    return [t for t in targets if t not in TARGET_GROUPS]


def iter_target_linears(model: nn.Layer, targets: list[str]) -> Iterator[tuple[nn.Layer, str, str]]:
    """(parent layer, attribute name, full name) of every linear whose attribute name is a target; the
    groups ``vision``, ``resampler`` and ``projector`` stand for the linears of the vision encoder, of
    ERNIE 4.5 VL's resampler and of PaddleOCR-VL's projector."""
    for name, layer in list(model.named_sublayers(include_self=True)):
        for attr in _attrs_for(name, targets):
            child = getattr(layer, attr, None)
            if isinstance(child, nn.Layer) and not isinstance(child, LoRALinear) and _is_linear(child):
                yield layer, attr, f"{name}.{attr}" if name else attr


def _is_linear(layer: nn.Layer) -> bool:
    """nn.Linear or a quantized linear (not a container such as the decoder's ``mlp``)."""
    weight = getattr(layer, "weight", None)
    return hasattr(layer, "in_features") or (weight is not None and len(weight.shape) == 2)


def apply_lora(
    model: nn.Layer,
    rank: int,
    alpha: float,
    rslora: bool = False,
    targets: list[str] | None = None,
    seed: int = 0,
) -> list[str]:
    """Wrap the target linears with LoRA (experts included), freeze everything else. Returns wrapped names."""
    targets = targets or DEFAULT_TARGETS
    for p in model.parameters():
        p.stop_gradient = True
    wrapped = []
    # Each A is drawn from a seed of the run's seed and the linear's name: reproducible whatever was drawn
    # before, and the same whichever other linears this process holds (an expert-parallel rank holds some
    # of the experts only, and must draw what one process draws for them).
    for parent, attr, name in list(iter_target_linears(model, targets)):
        base = getattr(parent, attr)
        fin, fout = linear_shape(base)
        with _seeded((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF):
            setattr(parent, attr, LoRALinear(base, fin, fout, rank, alpha, rslora))
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"no LoRA target layers ({', '.join(targets)}) found in the model")
    return wrapped


@contextlib.contextmanager
def _seeded(seed: int):
    state = paddle.get_rng_state()
    paddle.seed(seed)
    try:
        yield
    finally:
        paddle.set_rng_state(state)


def lora_layers(model: nn.Layer) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_sublayers() if isinstance(m, LoRALinear)]


def load_adapter_weights(model: nn.Layer, directory: str | Path) -> None:
    """Set every LoRA layer's A and B from ``adapter_model.safetensors``; missing or extra tensors raise."""
    f = SafetensorsFile(Path(directory) / ADAPTER_FILE)
    layers = dict(lora_layers(model))
    keys = set(f.keys())
    for name, m in layers.items():
        for part in ("lora_A", "lora_B"):
            key = f"{name}.{part}"
            if key not in keys:
                raise ValueError(f"{directory}/{ADAPTER_FILE}: missing tensor {key}")
            getattr(m, part).set_value(paddle.to_tensor(f.get(key)))
    extra = keys - {f"{n}.{p}" for n in layers for p in ("lora_A", "lora_B")}
    if extra:
        raise ValueError(
            f"{directory}/{ADAPTER_FILE}: tensors for layers the model lacks: {sorted(extra)[:3]}"
        )


def adapter_merges(model: nn.Layer, chain: list[tuple[Path, dict]]) -> dict[str, list[Merge]]:
    """For LoRA run directories stacked on a base (innermost first, each with its adapter_config.json):
    linear name -> what each adapter does to that linear's weight as it is read (``streaming.Merge``).

    The same as wrapping the model, loading each adapter and ``merge_lora``, without the model in fp32: an
    adapter trained on a weight-only base first rounds every decoder linear through that quantization."""
    merges: dict[str, list[Merge]] = {}
    for directory, cfg in chain:
        decoder = {name for _, _, name in decoder_linears(model)}
        bits = {}
        if cfg.get("compute_type") in WEIGHT_ONLY_COMPUTE_TYPES:
            bits = {name: bits_for(name, cfg["compute_type"]) for name in decoder}
        targets = cfg["target_modules"] or DEFAULT_TARGETS
        linears = {
            name: linear_shape(getattr(parent, attr))
            for parent, attr, name in iter_target_linears(model, targets)
        }
        if not linears:
            raise ValueError(f"no LoRA target layers ({', '.join(targets)}) found in the model")
        f = SafetensorsFile(Path(directory) / ADAPTER_FILE)
        keys = set(f.keys())
        rank, alpha = cfg["r"], cfg["lora_alpha"]
        scale = alpha / math.sqrt(rank) if cfg.get("rslora", False) else alpha / rank
        for name in sorted(set(bits) | set(linears)):
            merge = Merge(bits.get(name, 0), cfg.get("weight_quant_group_size", -1))
            if name in linears:
                merge.lora_a, merge.lora_b = _adapter_pair(f, directory, name, rank, linears[name])
                merge.scale = scale
            merges.setdefault(name, []).append(merge)
        extra = keys - {f"{n}.{p}" for n in linears for p in ("lora_A", "lora_B")}
        if extra:
            raise ValueError(
                f"{directory}/{ADAPTER_FILE}: tensors for layers the model lacks: {sorted(extra)[:3]}"
            )
    return merges


def _adapter_pair(
    f: SafetensorsFile, directory: Path, name: str, rank: int, shape: tuple[int, int]
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(A, B) of one linear from an adapter file, checked against the linear's (in, out)."""
    out = []
    for part, want in (("lora_A", [shape[0], rank]), ("lora_B", [rank, shape[1]])):
        key = f"{name}.{part}"
        if key not in f.header:
            raise ValueError(f"{directory}/{ADAPTER_FILE}: missing tensor {key}")
        if f.shape(key) != want:
            raise ValueError(
                f"{directory}/{ADAPTER_FILE}: {key} has shape {f.shape(key)}, the model needs {want}"
            )
        out.append(paddle.to_tensor(f.get(key)))
    return out[0], out[1]


def merge_lora(model: nn.Layer) -> nn.Layer:
    """Fold every adapter into its base weight and unwrap it, giving a plain model with the same outputs."""
    for name, m in lora_layers(model):
        base = dequantized_linear(m.base)
        with paddle.no_grad():
            base.weight.set_value(base.weight + m.delta_weight().astype(base.weight.dtype))
        parent_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
        parent = model if not parent_name else _sublayer(model, parent_name)
        setattr(parent, attr, base)
    return model


def _sublayer(model: nn.Layer, dotted: str) -> nn.Layer:
    layer = model
    for part in dotted.split("."):
        layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
    return layer
