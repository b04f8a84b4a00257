"""PaddleOCR-VL checkpoints in the two forms people have, safetensors only.

- ``official``: ``PaddlePaddle/PaddleOCR-VL`` as published (its remote code's names): the decoder under
  ``model.*`` (``model.layers.N.self_attn.q_proj`` ...), the encoder under ``visual.vision_model.*``, the
  projector as ``mlp_AR.*``, ``lm_head.weight``; flat config.json. It may also hold the SigLIP pooling head
  (``visual.vision_model.head.*``) and ``packing_position_embedding``, which the model never uses
  (transformers' ``_keys_to_ignore_on_load_unexpected``): they are skipped on load and not written.
- ``hf``: what transformers 5 ``save_pretrained`` writes: the same official tensor names (it saves in the
  "original format" by default, undoing its ``conversion_mapping.py`` entry ``paddleocr_vl``) with its nested
  config.json. With ``save_original_format=False`` it writes its in-memory names instead
  (``model.language_model.*``, ``model.visual.*``, ``model.projector.*``); those load too.

Both hold PyTorch Linear weights [out, in] and the patch embedding as a convolution [out, C, p, p]. In
memory the decoder is ERNIE's Paddle layout (fused qkv / up_gate, [in, out]) with each q / k head's output
dimensions permuted from the rotate-half order (i, i + d/2) into ERNIE's interleaved pairs (2i, 2i + 1);
saving undoes it, so load -> save gives back the same tensors bit for bit.

Loading streams as the ERNIE loader does (``engine.models.streaming``): the model is built without parameter
memory and each tensor is read into the precision a ``Storage`` holds it in, a single stored tensor (the
embedding, the head, most linears) in blocks of rows; a LoRA run's adapters are folded into their linears as
they are read. Nothing holds a whole fp32 copy of the model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import paddle

from engine.models.checkpoint import (
    CheckpointError,
    TensorStore,
    hf_sources,
    numpy_state,
    resolve_dtype,
    write_tensors,
    write_tensors_streamed,
)
from engine.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration
from engine.models.paddleocr_vl_config import PaddleOCRVLConfig
from engine.models.streaming import Merge, Storage, assign, held_dtypes, merged_weight, read_blocks

log = logging.getLogger(__name__)

LAYOUTS = ("official", "hf")  # config.json forms; both write the official tensor names
# Tensor names on disk: "official" (the published and transformers' default) or "transformers" (in-memory)
NAMINGS = ("official", "transformers")
# Official tensors the model does not use (transformers ignores them the same way).
UNUSED_PREFIXES = ("visual.vision_model.head.", "packing_position_embedding")
# (internal prefix, official prefix, transformers prefix)
_PREFIXES = (
    ("visual.layers.", "visual.vision_model.encoder.layers.", "model.visual.vision_model.encoder.layers."),
    ("visual.", "visual.vision_model.", "model.visual.vision_model."),
    ("projector.", "mlp_AR.", "model.projector."),
)
_VISION_LINEARS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "out_proj.weight",
    "fc1.weight",
    "fc2.weight",
)
_PATCH = "visual.embeddings.patch_embedding.weight"


def detect_naming(keys: list[str]) -> str:
    if any(k.startswith("model.language_model.") for k in keys):
        return "transformers"
    if any(k.startswith(("mlp_AR.", "visual.vision_model.", "model.layers.")) for k in keys):
        return "official"
    raise CheckpointError(
        "unrecognised PaddleOCR-VL checkpoint: keys start neither with 'model.language_model.' (transformers) "
        f"nor with 'mlp_AR.' / 'visual.vision_model.' / 'model.layers.' (official); first keys: {keys[:5]}"
    )


def rotate_half_order(head_dim: int) -> np.ndarray:
    """For each interleaved dimension (2i, 2i + 1) the rotate-half dimension it holds (i, i + d/2)."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def _permute_qk(arr: np.ndarray, config: PaddleOCRVLConfig, inverse: bool) -> np.ndarray:
    """Permute the q and k parts of a fused qkv tensor (last axis) per head; v stays."""
    t = config.text
    hd, nq, nkv = t.head_dim, t.num_attention_heads, t.num_key_value_heads
    order = rotate_half_order(hd)
    if inverse:
        order = np.argsort(order)
    qk = arr[..., : (nq + nkv) * hd]
    qk = qk.reshape([*qk.shape[:-1], nq + nkv, hd])[..., order].reshape([*arr.shape[:-1], -1])
    return np.concatenate([qk, arr[..., (nq + nkv) * hd :]], axis=-1)


def sources(name: str, naming: str, config: PaddleOCRVLConfig) -> list[tuple[str, Callable | None]]:
    """The stored tensors an internal tensor is built from, and how (concatenated on the last axis)."""
    if name.startswith("ernie.") or name == "lm_head.weight":
        srcs = hf_sources(name, config.text)  # model.* / lm_head.weight, [out, in], split projections
        if naming == "transformers":
            srcs = [
                ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k, fn)
                for k, fn in srcs
            ]
        return srcs
    for internal, official, hf in _PREFIXES:
        if name.startswith(internal):
            key = (official if naming == "official" else hf) + name[len(internal) :]
            break
    else:
        raise KeyError(name)
    if name == _PATCH:
        return [(key, lambda a: a.reshape(a.shape[0], -1).T)]
    if name.endswith(_VISION_LINEARS) or (name.startswith("projector.linear_") and name.endswith(".weight")):
        return [(key, np.transpose)]
    return [(key, None)]


