"""/api/v1/runs: create, import an ERNIEKit YAML, list, get, metrics, checkpoints, logs, config, events, cancel,
resume, clone, delete."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from engine.train.options import UNMET_REASONS
from studio.api.deps import ID, SessionDep, SettingsDep
from studio.db import session_factory
from studio.models import Run
from studio.schemas import (
    CheckpointOut,
    CloneIn,
    ConfigImportOut,
    ErrorOut,
    EventOut,
    LogsOut,
    MetricOut,
    PlacementOut,
    RunOut,
    RunProgressOut,
)
from studio.services import runs as svc
from studio.services.config_import import MAX_IMPORT_BYTES, ImportedConfig, import_train_yaml
from studio.services.events import list_events
from studio.services.progress import runs_progress
from studio.services.run_parts import placement
from studio.services.store import MAX_ID

router = APIRouter(prefix="/runs", tags=["runs"])
ERRORS = {404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut}}
IMPORT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/yaml": {
                "schema": {
                    "type": "string",
                    "maxLength": MAX_IMPORT_BYTES,
                    "description": "an ERNIEKit training config (what `ernie-studio train` reads), UTF-8",
                }
            }
        },
    }
}


def _out(session, run: Run) -> RunOut:
    out = RunOut.model_validate(run)
    out.queue_position = svc.queue_position(session, run)
    out.placement = _placement(session, run)
    return _with_progress(out, runs_progress(session, [run.id]).get(run.id))


def _placement(session, run: Run) -> list[PlacementOut]:
    return [PlacementOut(**p) for p in placement(session, run)]


def _with_progress(out: RunOut, progress: dict | None) -> RunOut:
    if progress is None:
        return out
    return out.model_copy(
        update={
            "progress": RunProgressOut.model_validate(progress, from_attributes=False),
            "eta_seconds": progress.get("eta_s"),
        }
    )


@router.post("", status_code=201, response_model=RunOut, responses=ERRORS)
def create_run(spec: svc.RunSpec, session: SessionDep, settings: SettingsDep) -> RunOut:
    """Queue a training run; it starts when a worker on its queue is free."""
    return _out(session, svc.create_run(session, settings, spec))


@router.post("/estimate", responses=ERRORS)
def estimate_run(spec: svc.RunSpec, session: SessionDep, settings: SettingsDep) -> dict:
    """Memory and time a run would need (a rough guide for picking hardware)."""
    return svc.estimate_resources(session, settings, spec)


@router.post(
    "/import",
    response_model=ConfigImportOut,
    openapi_extra=IMPORT_BODY,
    responses={**ERRORS, 413: {"model": ErrorOut}},
)
async def import_config(request: Request, settings: SettingsDep) -> ConfigImportOut:
    """Read an ERNIEKit training YAML (the body) as `ernie-studio train` does and map it onto the studio: its
    keys, the model and the datasets by name (paths are never opened). Nothing is created."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_IMPORT_BYTES:  # enough for the service to name the size; the rest is not read
            break

    def read() -> ConfigImportOut:
        with session_factory(settings)() as session:
            return imported_out(import_train_yaml(session, settings, bytes(body), "request body"))

    return await run_in_threadpool(read)


def imported_out(imported: ImportedConfig) -> ConfigImportOut:
    return ConfigImportOut(
        stage=imported.stage,
        fine_tuning=imported.fine_tuning,
        compute_type=imported.compute_type,
        base_model=imported.base_model,
        model_path=imported.model_path,
        dataset_ids=imported.dataset_ids,
        dataset_probs=imported.dataset_probs,
        eval_dataset_ids=imported.eval_dataset_ids,
        hyperparameters=imported.spec_hyperparameters(),
        datasets=[{**dataclasses.asdict(m), "note": m.note} for m in imported.datasets],
        notices=dict(imported.notices),
        not_applied={
            key: [UNMET_REASONS[what].format(needed=needed) for what, needed in reasons]
            for key, reasons in imported.not_applied
        },
        studio_set={key: instead for key, _, instead in imported.studio_set},
    )


