"""Training runs as a person handles them: create / list / cancel / resume / clone / delete, queue position,
metrics, logs, estimates. What a person chooses and the config built from it: `studio.services.run_spec`.
What the workers do to a run: `studio.services.run_lifecycle`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import to_json
from sqlalchemy import Select, func, select, update
from sqlalchemy.orm import Session

from engine.messages import Word
from studio import queue
from studio.config import Settings
from studio.models import TERMINAL_RUN_STATUSES, Checkpoint, Dataset, Run, RunMetric, RunStatus, utcnow
from studio.services import metric_series
from studio.services.datasets import dataset_path, get_dataset
from studio.services.errors import Conflict, InvalidInput, ServiceError
from studio.services.estimates import estimate_spec
from studio.services.eval_after import hold_out
from studio.services.evals import engine_config
from studio.services.events import add_event
from studio.services.exports import create_export as queue_export
from studio.services.forgetting import check_names
from studio.services.messages import SERVICES
from studio.services.models import is_ocr_model, model_config
from studio.services.paths import confine_config_paths
from studio.services.run_lifecycle import dispatch_run, withdraw_run
from studio.services.run_spec import MANAGED_KEYS as MANAGED_KEYS
from studio.services.run_spec import (
    MAX_NAME,
    STUDIO_KEYS,
    EvaluateAfter,
    RunSpec,
    build_config,
    check_devices,
    check_evaluate,
    check_gpu,
    check_node_devices,
    effective_config,
    general_check_files,
    preview_config,
)
from studio.services.run_spec import MAX_NODES as MAX_NODES
from studio.services.run_spec import config_problems as config_problems
from studio.services.run_spec import model_family_problems as model_family_problems
from studio.services.run_spec import spec_problems as spec_problems
from studio.services.store import get_or_404

# The `X as X` imports above are re-exported: the Train tab, compare and the sweeps read them through `runs`.
log = logging.getLogger(__name__)

# A whole-series metrics read returns at most this many points (about a plot's width in pixels); the full
# resolution is read in pages of at most METRICS_PAGE points by `after_step`.
METRICS_MAX_POINTS = 1000
METRICS_PAGE = 10000


def run_dir(settings: Settings, run_id: int) -> Path:
    return settings.runs_dir / str(run_id)


def log_path(settings: Settings, run_id: int) -> Path:
    """The run's train.log: every attempt's trainer output, each after an `=== ... attempt N ===` line."""
    return run_dir(settings, run_id) / "train.log"


def _queue_for(settings: Settings, spec: RunSpec) -> str:
    """The queue a run of `spec` waits on (refused when no worker of the studio's node could take it)."""
    check_devices(settings, spec)
    check_gpu(settings, spec.gpu)
    if spec.gpu is not None:
        return queue.gpu_queue(settings.node_name, spec.gpu)
    return queue.devices_queue(spec.num_devices // spec.num_nodes)


def _recorded_estimate(session: Session, settings: Settings, spec: RunSpec, queue_name: str) -> dict | None:
    """The estimate kept on the run to compare with what it measures; a run is queued without one when
    the estimate cannot be made (it is a guide, never a gate)."""
    try:
        return _estimate(session, settings, spec, queue_name, compute_stats=False)
    except ServiceError:  # an invalid spec: create_run refuses it with the same message right after
        return None
    except Exception:
        log.exception("estimate of a new run failed; queued without one")
        return None


def create_run(
    session: Session,
    settings: Settings,
    spec: RunSpec,
    *,
    parent_run_id: int | None = None,
    sweep: tuple[int, int] | None = None,
) -> Run:
    """Record a queued run and put it on its queue; `sweep` = (sweep id, trial number) for a sweep's trial."""
    queue_name = _queue_for(settings, spec)
    check_node_devices(session, settings, spec)
    check_evaluate(session, settings, spec)
    # before the run row exists: computing token statistics commits the dataset's cache
    estimate = _recorded_estimate(session, settings, spec, queue_name)
    run = Run(
        name=spec.name or "",
        stage=spec.stage,
        fine_tuning=spec.fine_tuning,
        base_model=spec.base_model,
        dataset_ids=list(spec.dataset_ids),
        config={},
        status=RunStatus.QUEUED,
        queue=queue_name,
        output_dir="",
        parent_run_id=parent_run_id,
        sweep_id=sweep[0] if sweep else None,
        sweep_trial=sweep[1] if sweep else None,
    )
    session.add(run)
    session.flush()
    out = run_dir(settings, run.id) / "output"
    run.config = build_config(session, settings, spec, out)
    run.output_dir = str(out)
    if spec.evaluate is not None:
        try:
            run.evaluate = _evaluate_plan(session, settings, spec, run)
        except ServiceError:
            shutil.rmtree(run_dir(settings, run.id), ignore_errors=True)  # a split written before the refusal
            raise
    run.name = spec.name or f"{spec.stage.lower()}-{spec.fine_tuning.lower()}-{run.id}"
    run.estimate = estimate  # its notes keep their keys (studio.models.KeyedJSON)
    per_node = spec.num_devices // spec.num_nodes
    run.num_nodes = spec.num_nodes
    waits_for = f" (waits for a worker owning {per_node} devices)" if per_node > 1 else ""
    if spec.num_nodes > 1:
        waits_for = f" (waits for {spec.num_nodes} nodes' workers owning {per_node} device(s) each)"
    add_event(session, "run.queued", f"run {run.name} queued on {queue_name}{waits_for}", run_id=run.id)
    session.commit()
    run_dir(settings, run.id).mkdir(parents=True, exist_ok=True)
    dispatch_run(session, settings, run)
    return run


def _evaluate_plan(session: Session, settings: Settings, spec: RunSpec, run: Run) -> dict[str, Any]:
    """Hold out the split (the trainer is given the rest) and keep what the evals after training need."""
    ev = spec.evaluate
    plan: dict[str, Any] = ev.model_dump()
    plan["holdout_files"] = []
    if ev.holdout:
        datasets = [get_dataset(session, i) for i in spec.dataset_ids]
        seed = effective_config(run.config).seed
        train, held = hold_out(settings, session, run, datasets, ev.holdout, seed, "evaluate.holdout")
        run.config = {**run.config, "train_dataset_path": ",".join(train)}
        plan["holdout_files"], plan["seed"] = held, seed
    # The engine's checks of the eval options, on the files the evals will read.
    files = [(f["path"], f["type"]) for f in plan["holdout_files"]]
    evals = [get_dataset(session, i) for i in ev.dataset_ids or []]
    files += [(str(dataset_path(settings, ds)), ds.format) for ds in evals]
    if ev.general is not None:
        plan["general_files"] = general_check_files(session, settings, ev.general)
        general = [f["path"] for f in plan["general_files"]]
        check_names([p for p, _ in files], general, "evaluate.general")
        files += [(f["path"], f["type"]) for f in plan["general_files"]]
    model_dir = run.config["model_name_or_path"]
    engine_config(
        model_dir, files, ev.options, "<eval dir>/output", "evaluate.options",
        ocr_model=is_ocr_model(spec.base_model, model_dir),
    )  # fmt: skip
    return plan


def spec_of(run: Run) -> RunSpec:
    """The choices `run` was made from (its evaluation sets are by path in the config: see `clone_run`)."""
    hyper = {k: v for k, v in run.config.items() if k not in STUDIO_KEYS}
    return RunSpec(
        name=run.name,
        base_model=run.base_model,
        dataset_ids=list(run.dataset_ids),
        stage=run.stage,
        fine_tuning=run.fine_tuning,
        hyperparameters=hyper,
        num_devices=queue.devices_of(run.queue) * run.num_nodes,
        num_nodes=run.num_nodes,
        evaluate=EvaluateAfter(
            **{k: run.evaluate.get(k) for k in ("holdout", "dataset_ids", "options", "general")}
        )
        if run.evaluate
        else None,
    )


def list_runs(session: Session, *, status: str | None = None, limit: int = 200, offset: int = 0) -> list[Run]:
    if status is not None and status not in {s.value for s in RunStatus}:
        raise InvalidInput(f"status: {status!r} is not one of {', '.join(s.value for s in RunStatus)}")
    q = select(Run).order_by(Run.id.desc()).limit(limit).offset(offset)
    if status:
        q = q.where(Run.status == status)
    return list(session.scalars(q).all())


def get_run(session: Session, run_id: int) -> Run:
    return get_or_404(session, Run, run_id, "run")


def queue_position(session: Session, run: Run) -> int | None:
    """1 means next on its queue; None when the run is not queued.

    Workers take a queue's messages in the order the broker received them, so runs are ordered by dispatch
    time: a resumed, requeued or re-sent run goes behind the others, and runs still waiting for the
    reconciler to send them (a broker outage) come last, in id order, as it sends them."""
    if run.status != RunStatus.QUEUED:
        return None
    if run.dispatched_at is None:
        before = Run.dispatched_at.is_not(None) | (Run.id < run.id)
    else:
        before = (Run.dispatched_at < run.dispatched_at) | (
            (Run.dispatched_at == run.dispatched_at) & (Run.id < run.id)
        )
    ahead = session.scalar(
        select(func.count())
        .select_from(Run)
        .where(Run.status == RunStatus.QUEUED, Run.queue == run.queue, before)
    )
    return int(ahead or 0) + 1


def queue_positions(session: Session) -> dict[int, int]:
    """{run id: position} for every queued run, in one query (for lists), ordered as `queue_position`."""
    rows = session.execute(
        select(Run.id, Run.queue)
        .where(Run.status == RunStatus.QUEUED)
        .order_by(Run.dispatched_at.asc().nulls_last(), Run.id)
    ).all()
    seen: dict[str, int] = {}
    out: dict[int, int] = {}
    for run_id, queue_name in rows:
        seen[queue_name] = seen.get(queue_name, 0) + 1
        out[run_id] = seen[queue_name]
    return out


def get_metrics(
    session: Session,
    run_id: int,
    *,
    after_step: int | None = None,
    limit: int | None = None,
    max_points: int | None = None,
) -> list[RunMetric]:
    """The points `metric_rows` selects, as ORM rows."""
    if max_points is None and (after_step is not None or limit is not None):
        get_run(session, run_id)
        return list(session.scalars(_metric_page(select(RunMetric), run_id, after_step, limit)))
    rows = metric_rows(session, run_id, after_step=after_step, limit=limit, max_points=max_points)
    steps = [r["step"] for r in rows]
    q = (
        select(RunMetric)
        .where(RunMetric.run_id == run_id, RunMetric.step.in_(steps))
        .order_by(RunMetric.step)
    )
    return list(session.scalars(q)) if steps else []


def metric_rows(
    session: Session,
    run_id: int,
    *,
    after_step: int | None = None,
    limit: int | None = None,
    max_points: int | None = None,
) -> list[dict[str, Any]]:
    """Logged points in step order as plain dicts (the hot path of a polling UI).

    With neither `after_step` nor `limit`: the whole series, thinned to at most `max_points` (default
    METRICS_MAX_POINTS; see `studio.services.metric_series`). Otherwise the exact points after `after_step`,
    at most `limit` (default METRICS_PAGE), thinned only when `max_points` is given: paging reads every point.
    """
    run = _metrics_run(session, run_id, max_points)
    if after_step is None and limit is None:
        return metric_series.whole_series(session, run, max_points or METRICS_MAX_POINTS)
    if max_points is None:
        return metric_series.as_rows(
            session.execute(_metric_page(metric_series.ROW, run_id, after_step, limit))
        )
    points = session.execute(_metric_page(select(RunMetric.step, RunMetric.loss), run_id, after_step, limit))
    return metric_series.rows_at(session, run_id, metric_series.thin(points.all(), max_points))


def metrics_json(
    session: Session,
    run_id: int,
    *,
    after_step: int | None = None,
    limit: int | None = None,
    max_points: int | None = None,
) -> bytes:
    """`metric_rows` as a JSON array (non-finite numbers as null); a whole series is encoded once per change."""
    if after_step is None and limit is None:
        run = _metrics_run(session, run_id, max_points)
        return metric_series.whole_series_json(session, run, max_points or METRICS_MAX_POINTS)
    rows = metric_rows(session, run_id, after_step=after_step, limit=limit, max_points=max_points)
    return to_json(rows, inf_nan_mode="null")


def _metrics_run(session: Session, run_id: int, max_points: int | None) -> Run:
    if max_points is not None and max_points < 4:
        raise InvalidInput("max_points: give at least 4 (a bucket keeps its first, last, min and max)")
    return get_run(session, run_id)


def _metric_page(q: Select, run_id: int, after_step: int | None, limit: int | None) -> Select:
    """`q` narrowed to the run's points after `after_step`, at most `limit`, in step order."""
    q = q.where(RunMetric.run_id == run_id).order_by(RunMetric.step).limit(limit or METRICS_PAGE)
    return q if after_step is None else q.where(RunMetric.step > after_step)


def list_checkpoints(session: Session, run_id: int) -> list[Checkpoint]:
    get_run(session, run_id)
    return list(
        session.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)).all()
    )