def read_tensor(
    store: TensorStore, naming: str, name: str, expected: list[int], config: PaddleOCRVLConfig
) -> tuple[np.ndarray, list[str]]:
    """One internal tensor from the store (layout converted) and the stored keys it came from."""
    parts, keys = [], []
    for key, fn in sources(name, naming, config):
        if key not in store:
            raise CheckpointError(f"{store.directory}: checkpoint is missing tensor {key} (for {name})")
        a = store.get(key)
        parts.append(fn(a) if fn is not None else a)
        keys.append(key)
    try:
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    except ValueError:
        arr = None
    if arr is None or list(arr.shape) != list(expected):
        got = [list(p.shape) for p in parts]
        raise CheckpointError(
            f"{store.directory}: {', '.join(keys)} give shape(s) {got} but config.json implies {expected} "
            f"for {name} (hidden sizes, heads, head_dim, vocab_size, patch_size)"
        )
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        arr = _permute_qk(arr, config, inverse=False)
    return np.ascontiguousarray(arr), keys


def direct_source(name: str, naming: str, config: PaddleOCRVLConfig) -> tuple[str, bool] | None:
    """(stored key, transposed) when an internal tensor is one stored tensor as it is or transposed: those
    are read in blocks of rows. None for the fused / permuted q-k-v and gate-up and the patch embedding."""
    srcs = sources(name, naming, config)
    if len(srcs) != 1 or name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        return None
    key, fn = srcs[0]
    if fn not in (None, np.transpose):
        return None
    return key, fn is np.transpose


def stream_state(
    model: PaddleOCRVLForConditionalGeneration,
    directory: Path,
    storage: Storage | None = None,
    merges: dict[str, list[Merge]] | None = None,
) -> str:
    """Fill ``model`` (lazy or not) from ``directory`` tensor by tensor into ``storage``, folding ``merges``
    (linear name -> LoRA adapters, innermost first) into their weights; returns the tensor naming found."""
    storage = storage or Storage()
    if storage.weight_only:
        raise ValueError(
            f"{directory}: a weight-only ({storage.weight_only}) base is not supported for PaddleOCR-VL; "
            "train it in fp32 or bf16"
        )
    store = TensorStore(directory)
    naming = detect_naming(store.keys())
    dtypes = held_dtypes(model, storage)
    merges = merges or {}
    used: set[str] = set()
    for name, param in model.state_dict().items():
        shape, target = list(param.shape), dtypes.get(name, "float32")
        chain = merges.get(name[: -len(".weight")], []) if name.endswith(".weight") else []
        direct = None if chain else direct_source(name, naming, model.config)
        if direct is not None and direct[0] in store:
            used.add(direct[0])
            assign(param, read_blocks(store, direct, shape, target))
            continue
        arr, keys = read_tensor(store, naming, name, shape, model.config)
        used.update(keys)
        value = merged_weight(arr, chain) if chain else paddle.to_tensor(arr, dtype="float32")
        del arr
        assign(param, value if target == "float32" else value.astype(target))
    _report_left(directory, store, used)
    return naming


def _report_left(directory: Path, store: TensorStore, used: set[str]) -> None:
    """Log the stored tensors the model did not read (the unused SigLIP head quietly, others loudly)."""
    left = [k for k in store if k not in used]
    skipped = [k for k in left if k.startswith(UNUSED_PREFIXES) or k == "lm_head.weight"]
    unknown = [k for k in left if k not in skipped]
    if skipped:
        log.info(
            "%s: skipped %d tensors the model does not use (%s ...)", directory, len(skipped), skipped[0]
        )
    if unknown:
        log.warning(
            "%s: %d tensors not used by PaddleOCR-VL: %s", directory, len(unknown), ", ".join(unknown[:8])
        )


def load_paddleocr_vl(
    path: str | Path,
    dtype: str = "float32",
    storage: Storage | None = None,
    prepare: Callable | None = None,
    chain: list[tuple[Path, dict]] | None = None,
) -> PaddleOCRVLForConditionalGeneration:
    """A PaddleOCR-VL directory (either form) in eval mode, read tensor by tensor into ``dtype`` (float32 on
    a CPU) or into ``storage`` (a training run's: bf16 decoder weights for emulated bf16). ``chain``: the LoRA
    runs stacked on it (``loading.lora_chain``), folded in as their linears are read. ``prepare(model)``
    runs before any weight is read."""
    from engine.models.lora import adapter_merges

    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: model directory does not exist")
    config = PaddleOCRVLConfig.from_file(directory)
    with paddle.LazyGuard():
        model = PaddleOCRVLForConditionalGeneration(config)
    if prepare is not None:
        prepare(model)
    merges = adapter_merges(model, chain) if chain else None
    naming = stream_state(model, directory, storage or Storage(resolve_dtype(dtype)), merges)
    log.info("loaded PaddleOCR-VL %s (%s tensor names)", directory, naming)
    model.eval()
    return model


