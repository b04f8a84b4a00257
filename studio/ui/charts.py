"""Turn metrics rows and dataset stats into the long-format DataFrames Gradio's plots draw."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

# The curves every stage logs (contract: metrics.jsonl) and the extras that only some stages log.
CORE_METRICS = ("loss", "learning_rate", "tokens_per_second")
EXTRA_METRIC_PREFIXES = ("rewards/", "logps/", "aux_loss", "z_loss", "orthogonal_loss", "eval_", "lm_loss")
PLOT_COLUMNS = ["step", "value", "series"]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def metric_frame(
    rows: Iterable[Mapping[str, Any]], metrics: Sequence[str], label: str | None = None
) -> pd.DataFrame:
    """One row per (step, metric) with a numeric value; ``series`` is the metric or ``label`` when given."""
    records = []
    for row in rows:
        step = row.get("step")
        if not _finite(step):
            continue
        for name in metrics:
            value = row.get(name)
            if _finite(value):
                records.append({"step": int(step), "value": float(value), "series": label or name})
    frame = pd.DataFrame(records, columns=PLOT_COLUMNS)
    return frame.sort_values(["series", "step"], kind="stable").reset_index(drop=True)


def extra_metric_names(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Stage-specific metrics present in the rows (DPO rewards, MoE router losses, eval loss), in first-seen order."""
    names: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key in CORE_METRICS or not _finite(value):
                continue
            if any(key.startswith(p) for p in EXTRA_METRIC_PREFIXES):
                names.setdefault(key, None)
    return list(names)


def compare_frame(runs: Mapping[str, Iterable[Mapping[str, Any]]], metric: str) -> pd.DataFrame:
    """Overlay one metric of several runs, aligned by step; ``series`` is the run's label."""
    frames = [metric_frame(rows, [metric], label=label) for label, rows in runs.items()]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=PLOT_COLUMNS)
    return pd.concat(frames, ignore_index=True)


def histogram_frame(stats: Mapping[str, Any] | None) -> pd.DataFrame:
    """Token-length histogram from ``dataset_stats``: one bar per bin, labelled by its lower edge."""
    hist = (stats or {}).get("histogram") or {}
    bins, counts = list(hist.get("bins") or []), list(hist.get("counts") or [])
    if not counts:
        return pd.DataFrame(columns=["tokens", "samples"])
    # bins are edges (len(counts) + 1) in numpy's convention; tolerate lower edges only.
    lows = bins[: len(counts)] if len(bins) >= len(counts) else list(range(len(counts)))
    highs = bins[1 : len(counts) + 1] if len(bins) > len(counts) else lows
    labels = [
        f"{int(lo)}-{int(hi)}" if hi != lo else f"{int(lo)}" for lo, hi in zip(lows, highs, strict=False)
    ]
    return pd.DataFrame({"tokens": labels, "samples": [int(c) for c in counts]})


def last_value(rows: Sequence[Mapping[str, Any]], metric: str) -> float | None:
    """The most recent logged value of a metric, or None."""
    for row in reversed(rows):
        if _finite(row.get(metric)):
            return float(row[metric])
    return None
