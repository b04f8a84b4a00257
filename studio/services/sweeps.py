"""Hyperparameter sweeps (issue 33): create, list, get with trials and leaderboard, cancel, promote the best;
and `advance`, one idempotent step of the driver a worker runs (workers/sweeping.py).

A sweep's trials are ordinary runs made by `runs.create_run`, tagged with the sweep and Optuna's trial
number (unique together). Optuna's study is in the studio's database (studio.sweep_storage). Every step of
`advance` reads what is there and does only what is missing, so a driver killed anywhere and started again
(on another worker) loses no trial and runs none twice: a trial Optuna handed out without a run gets its run;
a run's evaluations are reported by step (a repeat overwrites the same value); a pruning decision is written
on the trial before its run is cancelled, and the trial is told once its run has ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from typing import Any

from pydantic import Field
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from engine.messages import Word
from engine.sweep import (
    MAX_TRIALS,
    Param,
    SweepError,
    SweepSettings,
    check_base,
    check_settings,
    parse_space,
)
from studio.config import Settings
from studio.models import TERMINAL_RUN_STATUSES, Run, RunMetric, RunStatus, Sweep, utcnow
from studio.schemas import RequestModel
from studio.services import jobs as jobs_svc
from studio.services import runs as runs_svc
from studio.services.errors import Conflict, InvalidInput, ServiceError
from studio.services.messages import SERVICES
from studio.services.nodes import OFFLINE, list_nodes
from studio.services.store import get_or_404
from studio.sweep_storage import optuna_storage

log = logging.getLogger(__name__)
MAX_PARALLELISM = 64
# Trial system attributes: why the driver stopped a trial's run (so a restarted driver tells it the same).
STOPPED = "studio:stopped"  # "pruned" | "budget" | "cancelled" | "refused: <why>"
_DEFAULTS = SweepSettings()


class SweepIn(RequestModel):
    """A sweep: the run every trial starts from, the keys to search and how (docs/training.md, Sweeps)."""

    name: str | None = Field(default=None, max_length=runs_svc.MAX_NAME)
    run: runs_svc.RunSpec = Field(
        description="the base run, as POST /runs takes it; it needs eval_dataset_ids"
    )
    parameters: dict[str, dict[str, Any]] = Field(
        description="searched training keys: {key: {type: float|int|categorical, low, high, log, step, choices}}"
    )
    objective: str = Field(
        default=_DEFAULTS.objective, description="an eval metric: eval_loss, eval_ppl, ..."
    )
    direction: str = Field(default=_DEFAULTS.direction, description="minimize or maximize")
    n_trials: int = Field(default=_DEFAULTS.n_trials, ge=1, le=MAX_TRIALS)
    parallelism: int = Field(default=1, ge=1, le=MAX_PARALLELISM, description="trials queued at once")
    sampler: str = Field(default=_DEFAULTS.sampler, description="tpe or random")
    pruner: str = Field(default=_DEFAULTS.pruner, description="median, asha (successive halving) or none")
    prune_after_trials: int = Field(default=_DEFAULTS.prune_after_trials, ge=0, le=MAX_TRIALS)
    prune_warmup_steps: int = Field(default=_DEFAULTS.prune_warmup_steps, ge=0)
    seed: int = Field(default=_DEFAULTS.seed, ge=0, le=2**31 - 1)
    max_wall_s: float = Field(default=0, ge=0, description="stop after this long (0: no limit)")
    max_total_steps: int = Field(default=0, ge=0, description="stop once the trials trained this many steps")
    enqueue: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_TRIALS)
    max_general_drop: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="the forgetting check as a constraint: a trial whose general score (run.evaluate.general) "
        "fell by more than this is not eligible as best",
    )

    def sweep_settings(self) -> SweepSettings:
        names = {f.name for f in dataclasses.fields(SweepSettings)}
        return SweepSettings(**{k: v for k, v in self.model_dump().items() if k in names})


def _checked(session: Session, settings: Settings, body: SweepIn) -> tuple[SweepSettings, list[Param]]:
    try:
        params = parse_space(body.parameters)
        sw = body.sweep_settings()
        check_settings(sw, body.run.stage, params)
    except SweepError as e:
        raise InvalidInput(str(e), details={"problems": e.problems}) from None
    if not body.run.eval_dataset_ids:
        raise InvalidInput(
            f"objective: {sw.objective} comes from the evaluation every eval_steps; give run.eval_dataset_ids"
        )
    if sw.max_general_drop is not None and (body.run.evaluate is None or body.run.evaluate.general is None):
        raise InvalidInput(
            "max_general_drop: the constraint reads each trial's forgetting check; give run.evaluate.general "
            "(the general sets scored on the base and the trial's result)"
        )
    problems = runs_svc.spec_problems(session, settings, body.run)
    if problems:
        raise InvalidInput(f"run: {'; '.join(problems)}", details={"problems": problems})
    cfg = runs_svc.effective_config(runs_svc.preview_config(session, settings, body.run))
    try:
        check_base(cfg, sw.objective, "run.hyperparameters")
    except SweepError as e:
        raise InvalidInput(str(e), details={"problems": e.problems}) from None
    _check_parallelism(session, settings, body)
    return sw, params


def _check_parallelism(session: Session, settings: Settings, body: SweepIn) -> None:
    """More trials at once than training workers serve the run's queue would only wait; nothing is checked
    before a worker has reported."""
    queue_name = runs_svc._queue_for(settings, body.run)
    views = [v for v in list_nodes(session, settings) if v.state != OFFLINE and v.state != "failed"]
    serving = [v for v in views if queue_name in v.queues]
    if views and body.parallelism > len(serving):
        raise InvalidInput(
            f"parallelism: {body.parallelism} trials at once, but {len(serving)} training worker(s) take "
            f"runs of queue {queue_name}; ask for at most {max(len(serving), 1)} or start more workers"
        )


def estimate_sweep(session: Session, settings: Settings, body: SweepIn) -> dict[str, Any]:
    """The single-run estimate of the base run, and the sweep's: n_trials runs, parallelism at a time (an
    upper bound: pruned trials stop early)."""
    sw, _ = _checked(session, settings, body)
    one = runs_svc.estimate_resources(session, settings, body.run)
    t = one.get("time") or {}
    waves = -(-sw.n_trials // body.parallelism)
    return {
        "run": one,
        "n_trials": sw.n_trials,
        "parallelism": body.parallelism,
        "steps": (one.get("steps") or 0) * sw.n_trials,
        "total_s": (t.get("total_s") or 0.0) * waves,
        "note": "an upper bound: pruned trials and the budget end trials early",
    }


def create_sweep(session: Session, settings: Settings, body: SweepIn) -> Sweep:
    """Record the sweep and its Optuna study, and hand it to a driver (a serving worker)."""
    from engine.sweep import create_study

    sw, params = _checked(session, settings, body)
    try:
        estimate = estimate_sweep(session, settings, body)
    except ServiceError:
        estimate = None
    # The study first: Optuna writes through its own connection, which must not wait on this session's
    # open insert (SQLite has one writer at a time).
    study_name = f"studio-sweep-{uuid.uuid4().hex}"
    create_study(sw, params, optuna_storage(settings), study_name)
    sweep = Sweep(
        name=body.name or "",
        spec=body.run.model_dump(mode="json"),
        parameters=body.parameters,
        settings=dataclasses.asdict(sw),
        parallelism=body.parallelism,
        study_name=study_name,
        status=RunStatus.QUEUED,
        estimate=estimate,
    )
    session.add(sweep)
    session.flush()
    sweep.name = body.name or f"sweep-{sweep.id}"
    jobs_svc.SWEEPS.event(session, sweep, "queued", f"sweep {sweep.name} queued: {sw.n_trials} trials")
    session.commit()
    jobs_svc.dispatch(session, settings, jobs_svc.SWEEPS, sweep)
    return sweep


def list_sweeps(session: Session, limit: int = 200, offset: int = 0) -> list[Sweep]:
    return list(session.scalars(select(Sweep).order_by(Sweep.id.desc()).limit(limit).offset(offset)).all())


def get_sweep(session: Session, sweep_id: int) -> Sweep:
    return get_or_404(session, Sweep, sweep_id, "sweep")


def _study(settings: Settings, sweep: Sweep):
    from engine.sweep import load_study

    return load_study(_settings_of(sweep), optuna_storage(settings), sweep.study_name)


def _settings_of(sweep: Sweep) -> SweepSettings:
    return SweepSettings(**sweep.settings)


def _trial_runs(session: Session, sweep_id: int) -> dict[int, Run]:
    runs = session.scalars(select(Run).where(Run.sweep_id == sweep_id)).all()
    return {r.sweep_trial: r for r in runs}


def trials(session: Session, settings: Settings, sweep: Sweep) -> list[dict[str, Any]]:
    """Each trial: number, Optuna state, params, objective value, its run (id, status) and last report."""
    try:
        study_trials = _study(settings, sweep).get_trials(deepcopy=False)
    except KeyError:  # no study (a row made by hand, or its study deleted)
        study_trials = []
    runs = _trial_runs(session, sweep.id)
    out = []
    for t in study_trials:
        run = runs.get(t.number)
        last = max(t.intermediate_values) if t.intermediate_values else None
        out.append(
            {
                "number": t.number,
                "state": t.state.name.lower(),
                # an enqueued trial waiting for its turn has its values as fixed_params
                "params": t.params or t.system_attrs.get("fixed_params", {}),
                "value": t.value,
                "run_id": run.id if run else None,
                "run_status": run.status if run else None,
                "last_step": last,
                "last_value": t.intermediate_values[last] if last is not None else None,
                "stopped": t.system_attrs.get(STOPPED),
                **_general_constraint(run, _settings_of(sweep).max_general_drop),
            }
        )
    return out


def _general_constraint(run: Run | None, max_drop: float | None) -> dict[str, Any]:
    """The trial's general change (its run's forgetting check) and, under a max_general_drop constraint,
    why it is not eligible as best (None when it is)."""
    check = run.forgetting if run is not None else None
    change = ((check or {}).get("general") or {}).get("change")
    why = None
    if max_drop is not None:
        if change is None:
            why = "its forgetting check has not ended (the base and result evals of its run)"
        elif change < -max_drop:
            why = f"its general score fell by {-change:.3g}, more than max_general_drop {max_drop:g}"
    return {"general_change": change, "ineligible": why}


def leaderboard(sweep: Sweep, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed trials, best first; under max_general_drop the eligible ones first (each row says in
    `ineligible` why it is not)."""
    done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    ranked = sorted(done, key=lambda r: r["value"], reverse=_settings_of(sweep).direction == "maximize")
    return sorted(ranked, key=lambda r: r.get("ineligible") is not None)


def best_trial(session: Session, settings: Settings, sweep_id: int) -> dict[str, Any]:
    """The best completed trial and its run (to deploy or export: POST /deployments, /runs/{id}/export)."""
    sweep = get_sweep(session, sweep_id)
    board = leaderboard(sweep, trials(session, settings, sweep))
    if not board:
        raise Conflict(f"sweep {sweep_id} has no completed trial yet; wait for one, or look at its trials")
    if board[0].get("ineligible"):
        why = "; ".join(f"trial {r['number']}: {r['ineligible']}" for r in board)
        raise Conflict(f"sweep {sweep_id} has no trial within max_general_drop: {why}")
    best = board[0]
    run = session.get(Run, best["run_id"])
    return {**best, "objective": _settings_of(sweep).objective, "model_dir": run.model_dir if run else None}


def cancel_sweep(session: Session, settings: Settings, sweep_id: int) -> Sweep:
    """Stop asking for trials and cancel the running ones (through the runs' cancel path). A sweep no driver
    holds ends at once; a driven one ends when its driver has seen every trial's run end."""
    sweep = get_sweep(session, sweep_id)
    if sweep.status in TERMINAL_RUN_STATUSES:
        raise Conflict(
            SERVICES("nothing_to_cancel", what=Word("sweep"), id=sweep_id, status=str(sweep.status))
        )
    session.execute(update(Sweep).where(Sweep.id == sweep_id).values(cancel_requested=True))
    n = session.execute(
        update(Sweep)
        .where(Sweep.id == sweep_id, Sweep.status == RunStatus.QUEUED)
        .values(status=RunStatus.CANCELLED, ended_at=utcnow(), stop_reason="cancelled")
    ).rowcount
    session.commit()
    if n:
        jobs_svc.SWEEPS.event(session, sweep, "cancelled", "cancelled before a driver took it")
        for run in _trial_runs(session, sweep_id).values():
            if run.status not in TERMINAL_RUN_STATUSES and not run.cancel_requested:
                runs_svc.cancel_run(session, settings, run.id)
        session.commit()
    session.refresh(sweep)
    return sweep


def param_importances(session: Session, settings: Settings, sweep_id: int) -> dict[str, float]:
    """Optuna's importance of each searched key for the objective (PED-ANOVA over the completed trials),
    largest first; empty until two trials have completed."""
    import optuna

    sweep = get_sweep(session, sweep_id)
    try:
        study = _study(settings, sweep)
    except KeyError:
        return {}
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(done) < 2:
        return {}
    try:
        return dict(optuna.importance.get_param_importances(study))
    except (ValueError, RuntimeError) as e:  # e.g. every completed trial has the same values
        log.info("sweep %s: no importances yet (%s)", sweep_id, e)
        return {}


# ---- the driver ------------------------------------------------------------------------------------------


def advance(session: Session, settings: Settings, sweep_id: int) -> bool:
    """One step of the sweep's driver; True once the sweep has ended (it is then finished in the store)."""
    sweep = session.get(Sweep, sweep_id)
    session.refresh(sweep)
    s = _settings_of(sweep)
    params = parse_space(sweep.parameters)
    study = _study(settings, sweep)
    runs = _trial_runs(session, sweep_id)
    # `halt`: cancelled or a budget spent: running trials are stopped and no new one is asked for;
    # n_trials only stops the asking
    halt = _halt_reason(session, sweep, s, runs)
    active = 0
    for t in study.get_trials(deepcopy=False):
        if t.state.name != "RUNNING":
            continue
        run = runs.get(t.number)
        if run is None and not halt:
            run = _start_trial(session, settings, sweep, study, t.number, t.params)
        active += _follow(session, settings, study, t, run, s, halt)
    from engine.sweep import ask, asked, make_sampler

    while not halt and active < sweep.parallelism and asked(study) < s.n_trials:
        # Each step loads the study with a sampler made afresh from the sweep's seed, so trials asked in
        # different steps drew the same random values (every start-up trial of a sweep one at a time was the
        # same); seeded by the trial count, they differ and stay reproducible.
        study.sampler = make_sampler(dataclasses.replace(s, seed=s.seed + len(study.trials)))
        trial = ask(study, params)
        if _start_trial(session, settings, sweep, study, trial.number, trial.params) is not None:
            active += 1
        halt = _halt_reason(session, sweep, s, _trial_runs(session, sweep_id))
    if active or (not halt and asked(study) < s.n_trials):
        return False
    return _finish(session, sweep, s, study, halt or "n_trials")


