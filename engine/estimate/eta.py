"""The ETA of a running run: seconds per step from its recent steps, and what is left."""

from __future__ import annotations

import statistics

# Recent steps the ETA looks at: the median of their per-step times (the first, slow step drops out).
ETA_WINDOW = 5


# ---- the ETA of a running run ----------------------------------------------------------------------------


def recent_step_seconds(step_times: list[float]) -> float | None:
    """Seconds per step from the last ``ETA_WINDOW`` per-step times: their median (one slow first step or a
    hiccup does not swing it, and a run that slows down moves it within a few steps)."""
    times = [t for t in step_times if t and t > 0]
    if not times:
        return None
    if len(times) > 1:
        times = times[1:] if len(times) <= ETA_WINDOW else times[-ETA_WINDOW:]
    return float(statistics.median(times))


def remaining_seconds(
    *,
    step: int,
    total: int,
    step_s: float | None,
    eval_s: float = 0.0,
    evals_left: int = 0,
    checkpoint_s: float = 0.0,
    checkpoints_left: int = 0,
    final_save_s: float = 0.0,
    since_last_step_s: float = 0.0,
) -> float | None:
    """Seconds until a run ends: its remaining steps, evaluations and saves, and the final save (the last
    step's checkpoint and the final model). Past the last step: what is left of the final save, never 0
    while it runs."""
    if step >= total:
        return max(final_save_s - since_last_step_s, 1.0)
    if step_s is None:
        return None
    left = (total - step) * step_s - min(since_last_step_s, step_s)
    return max(left, 0.0) + evals_left * eval_s + checkpoints_left * checkpoint_s + final_save_s
