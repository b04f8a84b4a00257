"""Progress of runs from their stored metric points: last step, share of max_steps, ETA, last loss."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from studio.models import Run, RunMetric


def runs_progress(session: Session, run_ids: list[int]) -> dict[int, dict[str, Any]]:
    """``{run_id: {step, max_steps, fraction, elapsed_s, eta_s, loss}}`` for the runs that exist.

    ``max_steps`` comes from the run's config (None when it trains by epochs); the ETA extrapolates the
    mean time per step so far, which is what a person watching a run wants to know.
    """
    if not run_ids:
        return {}
    runs = {r.id: r for r in session.scalars(select(Run).where(Run.id.in_(run_ids))).all()}
    last_steps = dict(
        session.execute(
            select(RunMetric.run_id, func.max(RunMetric.step))
            .where(RunMetric.run_id.in_(run_ids))
            .group_by(RunMetric.run_id)
        ).all()
    )
    out: dict[int, dict[str, Any]] = {}
    for run_id, run in runs.items():
        max_steps = (run.config or {}).get("max_steps")
        max_steps = int(max_steps) if isinstance(max_steps, int | float) and max_steps > 0 else None
        info: dict[str, Any] = {
            "step": None,
            "max_steps": max_steps,
            "fraction": None,
            "elapsed_s": None,
            "eta_s": None,
            "loss": None,
        }
        step = last_steps.get(run_id)
        if step is not None:
            point = session.scalar(
                select(RunMetric).where(RunMetric.run_id == run_id, RunMetric.step == step)
            )
            values = point.values if point is not None else {}
            elapsed = values.get("elapsed_s")
            info.update(step=int(step), loss=point.loss if point is not None else None)
            if isinstance(elapsed, int | float) and not isinstance(elapsed, bool):
                info["elapsed_s"] = float(elapsed)
            if max_steps:
                info["fraction"] = min(step / max_steps, 1.0)
                if info["elapsed_s"] is not None and step > 0:
                    info["eta_s"] = max(info["elapsed_s"] / step * (max_steps - step), 0.0)
        out[run_id] = info
    return out
