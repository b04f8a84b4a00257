"""/api/v1/exports and /api/v1/runs/{id}/export: merge LoRA, convert the layout, quantize (PTQ), cut an
elastic run's member out (/api/v1/runs/{id}/elastic lists them; .../elastic/deploy exports one and deploys it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from studio.api.deps import ID, SessionDep, SettingsDep
from studio.schemas import ElasticDeployIn, ElasticFamilyOut, ErrorOut, ExportIn, ExportOut
from studio.services import exports as svc
from studio.services.store import MAX_ID

router = APIRouter(tags=["exports"])
ERRORS = {404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut}}


@router.post("/runs/{run_id}/export", status_code=201, response_model=ExportOut, responses=ERRORS)
def export_run(run_id: ID, body: ExportIn, session: SessionDep, settings: SettingsDep) -> ExportOut:
    """Queue an export of a succeeded run; the model appears under /models when it is done."""
    return ExportOut.model_validate(svc.create_export(session, settings, run_id, **body.model_dump()))


@router.get("/runs/{run_id}/elastic", response_model=ElasticFamilyOut, responses=ERRORS)
def elastic_family(run_id: ID, session: SessionDep) -> ElasticFamilyOut:
    """An elastic run's family: each member's depth, experts, top-k, weights, steps trained and eval loss."""
    return ElasticFamilyOut.model_validate(svc.elastic_family(session, run_id))


@router.post("/runs/{run_id}/elastic/deploy", status_code=201, response_model=ExportOut, responses=ERRORS)
def deploy_elastic_member(
    run_id: ID, body: ElasticDeployIn, session: SessionDep, settings: SettingsDep
) -> ExportOut:
    """Export one member of an elastic run's family and deploy it once it is written: poll the export
    (deploy_state exporting -> deploying -> running), then chat with its deployment_id."""
    return ExportOut.model_validate(svc.deploy_member(session, settings, run_id, body.member))


@router.get("/exports", response_model=list[ExportOut])
def list_exports(
    session: SessionDep, run_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None
) -> list[ExportOut]:
    return [ExportOut.model_validate(e) for e in svc.list_exports(session, run_id)]


@router.get("/exports/{export_id}", response_model=ExportOut, responses=ERRORS)
def get_export(export_id: ID, session: SessionDep) -> ExportOut:
    return ExportOut.model_validate(svc.get_export(session, export_id))
