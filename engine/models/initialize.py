"""Random-initialised model directories for trying the engine without downloads."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import paddle

from engine import tokenizer as tokens
from engine.models.config import ErnieConfig
from engine.models.ernie import ErnieForCausalLM
from engine.models.presets import TINY_PRESETS, ocr_preset_config, preset_config
from engine.models.saving import save_model
from engine.tokenizer import train_tokenizer

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus.txt"


def init_weights(model: paddle.nn.Layer, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) matrices, unit norms, zero biases; deterministic for a seed."""
    rng = np.random.default_rng(seed)
    for name, p in model.state_dict().items():
        shape = list(p.shape)
        if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            value = np.zeros(shape, np.float32)
        elif "norm" in name.split(".")[-2] or len(shape) == 1:
            value = np.ones(shape, np.float32)
        else:
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        p.set_value(paddle.to_tensor(value, dtype=p.dtype))


# Official shapes init-model writes with random weights (the 0.3B: 0.7 GB in bf16), for measuring memory
# and speed at a real size without a download; the tiny tokenizer's ids all fall inside their vocabulary.
RANDOM_OFFICIAL = ("ernie-4.5-0.3b",)


def write_random_checkpoint(config: ErnieConfig, out: Path, seed: int = 0, std: float = 0.02) -> Path:
    """``model.safetensors`` of ``config``'s shape with uniform matrices of standard deviation ``std``, unit norms and zero biases,
    stored as ``config.dtype`` (router gates and correction biases fp32) and written one tensor at a time:
    the process never holds more than one tensor of it."""
    from engine.models.safetensors_io import f32_to_bf16_bits, write_streamed
    from engine.models.streaming import lazy_model

    rng = np.random.default_rng(seed)
    low = "BF16" if config.dtype == "bfloat16" else "F32"
    shapes = {name: list(p.shape) for name, p in lazy_model(config).state_dict().items()}
    codes = {n: "F32" if n.endswith(("e_score_correction_bias", "gate.weight")) else low for n in shapes}

    def produce(name: str) -> np.ndarray:
        shape = shapes[name]
        if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            value = np.zeros(shape, np.float32)
        elif "norm" in name.split(".")[-2] or len(shape) == 1:
            value = np.ones(shape, np.float32)
        else:  # in blocks of rows, so a large tensor never exists in fp32 beside its bf16 bits
            value = np.empty(shape, np.uint16 if codes[name] == "BF16" else np.float32)
            step = max(1, 2**21 // max(1, int(np.prod(shape[1:]))))
            for a in range(0, shape[0], step):
                block = rng.random([min(step, shape[0] - a), *shape[1:]], dtype=np.float32)
                block -= 0.5
                block *= 2 * math.sqrt(3) * std  # uniform with standard deviation std (cheaper than normal)
                value[a : a + step] = f32_to_bf16_bits(block) if codes[name] == "BF16" else block
            return value
        return f32_to_bf16_bits(value) if codes[name] == "BF16" else value

    out.mkdir(parents=True, exist_ok=True)
    write_streamed(out / "model.safetensors", [(n, codes[n], s) for n, s in shapes.items()], produce)
    return out


# The VL config's token-id fields and the special tokens they hold.
VL_TOKENS = {
    "im_patch_id": "IMAGE_PLACEHOLDER",
    "image_start_token_id": "IMAGE_START",
    "image_end_token_id": "IMAGE_END",
    "video_token_id": "VIDEO_PLACEHOLDER",
    "video_start_token_id": "VIDEO_START",
    "video_end_token_id": "VIDEO_END",
}


def round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def init_model(preset: str, out: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write ``config.json``, safetensors weights and a small trained tokenizer to ``out``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: directory is not empty; choose a new --out")
    random_presets = [*TINY_PRESETS, TINY_OCR, *RANDOM_OFFICIAL]
    if preset not in random_presets:
        raise ValueError(
            f"init-model builds random models ({', '.join(random_presets)}); larger "
            f"official sizes ({preset}) are downloaded, not initialised"
        )
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(CORPUS, out)
    if preset == TINY_OCR:
        return init_paddleocr_vl(tok, out, seed, dtype)
    if preset in RANDOM_OFFICIAL:  # the official shape and vocabulary, written tensor by tensor
        config = preset_config(preset).replace(dtype=dtype)
        write_random_checkpoint(config, out, seed)
        config.save(out)
        return out
    config: ErnieConfig = preset_config(preset, vocab_size=round_up(tok.vocab_size))
    if config.vision_config is not None:
        ids = {name: tok.convert_tokens_to_ids(getattr(tokens, t)) for name, t in VL_TOKENS.items()}
        config = config.replace(**ids)
    paddle.seed(seed)
    model = ErnieForCausalLM(config)
    init_weights(model, seed)
    save_model(model, out, dtype=dtype)
    if config.vision_config is not None:
        write_tiny_processor(out)
    return out


TINY_OCR = "tiny-ocr-vl"
# The PaddleOCR-VL config's token-id fields and the tokenizer's special tokens they hold.
OCR_TOKENS = {
    "image_token_id": "IMAGE_PLACEHOLDER",
    "vision_start_token_id": "IMAGE_START",
    "vision_end_token_id": "IMAGE_END",
    "video_token_id": "VIDEO_PLACEHOLDER",
}


def init_paddleocr_vl(tok: tokens.ErnieTokenizer, out: Path, seed: int, dtype: str) -> Path:
    """A tiny random PaddleOCR-VL in its published form, with the tokenizer's image tokens, the published
    chat template and a preprocessor config of small pixel bounds (a tiny model needs few image tokens)."""
    import json

    from engine.data.paddleocr_vl_processor import CHAT_TEMPLATE, OCRProcessorSettings
    from engine.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration
    from engine.models.paddleocr_vl_checkpoint import save_paddleocr_vl

    ids = {name: tok.convert_tokens_to_ids(getattr(tokens, t)) for name, t in OCR_TOKENS.items()}
    config = ocr_preset_config(TINY_OCR, vocab_size=round_up(tok.vocab_size), **ids)
    paddle.seed(seed)
    model = PaddleOCRVLForConditionalGeneration(config)
    init_weights(model, seed)
    save_paddleocr_vl(model, out, "official", dtype)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    settings = OCRProcessorSettings(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    (out / "preprocessor_config.json").write_text(
        json.dumps(settings.to_preprocessor_config(), indent=2) + "\n"
    )
    return out


def write_tiny_processor(out: Path) -> None:
    """The official processor's settings, but videos of a few small frames: under the official video
    bounds (at least 299 merge windows a frame) one 4-frame clip fills 600+ tokens of a tiny model."""
    import dataclasses

    from engine.data.vl_processor import ProcessorSettings, write_processor_configs

    small = dataclasses.replace(
        ProcessorSettings(),
        video_min_pixels=28 * 28 * 4,
        video_max_pixels=28 * 28 * 16,
        video_min_frames=2,
        video_max_frames=16,
    )
    write_processor_configs(small, out)
