"""Loading a checkpoint straight into the precision the model is held in, one tensor at a time.

The model is built under ``paddle.LazyGuard`` (parameters get names and shapes, no memory), then each
tensor is read from the safetensors files, converted (layout; a LoRA adapter folded in), cast or quantized
to what ``Storage`` says, placed on the current device and handed to its parameter. Nothing holds a whole
fp32 copy of the model: the transient is one tensor, and the large ones (the token embedding, an untied
head, big linears) are read in blocks of rows straight into their low-precision destination.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
from paddle import nn

from engine.models.checkpoint import (
    CheckpointError,
    HFReader,
    TensorStore,
    detect_layout,
    hf_sources,
    lm_head_orientation,
    read_internal,
    shape_error,
)
from engine.models.config import ErnieConfig
from engine.models.ernie import ErnieForCausalLM
from engine.models.quantized import (
    WeightOnlyLinear,
    bits_for,
    decoder_linears,
    dequantize_weight,
    quantize_weight,
)

log = logging.getLogger(__name__)

# A tensor larger than this in fp32 is read in blocks of about BLOCK_BYTES (fp32) of rows.
CHUNK_BYTES = 16 * 2**20
BLOCK_BYTES = 8 * 2**20
WEIGHT_ONLY = ("wint8", "wint4", "wint4/8")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# dtypes whose stored bytes ``paddle.to_tensor`` takes as they are (bf16 arrives as uint16 bits)
_STORED_AS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class Storage:
    """How a loaded model holds its weights.

    ``dtype``: the floating dtype of the weights that take a low precision. ``scope`` says which those are:
    ``all`` every floating tensor but the MoE router gates and correction biases (what ``cast_model`` and
    ``paddle.amp`` O2 do), ``decoder`` the decoder's linears, the token embedding and an untied head (what
    ``hold_in_low_precision`` keeps in bf16 for emulated bf16 on a CPU). ``weight_only`` (wint8, wint4,
    wint4/8) quantizes the decoder's linears as they are read, per channel or in ``group_size`` groups.
    """

    dtype: str = "float32"
    scope: str = "all"
    weight_only: str = ""
    group_size: int = -1

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(FLOAT_DTYPES)}, not {self.dtype!r}")
        if self.scope not in ("all", "decoder"):
            raise ValueError(f"storage scope must be 'all' or 'decoder', not {self.scope!r}")
        if self.weight_only and self.weight_only not in WEIGHT_ONLY:
            raise ValueError(f"weight_only must be one of {', '.join(WEIGHT_ONLY)}, not {self.weight_only!r}")


@dataclass
class Merge:
    """One LoRA adapter's part in a linear's weight, applied as the weight is read: first the weight-only
    round trip the adapter was trained against (``bits`` 0: none), then ``A @ B * scale`` (no ``lora_a``:
    a linear the adapter did not target)."""

    bits: int = 0
    group_size: int = -1
    lora_a: paddle.Tensor | None = None
    lora_b: paddle.Tensor | None = None
    scale: float = 1.0


def lazy_model(config: ErnieConfig) -> ErnieForCausalLM:
    """The model's layers and parameter names without parameter memory (``paddle.LazyGuard``)."""
    with paddle.LazyGuard():
        return ErnieForCausalLM(config)


def held_dtypes(model: nn.Layer, storage: Storage) -> dict[str, str]:
    """Parameter name -> the dtype ``storage`` holds it in (quantized weights are decided apart)."""
    names = [n for n, _ in model.named_parameters()]
    if storage.dtype == "float32":
        return dict.fromkeys(names, "float32")
    if storage.scope == "all":
        keep = tuple(n.rsplit(".", 1)[0].endswith(("mlp.gate", "moe_statics")) for n in names)
        return {n: "float32" if k else storage.dtype for n, k in zip(names, keep, strict=True)}
    low = {"ernie.embed_tokens.weight"}
    if not model.config.tie_word_embeddings:
        low.add("lm_head.weight")
    for _, _, lin in decoder_linears(model):
        low.update((f"{lin}.weight", f"{lin}.bias"))
    return {n: storage.dtype if n in low else "float32" for n in names}


def quantized_linears(model: nn.Layer, storage: Storage) -> dict[str, tuple[nn.Layer, str, str, int, int]]:
    """``<linear>.weight`` -> (parent, attribute, linear name, bits, group size) of every decoder linear
    ``storage`` quantizes."""
    if not storage.weight_only:
        return {}
    return {
        f"{name}.weight": (parent, attr, name, bits_for(name, storage.weight_only), storage.group_size)
        for parent, attr, name in decoder_linears(model)
    }


