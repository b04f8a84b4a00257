"""The forgetting check: a held-out general set scored on a base model and on a fine-tune of it, and the
change with its confidence interval beside the task gain.

Built-in general sets (``engine/assets/general``) are small files written for this repository in the
*style* of MMLU (multiple choice, letter answers), C-Eval (Chinese multiple choice, CSV) and GSM8K (short
arithmetic word problems ending in ``#### <number>``); none is copied from those datasets. They are scored
as any benchmark file is (docs/evaluation.md): multiple choice by each option's log-likelihood (``acc``),
word problems by the generated final number (``accuracy``).

Intervals are paired percentile bootstrap intervals over items: both models answered the same items, so each
resample draws items (with replacement) and takes the mean of ``result - base`` over them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GENERAL_DIR = Path(__file__).resolve().parent.parent / "assets" / "general"
# name -> file; the file name is what the evals key samples by (`general_mmlu.jsonl:3`)
GENERAL_SETS: dict[str, str] = {
    "mmlu": "general_mmlu.jsonl",
    "ceval": "general_ceval.csv",
    "gsm8k": "general_gsm8k.jsonl",
}
# The per-sample score each kind of file is compared by, in order of preference (a sample has one of them):
# benchmarks' acc / accuracy, then the chat metrics a person asked for. CER (lower is better) is not one;
# an OCR set is compared by its exact match.
SCORE_KEYS = ("acc", "accuracy", "exact_match", "contains", "regex", "rouge_l", "judge")
RESAMPLES = 1000
CONFIDENCE = 0.95


def general_set_path(name: str) -> Path:
    """The built-in general set called ``name`` (one of GENERAL_SETS)."""
    if name not in GENERAL_SETS:
        raise ValueError(f"no built-in general set is called {name!r}; pick from {', '.join(GENERAL_SETS)}")
    return GENERAL_DIR / GENERAL_SETS[name]


def sample_score(scores: dict[str, Any]) -> tuple[str, float] | None:
    """(metric, value) a sample is compared by, None when it has no score to compare."""
    for key in SCORE_KEYS:
        value = scores.get(key)
        if isinstance(value, int | float):
            return key, float(value)
    return None


def paired_change(
    base: list[float],
    result: list[float],
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean scores of base and result on the same items and the change (result - base), each with a
    percentile bootstrap interval (the change's paired: items are resampled, both scores kept together)."""
    b = np.asarray(base, dtype=np.float64)
    r = np.asarray(result, dtype=np.float64)
    if b.shape != r.shape:
        raise ValueError(f"paired scores differ in length: {len(b)} base, {len(r)} result")
    n = len(b)
    out: dict[str, Any] = {"n": n, "base": None, "result": None, "change": None}
    if not n:
        return out
    out.update(base=float(b.mean()), result=float(r.mean()), change=float((r - b).mean()))
    if n < 2 or not resamples:
        return out
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    tail = (1 - confidence) / 2 * 100
    for key, values in (("base", b), ("result", r), ("change", r - b)):
        means = values[idx].mean(axis=1)
        out[f"{key}_ci"] = [float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))]
    out["confidence"] = confidence
    return out


def forgetting_summary(
    base_samples: dict[str, tuple[str, dict[str, Any]]],
    result_samples: dict[str, tuple[str, dict[str, Any]]],
    general: set[str],
    margin: float,
    seed: int = 0,
) -> dict[str, Any]:
    """The task gain and the general change of a fine-tune. ``*_samples``: sample id -> (dataset file name,
    scores) of the base's and the result's evals; ``general``: the general sets' file names (the rest are the
    task's). ``warning`` is set when the general score fell by more than ``margin`` (a fraction: 0.05 is 5
    points of accuracy)."""
    parts: dict[str, dict[str, tuple[list[float], list[float]]]] = {"task": {}, "general": {}}
    for sid, (dataset, scores) in sorted(base_samples.items()):
        if sid not in result_samples:
            continue
        a, b = sample_score(scores), sample_score(result_samples[sid][1])
        if a is None or b is None:
            continue
        side = parts["general" if dataset in general else "task"]
        pair = side.setdefault(dataset, ([], []))
        pair[0].append(a[1])
        pair[1].append(b[1])
    out: dict[str, Any] = {"margin": margin, "interval": "paired percentile bootstrap over items"}
    for side, files in parts.items():
        base = [v for pair in files.values() for v in pair[0]]
        result = [v for pair in files.values() for v in pair[1]]
        out[side] = paired_change(base, result, seed=seed) if files else None
        if files:
            out[side]["sets"] = {
                name: paired_change(*pair, seed=seed) for name, pair in sorted(files.items())
            }
    change = (out["general"] or {}).get("change")
    out["warning"] = change is not None and change < -margin
    return out
