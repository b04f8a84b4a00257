"""Named model configs: tiny random models for trying things, and the official ERNIE 4.5 sizes."""

from __future__ import annotations

from engine.models.config import ErnieConfig, VisionConfig
from engine.models.paddleocr_vl_config import OCRVisionConfig, PaddleOCRVLConfig

_TINY = dict(
    model_type="ernie4_5",
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    dtype="float32",
)

_TINY_MOE = dict(
    _TINY,
    model_type="ernie4_5_moe",
    num_hidden_layers=3,
    moe_num_experts=8,
    moe_k=2,
    moe_num_shared_experts=1,
    moe_intermediate_size=96,
    moe_layer_start_index=1,
    moe_layer_end_index=2,
    moe_layer_interval=1,
    moe_use_aux_free=True,
)

_TINY_VL = dict(
    _TINY_MOE,
    model_type="ernie4_5_moe_vl",
    moe_num_experts=[8, 8],
    moe_intermediate_size=[96, 48],
    moe_layer_start_index=[1, 1],
    moe_layer_end_index=[2, 2],
    vision_config=VisionConfig(depth=2, hidden_size=64, num_heads=4, intermediate_size=256),
    # head_dim 32 = 16 rotary pairs: 4 turn with time, 6 with the row and 6 with the column
    rope_3d=True,
    freq_allocation=4,
)

# Benchmark shapes (bench/): wide enough that matmuls, not Python, dominate a CPU step.
_BENCH_DENSE = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    dtype="float32",
)

# Same shape, FFN replaced from layer 1 on by 16 experts of width 512 with top-2 routing plus one shared
# expert of width 512: 3 x 512 = 1536 active FFN width per token, as in the dense model.
_BENCH_MOE = dict(
    _BENCH_DENSE,
    moe_num_experts=16,
    moe_k=2,
    moe_num_shared_experts=1,
    moe_intermediate_size=512,
    moe_layer_start_index=1,
    moe_layer_interval=1,
)

OFFICIAL = {
    "ernie-4.5-0.3b": dict(
        model_type="ernie4_5",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=103424,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "ernie-4.5-21b-a3b": dict(
        model_type="ernie4_5_moe",
        hidden_size=2560,
        intermediate_size=12288,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=103424,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        moe_num_experts=64,
        moe_k=6,
        moe_num_shared_experts=2,
        moe_intermediate_size=1536,
        moe_layer_start_index=1,
        moe_layer_end_index=27,
        moe_layer_interval=1,
    ),
    "ernie-4.5-300b-a47b": dict(
        model_type="ernie4_5_moe",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=54,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=103424,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        moe_num_experts=64,
        moe_k=8,
        moe_num_shared_experts=0,
        moe_intermediate_size=3584,
        moe_layer_start_index=3,
        moe_layer_end_index=53,
        moe_layer_interval=1,
    ),
    "ernie-4.5-vl-28b-a3b": dict(
        model_type="ernie4_5_moe_vl",
        hidden_size=2560,
        intermediate_size=12288,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=103424,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        moe_num_experts=[64, 64],
        moe_k=6,
        moe_num_shared_experts=2,
        moe_intermediate_size=[1536, 512],
        moe_layer_start_index=[1, 1],
        moe_layer_end_index=[27, 27],
        moe_layer_interval=1,
        vision_config=VisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=5120),
        rope_3d=True,
        freq_allocation=20,
    ),
}

# PaddleOCR-VL (engine.models.paddleocr_vl): the decoder's and the encoder's fields. The tiny one: head_dim
# 32 = 16 rotary pairs (4 time, 6 row, 6 column); a 4 x 4 learned position grid resampled to each image.
OCR_PRESETS = {
    "tiny-ocr-vl": dict(
        text=dict(_TINY, mrope_section=[4, 6, 6], tie_word_embeddings=False),
        vision=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=56
        ),
    ),
    # the published model: ERNIE-4.5-0.3B's decoder with an untied head (a checkpoint's config.json decides)
    "paddleocr-vl-0.9b": dict(
        text=dict(OFFICIAL["ernie-4.5-0.3b"], mrope_section=[16, 24, 24], tie_word_embeddings=False),
        vision=dict(),  # OCRVisionConfig's defaults are the 0.9B's
    ),
}

TINY_PRESETS = {"tiny": _TINY, "tiny-moe": _TINY_MOE, "tiny-vl": _TINY_VL}
BENCH_PRESETS = {"bench-dense": _BENCH_DENSE, "bench-moe": _BENCH_MOE}

# Hugging Face repos of the official checkpoints (Paddle layout): what `ernie-studio download <preset>`
# fetches into a model directory named after the preset.
HUB_IDS = {
    "ernie-4.5-0.3b": "baidu/ERNIE-4.5-0.3B-Paddle",
    "ernie-4.5-21b-a3b": "baidu/ERNIE-4.5-21B-A3B-Paddle",
    "ernie-4.5-300b-a47b": "baidu/ERNIE-4.5-300B-A47B-Paddle",
    "ernie-4.5-vl-28b-a3b": "baidu/ERNIE-4.5-VL-28B-A3B-Paddle",
}


def preset_names() -> list[str]:
    return [*TINY_PRESETS, *OFFICIAL]


def ocr_preset_config(name: str, vocab_size: int | None = None, **token_ids: int) -> PaddleOCRVLConfig:
    """A PaddleOCR-VL preset's config; the tiny one takes its vocab size and token ids from its tokenizer."""
    if name not in OCR_PRESETS:
        raise ValueError(f"unknown PaddleOCR-VL preset {name!r}; choose one of: {', '.join(OCR_PRESETS)}")
    text = dict(OCR_PRESETS[name]["text"])
    if vocab_size is not None:
        text["vocab_size"] = vocab_size
    vision = OCRVisionConfig(**OCR_PRESETS[name]["vision"])
    return PaddleOCRVLConfig(text=ErnieConfig(**text), vision=vision, **token_ids)


def preset_fields(name: str) -> dict:
    """The ErnieConfig fields a preset sets (a copy), for tools that pass them on to other libraries."""
    table = {**TINY_PRESETS, **OFFICIAL, **BENCH_PRESETS}
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(table)}")
    return dict(table[name])


def preset_config(name: str, vocab_size: int | None = None, **overrides) -> ErnieConfig:
    """The config of a named preset; tiny presets take their vocab size from their tokenizer."""
    kwargs = preset_fields(name)
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    return ErnieConfig(**{**kwargs, **overrides})


def scaled_config(name: str, hidden_size: int, num_hidden_layers: int, **overrides) -> ErnieConfig:
    """A preset made wider or deeper with its head size, KV heads and FFN ratio kept (FFN width rounded
    down to a multiple of 32): how the benches vary model size."""
    base = preset_fields(name)
    ffn = hidden_size * base["intermediate_size"] // base["hidden_size"] // 32 * 32
    shape = dict(
        hidden_size=hidden_size,
        intermediate_size=ffn,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=hidden_size // base["head_dim"],
    )
    return preset_config(name, **{**shape, **overrides})
