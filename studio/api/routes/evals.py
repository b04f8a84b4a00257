"""/api/v1/evals: evaluate a run, an export, a deployment's model or a base model on datasets; list, get,
samples (paged, only where two evals differ), compare, cancel, resume, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from studio.api.deps import ID, QueryID, SessionDep, SettingsDep
from studio.models import Evaluation
from studio.schemas import ErrorOut, EvalCompareOut, EvalOut, EvalSamplesOut, EventOut
from studio.services import eval_reads as reads
from studio.services import evals as svc
from studio.services.store import MAX_ID

router = APIRouter(prefix="/evals", tags=["evals"])
ERRORS = {404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut}}


def eval_out(session, ev: Evaluation, done: int | None = None) -> EvalOut:
    out = EvalOut.model_validate(ev)
    out.samples_done = done if done is not None else reads.samples_done(session, [ev.id])[ev.id]
    return out


@router.post("", status_code=201, response_model=EvalOut, responses=ERRORS)
def create_eval(spec: svc.EvalSpec, session: SessionDep, settings: SettingsDep) -> EvalOut:
    """Queue an evaluation of one model (`model`, `run_id`, `export_id` or `deployment_id`) on datasets;
    a training worker runs `ernie-studio eval` and the samples appear as they are scored."""
    return eval_out(session, svc.create_eval(session, settings, spec), 0)


@router.get("", response_model=list[EvalOut], responses=ERRORS)
def list_evals(
    session: SessionDep,
    run_id: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="evals of this run (and after it)")
    ] = None,
    status: Annotated[str | None, Query(max_length=16)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[EvalOut]:
    evals = reads.list_evals(session, run_id=run_id, status=status, limit=limit)
    done = reads.samples_done(session, [e.id for e in evals])
    return [eval_out(session, e, done[e.id]) for e in evals]


@router.get("/compare", response_model=EvalCompareOut, responses=ERRORS)
def compare_evals(
    session: SessionDep, eval_ids: Annotated[list[QueryID], Query(min_length=1, max_length=20)]
) -> EvalCompareOut:
    """`?eval_ids=1&eval_ids=2`: metrics side by side, how many samples the first two differ on, and the
    pairwise judge's wins / ties / losses."""
    return EvalCompareOut(**reads.compare_evals(session, eval_ids))


@router.get("/{eval_id}", response_model=EvalOut, responses=ERRORS)
def get_eval(eval_id: ID, session: SessionDep) -> EvalOut:
    return eval_out(session, svc.get_eval(session, eval_id))


@router.get("/{eval_id}/samples", response_model=EvalSamplesOut, responses=ERRORS)
def eval_samples(
    eval_id: ID,
    session: SessionDep,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = svc.SAMPLES_PAGE,
    dataset: Annotated[str | None, Query(max_length=255, description="one eval file's name")] = None,
    compare_to: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="another eval of the same data")
    ] = None,
    only_differ: Annotated[
        bool, Query(description="with compare_to: only samples predicted differently")
    ] = False,
) -> EvalSamplesOut:
    """Scored samples in (dataset, line) order; with `compare_to` the ones where the predictions differ
    first, each with the other eval's prediction and scores."""
    page = reads.list_samples(
        session,
        eval_id,
        offset=offset,
        limit=limit,
        dataset=dataset,
        compare_to=compare_to,
        only_differ=only_differ,
    )
    return EvalSamplesOut(**page)


@router.get("/{eval_id}/events", response_model=list[EventOut], responses=ERRORS)
def eval_events(eval_id: ID, session: SessionDep) -> list[EventOut]:
    svc.get_eval(session, eval_id)
    return [EventOut.model_validate(e) for e in reads.eval_events(session, eval_id)]


@router.post("/{eval_id}/cancel", response_model=EvalOut, responses=ERRORS)
def cancel_eval(eval_id: ID, session: SessionDep, settings: SettingsDep) -> EvalOut:
    return eval_out(session, svc.cancel_eval(session, settings, eval_id))


@router.post("/{eval_id}/resume", response_model=EvalOut, responses=ERRORS)
def resume_eval(eval_id: ID, session: SessionDep, settings: SettingsDep) -> EvalOut:
    """Queue a failed or cancelled eval again; the samples it scored are kept."""
    return eval_out(session, svc.resume_eval(session, settings, eval_id))


@router.delete("/{eval_id}", status_code=204, responses=ERRORS)
def delete_eval(eval_id: ID, session: SessionDep, settings: SettingsDep) -> Response:
    svc.delete_eval(session, settings, eval_id)
    return Response(status_code=204)
