"""``load_model``: the one way to load a model directory a person hands in.

Three kinds of directory load: a plain checkpoint (either public layout, ``load_plain_model``), a
LoRA run (adapter + base path, no config.json: the base with the adapter merged) and a PTQ export
(``quantization_config`` in config.json: quantized linears stay quantized).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import paddle
from paddle import nn

from engine.models.checkpoint import (
    CheckpointError,
    HFReader,
    TensorStore,
    cast_model,
    detect_layout,
    resolve_dtype,
)
from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES, ErnieConfig
from engine.models.ernie import ErnieForCausalLM
from engine.models.lora import adapter_merges, apply_lora, load_adapter_weights, merge_lora
from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir
from engine.models.paths import ADAPTER_CONFIG, is_lora_dir, lora_base_dir
from engine.models.quantized import (
    QUANT_METHODS,
    FP8WeightLinear,
    WeightOnlyLinear,
    apply_weight_only,
    decoder_linears,
    unpack_int4,
)
from engine.models.streaming import Storage, lazy_model, read_value, stream_state

log = logging.getLogger(__name__)


def load_model(
    path: str | Path,
    dtype: str = "float32",
    storage: Storage | None = None,
    prepare: Callable[[nn.Layer], None] | None = None,
) -> ErnieForCausalLM:
    """Load a model directory in eval mode: plain (Paddle or PyTorch layout), LoRA run, or PTQ export;
    a PaddleOCR-VL directory (either of its forms) loads as ``PaddleOCRVLForConditionalGeneration``.

    A LoRA run directory loads as its base model with the adapter merged; a PTQ export stays quantized.
    Weights are read tensor by tensor into ``dtype`` (float32 on a CPU) or into ``storage``, a training
    run's bf16 / weight-only storage (``engine.models.streaming``). ``prepare`` is called on the model
    before any weight is read (expert parallelism drops the experts other ranks hold: never read here).
    """
    if is_paddleocr_vl_dir(path):  # its own model class (engine.models.paddleocr_vl)
        from engine.models.paddleocr_vl_checkpoint import load_paddleocr_vl

        return load_paddleocr_vl(path, dtype, storage, prepare)
    if is_lora_dir(path):
        return load_lora_model(path, dtype, storage, prepare)
    if is_quantized_dir(path):
        return load_quantized_model(path, storage, prepare)
    return load_plain_model(path, dtype, storage, prepare)


def load_state(model: ErnieForCausalLM, directory: Path, storage=None) -> dict[str, str]:
    """Fill ``model`` from the checkpoint in ``directory`` tensor by tensor (``streaming.stream_state``),
    held as ``storage`` says (default fp32). Returns a report of what was done."""
    return stream_state(model, directory, storage)


def load_plain_model(
    path: str | Path, dtype: str = "float32", storage=None, prepare: Callable | None = None
) -> ErnieForCausalLM:
    """Load a plain checkpoint directory (either public layout, single or sharded) in eval mode.

    The model is built without parameter memory and each tensor is read straight into its held precision:
    ``dtype`` (fp32 on a CPU, which has no bf16 / fp16 matmul), or a ``streaming.Storage`` (a training run's
    bf16 / wint8 / wint4 storage). LoRA runs and PTQ exports are not plain checkpoints:
    ``engine.models.loading.load_model`` reads all kinds. ``prepare(model)`` runs before any weight is
    read (expert parallelism drops the experts other ranks hold).
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: model directory does not exist")
    config = ErnieConfig.from_file(directory)
    storage = storage or Storage(resolve_dtype(dtype))
    model = lazy_model(config)
    if prepare is not None:
        prepare(model)
    report = stream_state(model, directory, storage)
    log.info("loaded %s (%s layout, stored %s)", directory, report["layout"], report["stored_dtypes"])
    model.eval()
    return model


def is_quantized_dir(directory: str | Path) -> bool:
    cfg = Path(directory) / "config.json"
    if not cfg.exists():
        return False
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config")
    except json.JSONDecodeError:
        return False
    # A serving export's FastDeploy-shaped config ({"quantization": ..., "is_quantized": false}) holds plain
    # weights FastDeploy quantizes at load; only our PTQ exports (quant_method) hold quantized tensors.
    return isinstance(qc, dict) and "quant_method" in qc


# ---- LoRA runs -----------------------------------------------------------------------------------------


def load_lora_model(
    directory: str | Path,
    dtype: str = "float32",
    storage: Storage | None = None,
    prepare: Callable[[nn.Layer], None] | None = None,
) -> nn.Layer:
    """A LoRA run dir -> its base model with the adapter merged in (eval mode).

    The base may itself be a LoRA run (DPO-LoRA on an SFT-LoRA run): every adapter of the stack is folded
    into each weight as it is read (``lora.adapter_merges``), so no fp32 copy of the model is made."""
    d, chain = lora_chain(Path(directory))
    if is_paddleocr_vl_dir(d):
        from engine.models.paddleocr_vl_checkpoint import load_paddleocr_vl

        return load_paddleocr_vl(d, dtype, storage, prepare, chain)
    if is_quantized_dir(d):
        return _lora_on_quantized(d, chain, dtype, prepare)
    storage = storage or Storage(resolve_dtype(dtype))
    model = lazy_model(ErnieConfig.from_file(d))
    if prepare is not None:
        prepare(model)
    stream_state(model, d, storage, adapter_merges(model, chain))
    model.eval()
    return model


