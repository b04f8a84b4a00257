"""PaddleOCR-VL's config: the ERNIE 4.5 decoder's keys, its NaViT vision encoder's and the image token ids.

Two config.json forms exist (no Paddle import here, so the CLI and presets read them cheaply):

- official (``PaddlePaddle/PaddleOCR-VL``, written for its remote code): the decoder's keys at the top level,
  ``rope_theta`` and ``rope_scaling.mrope_section`` for the 3-D RoPE, ``vision_config`` nested;
- transformers 5 (``save_pretrained``): ``text_config`` and ``vision_config`` nested, RoPE under
  ``rope_parameters``. ``PaddleOCRVLConfig.__post_init__`` in transformers reads the flat form the same way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.config import ErnieConfig, config_from_file

log = logging.getLogger(__name__)

MODEL_TYPE = "paddleocr_vl"
ARCHITECTURE = "PaddleOCRVLForConditionalGeneration"
# transformers' PaddleOCRTextConfig default (the 0.3B's 64 rotary pairs: 16 time, 24 row, 24 column)
DEFAULT_MROPE_SECTION = [16, 24, 24]
# The transformers release whose config.json form ``layout="hf"`` writes.
HF_FORMAT_VERSION = "5.24.0"

# The decoder keys both forms carry (transformers' PaddleOCRTextConfig fields).
TEXT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "use_bias",
    "pad_token_id", "bos_token_id", "eos_token_id",
)  # fmt: skip


@dataclass
class OCRVisionConfig:
    """The SigLIP-like NaViT encoder (transformers' ``PaddleOCRVisionConfig``; defaults are the 0.9B's)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 384  # the learned position grid is (image_size / patch_size)^2, resampled per image
    patch_size: int = 14
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    attention_dropout: float = 0.0  # training only; kept so that exports carry the published key

    # Images only: one frame per image, positions as ERNIE VL's images (engine.models.positions).
    temporal_merge_size = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OCRVisionConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        rope = d.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        theta = d.pop("rope_theta")
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": theta}
        return d


@dataclass
class PaddleOCRVLConfig:
    """The whole model: ``text`` (an ``ErnieConfig`` with ``mrope_section``), ``vision`` and token ids."""

    text: ErnieConfig
    vision: OCRVisionConfig = field(default_factory=OCRVisionConfig)
    image_token_id: int = 100295
    video_token_id: int = 100296
    vision_start_token_id: int = 101305
    vision_end_token_id: int = 101306
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        v = self.vision
        problems = []
        if v.hidden_size % v.num_attention_heads or v.head_dim % 4:
            problems.append(
                f"vision hidden_size {v.hidden_size} / num_attention_heads {v.num_attention_heads} must be a "
                "head size divisible by 4 (its 2-D rotary splits each half between row and column)"
            )
        if v.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            problems.append(
                f"vision hidden_act {v.hidden_act!r} is not supported (PaddleOCR-VL: gelu_pytorch_tanh)"
            )
        if self.text.mrope_section is None:
            problems.append("the decoder needs rope mrope_section (PaddleOCR-VL's 3-D RoPE)")
        if problems:
            raise ValueError("invalid PaddleOCR-VL config: " + "; ".join(problems))

    def __getattr__(self, name: str) -> Any:
        """The decoder's facts (layers, heads, vocabulary, MoE: none, GPAS: none) read through to ``text``,
        so what serves or trains an ERNIE 4.5 decoder reads this config as it reads an ``ErnieConfig``."""
        if name.startswith("__") or name in ("text", "vision"):  # copy / pickle probe before the fields exist
            raise AttributeError(name)
        return getattr(self.text, name)

    @property
    def is_vl(self) -> bool:
        return True

    # What engine.models.positions reads of a VL config (the image placeholder and the merge sizes).
    @property
    def vision_config(self) -> OCRVisionConfig:
        return self.vision

    @property
    def im_patch_id(self) -> int:
        return self.image_token_id

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text.tie_word_embeddings

    @property
    def dtype(self) -> str:
        return self.text.dtype

    def replace(self, **changes: Any) -> PaddleOCRVLConfig:
        return dataclasses.replace(self, **changes)

    # ---- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PaddleOCRVLConfig:
        """Either form (official flat or transformers nested)."""
        nested = isinstance(raw.get("text_config"), dict)
        t = dict(raw["text_config"]) if nested else dict(raw)
        rope = t.get("rope_parameters") or t.get("rope_scaling") or raw.get("rope_scaling") or {}
        text = {k: t[k] for k in TEXT_KEYS if k in t}
        text["rope_theta"] = float(rope.get("rope_theta", t.get("rope_theta", ErnieConfig.rope_theta)))
        text["mrope_section"] = list(rope.get("mrope_section", DEFAULT_MROPE_SECTION))
        # transformers' root value wins; pre-v5 saves kept it in text_config only
        text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", t.get("tie_word_embeddings", True)))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or t.get("dtype") or t.get("torch_dtype")
        if dtype:
            text["dtype"] = dtype
        vision = OCRVisionConfig.from_dict(raw.get("vision_config") or {})
        ids = {
            k: raw[k]
            for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
            if raw.get(k) is not None
        }
        return cls(text=ErnieConfig(model_type="ernie4_5", **text), vision=vision, **ids)

    @classmethod
    def from_file(cls, path: str | Path) -> PaddleOCRVLConfig:
        return config_from_file(cls, path)

    # ---- writing ---------------------------------------------------------------------------------
    def _text_dict(self) -> dict[str, Any]:
        return {k: getattr(self.text, k) for k in TEXT_KEYS}

    def _ids(self) -> dict[str, int]:
        return {
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
        }

    def official_dict(self, dtype: str) -> dict[str, Any]:
        """The published config.json form: flat decoder keys, ``rope_scaling`` with the mrope sections."""
        vision = {k: v for k, v in self.vision.to_dict().items() if k != "rope_parameters"}
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            **self._text_dict(),
            "rope_theta": self.text.rope_theta,
            "rope_scaling": {
                "type": "default",
                "rope_type": "default",
                "mrope_section": self.text.mrope_section,
            },
            "tie_word_embeddings": self.text.tie_word_embeddings,
            "torch_dtype": dtype,
            **self._ids(),
            "vision_config": {"model_type": "paddleocr_vl_vision", **vision},
        }

    def transformers_dict(self, dtype: str) -> dict[str, Any]:
        """transformers 5's nested form (what ``PaddleOCRVLConfig.save_pretrained`` writes)."""
        text = {
            "model_type": "paddleocr_vl_text",
            **self._text_dict(),
            "tie_word_embeddings": self.text.tie_word_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.text.rope_theta,
                "mrope_section": self.text.mrope_section,
            },
        }
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "dtype": dtype,
            "transformers_version": HF_FORMAT_VERSION,
            "tie_word_embeddings": self.text.tie_word_embeddings,
            **self._ids(),
            "text_config": text,
            "vision_config": {"model_type": "paddleocr_vl_vision", **self.vision.to_dict()},
        }


def is_paddleocr_vl_dir(directory: str | Path) -> bool:
    """Whether a model directory's config.json names PaddleOCR-VL (either form)."""
    cfg = Path(directory) / "config.json"
    if not cfg.is_file():
        return False
    try:
        raw = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE
