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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle

from engine.models.checkpoint import CheckpointError, TensorStore, hf_sources, numpy_state, write_tensors
from engine.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration
from engine.models.paddleocr_vl_config import PaddleOCRVLConfig

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


def load_state(model: PaddleOCRVLForConditionalGeneration, directory: Path) -> str:
    """Fill ``model`` from ``directory`` tensor by tensor; returns the tensor naming found."""
    store = TensorStore(directory)
    naming = detect_naming(store.keys())
    used: set[str] = set()
    for name, param in model.state_dict().items():
        arr, keys = read_tensor(store, naming, name, list(param.shape), model.config)
        param.set_value(paddle.to_tensor(arr, dtype=param.dtype))
        used.update(keys)
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
    return naming


def load_paddleocr_vl(path: str | Path, dtype: str = "float32") -> PaddleOCRVLForConditionalGeneration:
    """A PaddleOCR-VL directory (either form) in eval mode, in fp32 (``dtype`` other than float32 casts)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: model directory does not exist")
    config = PaddleOCRVLConfig.from_file(directory)
    model = PaddleOCRVLForConditionalGeneration(config)
    naming = load_state(model, directory)
    log.info("loaded PaddleOCR-VL %s (%s tensor names)", directory, naming)
    if dtype not in ("float32", "fp32"):
        from engine.models.checkpoint import resolve_dtype

        model = model.to(dtype=resolve_dtype(dtype))
    model.eval()
    return model


def external_state(
    model: PaddleOCRVLForConditionalGeneration, naming: str = "official"
) -> dict[str, np.ndarray]:
    """The model's tensors as a checkpoint with ``naming`` stores them."""
    if naming not in NAMINGS:
        raise ValueError(f"tensor naming must be one of {NAMINGS}, not {naming!r}")
    config = model.config
    t = config.text
    out: dict[str, np.ndarray] = {}
    for name, arr in numpy_state(model).items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            parts = np.split(
                _permute_qk(arr, config, inverse=True),
                [
                    t.num_attention_heads * t.head_dim,
                    (t.num_attention_heads + t.num_key_value_heads) * t.head_dim,
                ],
                axis=-1,
            )
        elif name.endswith(("up_gate_proj.weight", "up_gate_proj.bias")):
            parts = np.split(arr, 2, axis=-1)
        else:
            parts = [arr]
        for (key, fn), part in zip(sources(name, naming, config), parts, strict=True):
            if name == _PATCH:
                v = config.vision
                part = part.T.reshape(v.hidden_size, v.num_channels, v.patch_size, v.patch_size)
            elif fn is not None:  # every other conversion is a transpose, its own inverse
                part = part.T
            out[key] = np.ascontiguousarray(part)
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
