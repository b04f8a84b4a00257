"""One config class for ERNIE 4.5 dense, MoE and multimodal (VL) checkpoints."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# compute_type values whose frozen base is weight-only quantized (int8, or int4 experts + int8 elsewhere). A
# LoRA directory records its compute_type, and loading quantizes the base the same way before the adapter.
WEIGHT_ONLY_COMPUTE_TYPES = ("wint8", "wint4/8")
# Which decoder layers an elastic sub-model of fewer layers keeps (engine.models.elastic.kept_layers).
ELASTIC_DEPTH_PATTERNS = ("contiguous", "strided")


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '10KB' or a byte count -> bytes (a checkpoint's largest shard)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or '500MB'")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}[unit])


# Keys that only matter to ERNIEKit / PaddleFormers training or to fused GPU kernels.
TRAINING_ONLY_KEYS = {
    "use_flash_attention",
    "compression_ratio",
    "num_nextn_predict_layers",
    "paddlenlp_version",
    "transformers_version",
    "torch_dtype",
    "use_cache",
    "use_rmsnorm",
    "use_recompute",
    "recompute_granularity",
    "sequence_parallel",
    "tensor_parallel_degree",
    "multi_token_pred_lambda",
    "router_aux_loss_coef",
    "output_router_logits",
    "initializer_range",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "weight_share_add_bias",
    "moe_group",
    "moe_multimodal_dispatch_use_allgather",
    "moe_use_hard_gate",
    "moe_dense_experts_token_type_id",
    "moe_use_token_type_bias",
    "pixel_hidden_size",
    "rope_scaling",
    "auto_map",
    "pad_vocab_size_multiple",
}


@dataclass
class VisionConfig:
    """ERNIE 4.5 VL's ViT and resampler (``vision_config`` of a config.json, official or transformers form)."""

    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 5120  # official config.json files give mlp_ratio (4) instead
    hidden_act: str = "quick_gelu"
    patch_size: int = 14
    in_channels: int = 3
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        aliases = {"embed_dim": "hidden_size", "in_chans": "in_channels", "rms_norm_eps": "layer_norm_eps"}
        kwargs: dict[str, Any] = {}
        for k, v in d.items():
            k = aliases.get(k, k)
            if k in names:
                kwargs[k] = v
        if isinstance(d.get("rope_parameters"), dict) and "rope_theta" in d["rope_parameters"]:
            kwargs["rope_theta"] = d["rope_parameters"]["rope_theta"]
        hidden = kwargs.get("hidden_size", cls.hidden_size)
        if "intermediate_size" not in kwargs and "mlp_ratio" in d:
            kwargs["intermediate_size"] = int(hidden * d["mlp_ratio"])
        elif "intermediate_size" not in kwargs:
            kwargs["intermediate_size"] = 4 * hidden
        return cls(**kwargs)