def _halt_reason(session: Session, sweep: Sweep, s: SweepSettings, runs: dict[int, Run]) -> str | None:
    if sweep.cancel_requested:
        return "cancelled"
    if s.max_wall_s and sweep.started_at and (utcnow() - sweep.started_at).total_seconds() >= s.max_wall_s:
        return "max_wall_s"
    if s.max_total_steps and total_steps(session, [r.id for r in runs.values()]) >= s.max_total_steps:
        return "max_total_steps"
    return None


def total_steps(session: Session, run_ids: list[int]) -> int:
    """Steps the runs trained, counted from the store (each run's newest metric step)."""
    if not run_ids:
        return 0
    newest = (
        select(func.max(RunMetric.step).label("step"))
        .where(RunMetric.run_id.in_(run_ids))
        .group_by(RunMetric.run_id)
        .subquery()
    )
    return int(session.scalar(select(func.coalesce(func.sum(newest.c.step), 0))) or 0)


def _start_trial(
    session: Session, settings: Settings, sweep: Sweep, study, number: int, values: dict[str, Any]
) -> Run | None:
    """The run of trial `number` (made once: the unique (sweep, trial) pair holds against a second driver)."""
    import optuna

    spec = runs_svc.RunSpec(**sweep.spec)
    spec.hyperparameters = {**spec.hyperparameters, **values}
    spec.name = f"{sweep.name}-trial-{number}"
    try:
        run = runs_svc.create_run(session, settings, spec, sweep=(sweep.id, number))
    except IntegrityError:
        session.rollback()
        return _trial_runs(session, sweep.id).get(number)
    except ServiceError as e:  # this trial's values are refused (e.g. a combination the engine rejects)
        session.rollback()
        trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
        study._storage.set_trial_system_attr(trial_id, STOPPED, f"refused: {e.message}"[:500])
        _tell(study, number, state=optuna.trial.TrialState.FAIL)
        log.warning("sweep %s trial %s refused: %s", sweep.id, number, e.message)
        return None
    log.info("sweep %s trial %s: run %s %s", sweep.id, number, run.id, values)
    return run


