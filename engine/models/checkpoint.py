"""Read and write ERNIE 4.5 checkpoints in both public layouts (``loading.load_model`` and
``saving.save_model`` are the entry points: they also know PaddleOCR-VL and the streaming reader).

Paddle layout (``ernie.*``, Linear weights [in, out], fused ``qkv_proj`` / ``up_gate_proj``) is what the
engine holds in memory and writes by default. The PyTorch / Hugging Face layout (``model.*``, [out, in],
split projections) is converted on load and can be written for export.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import paddle

from engine.models.config import ErnieConfig, parse_size
from engine.models.ernie import ErnieForCausalLM
from engine.models.safetensors_io import (
    STORED_NP,
    SafetensorsFile,
    f32_to_bf16_bits,
    save_file,
    write_streamed,
)

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# The transformers release whose config.json form `layout="hf"` writes (tests/engine/golden holds its files).
HF_FORMAT_VERSION = "5.23.0"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and tensor."""


# ---- finding tensors on disk ---------------------------------------------------------------------------


class TensorStore:
    """All tensors of a checkpoint directory, single file or sharded with an index, read lazily."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        index = directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            for key, fname in weight_map.items():
                if not (directory / fname).exists():
                    raise CheckpointError(
                        f"{index}: shard {fname} (holding {key}) is missing from {directory}"
                    )
                self.where[key] = fname
        else:
            shards = sorted(directory.glob("*.safetensors"))
            if not shards:
                found = ", ".join(sorted(p.name for p in directory.iterdir())[:12]) or "nothing"
                raise CheckpointError(
                    f"{directory}: no model weights (expected model.safetensors or sharded "
                    f"model-*-of-*.safetensors with {INDEX_FILE}); found {found}"
                )
            for shard in shards:
                for key in self._file(shard.name).header:
                    self.where[key] = shard.name

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.files:
            self.files[name] = SafetensorsFile(self.directory / name)
        return self.files[name]

    def keys(self) -> list[str]:
        return list(self.where)

    def __iter__(self):
        return iter(self.where)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def shape(self, key: str) -> list[int]:
        return self._file(self.where[key]).shape(key)

    def dtype(self, key: str) -> str:
        return self._file(self.where[key]).dtype(key)

    def get(self, key: str, start_row: int | None = None, stop_row: int | None = None) -> np.ndarray:
        return self._file(self.where[key]).get(key, start_row, stop_row)

    def get_stored(self, key: str, start_row: int | None = None, stop_row: int | None = None) -> np.ndarray:
        return self._file(self.where[key]).get_stored(key, start_row, stop_row)


def detect_layout(keys: Iterable[str]) -> str:
    keys = list(keys)
    if any(k.startswith("ernie.") for k in keys):
        return "paddle"
    if any(k.startswith("model.") for k in keys):
        return "hf"
    sample = ", ".join(keys[:5])
    raise CheckpointError(
        f"unrecognised checkpoint layout: keys start neither with 'ernie.' (Paddle) nor 'model.' "
        f"(PyTorch); first keys: {sample}"
    )


# ---- layout conversion ---------------------------------------------------------------------------------

_LAYER = re.compile(r"^ernie\.layers\.(\d+)\.(.+)$")


def _hf_name(name: str) -> str:
    if name.startswith("ernie."):
        return "model." + name[len("ernie.") :]
    if name.startswith("vision_model."):
        return "model." + name  # transformers' form; the hub's flat -PT repos keep it at the top
    return name


# VL Linear weights outside the decoder ([out, in] in the -PT layout): the ViT's qkv / proj / fc1 / fc2 and
# patch embedding, the resampler's fc layers (Sequential indices 0 and 2) and its output projection.
_VL_LINEAR = re.compile(
    r"^(vision_model\..*\.(qkv|proj|fc1|fc2)\.weight"
    r"|ernie\.resampler_model\.((spatial_linear|temporal_linear)\.[02]|mlp)\.weight)$"
)


def hf_sources(name: str, config: ErnieConfig | None = None) -> list[tuple[str, Callable | None]]:
    """For an internal (Paddle-layout) tensor name: the hub-format PyTorch tensors it is built from and how.

    Linear weights are transposed ([out, in] -> [in, out]); fused projections are concatenated on the last
    axis in the order returned (q, k, v; gate, up).
    """
    base = _hf_name(name)
    if name.endswith("self_attn.qkv_proj.weight"):
        stem = base[: -len("qkv_proj.weight")]
        return [(stem + p + "_proj.weight", np.transpose) for p in "qkv"]
    if name.endswith("up_gate_proj.weight"):
        stem = base[: -len("up_gate_proj.weight")]
        return [(stem + "gate_proj.weight", np.transpose), (stem + "up_proj.weight", np.transpose)]
    if name.endswith("self_attn.qkv_proj.bias"):
        stem = base[: -len("qkv_proj.bias")]
        return [(stem + p + "_proj.bias", None) for p in "qkv"]
    if name.endswith("up_gate_proj.bias"):
        stem = base[: -len("up_gate_proj.bias")]
        return [(stem + "gate_proj.bias", None), (stem + "up_proj.bias", None)]
    if re.search(r"\.(o_proj|down_proj)\.weight$", name) or _VL_LINEAR.match(name):
        return [(base, np.transpose)]
    if re.search(r"mlp\.gate\.weight(_\d+)?$", name):
        # Text MoE checkpoints store the router [E, H]; VL ones store it [H, E] like the Paddle layout.
        vl = config is not None and config.vision_config is not None
        return [(base, None if vl else np.transpose)]
    if name == "lm_head.weight":
        return [("lm_head.weight", np.transpose)]
    return [(base, None)]


def hf_parts(name: str, arr: np.ndarray, config: ErnieConfig) -> list[tuple[str, np.ndarray]]:
    """One internal (Paddle-layout) tensor as the hub-format PyTorch tensors it becomes (views of ``arr``
    where the layout allows: fused projections split, linear weights transposed)."""
    nq, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        parts = np.split(arr, [nq * hd, (nq + nkv) * hd], axis=-1)
    elif name.endswith("up_gate_proj.weight") or name.endswith("up_gate_proj.bias"):
        parts = np.split(arr, 2, axis=-1)
    else:
        parts = [arr]
    return [
        (hf, fn(part) if fn is not None else part)
        for (hf, fn), part in zip(hf_sources(name, config), parts, strict=True)
    ]


def to_hf_state_dict(state: dict[str, np.ndarray], config: ErnieConfig) -> dict[str, np.ndarray]:
    """Internal (Paddle layout) numpy state -> PyTorch layout tensors (hub key format, per-expert keys)."""
    return {
        hf: np.ascontiguousarray(part)
        for name, arr in state.items()
        for hf, part in hf_parts(name, arr, config)
    }


class ModelTensors(Mapping):
    """A model's tensors as float32 numpy arrays made one at a time on access, in the Paddle layout or, with
    ``hf_config``, the PyTorch one (``hf_parts``): what ``write_tensors_streamed`` writes without a whole
    fp32 copy of the model. ``shapes`` gives every name's shape, in file order."""

    def __init__(self, model: paddle.nn.Layer, hf_config: ErnieConfig | None = None):
        self.state = model.state_dict()
        self.hf_config = hf_config
        self.source: dict[str, tuple[str, int]] = {}
        self.shapes: dict[str, list[int]] = {}
        for name, t in self.state.items():
            shape = list(t.shape)
            if hf_config is None:
                self.source[name], self.shapes[name] = (name, 0), shape
                continue
            # the parts' shapes from a zero-stride stand-in: no memory
            stand_in = np.broadcast_to(np.float32(0), shape)
            for i, (hf, part) in enumerate(hf_parts(name, stand_in, hf_config)):
                self.source[hf], self.shapes[hf] = (name, i), list(part.shape)
        self._last: tuple[str, list[np.ndarray]] | None = None  # a fused tensor's parts, read in a row

    def __getitem__(self, key: str) -> np.ndarray:
        name, index = self.source[key]
        if self._last is None or self._last[0] != name:
            t = self.state[name]
            arr = t.astype("float32").numpy() if t.dtype != paddle.float32 else t.numpy()
            parts = [arr] if self.hf_config is None else [p for _, p in hf_parts(name, arr, self.hf_config)]
            self._last = (name, parts)
        return self._last[1][index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


# ---- loading -------------------------------------------------------------------------------------------

# Hub keys of one expert's projection: model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
_HUB_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class HFReader:
    """Reads hub-format PyTorch tensors, also from transformers' fused-expert and renamed-bias variants.

    transformers 5 holds MoE experts as 3-D ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
    ``experts.down_proj`` [E, H, I] and keeps the correction bias under ``mlp.gate.moe_statics``; it
    writes that form with ``save_pretrained(save_original_format=False)``.
    """

    def __init__(self, store: TensorStore):
        self.store = store
        self.used: set[str] = set()
        self._fused: dict[str, np.ndarray] = {}  # one layer's fused experts, read once for all experts

    def where(self, key: str) -> str:
        """The stored key that provides hub key ``key`` (itself, a fused tensor, or a renamed bias)."""
        if key in self.store:
            return key
        m = _HUB_EXPERT.match(key)
        if m:
            fused = m.group(1) + (".down_proj" if m.group(3) == "down" else ".gate_up_proj")
            if fused in self.store:
                return fused
        if key.endswith("mlp.moe_statics.e_score_correction_bias"):
            alt = key.replace("mlp.moe_statics.", "mlp.gate.moe_statics.")
            if alt in self.store:
                return alt
        if key.startswith("model.vision_model.") and key[len("model.") :] in self.store:
            return key[len("model.") :]  # the hub's top-level vision_model.*
        raise KeyError(key)

    def get(self, key: str) -> np.ndarray:
        src = self.where(key)
        self.used.add(src)
        if src == key or not _HUB_EXPERT.match(key):
            return self.store.get(src)
        m = _HUB_EXPERT.match(key)
        if src not in self._fused:
            self._fused = {src: self.store.get(src)}
        fused, e = self._fused[src], int(m.group(2))
        if e >= fused.shape[0]:
            raise CheckpointError(
                f"{self.store.directory / self.store.where[src]}: {src} holds {fused.shape[0]} experts; "
                f"the config needs expert {e}"
            )
        if m.group(3) == "down":
            return fused[e]
        half = fused.shape[1] // 2
        return fused[e, :half] if m.group(3) == "gate" else fused[e, half:]


def shape_error(
    store: TensorStore, name: str, sources: list[str], got: list[int], expected: list[int]
) -> str:
    files = ", ".join(f"{s} in {store.where[s]}" for s in dict.fromkeys(sources) if s in store.where)
    return (
        f"{store.directory}: tensor {name} ({files}) has shape {got} but config.json "
        f"(hidden_size, heads, head_dim, experts, vocab_size) implies {expected}"
    )


def read_internal(
    store: TensorStore,
    layout: str,
    name: str,
    expected: list[int],
    config: ErnieConfig,
    hf: HFReader | None = None,
) -> np.ndarray:
    """Fetch one internal tensor from the store, converting layout; KeyError names the absent tensor."""
    if layout == "paddle":
        if name not in store:
            raise KeyError(name)
        arr, sources = store.get(name), [name]
    else:
        hf = hf or HFReader(store)
        parts, sources = [], []
        for key, fn in hf_sources(name, config):
            a = hf.get(key)
            sources.append(hf.where(key))
            parts.append(fn(a) if fn is not None else a)
        if len(parts) > 1 and len({p.shape[:-1] for p in parts}) > 1:
            raise CheckpointError(
                shape_error(store, name, sources, [list(p.shape) for p in parts], expected)  # type: ignore[arg-type]
            )
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    if name.endswith("e_score_correction_bias") and arr.ndim == 1:
        arr = arr[None, :]
    if (
        name.endswith("e_score_correction_bias")
        and arr.shape[-1] < expected[-1]
        and arr.shape[0] == expected[0]
    ):
        # VL checkpoints keep one bias row per modality group, each as long as that group.
        arr = np.pad(arr, [(0, 0), (0, expected[-1] - arr.shape[-1])])
    if list(arr.shape) != list(expected):
        raise CheckpointError(shape_error(store, name, sources, list(arr.shape), expected))
    return arr


def lm_head_orientation(store: TensorStore, layout: str, config: ErnieConfig) -> bool:
    """Whether the stored untied head is [V, H] (to be transposed to the model's [H, V]); either
    orientation is accepted on disk."""
    shape = store.shape("lm_head.weight")
    h, v = config.hidden_size, config.vocab_size
    if h == v:  # square: only the layout can tell the orientation
        return layout != "paddle"
    if shape == [h, v]:
        return False
    if shape == [v, h]:
        return True
    raise CheckpointError(
        f"{store.directory / store.where['lm_head.weight']}: lm_head.weight has shape {shape}; "
        f"expected [{h}, {v}] or [{v}, {h}] (hidden_size, vocab_size from config.json)"
    )


def resolve_dtype(dtype: str) -> str:
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    if dtype not in {"float32", "float16", "bfloat16"}:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    if dtype != "float32" and not paddle.is_compiled_with_cuda():
        log.warning("%s matmul is not available on CPU; loading in float32", dtype)
        return "float32"
    return dtype


def cast_model(model: ErnieForCausalLM, dtype: str) -> ErnieForCausalLM:
    """Cast to ``dtype`` but keep router gates and correction biases in fp32, as the reference does."""
    if dtype == "float32":
        return model
    for name, layer in model.named_sublayers(include_self=True):
        if name.endswith("mlp.gate") or name.endswith("moe_statics"):
            continue
        # Layer by layer: ``Parameter.set_value`` refuses another dtype, ``_to_impl`` swaps the storage.
        layer._to_impl(dtype=dtype, include_sublayers=False, floating_only=True)
    return model


# ---- saving --------------------------------------------------------------------------------------------


def numpy_state(model: paddle.nn.Layer) -> dict[str, np.ndarray]:
    return {
        k: v.astype("float32").numpy() if v.dtype != paddle.float32 else v.numpy()
        for k, v in model.state_dict().items()
    }


def write_tensors(
    tensors: dict[str, np.ndarray],
    directory: Path,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    keep_float32: Collection[str] = (),
) -> list[str]:
    """Write safetensors shards (``model.safetensors`` when one shard) and the index; tensors named in
    ``keep_float32`` stay float32 whatever ``dtype`` is. Returns file names."""
    limit = parse_size(max_shard_size)
    itemsize = 2 if dtype in {"bfloat16", "float16"} else 4
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        nbytes = arr.size * (itemsize if arr.dtype.kind == "f" else arr.itemsize)
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += nbytes
    for old in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", dtype, keep_float32=keep_float32)
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += save_file(shard, directory / fname, dtype, keep_float32=keep_float32)
        names.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_tensors_streamed(
    tensors: Mapping[str, np.ndarray],
    shapes: dict[str, list[int]],
    directory: Path,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    keep_float32: Collection[str] = (),
    integer: dict[str, str] | None = None,
) -> list[str]:
    """``write_tensors`` for a mapping whose values are read on access (``loading.TensorSource``): the same
    files, shards and index, with one tensor in memory at a time. ``shapes`` gives every tensor's shape;
    ``integer`` the stored code (``I8``, ``U8``) of tensors that are not floating point (PTQ's values)."""
    limit = parse_size(max_shard_size)
    integer = integer or {}
    code = {"bfloat16": "BF16", "float16": "F16"}.get(dtype, "F32")
    codes = {n: integer.get(n) or ("F32" if n in keep_float32 else code) for n in shapes}
    shards: list[list[str]] = [[]]
    size = 0
    itemsize = 2 if dtype in {"bfloat16", "float16"} else 4  # as write_tensors counts (kept fp32 too)
    for name, shape in shapes.items():
        width = STORED_NP[integer[name]]().itemsize if name in integer else itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * width
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    def produce(name: str) -> np.ndarray:
        if name in integer:
            return np.asarray(tensors[name])
        arr = np.asarray(tensors[name], dtype=np.float32)
        if codes[name] == "BF16":
            return f32_to_bf16_bits(arr)
        return arr.astype(np.float16) if codes[name] == "F16" else arr

    for old in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        old.unlink(missing_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    total, weight_map = 0, {}
    for fname, shard in zip(names, shards, strict=True):
        total += write_streamed(directory / fname, [(n, codes[n], shapes[n]) for n in shard], produce)
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def save_ernie(
    model: ErnieForCausalLM,
    directory: str | Path,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    layout: str = "paddle",
) -> Path:
    """Write an ERNIE model's config.json and weights (Paddle layout by default, ``layout='hf'`` for
    PyTorch). ``saving.save_model`` writes any model the engine builds (PaddleOCR-VL too)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.replace(dtype=dtype)
    if layout == "hf":
        write_hf_config(config, directory)
    elif layout == "paddle":
        config.save(directory)
    else:
        raise ValueError(f"layout must be 'paddle' or 'hf', not {layout!r}")
    # one tensor at a time: a model is never copied whole into float32 numpy on its way to disk
    tensors = ModelTensors(model, config if layout == "hf" else None)
    write_tensors_streamed(tensors, tensors.shapes, directory, dtype, max_shard_size)
    return directory


def write_hf_config(config: ErnieConfig, directory: Path) -> None:
    """A transformers-style config.json (``model_type`` ernie4_5 / ernie4_5_moe / ernie4_5_vl_moe)."""
    if config.vision_config is not None:
        d = hf_vl_config(config)
        (directory / "config.json").write_text(json.dumps(d, indent=2) + "\n")
        return
    d = config.to_dict()
    d["model_type"] = "ernie4_5_moe" if config.is_moe else "ernie4_5"
    d["architectures"] = ["Ernie4_5_MoeForCausalLM" if config.is_moe else "Ernie4_5ForCausalLM"]
    d["use_cache"] = True
    # transformers 5.x names (its own config.json files carry these). One dtype key only: FastDeploy refuses
    # a config.json holding both `dtype` and `torch_dtype`. FastDeploy 2.3 (fastdeploy/config.py
    # ModelConfig.read_model_config) takes `torch_dtype` for the PyTorch layout and `dtype` for the Paddle one,
    # whatever transformers_version says (the transformers_version rule came after 2.3): it would misread this
    # file, so `ernie-studio serve --backend fastdeploy` rewrites it in the Paddle layout first
    # (engine.train.serving_export.export_for_serving).
    d["rope_parameters"] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    d["transformers_version"] = HF_FORMAT_VERSION
    (directory / "config.json").write_text(json.dumps(d, indent=2) + "\n")


def hf_vl_config(config: ErnieConfig) -> dict:
    """transformers' nested ``ernie4_5_vl_moe`` config: ``text_config``, ``vision_config``, token ids."""
    c, v = config, config.vision_config
    experts = c.expert_counts
    if len(set(experts)) > 1:
        log.warning(
            "transformers' ernie4_5_vl_moe holds one expert count for both groups; writing %s", experts
        )
    pairs = c.head_dim // 2
    text = {
        "model_type": "ernie4_5_vl_moe_text",
        **{k: getattr(c, k) for k in _HF_TEXT_KEYS},
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "mrope_section": [(pairs - c.freq_allocation) // 2] * 2 + [c.freq_allocation],
        },
        "moe_num_experts": experts[0] if len(set(experts)) == 1 else experts,
        "moe_intermediate_size": c.expert_intermediate_sizes,
        "mlp_layer_types": ["sparse" if c.is_moe_layer(i) else "dense" for i in range(c.num_hidden_layers)],
        "use_cache": True,
    }
    vision = {
        "model_type": "ernie4_5_vl_moe_vision",
        **{k: getattr(v, k) for k in _HF_VISION_KEYS},
        "rms_norm_eps": v.layer_norm_eps,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    return {
        "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
        "model_type": "ernie4_5_vl_moe",
        "dtype": c.dtype,
        "transformers_version": HF_FORMAT_VERSION,
        "tie_word_embeddings": c.tie_word_embeddings,
        "image_token_id": c.im_patch_id,
        **{k: getattr(c, k) for k in ("image_start_token_id", "image_end_token_id", "video_token_id")},
        **{k: getattr(c, k) for k in ("video_start_token_id", "video_end_token_id")},
        "text_config": text,
        "vision_config": vision,
    }


_HF_TEXT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "use_bias",
    "tie_word_embeddings", "moe_k", "moe_num_shared_experts", "moe_norm_min", "pad_token_id", "bos_token_id",
    "eos_token_id",
)  # fmt: skip
_HF_VISION_KEYS = (
    "depth", "hidden_size", "num_heads", "intermediate_size", "hidden_act", "patch_size", "in_channels",
    "spatial_merge_size", "temporal_merge_size",
)  # fmt: skip