@router.get("", response_model=list[RunOut], responses=ERRORS)
def list_runs(
    session: SessionDep,
    status: Annotated[str | None, Query(max_length=16)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> list[RunOut]:
    runs = svc.list_runs(session, status=status, limit=limit, offset=offset)
    positions = svc.queue_positions(session)
    progress = runs_progress(session, [r.id for r in runs])
    return [
        _with_progress(
            RunOut.model_validate(r).model_copy(
                update={"queue_position": positions.get(r.id), "placement": _placement(session, r)}
            ),
            progress.get(r.id),
        )
        for r in runs
    ]


@router.get("/{run_id}", response_model=RunOut, responses=ERRORS)
def get_run(run_id: ID, session: SessionDep) -> RunOut:
    return _out(session, svc.get_run(session, run_id))


@router.get("/{run_id}/metrics", response_model=list[MetricOut], responses=ERRORS)
def run_metrics(
    run_id: ID,
    session: SessionDep,
    after_step: Annotated[
        int | None,
        Query(ge=-1, le=MAX_ID, description="page: only points after this step (-1 = from the start)"),
    ] = None,
    limit: Annotated[
        int | None,
        Query(ge=1, le=100000, description=f"page: at most this many points (default {svc.METRICS_PAGE})"),
    ] = None,
    max_points: Annotated[
        int | None,
        Query(
            ge=4,
            le=100000,
            description=f"thin to at most this many points (whole series: default {svc.METRICS_MAX_POINTS})",
        ),
    ] = None,
) -> Response:
    """Logged points in step order.

    Without `after_step` and `limit`: the whole series, thinned on the server to at most `max_points`:
    steps are cut into at most `max_points / 4` buckets of equal width and each keeps its first, last,
    lowest-loss and highest-loss point, so the ends and every spike are in. With `after_step` or `limit`:
    the exact points of that page (thinned only if `max_points` is given); pass the last step seen as
    `after_step` to poll for new points or to read the full resolution page by page."""
    # Encoded in the threadpool by pydantic-core, not on the event loop; the rows already have MetricOut's
    # shape, so no per-row validation.
    body = svc.metrics_json(session, run_id, after_step=after_step, limit=limit, max_points=max_points)
    return Response(body, media_type="application/json")


@router.get("/{run_id}/checkpoints", response_model=list[CheckpointOut], responses=ERRORS)
def run_checkpoints(run_id: ID, session: SessionDep) -> list[CheckpointOut]:
    return [CheckpointOut.model_validate(c) for c in svc.list_checkpoints(session, run_id)]


@router.get("/{run_id}/logs", response_model=LogsOut, responses=ERRORS)
def run_logs(
    run_id: ID,
    session: SessionDep,
    settings: SettingsDep,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=1_048_576)] = 65536,
) -> LogsOut:
    """The trainer's output from byte `offset`; follow it by passing `next_offset` back."""
    return LogsOut(**svc.read_logs(session, settings, run_id, offset=offset, limit=limit))


@router.get("/{run_id}/config", response_class=PlainTextResponse, responses=ERRORS)
def run_config(run_id: ID, session: SessionDep) -> PlainTextResponse:
    """The ERNIEKit YAML of the run (`ernie-studio train` accepts it as is)."""
    return PlainTextResponse(svc.erniekit_yaml(session, run_id), media_type="application/yaml")


@router.get("/{run_id}/events", response_model=list[EventOut], responses=ERRORS)
def run_events(run_id: ID, session: SessionDep) -> list[EventOut]:
    svc.get_run(session, run_id)
    return [EventOut.model_validate(e) for e in list_events(session, run_id=run_id)]


@router.post("/{run_id}/cancel", response_model=RunOut, responses=ERRORS)
def cancel_run(run_id: ID, session: SessionDep, settings: SettingsDep) -> RunOut:
    """Queued runs are cancelled at once; running ones within a few seconds (their process group is stopped)."""
    return _out(session, svc.cancel_run(session, settings, run_id))


@router.post("/{run_id}/resume", response_model=RunOut, responses=ERRORS)
def resume_run(run_id: ID, session: SessionDep, settings: SettingsDep) -> RunOut:
    """Queue a failed or cancelled run again from its newest checkpoint."""
    return _out(session, svc.resume_run(session, settings, run_id))


@router.post("/{run_id}/clone", status_code=201, response_model=RunOut, responses=ERRORS)
def clone_run(run_id: ID, body: CloneIn, session: SessionDep, settings: SettingsDep) -> RunOut:
    """A new run with the same choices, with `overrides` applied."""
    return _out(session, svc.clone_run(session, settings, run_id, body.overrides))


@router.delete("/{run_id}", status_code=204, responses=ERRORS)
def delete_run(run_id: ID, session: SessionDep, settings: SettingsDep) -> Response:
    svc.delete_run(session, settings, run_id)
    return Response(status_code=204)