def _lora_on_quantized(
    base: Path, chain: list[tuple[Path, dict]], dtype: str, prepare: Callable[[nn.Layer], None] | None = None
) -> nn.Layer:
    """LoRA runs trained on a PTQ export: its linears are int8 / e4m3 on disk already, so the adapters wrap
    and merge into the loaded (quantized) model."""
    model = load_quantized_model(base, prepare=prepare)
    for d, cfg in chain:
        if cfg.get("compute_type") in WEIGHT_ONLY_COMPUTE_TYPES:
            apply_weight_only(model, cfg["compute_type"], cfg.get("weight_quant_group_size", -1))
        apply_lora(model, cfg["r"], cfg["lora_alpha"], cfg.get("rslora", False), cfg["target_modules"])
        load_adapter_weights(model, d)
        merge_lora(model)
    if dtype != "float32":
        model = cast_model(model, resolve_dtype(dtype))
    model.eval()
    return model


class TensorSource(Mapping):
    """A plain checkpoint or a LoRA run directory as a mapping of internal (Paddle-layout) tensor names to
    fp32 arrays, each read (layout converted, adapters folded in) only when asked for: what writes a whole
    model out (export, GGUF) holds one tensor at a time instead of the model.

    A linear an adapter trained on a weight-only base left quantized (not targeted) comes back dequantized,
    which is what the loaded model computes with; ``left_quantized`` names those."""

    def __init__(self, directory: str | Path):
        base, chain = lora_chain(Path(directory))
        if is_quantized_dir(base):
            raise ValueError(
                f"{base}: a quantized export (quantization_config in config.json) is not read as fp32"
            )
        self.directory, self.merged = base, bool(chain)
        self.config = ErnieConfig.from_file(base)
        model = lazy_model(self.config)
        self.shapes = {n: list(p.shape) for n, p in model.state_dict().items()}
        self.merges = adapter_merges(model, chain) if chain else {}
        self.left_quantized = sorted(
            n for n, c in self.merges.items() if c and c[-1].bits and c[-1].lora_a is None
        )
        self.store = TensorStore(base)
        self.layout = detect_layout(self.store.keys())
        self.hf = HFReader(self.store) if self.layout == "hf" else None

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        chain = self.merges.get(name[: -len(".weight")], []) if name.endswith(".weight") else []
        try:
            return read_value(self.store, self.layout, name, self.shapes[name], self.config, self.hf, chain)
        except KeyError as e:
            raise CheckpointError(f"{self.directory}: checkpoint is missing tensor {e.args[0]}") from e

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def lora_chain(directory: Path) -> tuple[Path, list[tuple[Path, dict]]]:
    """(the plain base, the LoRA runs stacked on it innermost first with their adapter configs)."""
    chain: list[tuple[Path, dict]] = []
    d = Path(directory)
    while is_lora_dir(d):
        cfg = json.loads((d / ADAPTER_CONFIG).read_text())
        chain.append((d, cfg))
        d = lora_base_dir(d, cfg)
    chain.reverse()
    return d, chain


# ---- PTQ exports ---------------------------------------------------------------------------------------


def load_quantized_model(
    directory: str | Path, storage: Storage | None = None, prepare: Callable[[nn.Layer], None] | None = None
) -> nn.Layer:
    """Read a PTQ export back: quantized linears stay quantized (dequantized per call); the other tensors
    are read one at a time into ``storage`` (default fp32). ``prepare``: as ``load_model``'s."""
    d = Path(directory)
    raw = json.loads((d / "config.json").read_text())
    qc = raw["quantization_config"]
    method = {v: k for k, v in QUANT_METHODS.items()}.get(qc.get("quant_method"))
    if method is None:
        raise ValueError(
            f"{d}/config.json: unsupported quantization_config.quant_method {qc.get('quant_method')!r}"
        )
    model = lazy_model(ErnieConfig.from_dict(raw))
    if prepare is not None:
        prepare(model)
    store = TensorStore(d)
    quantized = set()
    for parent, attr, name in list(decoder_linears(model)):
        for key in (f"{name}.weight", f"{name}.weight_scale"):
            if key not in store:
                raise ValueError(f"{d}: quantized checkpoint lacks tensor {key}")
        bias = getattr(parent, attr).bias
        setattr(parent, attr, _quantized_linear(store, name, method, qc.get("bits", 8), bias))
        quantized.update({f"{name}.weight", f"{name}.weight_scale", f"{name}.weight_quant"})
    base = Storage(storage.dtype, storage.scope) if storage is not None else Storage()
    stream_state(model, d, base, skip=quantized)
    model.eval()
    return model


def _quantized_linear(store: TensorStore, name: str, method: str, bits: int, bias) -> nn.Layer:
    q = store.get(f"{name}.weight")
    scale = store.get(f"{name}.weight_scale")
    if method == "fp8":
        w8 = paddle.to_tensor(q.astype(np.uint8)).view(paddle.float8_e4m3fn)
        return FP8WeightLinear(w8, float(scale.reshape(-1)[0]), bias)
    if bits == 4:
        return WeightOnlyLinear(unpack_int4(q), scale.astype(np.float32), 4, bias)
    return WeightOnlyLinear(q.astype(np.int8), scale.astype(np.float32), 8, bias)
