"""Images for VL samples: loaded with PIL, resized to the vision grid, as float [3, H, W] in [0, 1]."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image

from engine.models.config import VisionConfig

# The tiny VL encoder embeds at most 64 patches per side; large images also cost CPU time quadratically.
DEFAULT_MAX_PIXELS = 448 * 448
DEFAULT_MIN_PIXELS = 56 * 56


def grid_factor(vision_config: VisionConfig | None) -> int:
    """Both image sides must be multiples of patch_size * spatial_merge_size (28 for ERNIE 4.5 VL)."""
    cfg = vision_config or VisionConfig()
    return cfg.patch_size * cfg.spatial_merge_size


def target_size(
    width: int,
    height: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """(width, height) rounded to multiples of ``factor``, keeping the aspect ratio within the pixel budget."""
    w = max(factor, round(width / factor) * factor)
    h = max(factor, round(height / factor) * factor)
    if w * h > max_pixels:
        scale = math.sqrt(width * height / max_pixels)
        w = max(factor, math.floor(width / scale / factor) * factor)
        h = max(factor, math.floor(height / scale / factor) * factor)
    elif w * h < min_pixels:
        scale = math.sqrt(min_pixels / (width * height))
        w = math.ceil(width * scale / factor) * factor
        h = math.ceil(height * scale / factor) * factor
    return w, h


def image_size(path: str | Path, factor: int = 28, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """The (width, height) an image will have after resizing, read from its header only."""
    with Image.open(path) as im:
        return target_size(im.width, im.height, factor, max_pixels=max_pixels)


def load_image(path: str | Path, factor: int = 28, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Pixels as float32 [3, H, W] in [0, 1], with H and W multiples of ``factor``."""
    with Image.open(path) as im:
        rgb = im.convert("RGB")
        w, h = target_size(rgb.width, rgb.height, factor, max_pixels=max_pixels)
        if (w, h) != rgb.size:
            rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
        arr = np.asarray(rgb, dtype=np.float32) / 255.0
    return np.ascontiguousarray(arr.transpose(2, 0, 1))
