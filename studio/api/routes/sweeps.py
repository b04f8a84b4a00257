"""/api/v1/sweeps: hyperparameter sweeps (create, estimate, list, get with trials and leaderboard, cancel,
the best trial's run to deploy or export)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from studio.api.deps import ID, SessionDep, SettingsDep
from studio.schemas import ErrorOut, SweepBestOut, SweepOut, SweepTrialOut
from studio.services import sweeps as svc

router = APIRouter(prefix="/sweeps", tags=["sweeps"])
ERRORS = {404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut}}


def _full(session, settings, sweep) -> SweepOut:
    out = SweepOut.model_validate(sweep)
    rows = svc.trials(session, settings, sweep)
    out.trials = [SweepTrialOut(**r) for r in rows]
    out.leaderboard = [SweepTrialOut(**r) for r in svc.leaderboard(sweep, rows)]
    return out


@router.post("", status_code=201, response_model=SweepOut, responses=ERRORS)
def create_sweep(body: svc.SweepIn, session: SessionDep, settings: SettingsDep) -> SweepOut:
    """Queue a sweep: its trials are runs of `run` with the searched keys set by Optuna."""
    return _full(session, settings, svc.create_sweep(session, settings, body))


@router.post("/estimate", responses=ERRORS)
def estimate_sweep(body: svc.SweepIn, session: SessionDep, settings: SettingsDep) -> dict:
    """The single-run estimate of the base run and the sweep's: n_trials runs, parallelism at a time."""
    return svc.estimate_sweep(session, settings, body)


@router.get("", response_model=list[SweepOut])
def list_sweeps(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> list[SweepOut]:
    """Sweeps, newest first (without their trials: GET /sweeps/{id} has them)."""
    return [SweepOut.model_validate(s) for s in svc.list_sweeps(session, limit, offset)]


@router.get("/{sweep_id}", response_model=SweepOut, responses=ERRORS)
def get_sweep(sweep_id: ID, session: SessionDep, settings: SettingsDep) -> SweepOut:
    return _full(session, settings, svc.get_sweep(session, sweep_id))


@router.post("/{sweep_id}/cancel", response_model=SweepOut, responses=ERRORS)
def cancel_sweep(sweep_id: ID, session: SessionDep, settings: SettingsDep) -> SweepOut:
    """Stop asking for trials and cancel the running ones (their checkpoints are kept)."""
    return _full(session, settings, svc.cancel_sweep(session, settings, sweep_id))


@router.post("/{sweep_id}/promote", response_model=SweepBestOut, responses=ERRORS)
def promote_best(sweep_id: ID, session: SessionDep, settings: SettingsDep) -> SweepBestOut:
    """The best completed trial and its run: deploy it (POST /deployments with run_id) or export it
    (POST /runs/{run_id}/export). 409 while no trial has completed."""
    return SweepBestOut(**svc.best_trial(session, settings, sweep_id))
