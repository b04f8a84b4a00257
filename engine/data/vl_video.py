"""ERNIE 4.5 VL video preprocessing: frames read from a directory, a list of images or an animated image,
sampled like the official processor, timestamps drawn, resized with torch's uint8 antialiased bicubic kernel
(numpy copy) and cut into patches. The image side and the settings are `engine.data.vl_processor`, whose
docstring says what matches the reference and how closely."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageSequence

from engine.data.messages import MEDIA
from engine.data.vl_processor import (
    _DECODE_ERRORS,
    DEFAULT_MAX_IMAGE_PIXELS,
    FRAME_SUFFIXES,
    MAX_FILE_FRAMES,
    ProcessorSettings,
    VisionInput,
    VisionInputError,
    _check_pixels,
    _open,
    _patchify_image,
    _sized,
    _truncated,
    load_image,
)


def read_video_frames(
    source: str | Path | Sequence[str | Path],
    fps: float | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> tuple[list[Image.Image], float | None]:
    """Frames and frame rate from a directory of frame images (name order), image paths or an animated file.

    No video codec is read (the project depends on none): extract frames first, e.g. ``ffmpeg -i clip.mp4
    -vf fps=2 frames/%05d.png``. The frame rate is ``fps`` if given, else an animated file's own timing.
    """
    if not isinstance(source, (str, Path)):
        return [load_image(Path(p), max_image_pixels) for p in source], fps
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise VisionInputError(
                f"video frame directory {path}: no image files ({', '.join(FRAME_SUFFIXES)})"
            )
        return [load_image(p, max_image_pixels) for p in files], fps
    return _read_animated(path, fps, max_image_pixels)


def _read_animated(path: Path, fps: float | None, limit: int) -> tuple[list[Image.Image], float | None]:
    label = MEDIA("video_file", path=str(path))
    with _open(label, path, limit) as image:
        _check_pixels(label, image.width, image.height, limit)
        frames, durations = [], []
        try:
            for frame in ImageSequence.Iterator(image):
                if len(frames) == MAX_FILE_FRAMES:
                    raise VisionInputError(f"{label}: more than {MAX_FILE_FRAMES} frames")
                frames.append(frame.convert("RGB"))
                durations.append(frame.info.get("duration") or 0)
        except _DECODE_ERRORS as exc:
            raise VisionInputError(_truncated(label, exc)) from None
    if fps is None and all(durations):
        fps = 1000.0 / (sum(durations) / len(durations))
    return frames, fps


def sample_frame_indices(
    total_frames: int, settings: ProcessorSettings, fps: float | None = None
) -> np.ndarray:
    """Indices of the frames the official video processor keeps (``fps``: the frame rate of the frames)."""
    if total_frames < 1:
        raise VisionInputError("video has no frames")
    s = settings
    if fps is not None and not fps > 0:
        raise VisionInputError(f"the frame rate fps={fps} is not positive")
    if s.video_fps is not None:
        if not s.video_fps > 0:
            raise ValueError(f"video_fps={s.video_fps} is not positive")
        if fps is None:
            raise VisionInputError(
                f"sampling at video_fps={s.video_fps} needs the frame rate of the frames (fps)"
            )
        wanted: float = total_frames / fps * s.video_fps
    else:
        wanted = total_frames
    wanted = min(max(wanted, s.video_min_frames), s.video_max_frames, total_frames)
    return _torch_arange_int(total_frames / wanted, math.ceil(total_frames / (total_frames / wanted)))


def _torch_arange_int(step: float, count: int, lanes: int = 8) -> np.ndarray:
    """``torch.arange(0, total, step).int()`` on an AVX2 CPU: float32 positions, truncated.

    torch fills whole pairs of 8-float vectors from a float32 base per vector (``base + k * step`` in double),
    the rest one by one (``i * step`` in double); a truncated position can differ by one between the two
    only past some 70,000 frames, and the official indices do.
    """
    i = np.arange(count)
    base = i // lanes * lanes
    vector = (base * step).astype(np.float32).astype(np.float64) + (i - base) * step
    position = np.where(i < count // (2 * lanes) * (2 * lanes), vector, i * step)
    return position.astype(np.float32).astype(np.int64)


def _frames_array(frames: Sequence[Image.Image] | np.ndarray, keep: np.ndarray, limit: int) -> np.ndarray:
    """The kept frames as uint8 [T, H, W, 3], all one size."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4 or frames.dtype != np.uint8 or 3 not in (frames.shape[1], frames.shape[3]):
            raise VisionInputError(
                f"video array: expected uint8 [frames, height, width, 3] (or [frames, 3, height, width]), "
                f"got {frames.dtype} {list(frames.shape)}"
            )
        video = frames[keep]
        video = video.transpose(0, 2, 3, 1) if frames.shape[1] == 3 else video  # channels first wins, as HF
    else:
        video = np.stack([np.asarray(frames[i].convert("RGB")) for i in keep])
    _check_pixels("video frames", video.shape[2], video.shape[1], limit)
    return np.ascontiguousarray(video)


def _check_frames(frames: Sequence[Image.Image]) -> None:
    """Every frame a PIL image, all of one size."""
    for index, frame in enumerate(frames):
        if not isinstance(frame, Image.Image):
            raise VisionInputError(f"video frame {index}: expected a PIL image, got {type(frame).__name__}")
        if frame.size != frames[0].size:
            (w, h), (w0, h0) = frame.size, frames[0].size
            raise VisionInputError(
                f"video frame {index} is {w}x{h} pixels but frame 0 is {w0}x{h0}; all frames need one size"
            )


