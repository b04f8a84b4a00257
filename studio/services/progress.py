"""Progress of runs from their stored metric points: step of total steps, ETA, last loss, and the run's
measured peak memory and step time beside what its estimate predicted."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from engine.estimate import ETA_WINDOW, recent_step_seconds, remaining_seconds
from engine.train.config import TrainConfig
from studio.models import Run, RunMetric, RunStatus, utcnow


def runs_progress(session: Session, run_ids: list[int]) -> dict[int, dict[str, Any]]:
    """``{run_id: {step, total_steps, max_steps, fraction, elapsed_s, eta_s, loss, step_s, peak_rss_gib}}``.

    ``total_steps`` is what the trainer reports in each metrics row (epoch runs too), else the config's
    max_steps, else the estimate's steps. The ETA of a running run takes the median seconds per step of its
    last few logged rows, the evaluations and checkpoints still due and the final save; after the last
    step it counts down the final save (never 0 while the run still runs).
    """
    if not run_ids:
        return {}
    # Runs the caller's session already holds (GET /runs just listed them) are not read and decoded again.
    runs = {
        i: r for i in run_ids if (r := session.identity_map.get(session.identity_key(Run, i))) is not None
    }
    missing = [i for i in run_ids if i not in runs]
    if missing:
        runs.update((r.id, r) for r in session.scalars(select(Run).where(Run.id.in_(missing))))
    recent = _recent_points(session, list(runs))
    return {run_id: run_progress(run, recent.get(run_id, [])) for run_id, run in runs.items()}


def _recent_points(session: Session, run_ids: list[int]) -> dict[int, list[Any]]:
    """The last ETA_WINDOW + 1 metric points of each run, oldest first: one statement of per-run
    ``ORDER BY step DESC LIMIT`` lookups on the (run_id, step) index, so a read costs the same for a run of
    20 points and one of 200,000 (scanning every step of each run made `GET /runs` cost 30-40 ms of CPU).
    Written as text: building the same union from SQLAlchemy constructs cost more than running it."""
    if not run_ids:
        return {}
    table = RunMetric.__tablename__
    wanted = text(
        " UNION ALL ".join(
            f"SELECT id FROM (SELECT id FROM {table} WHERE run_id = :r{k} ORDER BY step DESC LIMIT {ETA_WINDOW + 1})"
            f" AS latest{k}"
            for k in range(len(run_ids))
        )
    ).bindparams(**{f"r{k}": int(run_id) for k, run_id in enumerate(run_ids)})
    # Core rows with the attributes run_progress reads, not ORM objects: building those was most of the cost.
    columns = (RunMetric.run_id, RunMetric.step, RunMetric.loss, RunMetric.recorded_at, RunMetric.values)
    out: dict[int, list[Any]] = {}
    for point in session.execute(
        select(*columns).where(RunMetric.id.in_(wanted)).order_by(RunMetric.run_id, RunMetric.step)
    ):
        out.setdefault(point.run_id, []).append(point)
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def run_progress(run: Run, points: list[RunMetric], now: datetime | None = None) -> dict[str, Any]:
    """One run's progress from its recent metric points (oldest first)."""
    config = run.config or {}
    estimate = run.estimate or {}
    est_time = estimate.get("time") or {}
    max_steps = _number(config.get("max_steps"))
    max_steps = int(max_steps) if max_steps and max_steps > 0 else None
    last = points[-1].values if points else {}
    total = _number(last.get("total_steps")) or max_steps or _number(estimate.get("steps"))
    total = int(total) if total else None
    info: dict[str, Any] = {
        "step": None,
        "total_steps": total,
        "max_steps": total,
        "fraction": None,
        "elapsed_s": None,
        "eta_s": None,
        "loss": None,
        "step_s": None,
        "peak_rss_gib": None,
        "peak_device_gib": None,
    }
    if points:
        step = int(points[-1].step)
        info.update(step=step, loss=points[-1].loss, elapsed_s=_number(last.get("elapsed_s")))
        rss = _number(last.get("peak_rss_mib"))
        info["peak_rss_gib"] = rss / 1024 if rss else None
        device = _number(last.get("peak_device_mib"))
        info["peak_device_gib"] = device / 1024 if device else None
        info["step_s"] = recent_step_seconds([_number(p.values.get("step_s")) or 0.0 for p in points])
        if total:
            info["fraction"] = min(step / total, 1.0)
    final = run.final_metrics or {}
    if final.get("peak_rss_mib"):
        info["peak_rss_gib"] = final["peak_rss_mib"] / 1024
    if run.status == RunStatus.RUNNING and total:
        info["eta_s"] = _eta(run, points, total, info["step_s"], est_time, now or utcnow())
    elif run.status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED):
        info["eta_s"] = 0.0 if run.status == RunStatus.SUCCEEDED else None
    return info


def _eta(
    run: Run, points: list[RunMetric], total: int, step_s: float | None, est: dict[str, Any], now: datetime
) -> float | None:
    config = run.config or {}
    step = int(points[-1].step) if points else 0
    if step_s is None:
        step_s = _number(est.get("step_s"))
    values = [p.values for p in points]
    measured_ckpt = next(
        (_number(v.get("checkpoint_s")) for v in reversed(values) if v.get("checkpoint_s")), None
    )
    est_ckpt = _number(est.get("checkpoint_s")) or 0.0
    ckpt_s = measured_ckpt if measured_ckpt is not None else est_ckpt
    final_s = _number(est.get("final_save_s")) or 0.0
    if measured_ckpt is not None and est_ckpt > 0.5:
        final_s *= measured_ckpt / est_ckpt  # this node writes faster or slower than the estimate assumed
    eval_s = next((_number(v.get("eval_s")) for v in reversed(values) if v.get("eval_s")), None)
    eval_s = eval_s if eval_s is not None else _number(est.get("eval_s")) or 0.0
    per_epoch = (run.estimate or {}).get("steps_per_epoch")
    since = (now - points[-1].recorded_at).total_seconds() if points and points[-1].recorded_at else 0.0
    return remaining_seconds(
        step=step,
        total=total,
        step_s=step_s,
        eval_s=eval_s,
        evals_left=_due_between(config, "eval", step, total, per_epoch)
        if config.get("eval_dataset_path")
        else 0,
        checkpoint_s=ckpt_s,
        checkpoints_left=_due_between(config, "save", step, total, per_epoch, last=False),
        final_save_s=final_s,
        since_last_step_s=max(since, 0.0),
    )


def _setting(config: dict[str, Any], key: str) -> Any:
    """A key of the run's config, or the engine's default when the run left it out."""
    if key in config:
        return config[key]
    f = _TRAIN_FIELDS[key]
    return f.default if f.default is not dataclasses.MISSING else None


_TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _due_between(
    config: dict[str, Any], what: str, step: int, total: int, per_epoch: int | None, last: bool = True
) -> int:
    """Evaluations (``what`` eval) or checkpoints (save) due after ``step`` up to ``total``: every period,
    and at the last step (evaluations; the last checkpoint is part of the final save)."""
    if step >= total:
        return 0
    strategy = _setting(config, "evaluation_strategy" if what == "eval" else "save_strategy")
    every = _number(_setting(config, "eval_steps" if what == "eval" else "save_steps")) or 0
    if strategy == "epoch":
        every = per_epoch or 0
    elif strategy != "steps":
        every = 0
    every = int(every)
    n = (total // every - step // every) if every else 0
    on_last = bool(every) and total % every == 0
    if last:
        return n + (0 if on_last else 1)
    return n - (1 if on_last else 0)
