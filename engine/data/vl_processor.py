"""ERNIE 4.5 VL image and video preprocessing in numpy + PIL, matching Hugging Face's official processor.

The reference is transformers 5.23 ``models/ernie4_5_vl_moe``; ``tools/make_vl_processor_goldens.py`` records
its outputs and ``tests/engine/test_vl_processor.py`` holds this module to them.

What a caller should know, all measured against that reference:

- Images match the official **PIL** backend (``Ernie4_5_VLMoeImageProcessorPil``) exactly (max abs difference
  0, tolerance 1e-5) under the Pillow this project locks (12.x). The default **torchvision** backend
  (``Ernie4_5_VLMoeImageProcessor``) differs from the PIL backend by up to about 0.03 after normalisation
  (its uint8 bicubic kernel rounds its fixed-point weights differently, so a pixel moves by one or two levels
  out of 255); the goldens record the figure per image.
- Pillow 13 changed the order of the two resampling passes when one side grows and the other shrinks
  (vertical first instead of horizontal first), which moves such pixels by up to 24 levels. We always resize
  horizontally first, as Pillow <= 12 and torchvision do, so results do not depend on the Pillow version;
  the official PIL backend run under Pillow 13 differs from us (and from its own Pillow 12 self) there.
- Videos match the official video processor, which only has a torchvision path: frames are resized with a
  numpy copy of torch's uint8 antialiased bicubic kernel (int16 weights), not with PIL.
- The official video processor draws a timestamp (``time: 00:00:01.50``) on each sampled frame with the font
  its model directory ships (``Roboto-Regular.ttf``). We draw it the same way when
  ``ProcessorSettings.timestamp_font`` names a font file (``from_model_dir`` finds the model's own);
  without one no timestamp is drawn and the frames differ from the official ones in that corner.
- No video codec: ``read_video_frames`` takes a directory of frame images, a list of image paths or an
  animated GIF/PNG/WebP, because the project depends on no video decoding library.
"""

from __future__ import annotations

import io
import json
import logging
import math
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.data.messages import MEDIA
from engine.messages import Message
from engine.models.positions import grid_tokens

log = logging.getLogger(__name__)

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
# Frames of an animated image file read at most: a guard against many-frame "bombs"; the model samples 180.
MAX_FILE_FRAMES = 10_000
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")

# Exceptions PIL raises for damaged files while decoding (beyond its own OSError subclasses).
_DECODE_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    struct.error,
    zlib.error,
    Image.DecompressionBombError,
)