def stream_state(
    model: ErnieForCausalLM,
    directory: Path,
    storage: Storage | None = None,
    merges: dict[str, list[Merge]] | None = None,
    skip: set[str] | frozenset = frozenset(),
) -> dict[str, str]:
    """Fill ``model`` (lazy or not) from the checkpoint in ``directory``, tensor by tensor, into ``storage``.

    ``merges`` (linear name -> adapters, innermost first) folds LoRA adapters into weights as they are read.
    Returns a report of what was done; raises ``CheckpointError`` naming what is missing or mis-shaped.
    """
    storage = storage or Storage()
    config = model.config
    store = TensorStore(directory)
    layout = detect_layout(store.keys())
    hf = HFReader(store) if layout == "hf" else None
    dtypes = held_dtypes(model, storage)
    quantize = quantized_linears(model, storage)
    merges = _settle_merges(model, merges or {}, quantize)
    missing: list[str] = []
    used: set[str] = set()
    for name, p in model.state_dict().items():
        if name in skip:
            continue
        shape = list(p.shape)
        if name == "lm_head.weight" and "lm_head.weight" not in store:
            missing.append("lm_head.weight (config.json says tie_word_embeddings=false)")
            continue
        chain = merges.get(name[: -len(".weight")], []) if name.endswith(".weight") else []
        target = dtypes.get(name, "float32")
        direct = None if chain or name in quantize else _direct_source(store, layout, name, config)
        if direct is not None:
            used.add(direct[0])
            assign(p, read_blocks(store, direct, shape, target))
            continue
        try:
            arr = _read_whole(store, layout, name, shape, config, hf)
        except KeyError as e:
            if not name.endswith("e_score_correction_bias"):
                missing.append(str(e.args[0]))
                continue
            arr = np.zeros(shape, np.float32)  # checkpoints trained without aux-free balancing omit it
        used.add(name)
        if chain:
            arr = merged_weight(arr, chain)
        if name in quantize:
            parent, attr, _, bits, group_size = quantize[name]
            weight = arr.numpy() if isinstance(arr, paddle.Tensor) else arr.astype(np.float32, copy=False)
            del arr
            q, scale = quantize_weight(weight, bits, group_size)
            del weight
            setattr(parent, attr, WeightOnlyLinear(q, scale, bits, getattr(parent, attr).bias))
            continue
        value = arr if isinstance(arr, paddle.Tensor) else paddle.to_tensor(arr, dtype="float32")
        del arr
        assign(p, value if target == "float32" else value.astype(target))
    return _report(directory, store, layout, hf, missing, used, skip, config.tie_word_embeddings)


def _report(
    directory: Path, store: TensorStore, layout: str, hf, missing: list, used: set, skip, tied: bool
) -> dict:
    """Raise for missing tensors; log the stored ones this config does not use; the load's report."""
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(
            f"{directory}: checkpoint ({layout} layout) is missing {len(missing)} tensor(s) the config needs: "
            + ", ".join(missing[:8])
            + more
        )
    if hf is not None:
        used = hf.used | ({"lm_head.weight"} & used) | {k for k in used if k in store}
    unused = [k for k in store if k not in used and k not in skip and not (k == "lm_head.weight" and tied)]
    if unused:
        log.info("%s: %d tensors not used by this config (e.g. %s)", directory, len(unused), unused[0])
    stored = {store.dtype(k) for k in store}
    return {"layout": layout, "stored_dtypes": ",".join(sorted(stored)), "unused": str(len(unused))}


def _settle_merges(model: nn.Layer, merges: dict[str, list[Merge]], quantize: dict) -> dict[str, list[Merge]]:
    """Copies of the merge chains; a chain ending in a bare weight-only round trip (a linear the last
    adapter did not target) leaves its linear quantized, as merging the adapter into the loaded run's model
    did, and that quantization replaces the storage's (``quantize`` is updated)."""
    out = {}
    for lin, chain in merges.items():
        chain = list(chain)
        if chain and chain[-1].bits and chain[-1].lora_a is None:
            last = chain.pop()
            parent, attr = _parent(model, lin)
            quantize[f"{lin}.weight"] = (parent, attr, lin, last.bits, last.group_size)
        out[lin] = chain
    return out


def read_value(
    store: TensorStore, layout: str, name: str, shape: list[int], config, hf, chain: list[Merge]
) -> np.ndarray:
    """One internal tensor in fp32 with ``chain`` folded in; KeyError names a missing tensor (a checkpoint
    without a correction bias gives zeros, as loading does)."""
    try:
        arr = _read_whole(store, layout, name, shape, config, hf)
    except KeyError:
        if not name.endswith("e_score_correction_bias"):
            raise
        arr = np.zeros(shape, np.float32)
    if chain:
        return merged_weight(arr, chain).numpy()
    return arr.astype(np.float32, copy=False)