@dataclass
class ErnieConfig:
    """Hyper-parameters of an ERNIE 4.5 model, readable from an official ``config.json``."""

    model_type: str = "ernie4_5"
    vocab_size: int = 103424
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 18
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = None  # hidden_size // num_attention_heads when a config.json omits it
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    use_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int = 1
    eos_token_id: int | list[int] = 2
    pad_token_id: int = 0
    dtype: str = "bfloat16"
    # MoE. Lists hold one value per modality group (text, vision) in VL models.
    moe_num_experts: int | list[int] = 0
    moe_k: int = 0
    moe_num_shared_experts: int = 0
    moe_intermediate_size: int | list[int] = 0
    moe_layer_start_index: int | list[int] = 0
    moe_layer_end_index: int | list[int] = -1
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    moe_gate: str = "topk"
    moe_capacity: list[float] = field(default_factory=list)
    moe_use_aux_free: bool = True
    moe_aux_loss_lambda: float = 1e-5
    moe_z_loss_lambda: float = 0.0
    moe_orthogonal_loss_lambda: float = 0.0
    # VL: the vision tower, 3-D RoPE (``freq_allocation`` rotary pairs turn with time, the others alternate
    # between row and column) and the special tokens. ``im_patch_id`` is the image placeholder.
    vision_config: VisionConfig | None = None
    rope_3d: bool = False
    freq_allocation: int = 0
    im_patch_id: int | None = None
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    video_token_id: int | None = None
    video_start_token_id: int | None = None
    video_end_token_id: int | None = None
    # PaddleOCR-VL's decoder (engine.models.paddleocr_vl): 3-D RoPE in contiguous sections of rotary pairs,
    # (time, row, column) = transformers' ``rope_parameters.mrope_section``; None for ERNIE's own models.
    mrope_section: list[int] | None = None
    # GPAS gates after every residual add (engine.models.gpas); written to config.json only when true
    gpas: bool = False
    # transformers' form of the MoE layer rule: "dense" / "sparse" per layer (overrides start/end/interval)
    mlp_layer_types: list[str] | None = None

    # ---- derived -------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.vision_config, dict):
            self.vision_config = VisionConfig.from_dict(self.vision_config)
        if self.vision_config is not None:
            for name, default in VL_TOKEN_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
            if self.video_token_id is None:
                # Baidu's own configs fill video frames with the image placeholder too (transformers gives
                # videos an id of their own); a video's grid (t > 1) tells the two apart.
                self.video_token_id = self.im_patch_id
        problems = [
            f"{f.name} must be a number, not {getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.type in ("int", "float")
            and (
                isinstance(getattr(self, f.name), bool) or not isinstance(getattr(self, f.name), int | float)
            )
        ]
        if problems:
            raise ValueError("invalid ERNIE config: " + "; ".join(problems))
        problems = self._shape_problems() + self._vl_problems()
        if problems:
            raise ValueError("invalid ERNIE config: " + "; ".join(problems))

    def _shape_problems(self) -> list[str]:
        problems = []
        if self.hidden_act not in ("silu", "swish"):
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (ERNIE 4.5 uses silu)")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mlp_layer_types is not None and len(self.mlp_layer_types) != self.num_hidden_layers:
            problems.append(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if self.is_moe and self.moe_k > min(self.expert_counts):
            problems.append(f"moe_k ({self.moe_k}) exceeds the number of experts {self.expert_counts}")
        return problems

    def _vl_problems(self) -> list[str]:
        if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
            return [
                f"mrope_section {self.mrope_section} must add up to head_dim / 2 ({self.head_dim // 2}) "
                "rotary pairs"
            ]
        if not self.rope_3d:
            return []
        pairs = self.head_dim // 2
        if not 0 <= self.freq_allocation <= pairs:
            return [f"freq_allocation ({self.freq_allocation}) must be between 0 and head_dim / 2 ({pairs})"]
        if (pairs - self.freq_allocation) % 2:
            return [
                f"head_dim / 2 - freq_allocation ({pairs - self.freq_allocation}) must be even: those rotary "
                "pairs alternate between row and column"
            ]
        return []

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_k) and any(n > 0 for n in self.expert_counts)

    @property
    def is_vl(self) -> bool:
        return self.vision_config is not None or self.model_type == "ernie4_5_moe_vl"

    @property
    def expert_counts(self) -> list[int]:
        """Experts per modality group: [text] or [text, vision]."""
        n = self.moe_num_experts
        return list(n) if isinstance(n, list | tuple) else [int(n)]

    @property
    def expert_intermediate_sizes(self) -> list[int]:
        sizes = self.moe_intermediate_size
        sizes = list(sizes) if isinstance(sizes, list | tuple) else [int(sizes)]
        if len(sizes) < len(self.expert_counts):
            sizes = sizes + [sizes[-1]] * (len(self.expert_counts) - len(sizes))
        return [s if s else self.intermediate_size for s in sizes]

    def is_moe_layer(self, i: int) -> bool:
        """ERNIE's MoE layer rule: start <= i <= end and (i + 1) % interval == 0."""
        if not self.is_moe:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[i] == "sparse"
        start = self.moe_layer_start_index
        end = self.moe_layer_end_index
        start = min(start) if isinstance(start, list | tuple) else start
        end = max(end) if isinstance(end, list | tuple) else end
        if end is None or end < 0:
            end = self.num_hidden_layers - 1
        return start <= i <= end and (i + 1) % max(self.moe_layer_interval, 1) == 0

    def moe_layer_rule(self) -> dict[str, int] | None:
        """start / end / interval keys equivalent to the MoE layers, if they are one contiguous run."""
        sparse = [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]
        if not sparse or sparse != list(range(sparse[0], sparse[-1] + 1)):
            return None
        return {
            "moe_layer_start_index": sparse[0],
            "moe_layer_end_index": sparse[-1],
            "moe_layer_interval": 1,
        }

    @property
    def stop_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, list | tuple) else [eos]

    # ---- io ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ErnieConfig:
        d = flatten_transformers_vl(raw) if isinstance(raw.get("text_config"), dict) else dict(raw)
        if isinstance(d.get("vision_config"), dict):
            vision = dict(d["vision_config"])
            vision.setdefault("spatial_merge_size", d.get("spatial_conv_size", 2))
            vision.setdefault("temporal_merge_size", d.get("temporal_conv_size", 2))
            d["vision_config"] = vision
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", cls.rope_theta)
        if "torch_dtype" in d and "dtype" not in d:
            d["dtype"] = d["torch_dtype"]
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        ignored = []
        for k, v in d.items():
            if k in names:
                kwargs[k] = v
            elif k.startswith("fuse_") or k in TRAINING_ONLY_KEYS or k in FORM_KEYS:
                continue
            else:
                ignored.append(k)
        if ignored:
            log.info("config.json keys not used by the engine: %s", ", ".join(sorted(ignored)))
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> ErnieConfig:
        return config_from_file(cls, path)

    @property
    def architecture(self) -> str:
        if self.is_vl:
            return "Ernie4_5_VLMoeForConditionalGeneration"
        return "Ernie4_5_MoeForCausalLM" if self.is_moe else "Ernie4_5_ForCausalLM"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.vision_config is None:
            for k in (
                "vision_config",
                "rope_3d",
                "freq_allocation",
                "im_patch_id",
                "video_token_id",
                *VL_TOKEN_DEFAULTS,
            ):
                d.pop(k)
        else:
            d["vision_config"] = vision_dict(self.vision_config)
            d["spatial_conv_size"] = self.vision_config.spatial_merge_size
            d["temporal_conv_size"] = self.vision_config.temporal_merge_size
        if self.mrope_section is None:
            d.pop("mrope_section")
        if self.mlp_layer_types is not None and (rule := self.moe_layer_rule()) is not None:
            # Baidu's loaders (FastDeploy, ERNIEKit) read the start / end / interval rule, not the list
            d.update(rule, mlp_layer_types=None)
        if d.get("mlp_layer_types") is None:
            d.pop("mlp_layer_types")
        if not self.is_moe:
            for k in list(d):
                if k.startswith("moe_"):
                    d.pop(k)
        if not self.gpas:
            d.pop("gpas")
        d["architectures"] = [self.architecture]
        return d

    def save(self, directory: str | Path) -> None:
        Path(directory, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> ErnieConfig:
        return dataclasses.replace(self, **changes)


# transformers' defaults (the ERNIE 4.5 VL tokenizer's ids); a config.json may give its own.
VL_TOKEN_DEFAULTS = {
    "image_start_token_id": 101304,
    "image_end_token_id": 101305,
    "video_start_token_id": 101306,
    "video_end_token_id": 101307,
}
# Keys that say which form a config.json is in, not what the model is.
FORM_KEYS = {"architectures", "rope_parameters", "spatial_conv_size", "temporal_conv_size"}


def flatten_transformers_vl(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' nested VL config (``text_config`` / ``vision_config``) -> the official flat keys."""
    d = dict(raw["text_config"])
    for k in ("vision_config", "tie_word_embeddings", "video_token_id", *VL_TOKEN_DEFAULTS):
        if k in raw:
            d[k] = raw[k]
    if "image_token_id" in raw:
        d["im_patch_id"] = raw["image_token_id"]
    d["model_type"] = "ernie4_5_moe_vl"
    rope = d.get("rope_parameters") or {}
    if "mrope_section" in rope:
        d["rope_3d"], d["freq_allocation"] = True, rope["mrope_section"][2]
    experts = d.get("moe_num_experts")
    if isinstance(experts, int):
        d["moe_num_experts"] = [experts, experts]  # text and vision groups of the same size
    return d


def vision_dict(v: VisionConfig) -> dict[str, Any]:
    """The official ``vision_config`` keys (``embed_dim`` and ``mlp_ratio`` beside the transformers names)."""
    d = dataclasses.asdict(v)
    d["embed_dim"] = v.hidden_size
    d["mlp_ratio"] = v.intermediate_size / v.hidden_size
    d["rms_norm_eps"] = d.pop("layer_norm_eps")
    return d


def vision_parameter_count(v: VisionConfig, text_hidden: int) -> int:
    """The ViT (patch embedding, blocks, final LayerNorm) and the resampler (spatial and temporal MLPs,
    projection to the decoder width, RMSNorm)."""
    d, inner = v.hidden_size, v.intermediate_size
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    vit = v.in_channels * v.patch_size**2 * d + v.depth * block + 2 * d
    s = d * v.spatial_merge_size**2
    spatial = 2 * (s * s + s) + 2 * s
    temporal = (v.temporal_merge_size * s * s + s) + (s * s + s) + 2 * s
    return vit + spatial + temporal + s * text_hidden + 2 * text_hidden


def config_from_file(cls: Any, path: str | Path) -> Any:
    """``cls.from_dict`` of a model directory's config.json (or the file itself), every error naming the
    file (and the line of a JSON error)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.json; a model directory needs one")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: config.json is not valid JSON: {e.msg}") from e
    try:
        return cls.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
