"""Dataset statistics with the real tokenizer: length histogram, truncation share, turns per sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.data.encode import EncodedPair, SampleEncoder, media_counts
from engine.data.record_types import Conversation, Preference
from engine.data.validate import read_examples
from engine.data.vl_processor import VisionInputError
from engine.models.config import VisionConfig
from engine.tokenizer import ErnieTokenizer


def _histogram(lengths: list[int], bins: int) -> dict[str, list[int]]:
    if not lengths:
        return {"bins": [], "counts": []}
    top = max(lengths)
    step = max(1, -(-top // bins))
    edges = [i * step for i in range(bins + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return {"bins": edges, "counts": [int(c) for c in counts]}


def dataset_stats(
    path: str | Path,
    format: str,
    kind: str,
    tokenizer: ErnieTokenizer,
    max_seq_len: int = 4096,
    bins: int = 20,
    max_records: int | None = None,
    vision_config: VisionConfig | None = None,
) -> dict[str, Any]:
    """JSON-serialisable token statistics of the valid records (lengths before truncation)."""
    encoder = SampleEncoder(tokenizer, max_seq_len, vision_config)
    lengths: list[int] = []
    trained = total = 0
    turns: dict[str, int] = {}
    invalid = dropped = truncated = records = 0
    images = videos = 0
    for _, ex, problems in read_examples(path, format, kind, tokenizer):
        if max_records is not None and records >= max_records:
            break
        records += 1
        if problems or ex is None:
            invalid += 1
            continue
        if isinstance(ex, Conversation | Preference):
            n = len(ex.turns) if isinstance(ex, Conversation) else len(ex.history) + 1
            turns[str(n)] = turns.get(str(n), 0) + 1
        for turn in ex.turns if isinstance(ex, Conversation) else []:
            pictures, clips = media_counts(turn)
            images, videos = images + pictures, videos + clips
        try:
            items = encoder.encode(ex)
        except VisionInputError:  # an image named by URL not fetched (yet), or a file gone since validation
            invalid += 1
            continue
        if not items:
            dropped += 1
            truncated += 1
            continue
        first = items[0]
        full = first.chosen.full_length if isinstance(first, EncodedPair) else first.full_length
        lengths.append(full)
        truncated += int(full > max_seq_len)
        for it in items:
            samples = [it.chosen, it.rejected] if isinstance(it, EncodedPair) else [it]
            for s in samples:
                total += len(s)
                trained += int((s.labels != -100).sum())
    arr = np.asarray(lengths or [0])
    valid = records - invalid
    return {
        "num_records": records,
        "num_valid": valid,
        "num_invalid": invalid,
        "num_dropped": dropped,
        "max_seq_len": max_seq_len,
        "histogram": _histogram(lengths, bins),
        "mean_length": float(arr.mean()) if lengths else 0.0,
        "p50_length": float(np.percentile(arr, 50)) if lengths else 0.0,
        "p95_length": float(np.percentile(arr, 95)) if lengths else 0.0,
        "max_length": int(arr.max()) if lengths else 0,
        "truncated_share": truncated / valid if valid else 0.0,
        "mean_turns": sum(int(k) * v for k, v in turns.items()) / max(sum(turns.values()), 1),
        "turns_per_sample": dict(sorted(turns.items(), key=lambda kv: int(kv[0]))),
        "total_tokens": total,
        "trained_tokens": trained,
        "trained_share": trained / total if total else 0.0,
        "num_images": images,
        "num_videos": videos,
    }