def _follow(session: Session, settings: Settings, study, t, run: Run | None, s: SweepSettings, halt) -> int:
    """Report a running trial's new evaluations, prune or stop it, or tell Optuna how it ended; 1 while its
    run is still going."""
    import optuna

    if run is None:  # budget or cancel came before its run was made
        _tell(study, t.number, state=optuna.trial.TrialState.FAIL)
        return 0
    session.refresh(run)
    if run.status in TERMINAL_RUN_STATUSES:
        _tell_ended(session, study, t, run, s)
        return 0
    stopped = t.system_attrs.get(STOPPED)
    if stopped is None:
        stopped = "pruned" if _report(session, study, t, run, s.objective) else halt
        if stopped:
            study._storage.set_trial_system_attr(t._trial_id, STOPPED, stopped)
    if stopped and not run.cancel_requested:
        runs_svc.cancel_run(session, settings, run.id)
    return 1


def _report(session: Session, study, t, run: Run, objective: str) -> bool:
    """Report the run's evaluations Optuna has not seen yet; True when the pruner says stop."""
    import optuna

    seen = max(t.intermediate_values, default=-1)
    rows = session.execute(
        select(RunMetric.step, RunMetric.values)
        .where(RunMetric.run_id == run.id, RunMetric.step > seen)
        .order_by(RunMetric.step)
    ).all()
    trial = optuna.trial.Trial(study, t._trial_id)  # the trial as its own training would hold it
    reported = False
    for step, values in rows:
        if values.get(objective) is not None:
            trial.report(float(values[objective]), step)
            reported = True
    return reported and bool(trial.should_prune())


def _tell_ended(session: Session, study, t, run: Run, s: SweepSettings) -> None:
    import optuna

    _report(session, study, t, run, s.objective)
    stopped = study._storage.get_trial(t._trial_id).system_attrs.get(STOPPED)
    if stopped == "pruned":
        _tell(study, t.number, state=optuna.trial.TrialState.PRUNED)
        return
    value = _final_value(session, run.id, s.objective)
    if run.status == RunStatus.SUCCEEDED and value is not None:
        _tell(study, t.number, value)
    else:
        _tell(study, t.number, state=optuna.trial.TrialState.FAIL)


def _tell(study, number: int, value: float | None = None, state=None) -> None:
    """Tell Optuna how a trial ended, once: a trial already told (by a driver that was replaced while it
    still finished its step) is left as it is."""
    import optuna

    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
        study.tell(number, value, state=state, skip_if_finished=True)


def _final_value(session: Session, run_id: int, objective: str) -> float | None:
    """The objective of the run's last evaluation."""
    for (values,) in session.execute(
        select(RunMetric.values).where(RunMetric.run_id == run_id).order_by(RunMetric.step.desc())
    ):
        if values.get(objective) is not None:
            return float(values[objective])
    return None


def _finish(session: Session, sweep: Sweep, s: SweepSettings, study, reason: str) -> bool:
    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if reason == "cancelled":
        status, message = RunStatus.CANCELLED, "cancelled"
    elif done:
        best = study.best_trial
        status, message = RunStatus.SUCCEEDED, f"best trial {best.number}: {s.objective} {best.value:.6g}"
        if s.max_general_drop is not None:  # the forgetting checks end after the trials' runs
            message += f" by the objective; within max_general_drop: POST /sweeps/{sweep.id}/promote"
    else:
        status, message = RunStatus.FAILED, "no trial completed; look at the trials' runs"
    error = message if status == RunStatus.FAILED else None
    jobs_svc.finish(session, jobs_svc.SWEEPS, sweep.id, status, message, stop_reason=reason, error=error)
    return True