def format_timestamp(seconds: float) -> str:
    """The official stamp text, e.g. ``time: 00:01:02.50``."""
    t = np.float32(seconds)
    hours, t = t // np.float32(3600), t % np.float32(3600)
    minutes, t = t // np.float32(60), t % np.float32(60)
    return f"time: {int(hours):02d}:{int(minutes):02d}:{float(t):05.02f}"


def _draw_timestamps(video: np.ndarray, indices: np.ndarray, fps: float, font_path: str) -> np.ndarray:
    """Black text with a white outline in the top-left corner, sized to a tenth of the shorter side."""
    height, width = video.shape[1:3]
    size = int(min(width, height) * 0.1)
    if size < 1:  # transformers cannot draw on frames under 10 pixels either; nothing readable fits
        return video
    font = ImageFont.truetype(font_path, size)
    out = np.empty_like(video)
    for i, (frame, index) in enumerate(zip(video, indices, strict=True)):
        # The official stamps are float32 seconds: the frame index (an int32 tensor) over the fps.
        seconds = np.float32(index) / np.float32(fps)
        image = Image.fromarray(frame)
        ImageDraw.Draw(image).text(
            (0, 0),
            format_timestamp(seconds),
            font=font,
            fill=(0, 0, 0),
            stroke_width=int(size * 0.1),
            stroke_fill=(255, 255, 255),
        )
        out[i] = np.asarray(image)
    return out


def _cubic_aa(x: np.ndarray) -> np.ndarray:
    """torch's antialias bicubic filter (a = -0.5, Pillow's), written in torch's operation order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's uint8 resampling taps: first input index per output, int weights [out, taps], precision bits."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = math.ceil(support) * 2 + 1
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xsize = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    j = np.arange(taps)
    w = _cubic_aa((j + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j < xsize[:, None], w, 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # summed in tap order, as the C loop does
        total += w[:, k]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    precision = 0
    while precision < 22 and int(0.5 + w.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = w * (1 << precision)
    return xmin, np.trunc(np.where(w < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32), precision


def _resample_axis(video: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    """One uint8 pass of torch's antialiased bicubic along ``axis`` (fixed point, rounded, clamped)."""
    in_size = video.shape[axis]
    xmin, weights, precision = _int16_weights(in_size, out_size)
    out_shape = list(video.shape)
    out_shape[axis] = out_size
    along = [1] * video.ndim
    along[axis] = out_size
    acc = np.full(out_shape, 1 << (precision - 1), np.int32)  # the rounding offset
    for k in range(weights.shape[1]):
        taps = np.take(video, np.minimum(xmin + k, in_size - 1), axis=axis).astype(np.int32)
        acc += taps * weights[:, k].reshape(along)
    return np.clip(acc >> precision, 0, 255).astype(np.uint8)


def _resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] resized as torchvision resizes uint8 tensors: width first, then height."""
    if frame.shape[1] != width:
        frame = _resample_axis(frame, 1, width)
    if frame.shape[0] != height:
        frame = _resample_axis(frame, 0, height)
    return frame


def _video_patches(video: np.ndarray, height: int, width: int, s: ProcessorSettings) -> np.ndarray:
    """Resize, normalise and patchify frame by frame into one [T*gh*gw, 3*p*p] array (no full-video copies)."""
    per_frame = (height // s.patch_size) * (width // s.patch_size)
    # torchvision's fused arithmetic: (x - mean * 255) / (std * 255) in float32.
    scale = np.float32(1.0 / s.rescale_factor)
    mean = np.asarray(s.image_mean, np.float32) * scale
    std = np.asarray(s.image_std, np.float32) * scale
    out = np.empty((len(video) * per_frame, 3 * s.patch_size**2), np.float32)
    for i, frame in enumerate(video):
        x = (_resize_frame(frame, height, width).astype(np.float32) - mean) / std
        # A frame's patches are laid out as an image's: by merge window, then (C, p, p).
        out[i * per_frame : (i + 1) * per_frame] = _patchify_image(
            x.transpose(2, 0, 1), s.patch_size, s.merge_size, 1
        )
    return out


def preprocess_video(
    frames: Sequence[Image.Image] | np.ndarray,
    settings: ProcessorSettings | None = None,
    fps: float | None = None,
) -> VisionInput:
    """Official ERNIE 4.5 VL video preprocessing.

    ``frames``: PIL images or a uint8 array [T, H, W, 3], all one size; ``fps``: their frame rate (needed
    when ``settings.video_fps`` samples by time; timestamps assume 24 without it, as transformers does).
    Frames are sampled, stamped (with a font), padded to a whole temporal patch by repeating the last one,
    all resized to one size, normalised and patchified; ``pixel_values`` holds frame after frame.
    """
    s = settings or ProcessorSettings()
    if not isinstance(frames, np.ndarray):
        frames = list(frames)
        _check_frames(frames)
    indices = sample_frame_indices(len(frames), s, fps)
    video = _frames_array(frames, indices, s.max_image_pixels)
    if s.timestamp_font is not None:
        video = _draw_timestamps(video, indices, fps or 24.0, s.timestamp_font)
    pad = -len(video) % s.video_temporal_patch_size
    if pad:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    t, h0, w0 = video.shape[:3]
    height, width = _sized("video", h0, w0, s.video_min_pixels, s.video_max_pixels, s.factor)
    patches = _video_patches(video, height, width, s)
    grid = (t, height // s.patch_size, width // s.patch_size)
    return VisionInput(patches, grid, "video", s.merge_size, s.video_temporal_patch_size)
