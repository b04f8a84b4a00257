"""eval_samples.jsonl (one line per scored sample, appended and fsynced a batch at a time; a rerun skips
what is there and drops a line a kill left half written) and eval_results.json (aggregates with bootstrap
confidence intervals, written atomically)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from engine.eval.text_metrics import corpus_bleu
from engine.train.run_dir import read_append_log

log = logging.getLogger(__name__)

SAMPLES_FILE = "eval_samples.jsonl"
RESULTS_FILE = "eval_results.json"


class SampleLog:
    """The samples scored so far, by id; ``write`` appends new ones only."""

    def __init__(self, path: Path):
        self.path = path
        self.rows = {row["id"]: row for row in read_append_log(path, "id", "an interrupted eval")}

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.rows

    def write(self, rows: list[dict[str, Any]]) -> None:
        new = [r for r in rows if r["id"] not in self.rows]
        if not new:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
            f.flush()
            os.fsync(f.fileno())
        for r in new:
            self.rows[r["id"]] = r


def bootstrap_interval(
    values: np.ndarray, statistic, resamples: int, confidence: float, rng: np.random.Generator
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``statistic`` over resampled rows (None without resamples or data)."""
    n = len(values)
    if not resamples or n < 2:
        return None
    stats = np.array([statistic(values[rng.integers(0, n, n)]) for _ in range(resamples)])
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(stats, tail)), float(np.percentile(stats, 100 - tail))


def mean_metric(values: list[float], resamples: int, confidence: float, rng) -> dict[str, Any]:
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {"mean": float(arr.mean()) if len(arr) else None, "n": len(arr)}
    ci = bootstrap_interval(arr, np.mean, resamples, confidence, rng)
    if ci is not None:
        out["ci_low"], out["ci_high"] = ci
    return out


def bleu_metric(stats: list[dict[str, Any]], resamples: int, confidence: float, rng) -> dict[str, Any]:
    """Corpus BLEU, its interval from resampled sentence statistics, and the mean sentence BLEU."""
    out: dict[str, Any] = {"score": corpus_bleu(stats), "n": len(stats)}
    idx = np.arange(len(stats))
    ci = bootstrap_interval(
        idx, lambda rows: corpus_bleu([stats[i] for i in rows]), resamples, confidence, rng
    )
    if ci is not None:
        out["ci_low"], out["ci_high"] = ci
    out["sentence_mean"] = float(np.mean([s["sentence_bleu"] for s in stats])) if stats else None
    return out


# per-sample scores that are averaged (the judge's: score 1-10 or pairwise win share)
MEAN_SCORES = ("exact_match", "contains", "regex", "rouge_l", "acc", "acc_norm", "accuracy", "judge")


def cer_metric(rows: list[dict[str, Any]], resamples: int, confidence: float, rng) -> dict[str, Any]:
    """Corpus character error rate (every reading's edits over every reference's characters, as
    engine.eval.ocr scores a set), its interval from resampled readings, and the mean reading's CER."""
    edits = np.array([r["edits"] for r in rows], dtype=np.float64)
    chars = np.array([r["reference_chars"] for r in rows], dtype=np.float64)
    out: dict[str, Any] = {"score": float(edits.sum() / chars.sum()), "n": len(rows)}
    ci = bootstrap_interval(
        np.arange(len(rows)), lambda idx: edits[idx].sum() / chars[idx].sum(), resamples, confidence, rng
    )
    if ci is not None:
        out["ci_low"], out["ci_high"] = ci
    out["sample_mean"] = float(np.mean([r["scores"]["cer"] for r in rows]))
    return out


def aggregate(rows: list[dict[str, Any]], resamples: int, confidence: float, seed: int) -> dict[str, Any]:
    """Every metric of one dataset's sample rows."""
    rng = np.random.default_rng(seed)
    metrics: dict[str, Any] = {}
    for name in MEAN_SCORES:
        values = [r["scores"][name] for r in rows if r["scores"].get(name) is not None]
        if values:
            metrics[name] = mean_metric(values, resamples, confidence, rng)
        unscored = sum(1 for r in rows if name in r["scores"] and r["scores"][name] is None)
        if unscored:  # e.g. judge replies without a rating in the asked format
            metrics.setdefault(name, {"mean": None, "n": 0})["unparsed"] = unscored
    bleu = [r["scores"]["bleu"] for r in rows if isinstance(r["scores"].get("bleu"), dict)]
    if bleu:
        metrics["bleu"] = bleu_metric(bleu, resamples, confidence, rng)
    read = [r for r in rows if "cer" in r["scores"]]
    if read:
        metrics["cer"] = cer_metric(read, resamples, confidence, rng)
    return metrics


def headline(datasets: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``{"<dataset>/<metric>": value}``: one number per metric, for logs, TensorBoard and the studio."""
    flat = {}
    for name, result in datasets.items():
        stem = Path(name).stem
        for metric, value in result["metrics"].items():
            number = value.get("mean", value.get("score")) if isinstance(value, dict) else value
            if isinstance(number, int | float):
                flat[f"{stem}/{metric}"] = float(number)
    return flat