def read_logs(
    session: Session, settings: Settings, run_id: int, *, offset: int = 0, limit: int = 65536
) -> dict[str, Any]:
    """A slice of the run's log file by byte offset, so a UI can follow it by passing `next_offset` back."""
    if offset < 0 or not 1 <= limit <= 1_048_576:
        raise InvalidInput("offset must be >= 0 and limit between 1 and 1048576 bytes")
    run = get_run(session, run_id)
    path = log_path(settings, run.id)
    if not path.exists():
        return {"run_id": run_id, "text": "", "offset": offset, "next_offset": offset, "size": 0}
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(min(offset, size))
        data = f.read(limit)
    return {
        "run_id": run_id,
        "text": data.decode("utf-8", errors="replace"),
        "offset": offset,
        "next_offset": min(offset, size) + len(data),
        "size": size,
    }


def cancel_run(session: Session, settings: Settings, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one is flagged and its worker stops the process group."""
    run = get_run(session, run_id)
    if run.status in TERMINAL_RUN_STATUSES:
        raise Conflict(SERVICES("nothing_to_cancel", what=Word("run"), id=run_id, status=str(run.status)))
    now = utcnow()
    run.cancel_requested = True
    run.cancel_requested_at = now
    if run.status == RunStatus.QUEUED:
        # Conditional so a worker claiming it at the same instant wins or loses cleanly.
        n = session.execute(
            update(Run)
            .where(Run.id == run_id, Run.status == RunStatus.QUEUED)
            .values(status=RunStatus.CANCELLED, ended_at=now, cancel_requested=True, cancel_requested_at=now)
        ).rowcount
        if n:
            add_event(session, "run.cancelled", "cancelled while queued", run_id=run_id)
            session.commit()
            withdraw_run(settings, run)
            session.refresh(run)
            return run
    add_event(session, "run.cancel_requested", "cancel requested", run_id=run_id)
    session.commit()
    session.refresh(run)
    return run


def latest_checkpoint(settings: Settings, run: Run) -> Path | None:
    """The newest complete checkpoint-N directory of the run (as the trainer will resume from it)."""
    from engine.train.run_dir import latest_checkpoint as engine_latest

    return engine_latest(Path(run.output_dir)) if run.output_dir else None


def resume_run(session: Session, settings: Settings, run_id: int) -> Run:
    """Queue a failed or cancelled run again; it continues from its newest checkpoint."""
    run = get_run(session, run_id)
    if run.status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        raise Conflict(SERVICES("not_resumable", what=Word("run"), id=run_id, status=str(run.status)))
    # A config stored before paths were refused in hyperparameters must not reach the trainer again.
    confine_config_paths(settings, run.config, f"run {run_id}")
    ckpt = latest_checkpoint(settings, run)
    run.status = RunStatus.QUEUED
    run.cancel_requested = False
    run.cancel_requested_at = None
    run.error = None
    run.ended_at = None
    run.queued_at = utcnow()
    run.dispatched_at = None
    run.resume_from = str(ckpt) if ckpt else None
    add_event(
        session,
        "run.resumed",
        f"resumed from {ckpt.name}" if ckpt else "restarted from the beginning (no checkpoint yet)",
        run_id=run.id,
    )
    session.commit()
    dispatch_run(session, settings, run)
    return run


CLONE_SUFFIX = "-clone"


def clone_run(
    session: Session, settings: Settings, run_id: int, overrides: dict[str, Any] | None = None
) -> Run:
    """A new queued run with the same choices; `overrides` replace hyperparameters (or spec fields)."""
    src = get_run(session, run_id)
    overrides = overrides or {}
    data = spec_of(src).model_dump()
    data["name"] = f"{src.name[: MAX_NAME - len(CLONE_SUFFIX)]}{CLONE_SUFFIX}"
    if "eval_dataset_ids" not in overrides:
        data["eval_dataset_ids"] = _eval_dataset_ids(session, settings, src)
    for key, value in overrides.items():
        if key in RunSpec.model_fields:
            data[key] = value
        else:
            data["hyperparameters"][key] = value
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as e:
        problems = [f"overrides.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise InvalidInput("; ".join(problems), details=problems) from None
    return create_run(session, settings, spec, parent_run_id=src.id)


def _eval_dataset_ids(session: Session, settings: Settings, run: Run) -> list[int] | None:
    """The datasets a run evaluates on, found from the paths in its config (the run row keeps no ids)."""
    paths = [p.strip() for p in str(run.config.get("eval_dataset_path") or "").split(",") if p.strip()]
    if not paths:
        return None
    rels = {
        p: str(Path(p).relative_to(settings.home)) for p in paths if Path(p).is_relative_to(settings.home)
    }
    ids = dict(session.execute(select(Dataset.path, Dataset.id).where(Dataset.path.in_(rels.values()))).all())
    missing = [p for p in paths if ids.get(rels.get(p, "")) is None]
    if missing:
        raise InvalidInput(
            f"eval_dataset_ids: run {run.id} evaluates on {', '.join(missing)}, which is no dataset of the "
            "studio (deleted, or given as a path); pass eval_dataset_ids in overrides"
        )
    return [ids[rels[p]] for p in paths]


def delete_run(session: Session, settings: Settings, run_id: int) -> None:
    run = get_run(session, run_id)
    if run.status == RunStatus.RUNNING:
        raise Conflict(SERVICES("running_cancel_first", what=Word("run"), id=run_id))
    if run.status == RunStatus.QUEUED:
        withdraw_run(settings, run)
    session.delete(run)
    session.commit()
    shutil.rmtree(run_dir(settings, run_id), ignore_errors=True)


def create_export(session: Session, settings: Settings, run_id: int, **choices: Any):
    """Queue `ernie-studio export` of a finished run (see studio.services.exports.create_export)."""
    return queue_export(session, settings, run_id, **choices)


def erniekit_yaml(session: Session, run_id: int) -> str:
    """The run's config as the YAML a person would pass to `ernie-studio train` (or ERNIEKit)."""
    run = get_run(session, run_id)
    return yaml.safe_dump(run.config, sort_keys=False)


def estimate_resources(session: Session, settings: Settings, spec: RunSpec) -> dict[str, Any]:
    """Memory, time and disk a run of `spec` would take (engine.estimate), with a range and what it assumed,
    checked against the nodes serving its queue (`warning` when it will not fit)."""
    queue_name = _queue_for(settings, spec)
    check_node_devices(session, settings, spec)
    return _estimate(session, settings, spec, queue_name, compute_stats=True)


def _estimate(
    session: Session, settings: Settings, spec: RunSpec, queue_name: str, *, compute_stats: bool
) -> dict[str, Any]:
    return estimate_spec(
        session,
        settings,
        model=model_config(session, settings, spec.base_model),
        train=effective_config(preview_config(session, settings, spec)),
        base_model=spec.base_model,
        dataset_ids=list(spec.dataset_ids),
        eval_dataset_ids=spec.eval_dataset_ids,
        queue_name=queue_name,
        compute_stats=compute_stats,
    )