def to_external(
    name: str, arr: np.ndarray, config: PaddleOCRVLConfig, naming: str = "official"
) -> list[tuple[str, np.ndarray]]:
    """One internal tensor as the stored tensors a checkpoint of ``naming`` holds for it (views where the
    conversion allows)."""
    t = config.text
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
        parts = np.split(_permute_qk(arr, config, inverse=True), [q, q + kv], axis=-1)
    elif name.endswith(("up_gate_proj.weight", "up_gate_proj.bias")):
        parts = np.split(arr, 2, axis=-1)
    else:
        parts = [arr]
    out = []
    for (key, fn), part in zip(sources(name, naming, config), parts, strict=True):
        if name == _PATCH:
            v = config.vision
            part = part.T.reshape(v.hidden_size, v.num_channels, v.patch_size, v.patch_size)
        elif fn is not None:  # every other conversion is a transpose, its own inverse
            part = part.T
        out.append((key, part))
    return out


def external_state(
    model: PaddleOCRVLForConditionalGeneration, naming: str = "official"
) -> dict[str, np.ndarray]:
    """The model's tensors as a checkpoint with ``naming`` stores them."""
    if naming not in NAMINGS:
        raise ValueError(f"tensor naming must be one of {NAMINGS}, not {naming!r}")
    return {
        key: np.ascontiguousarray(part)
        for name, arr in numpy_state(model).items()
        for key, part in to_external(name, arr, model.config, naming)
    }


class ExternalTensors(Mapping):
    """A PaddleOCR-VL checkpoint, with the LoRA runs of ``chain`` folded in, as the stored tensors of its
    published form (``official`` naming), each read on access: what an export writes tensor by tensor
    (``checkpoint.write_tensors_streamed``) without the model in memory. ``shapes`` holds every one's shape."""

    def __init__(self, directory: str | Path, chain: list[tuple[Path, dict]] | None = None):
        from engine.models.lora import adapter_merges

        self.directory = Path(directory)
        self.config = PaddleOCRVLConfig.from_file(self.directory)
        with paddle.LazyGuard():
            model = PaddleOCRVLForConditionalGeneration(self.config)
        self.merges = adapter_merges(model, chain) if chain else {}
        self.store = TensorStore(self.directory)
        self.naming = detect_naming(self.store.keys())
        self.internal = {n: list(p.shape) for n, p in model.state_dict().items()}
        self.index: dict[str, tuple[str, int]] = {}
        self.shapes: dict[str, list[int]] = {}
        for name, shape in self.internal.items():
            empty = np.broadcast_to(np.float32(0), shape)  # shapes only: no memory
            for k, (key, part) in enumerate(to_external(name, empty, self.config)):
                self.index[key] = (name, k)
                self.shapes[key] = list(part.shape)
        self._last: tuple[str, list[np.ndarray]] | None = None  # the fused q / k / v are read once

    def internal_value(self, name: str) -> np.ndarray:
        """One internal tensor in fp32 with its adapters folded in."""
        arr, _ = read_tensor(self.store, self.naming, name, self.internal[name], self.config)
        chain = self.merges.get(name[: -len(".weight")], []) if name.endswith(".weight") else []
        return merged_weight(arr, chain).numpy() if chain else arr

    def __getitem__(self, key: str) -> np.ndarray:
        name, k = self.index[key]
        if self._last is None or self._last[0] != name:
            self._last = (name, [p for _, p in to_external(name, self.internal_value(name), self.config)])
        return np.ascontiguousarray(self._last[1][k])

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __contains__(self, key: object) -> bool:
        return key in self.shapes


def export_paddleocr_vl(
    directory: str | Path,
    out: str | Path,
    chain: list[tuple[Path, dict]] | None = None,
    layout: str = "official",
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write a PaddleOCR-VL directory (with the LoRA runs of ``chain`` merged in) to ``out`` in ``layout``
    (``official``: the published flat config.json; ``hf``: transformers' nested one), one tensor in memory at
    a time: the same files ``save_paddleocr_vl`` writes of the merged model."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = ExternalTensors(directory, chain)
    config = tensors.config
    d = config.official_dict(dtype) if layout == "official" else config.transformers_dict(dtype)
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    write_tensors_streamed(tensors, tensors.shapes, out, dtype, max_shard_size)
    return out


def save_paddleocr_vl(
    model: PaddleOCRVLForConditionalGeneration,
    directory: str | Path,
    layout: str = "official",
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
) -> Path:
    """config.json and safetensors weights: ``official`` (flat config.json) or ``hf`` (transformers' nested
    config.json); the tensors carry the official names in both, as transformers itself writes them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = external_state(model)
    config = model.config
    d = config.official_dict(dtype) if layout == "official" else config.transformers_dict(dtype)
    (directory / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    write_tensors(state, directory, dtype, max_shard_size)
    return directory
