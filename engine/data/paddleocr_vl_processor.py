"""PaddleOCR-VL image preprocessing and prompts in numpy + PIL, matching the official image processor.

The reference is transformers 5.24 ``models/paddleocr_vl/image_processing_pil_paddleocr_vl.py``
(``PaddleOCRVLImageProcessorPil``: ``smart_resize``, ``patchify``); tools/make_ocr_vl_goldens.py records its
outputs and tests/engine/test_paddleocr_vl.py holds this module to them (max difference 0 under the Pillow
this project locks). Differences from ERNIE 4.5 VL's processor (``vl_processor``): a side shorter than
``patch_size * merge_size`` is first scaled up to it, patches stay in raster order (the projector groups
them into merge windows), each patch is [C, p, p] rather than flat, and the defaults are 384 x 384 to
1536 x 1536 pixels. A model directory's ``preprocessor_config.json`` overrides the defaults (the published
one is said to use SigLIP's 0.5 mean / std; it could not be checked offline).

Prompts: ``TASK_PROMPTS`` are the four task prompts of PaddleOCR-VL's model card and serving recipes;
``CHAT_TEMPLATE`` (engine/assets/paddleocr_vl_chat_template.jinja) is the published ``chat_template.jinja``
as third-party copies of it read (the hub file itself was not reachable offline):
``<|begin_of_sentence|>User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>OCR:\\nAssistant: ``. As
transformers' ``PaddleOCRVLProcessor.replace_image_token`` does, each placeholder is then repeated
t * h * w / merge^2 times for its image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.vl_processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageSource,
    VisionInputError,
    _label,
    _resize_bicubic,
    header_size,
    load_image,
)
from engine.data.vl_processor import smart_resize as vl_smart_resize

IMAGE_PLACEHOLDER = "<|IMAGE_PLACEHOLDER|>"
TASK_PROMPTS = {
    "ocr": "OCR:",
    "table": "Table Recognition:",
    "formula": "Formula Recognition:",
    "chart": "Chart Recognition:",
}
CHAT_TEMPLATE = (
    Path(__file__).resolve().parent.parent / "assets" / "paddleocr_vl_chat_template.jinja"
).read_text(encoding="utf-8")


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 384 * 384, max_pixels: int = 1536 * 1536
) -> tuple[int, int]:
    """(height, width) as multiples of ``factor`` within [min_pixels, max_pixels], keeping the aspect ratio;
    a side shorter than ``factor`` is first scaled up to it (the other side with it)."""
    return vl_smart_resize(
        height, width, factor, min_pixels, max_pixels, scale_short_sides=True, model="PaddleOCR-VL"
    )


@dataclass(frozen=True)
class OCRProcessorSettings:
    """The official image processor's parameters (transformers' class defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 1
    min_pixels: int = 384 * 384
    max_pixels: int = 1536 * 1536
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # refuse larger images from their header

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> OCRProcessorSettings:
        """Settings from a model directory's ``preprocessor_config.json`` (the keys transformers reads:
        ``size.shortest_edge`` / ``longest_edge`` or the older ``min_pixels`` / ``max_pixels``), else defaults."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(key) is False:
                raise ValueError(f"{path}: {key}=false is not supported (the PaddleOCR-VL pipeline needs it)")
        if cfg.get("resample", 3) != 3:
            raise ValueError(f"{path}: resample={cfg['resample']} is not supported, only 3 (bicubic)")
        size = cfg.get("size") or {}
        fields: dict[str, Any] = {
            "min_pixels": cfg.get("min_pixels", size.get("shortest_edge")),
            "max_pixels": cfg.get("max_pixels", size.get("longest_edge")),
            **{k: cfg.get(k) for k in ("patch_size", "merge_size", "temporal_patch_size", "rescale_factor")},
            "image_mean": tuple(cfg["image_mean"]) if "image_mean" in cfg else None,
            "image_std": tuple(cfg["image_std"]) if "image_std" in cfg else None,
        }
        return cls(**{k: v for k, v in fields.items() if v is not None})

    def to_preprocessor_config(self) -> dict[str, Any]:
        """``preprocessor_config.json`` with the keys transformers writes (``from_model_dir`` reads it back)."""
        return {
            "image_processor_type": "PaddleOCRVLImageProcessor",
            "processor_class": "PaddleOCRVLProcessor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "merge_size": self.merge_size,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "resample": 3,
            "rescale_factor": self.rescale_factor,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
        }


@dataclass
class OCRImage:
    """One image as the encoder takes it: [h*w, C*temporal, p, p] patches in raster order and its grid."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the prompt holds for this image."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def patchify(pixels: np.ndarray, patch: int, temporal: int) -> np.ndarray:
    """[C, H, W] -> [gh*gw, C*temporal, patch, patch], patches row-major (the official ``patchify``)."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels.reshape(c, gh, patch, gw, patch).transpose(1, 3, 0, 2, 4)  # (gh, gw, C, p, p)
    x = np.broadcast_to(x[:, :, :, None], (gh, gw, c, temporal, patch, patch))
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal, patch, patch), dtype=np.float32)


def preprocess_image(image: ImageSource, settings: OCRProcessorSettings | None = None) -> OCRImage:
    """RGB, smart resize (bicubic), rescale, normalise, patchify: the official image processor's steps.

    A file or bytes larger than ``max_image_pixels`` (read from its header) or that does not decode is a
    ``VisionInputError`` naming it."""
    s = settings or OCRProcessorSettings()
    rgb = load_image(image, s.max_image_pixels)
    try:
        height, width = smart_resize(rgb.height, rgb.width, s.factor, s.min_pixels, s.max_pixels)
    except VisionInputError as e:
        raise VisionInputError(f"{_label(image)}: {e}") from None
    pixels = np.asarray(_resize_bicubic(rgb, width, height))
    # The PIL backend's arithmetic: rescale in float64 then float32, normalise in float32.
    x = (pixels.astype(np.float64) * s.rescale_factor).astype(np.float32)
    x = (x - np.asarray(s.image_mean, np.float32)) / np.asarray(s.image_std, np.float32)
    patches = patchify(x.transpose(2, 0, 1), s.patch_size, s.temporal_patch_size)
    return OCRImage(patches, (1, height // s.patch_size, width // s.patch_size), s.merge_size)


def image_grid(
    source: str | Path | bytes, settings: OCRProcessorSettings | None = None
) -> tuple[int, int, int]:
    """The (1, h, w) patch grid ``preprocess_image`` will give, from the file's header alone (no decoding):
    how many placeholder tokens a prompt needs before a batch reads the pixels."""
    s = settings or OCRProcessorSettings()
    height, width = header_size(source, s.max_image_pixels)
    try:
        height, width = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
    except VisionInputError as e:
        raise VisionInputError(f"{_label(source)}: {e}") from None
    return 1, height // s.patch_size, width // s.patch_size


def preprocess_images(
    images: list[ImageSource], settings: OCRProcessorSettings | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``pixel_values`` (all images' patches, in order) and ``image_grid_thw`` int64 [n, 3], as the official
    processor returns them."""
    done = [preprocess_image(image, settings) for image in images]
    return np.concatenate([d.pixel_values for d in done]), np.asarray([d.grid_thw for d in done], np.int64)


def expand_image_placeholders(text: str, grids: np.ndarray | list, merge_size: int = 2) -> str:
    """Repeat each image placeholder once per decoder token of its image (``replace_image_token``)."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(grids):
        raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders for {len(grids)} images")
    out = [pieces[0]]
    for grid, rest in zip(grids, pieces[1:], strict=True):
        t, h, w = (int(v) for v in grid)
        out += [IMAGE_PLACEHOLDER * (t * h * w // merge_size**2), rest]
    return "".join(out)


def task_messages(task: str, images: int = 1) -> list[dict[str, Any]]:
    """One user turn: the images, then a task prompt (``ocr``, ``table``, ``formula``, ``chart``)."""
    if task not in TASK_PROMPTS:
        raise ValueError(f"unknown PaddleOCR-VL task {task!r}; choose one of: {', '.join(TASK_PROMPTS)}")
    content = [{"type": "image"}] * images + [{"type": "text", "text": TASK_PROMPTS[task]}]
    return [{"role": "user", "content": content}]
