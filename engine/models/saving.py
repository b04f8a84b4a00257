"""``save_model``: the one way to write a model the engine builds to a directory.

An ERNIE model goes through ``checkpoint.save_ernie``; PaddleOCR-VL, which has no Paddle layout of its own,
through ``paddleocr_vl_checkpoint`` (``paddle`` writes its published, official form). The choice lives here,
above both writers, so the ERNIE checkpoint code never imports the PaddleOCR-VL one (which imports it).
"""

from __future__ import annotations

from pathlib import Path

from paddle import nn

from engine.models.checkpoint import save_ernie
from engine.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration
from engine.models.paddleocr_vl_checkpoint import save_paddleocr_vl


def save_model(
    model: nn.Layer,
    directory: str | Path,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    layout: str = "paddle",
) -> Path:
    """Write config.json and the weights (Paddle layout by default, ``layout='hf'`` for PyTorch)."""
    if isinstance(model, PaddleOCRVLForConditionalGeneration):
        form = "official" if layout == "paddle" else layout
        return save_paddleocr_vl(model, directory, form, dtype, max_shard_size)
    return save_ernie(model, directory, dtype, max_shard_size, layout)