class VisionInputError(ValueError):
    """An image or video the processor cannot use; the message names the file or the problem."""

    def _labelled(self, label: str) -> Message | None:
        message = self.args[0] if self.args else None
        if (
            isinstance(message, Message)
            and message.key == "media.labelled"
            and message.fields["label"] == label
        ):
            return message
        return None

    def unlabelled(self, label: str) -> str:
        """The message without the ``label: `` in front (for a caller that names the input its own way)."""
        message = self._labelled(label)
        return message.fields["msg"] if message is not None else str(self).replace(f"{label}: ", "")

    def relabelled(self, label: str, new: str) -> str:
        """The message naming its input ``new`` where it named it ``label``."""
        message = self._labelled(label)
        if message is not None:
            return MEDIA("labelled", label=new, msg=message.fields["msg"])
        return str(self).replace(label, new, 1)


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 6177,
    *,
    scale_short_sides: bool = False,
    model: str = "ERNIE 4.5 VL",
) -> tuple[int, int]:
    """(height, width) as multiples of ``factor`` within [min_pixels, max_pixels], keeping the aspect ratio.

    transformers' function of the same name defaults max_pixels to 14*14*4*1280; these are its image
    processor's defaults, the values it actually uses. ``scale_short_sides`` (PaddleOCR-VL's processor):
    a side shorter than ``factor`` is first scaled up to it, the other side with it. ``model`` names who
    refuses an image in the errors.
    """
    if height < 1 or width < 1:
        raise VisionInputError(f"{width}x{height} pixels is empty; an image needs at least 1x1")
    if scale_short_sides and height < factor:
        width, height = round(width * factor / height), factor
    if scale_short_sides and width < factor:
        height, width = round(height * factor / width), factor
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise VisionInputError(
            f"{width}x{height} pixels has an aspect ratio of {ratio:.1f}, over the {MAX_ASPECT_RATIO} "
            f"{model} accepts; crop or pad it"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ProcessorSettings:
    """The official processor's parameters; defaults are those of transformers' ERNIE 4.5 VL processors."""

    patch_size: int = 14
    merge_size: int = 2
    image_temporal_patch_size: int = 1  # the image processor repeats a patch this often in its features
    video_temporal_patch_size: int = 2  # frames per video token (the model's temporal_merge_size)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 6177
    video_min_pixels: int = 299 * 28 * 28
    video_max_pixels: int = 1196 * 28 * 28
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    video_fps: float | None = None  # None: keep every frame (then min/max frames apply)
    video_min_frames: int = 16
    video_max_frames: int = 180
    timestamp_font: str | None = None  # a TrueType file; None: no timestamps drawn on video frames
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # refuse larger images from their header

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ProcessorSettings:
        """Settings from a model directory's processor files (the keys transformers writes), else defaults."""
        root = Path(model_dir)
        # transformers' order: processor_config.json's nested entry first, then the processor's own file.
        nested = _read_json(root / "processor_config.json") or {}
        image, image_name = _processor_dict(root, nested, "image_processor", "preprocessor_config.json")
        video, video_name = _processor_dict(root, nested, "video_processor", "video_preprocessor_config.json")
        fields = _image_fields(image, image_name)
        fields.update(_video_fields(video, fields, root, video_name))
        return cls(**fields)

    @classmethod
    def for_model(cls, model_dir: str | Path | None, vision_config: Any) -> ProcessorSettings:
        """A model's processor: its directory's processor files (Baidu ships them) with the patch, merge and
        temporal sizes of its vision config; the defaults where the directory has none."""
        base = cls.from_model_dir(model_dir) if model_dir else None
        return cls.from_vision_config(vision_config, base=base)

    @classmethod
    def from_vision_config(
        cls, vision_config: Any, base: ProcessorSettings | None = None
    ) -> ProcessorSettings:
        """``base`` (or defaults) with the patch, merge and temporal sizes of a model's vision config."""
        base = base or cls()
        return replace(
            base,
            patch_size=int(getattr(vision_config, "patch_size", base.patch_size)),
            merge_size=int(getattr(vision_config, "spatial_merge_size", base.merge_size)),
            video_temporal_patch_size=int(
                getattr(vision_config, "temporal_merge_size", base.video_temporal_patch_size)
            ),
        )


def write_processor_configs(settings: ProcessorSettings, model_dir: str | Path) -> None:
    """``preprocessor_config.json`` and ``video_preprocessor_config.json`` with the keys transformers
    writes (and ``from_model_dir`` reads back to the same settings)."""
    s = settings
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(s.image_mean),
        "image_std": list(s.image_std),
        "merge_size": s.merge_size,
        "patch_size": s.patch_size,
        "resample": 3,  # bicubic
        "rescale_factor": s.rescale_factor,
    }
    image = {
        **common,
        "image_processor_type": "Ernie4_5_VLMoeImageProcessor",
        "size": {"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
        "temporal_patch_size": s.image_temporal_patch_size,
    }
    video = {
        **common,
        "video_processor_type": "Ernie4_5_VLMoeVideoProcessor",
        "size": {"shortest_edge": s.video_min_pixels, "longest_edge": s.video_max_pixels},
        "temporal_patch_size": s.video_temporal_patch_size,
        "min_frames": s.video_min_frames,
        "max_frames": s.video_max_frames,
        "do_sample_frames": True,
        "draw_on_frames": s.timestamp_font is not None,
    }
    if s.video_fps is not None:
        video["fps"] = s.video_fps
    if s.timestamp_font is not None:
        video["font"] = Path(s.timestamp_font).name
    root = Path(model_dir)
    (root / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    (root / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _processor_dict(root: Path, nested: dict[str, Any], key: str, file: str) -> tuple[dict[str, Any], str]:
    if isinstance(nested.get(key), dict):
        return nested[key], f"{root / 'processor_config.json'} ({key})"
    return _read_json(root / file) or {}, str(root / file)


def _check_supported(cfg: dict[str, Any], name: str) -> None:
    """Refuse switches that change the pipeline in ways this module does not implement."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames"):
        if cfg.get(key) is False:
            raise ValueError(f"{name}: {key}=false is not supported (the ERNIE 4.5 VL pipeline needs it)")
    if cfg.get("resample", 3) != 3:
        raise ValueError(f"{name}: resample={cfg['resample']} is not supported, only 3 (bicubic)")
    if cfg.get("num_frames") is not None:
        raise ValueError(f"{name}: num_frames is not supported; use fps with min_frames/max_frames")


def _pixel_bounds(cfg: dict[str, Any]) -> tuple[int | None, int | None]:
    size = cfg.get("size") or {}
    return size.get("shortest_edge", cfg.get("min_pixels")), size.get("longest_edge", cfg.get("max_pixels"))


def _image_fields(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    _check_supported(cfg, name)
    lo, hi = _pixel_bounds(cfg)
    fields: dict[str, Any] = {"min_pixels": lo, "max_pixels": hi}
    for key, field in (
        ("patch_size", "patch_size"),
        ("merge_size", "merge_size"),
        ("temporal_patch_size", "image_temporal_patch_size"),
        ("rescale_factor", "rescale_factor"),
    ):
        fields[field] = cfg.get(key)
    fields["image_mean"] = tuple(cfg["image_mean"]) if "image_mean" in cfg else None
    fields["image_std"] = tuple(cfg["image_std"]) if "image_std" in cfg else None
    return {k: v for k, v in fields.items() if v is not None}


def _video_fields(cfg: dict[str, Any], image: dict[str, Any], root: Path, name: str) -> dict[str, Any]:
    _check_supported(cfg, name)
    defaults = ProcessorSettings()
    for key in ("patch_size", "merge_size", "image_mean", "image_std", "rescale_factor"):
        if key in cfg:
            ours = image.get(key, getattr(defaults, key))
            theirs = tuple(cfg[key]) if isinstance(cfg[key], list) else cfg[key]
            if theirs != ours:
                raise ValueError(f"{name}: {key}={theirs} differs from the image processor's {ours}")
    lo, hi = _pixel_bounds(cfg)
    fields = {
        "video_min_pixels": lo,
        "video_max_pixels": hi,
        "video_temporal_patch_size": cfg.get("temporal_patch_size"),
        "video_min_frames": cfg.get("min_frames"),
        "video_max_frames": cfg.get("max_frames"),
    }
    out: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    out["video_fps"] = cfg.get("fps")
    # transformers' default is to draw timestamps; the font ships beside the weights.
    if cfg and cfg.get("draw_on_frames", True):
        font = root / str(cfg.get("font") or "Roboto-Regular.ttf")
        if font.is_file():
            out["timestamp_font"] = str(font)
        else:
            log.warning(
                "%s asks for timestamps on video frames but %s is missing: none will be drawn", name, font
            )
    return out


@dataclass
class VisionInput:
    """One image or video as the vision encoder takes it: flattened patches and their (t, h, w) grid."""

    pixel_values: np.ndarray  # float32 [t*h*w, C*temporal*patch*patch], grouped by spatial-merge window
    grid_thw: tuple[int, int, int]  # in patches; t counts frames for a video (1 for an image)
    kind: str  # "image" | "video"
    merge_size: int = 2
    temporal_merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the text sequence holds for this input."""
        return grid_tokens(self.grid_thw, self.merge_size, self.temporal_merge_size)


ImageSource = Image.Image | str | Path | bytes


def _label(source: ImageSource) -> str:
    """How messages name an input: "image file <path>", "image bytes" or "image"."""
    if isinstance(source, Image.Image):
        return MEDIA("image")
    return MEDIA("image_bytes") if isinstance(source, bytes) else MEDIA("image_file", path=str(source))


def _truncated(label: str, exc: BaseException) -> Message:
    return MEDIA("labelled", label=label, msg=MEDIA("truncated", detail=str(exc)))


def _check_pixels(label: str, width: int, height: int, limit: int) -> None:
    if width < 1 or height < 1:
        raise VisionInputError(f"{label}: {width}x{height} pixels is empty; an image needs at least 1x1")
    if width * height > limit:
        raise VisionInputError(
            f"{label}: {width}x{height} pixels ({width * height:,}) is more than max_image_pixels={limit:,}; "
            "downscale it first"
        )


def _open(label: str, target: Any, limit: int) -> Image.Image:
    try:
        return Image.open(target)
    except FileNotFoundError:
        raise VisionInputError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise VisionInputError(f"{label}: is a directory, not an image") from None
    except UnidentifiedImageError:
        raise VisionInputError(MEDIA("labelled", label=label, msg=MEDIA("not_pil_image"))) from None
    except Image.DecompressionBombError as exc:
        raise VisionInputError(f"{label}: larger than max_image_pixels={limit:,} ({exc})") from None
    except OSError as exc:
        raise VisionInputError(f"{label}: cannot be read ({exc})") from None


def _composite_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white, as the official processor does for PIL images."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: ImageSource, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """An RGB image as the official processor sees it.

    A file or bytes is checked against ``max_image_pixels`` from its header, decoded, turned upright by its
    EXIF orientation and converted to RGB (transparency dropped), as transformers' ``load_image`` does; a PIL
    image is taken as it is, with transparency composited onto white, as the official image processor does.
    """
    if isinstance(source, Image.Image):
        _check_pixels("image", source.width, source.height, max_image_pixels)
        return _composite_rgb(source)
    if not isinstance(source, (str, Path, bytes)):
        raise VisionInputError(f"expected a PIL image, a file path or bytes, got {type(source).__name__}")
    label = _label(source)
    target = io.BytesIO(source) if isinstance(source, bytes) else Path(source)
    with _open(label, target, max_image_pixels) as image:
        _check_pixels(label, image.width, image.height, max_image_pixels)
        try:
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
        except _DECODE_ERRORS as exc:
            raise VisionInputError(_truncated(label, exc)) from None


def _sized(label: str, height: int, width: int, lo: int, hi: int, factor: int) -> tuple[int, int]:
    try:
        return smart_resize(height, width, factor, lo, hi)
    except VisionInputError as exc:
        raise VisionInputError(f"{label}: {exc}") from None


def _resize_bicubic(image: Image.Image, width: int, height: int) -> Image.Image:
    """PIL bicubic, horizontal pass first (Pillow <= 12's order; Pillow 13 may go vertical first)."""
    if image.width != width:
        image = image.resize((width, image.height), Image.Resampling.BICUBIC)
    if image.height != height:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image


def _patchify_image(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[C, H, W] -> [gh*gw, C*temporal*patch*patch], patches ordered by spatial-merge window."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal * patch * patch), dtype=np.float32)


def preprocess_image(image: ImageSource, settings: ProcessorSettings | None = None) -> VisionInput:
    """Official ERNIE 4.5 VL image preprocessing: RGB, smart resize (bicubic), rescale, normalise, patchify."""
    s = settings or ProcessorSettings()
    rgb = load_image(image, s.max_image_pixels)
    height, width = _sized(_label(image), rgb.height, rgb.width, s.min_pixels, s.max_pixels, s.factor)
    pixels = np.asarray(_resize_bicubic(rgb, width, height))
    # The PIL backend's arithmetic: rescale in float64 then float32, normalise in float32.
    x = (pixels.astype(np.float64) * s.rescale_factor).astype(np.float32)
    x = (x - np.asarray(s.image_mean, np.float32)) / np.asarray(s.image_std, np.float32)
    patches = _patchify_image(x.transpose(2, 0, 1), s.patch_size, s.merge_size, s.image_temporal_patch_size)
    grid = (1, height // s.patch_size, width // s.patch_size)
    return VisionInput(patches, grid, "image", s.merge_size, s.video_temporal_patch_size)


def header_size(
    source: str | Path | bytes, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[int, int]:
    """(height, width) of an image as ``load_image`` will see it (EXIF rotation applied), from its header
    alone; larger than ``max_image_pixels`` or unreadable is a ``VisionInputError`` naming it."""
    label = _label(source)
    with _open(
        label, io.BytesIO(source) if isinstance(source, bytes) else Path(source), max_image_pixels
    ) as im:
        _check_pixels(label, im.width, im.height, max_image_pixels)
        width, height = im.size
        try:  # a PNG's EXIF may follow its pixels: PIL decodes them to find it
            orientation = im.getexif().get(0x0112)
        except _DECODE_ERRORS as exc:
            raise VisionInputError(_truncated(label, exc)) from None
        if orientation in (5, 6, 7, 8):  # EXIF orientations that turn the image on its side
            width, height = height, width
    return height, width


def image_grid(source: str | Path | bytes, settings: ProcessorSettings | None = None) -> tuple[int, int, int]:
    """The (t, h, w) patch grid ``preprocess_image`` will give, from the file's header (no decoding): how
    many placeholder tokens a prompt needs, known before a batch reads the pixels."""
    s = settings or ProcessorSettings()
    height, width = header_size(source, s.max_image_pixels)
    height, width = _sized(_label(source), height, width, s.min_pixels, s.max_pixels, s.factor)
    return 1, height // s.patch_size, width // s.patch_size