def _read_whole(store, layout, name, shape, config, hf) -> np.ndarray:
    if name == "lm_head.weight":
        arr = store.get("lm_head.weight")
        return arr.T if lm_head_orientation(store, layout, config) else arr
    return read_internal(store, layout, name, shape, config, hf)


def _direct_source(store: TensorStore, layout: str, name: str, config) -> tuple[str, bool] | None:
    """(stored key, transposed) when ``name`` is one stored tensor as it is or transposed: those can be
    read in blocks of rows. None for tensors built from several (fused q/k/v, hub expert stacks)."""
    if name == "lm_head.weight":
        return ("lm_head.weight", lm_head_orientation(store, layout, config))
    if layout == "paddle":
        return (name, False) if name in store and not name.endswith("e_score_correction_bias") else None
    sources = hf_sources(name, config)
    if len(sources) != 1 or sources[0][0] not in store:
        return None
    key, fn = sources[0]
    if fn not in (None, np.transpose):
        return None
    return key, fn is np.transpose


def read_blocks(store: TensorStore, source: tuple[str, bool], shape: list[int], dtype: str) -> paddle.Tensor:
    """One stored tensor (transposed or not) as a ``dtype`` tensor on the current device; a large one is
    read in blocks of rows into its destination."""
    key, transposed = source
    stored = store.shape(key)
    got = list(reversed(stored)) if transposed else stored
    if got != shape:
        raise CheckpointError(shape_error(store, key, [key], got, shape))
    as_stored = _STORED_AS.get(store.dtype(key)) == dtype

    def read(a: int | None, b: int | None) -> paddle.Tensor:
        if as_stored:  # the stored bytes are already the held dtype: no fp32 copy at all
            return paddle.to_tensor(store.get_stored(key, a, b))
        block = paddle.to_tensor(store.get(key, a, b), dtype="float32")
        return block if dtype == "float32" else block.astype(dtype)

    if not stored or int(np.prod(stored)) * 4 <= CHUNK_BYTES:
        whole = read(None, None)
        return whole.transpose([1, 0]) if transposed else whole
    rows = stored[0]
    step = max(1, BLOCK_BYTES // max(1, int(np.prod(stored[1:])) * 4))
    out = paddle.empty(shape, dtype=dtype)
    with paddle.no_grad():
        for a in range(0, rows, step):
            b = min(rows, a + step)
            if transposed:
                out[:, a:b] = read(a, b).transpose([1, 0])
            else:
                out[a:b] = read(a, b)
    return out


def merged_weight(arr: np.ndarray, chain: list[Merge]) -> paddle.Tensor:
    """The weight with each adapter's round trip and update applied in order, in fp32 (the same operations
    as wrapping the model, loading the adapter and ``merge_lora``)."""
    w = paddle.to_tensor(arr, dtype="float32")
    for m in chain:
        if m.bits:
            q, scale = quantize_weight(w.numpy(), m.bits, m.group_size)
            w = dequantize_weight(paddle.to_tensor(q, dtype="int8"), paddle.to_tensor(scale, dtype="float32"))
        if m.lora_a is not None:
            w = w + (paddle.matmul(m.lora_a, m.lora_b) * m.scale).astype(w.dtype)
    return w


def assign(p: paddle.Tensor, value: paddle.Tensor) -> None:
    """Hand ``value`` (any dtype, on the current device) to the parameter ``p`` as its storage; a lazy
    parameter gets its first memory this way. It is what ``Layer._to_impl`` does to change a dtype."""
    if list(value.shape) != list(p.shape):
        raise CheckpointError(f"{p.name}: read shape {list(value.shape)}, the model has {list(p.shape)}")
    if not value.is_contiguous():  # a transposed view: its strides are not the parameter's layout
        value = value.contiguous()
    p.value().get_tensor()._share_data_with(value.value().get_tensor())


def _parent(model: nn.Layer, dotted: str) -> tuple[nn.Layer, str]:
    parent_name, attr = dotted.rsplit(".", 1) if "." in dotted else ("", dotted)
    layer = model
    for part in parent_name.split(".") if parent_name else []:
        layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
    return layer, attr


def unmaterialized(model: nn.Layer) -> list[str]:
    """Parameters of a lazily built model that were never given memory (a loader bug if any)."""
    return [n for n, p in model.named_parameters() if not p._is_initialized()]
