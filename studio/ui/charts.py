"""Turn metrics rows and dataset stats into the long-format DataFrames Gradio's plots draw."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

# The curves every stage logs (contract: metrics.jsonl) and the extras that only some stages log.
CORE_METRICS = ("loss", "learning_rate", "tokens_per_second")
EXTRA_METRIC_PREFIXES = ("rewards/", "logps/", "aux_loss", "z_loss", "orthogonal_loss", "eval_")
# Shown in the stage-metrics plot when a stage logs none of the above (dense SFT / PT).
FALLBACK_EXTRA = ("grad_norm",)
PLOT_COLUMNS = ["step", "value", "series"]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def empty_frame() -> pd.DataFrame:
    """No points, but typed columns: Gradio picks axis types from the dtypes of the first frame it draws."""
    return pd.DataFrame(
        {
            "step": pd.Series(dtype="int64"),
            "value": pd.Series(dtype="float64"),
            "series": pd.Series(dtype="string"),
        }
    )


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
    if not records:
        return empty_frame()
    frame = pd.DataFrame(records, columns=PLOT_COLUMNS)
    return frame.sort_values(["series", "step"], kind="stable").reset_index(drop=True)


def extra_metric_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Stage metrics in the rows (DPO rewards, MoE router losses, eval loss) in first-seen order, else grad_norm."""
    names: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key in CORE_METRICS or not _finite(value):
                continue
            if any(key.startswith(p) for p in EXTRA_METRIC_PREFIXES):
                names.setdefault(key, None)
    if names:
        return list(names)
    return [k for k in FALLBACK_EXTRA if any(_finite(row.get(k)) for row in rows)]


def compare_frame(runs: Mapping[str, Iterable[Mapping[str, Any]]], metric: str) -> pd.DataFrame:
    """Overlay one metric of several runs, aligned by step; ``series`` is the run's label."""
    frames = [metric_frame(rows, [metric], label=label) for label, rows in runs.items()]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return empty_frame()
    return pd.concat(frames, ignore_index=True)


def histogram_frame(stats: Mapping[str, Any] | None) -> pd.DataFrame:
    """Token-length histogram from ``dataset_stats``: one bar per bin, labelled by its lower edge."""
    hist = (stats or {}).get("histogram") or {}
    bins, counts = list(hist.get("bins") or []), list(hist.get("counts") or [])
    if not counts:
        return empty_histogram()
    # bins are edges (len(counts) + 1) in numpy's convention; tolerate lower edges only.
    lows = bins[: len(counts)] if len(bins) >= len(counts) else list(range(len(counts)))
    highs = bins[1 : len(counts) + 1] if len(bins) > len(counts) else lows
    # Vega orders bar labels as text; padding the lower edge to one width makes that the numeric order.
    width = len(str(int(max([*lows, *highs], default=0))))
    labels = [
        f"{int(lo):>{width}}-{int(hi)}" if hi != lo else f"{int(lo):>{width}}"
        for lo, hi in zip(lows, highs, strict=False)
    ]
    return pd.DataFrame({"tokens": labels, "samples": [int(c) for c in counts]})


def empty_histogram() -> pd.DataFrame:
    return pd.DataFrame({"tokens": pd.Series(dtype="string"), "samples": pd.Series(dtype="int64")})


def last_value(rows: Sequence[Mapping[str, Any]], metric: str) -> float | None:
    """The most recent logged value of a metric, or None."""
    for row in reversed(rows):
        if _finite(row.get(metric)):
            return float(row[metric])
    return None


def trial_points(trials: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """A sweep's objective over its trials: one point per trial with a value (a complete trial's final one,
    else its last report), ``state`` the trial's Optuna state."""
    records = []
    for t in trials:
        value = t.get("value") if t.get("value") is not None else t.get("last_value")
        if _finite(value):
            records.append({"trial": int(t["number"]), "objective": float(value), "state": str(t["state"])})
    if not records:
        return pd.DataFrame(
            {
                "trial": pd.Series(dtype="int64"),
                "objective": pd.Series(dtype="float64"),
                "state": pd.Series(dtype="string"),
            }
        )
    return pd.DataFrame(records, columns=["trial", "objective", "state"])


def importance_frame(importances: Mapping[str, float]) -> pd.DataFrame:
    """Optuna's parameter importances as bars, largest first."""
    items = sorted(((k, float(v)) for k, v in importances.items() if _finite(v)), key=lambda kv: -kv[1])
    return pd.DataFrame(
        {
            "parameter": pd.Series([k for k, _ in items], dtype="string"),
            "importance": pd.Series([v for _, v in items], dtype="float64"),
        }
    )
