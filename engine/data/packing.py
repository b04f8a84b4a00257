"""Batches from encoded samples: packed rows (segment_ids, restarting position_ids) or padded rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.data.encode import IGNORE_INDEX, EncodedPair, EncodedSample, video_frame_rate
from engine.data.paddleocr_vl_processor import OCRImage, OCRProcessorSettings
from engine.data.paddleocr_vl_processor import preprocess_image as preprocess_ocr_image
from engine.data.record_types import Media, VideoClip
from engine.data.vl_processor import ProcessorSettings, VisionInput, preprocess_image

# the image processor of a VL run: ERNIE 4.5 VL's or PaddleOCR-VL's
from engine.data.vl_video import preprocess_video, read_video_frames

Vision = ProcessorSettings | OCRProcessorSettings


def pack_sequences(lengths: Sequence[int], max_seq_len: int, max_items: int = 0) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices whose lengths sum to at most ``max_seq_len``, each of at
    most ``max_items`` samples (0: no limit; ERNIEKit's ``packing_size``).

    Ties keep the original order so the result is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > max_seq_len:
            raise ValueError(f"sample {i} has {n} tokens, more than max_seq_len={max_seq_len}")
        for r, free in enumerate(room):
            if n <= free and not (max_items and len(rows[r]) >= max_items):
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_seq_len - n)
    return rows


def vision_input(item: Media, vision: Vision) -> VisionInput | OCRImage:
    """One image or video through the official processor (a video at the frame rate its tokens were counted
    at); ``OCRProcessorSettings``: PaddleOCR-VL's image processor ([N, C, p, p] patches in raster order)."""
    if isinstance(vision, OCRProcessorSettings):
        return preprocess_ocr_image(item, vision)
    if isinstance(item, VideoClip):
        frames, _ = read_video_frames(item.path, max_image_pixels=vision.max_image_pixels)
        return preprocess_video(frames, vision, video_frame_rate(item, vision))
    return preprocess_image(item, vision)


def add_media(batch: dict[str, object], samples: Sequence[EncodedSample], vision: Vision) -> None:
    """The batch's images and videos through the official processor: ``pixel_values`` (all patches, in the
    order the placeholder runs appear row by row) and one ``grid_thw`` per image or video. The model finds
    positions and routing types from the ids."""
    inputs = [vision_input(item, vision) for s in samples for item in s.media]
    if inputs:
        batch["pixel_values"] = np.concatenate([i.pixel_values for i in inputs])
        batch["grid_thw"] = [tuple(i.grid_thw) for i in inputs]


def collate_padded(
    samples: Sequence[EncodedSample], pad_id: int, vision: Vision | None = None
) -> dict[str, object]:
    """One sample per row, right-padded to the longest: input_ids, labels, position_ids, attention_mask."""
    width = max(len(s) for s in samples)
    b = len(samples)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.int64)
    for r, s in enumerate(samples):
        n = len(s)
        ids[r, :n] = s.input_ids
        labels[r, :n] = s.labels
        pos[r, :n] = np.arange(n)
        mask[r, :n] = 1
    batch: dict[str, object] = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "attention_mask": mask,
    }
    if vision is not None:
        add_media(batch, samples, vision)
    return batch


def collate_packed(
    rows: Sequence[Sequence[EncodedSample]], pad_id: int, vision: Vision | None = None
) -> dict[str, object]:
    """Several samples per row: segment_ids number them (-1 = padding), position_ids restart at 0."""
    width = max(sum(len(s) for s in row) for row in rows)
    b = len(rows)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros((b, width), dtype=np.int64)
    seg = np.full((b, width), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        t = 0
        for k, s in enumerate(row):
            n = len(s)
            ids[r, t : t + n] = s.input_ids
            labels[r, t : t + n] = s.labels
            pos[r, t : t + n] = np.arange(n)
            seg[r, t : t + n] = k
            t += n
    batch: dict[str, object] = {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}
    if vision is not None:
        add_media(batch, [s for row in rows for s in row], vision)
    return batch


def collate_pairs(
    pairs: Sequence[EncodedPair] | Sequence[Sequence[EncodedPair]], pad_id: int, packed: bool
) -> dict[str, object]:
    """DPO batch: ``chosen_*`` and ``rejected_*`` keys; pair k of a row is segment k on both sides."""
    if packed:
        rows = [list(r) for r in pairs]  # type: ignore[arg-type]
        chosen = collate_packed([[p.chosen for p in r] for r in rows], pad_id)
        rejected = collate_packed([[p.rejected for p in r] for r in rows], pad_id)
    else:
        flat: list[EncodedPair] = list(pairs)  # type: ignore[arg-type]
        chosen = collate_padded([p.chosen for p in flat], pad_id)
        rejected = collate_padded([p.rejected for p in flat], pad_id)
    batch = {f"chosen_{k}": v for k, v in chosen.items()}
    batch.update({f"rejected_{k}": v for k, v in rejected.items()})
    return batch


def non_pad_share(batch: dict[str, object]) -> float:
    """Fraction of the batch's positions that hold real tokens."""
    if "segment_ids" in batch:
        seg = np.asarray(batch["segment_ids"])
        return float((seg >= 0).mean())
    return float(np.asarray(batch["attention_mask"]).mean())
