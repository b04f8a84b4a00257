"""/api/v1/deployments: start a model server from a run or a model dir, list, get, stop, chat (SSE proxy)."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from studio.api.deps import ID, SessionDep, SettingsDep
from studio.schemas import ChatIn, DeploymentOut, ErrorOut, EventOut
from studio.services import deployments as svc
from studio.services.errors import Unavailable
from studio.services.events import list_events
from studio.services.messages import SERVICES

router = APIRouter(prefix="/deployments", tags=["deployments"])
ERRORS = {
    404: {"model": ErrorOut},
    409: {"model": ErrorOut},
    422: {"model": ErrorOut},
    503: {"model": ErrorOut},
}


@router.post("", status_code=201, response_model=DeploymentOut, responses=ERRORS)
def create_deployment(spec: svc.DeploymentSpec, session: SessionDep, settings: SettingsDep) -> DeploymentOut:
    """Start a server for a finished run (`run_id`) or a model (`model`); poll until status is running."""
    return DeploymentOut.model_validate(svc.create_deployment(session, settings, spec))


@router.get("", response_model=list[DeploymentOut])
def list_deployments(session: SessionDep, active_only: bool = False) -> list[DeploymentOut]:
    return [DeploymentOut.model_validate(d) for d in svc.list_deployments(session, active_only=active_only)]


@router.get("/{deployment_id}", response_model=DeploymentOut, responses=ERRORS)
def get_deployment(deployment_id: ID, session: SessionDep) -> DeploymentOut:
    return DeploymentOut.model_validate(svc.get_deployment(session, deployment_id))


@router.get("/{deployment_id}/events", response_model=list[EventOut], responses=ERRORS)
def deployment_events(deployment_id: ID, session: SessionDep) -> list[EventOut]:
    svc.get_deployment(session, deployment_id)
    return [EventOut.model_validate(e) for e in list_events(session, deployment_id=deployment_id)]


@router.post("/{deployment_id}/stop", response_model=DeploymentOut, responses=ERRORS)
def stop_deployment(deployment_id: ID, session: SessionDep) -> DeploymentOut:
    """Stop the server and free its port (status goes stopping -> stopped)."""
    return DeploymentOut.model_validate(svc.stop_deployment(session, deployment_id))


@router.delete("/{deployment_id}", status_code=204, responses={**ERRORS, 202: {"model": DeploymentOut}})
def delete_deployment(deployment_id: ID, session: SessionDep) -> Response:
    """Stop a running deployment (202) or remove a stopped one from the list (204)."""
    dep = svc.get_deployment(session, deployment_id)
    if dep.status in svc.ACTIVE:
        dep = svc.stop_deployment(session, deployment_id)
        return JSONResponse(DeploymentOut.model_validate(dep).model_dump(mode="json"), status_code=202)
    svc.delete_deployment(session, deployment_id)
    return Response(status_code=204)


@router.post("/{deployment_id}/chat", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def chat(deployment_id: ID, body: ChatIn, session: SessionDep) -> Response:
    """OpenAI chat completion through the deployment; with `stream: true` the SSE stream passes through."""
    url = svc.chat_url(session, deployment_id)
    payload = svc.prepare_chat_body(body.model_dump(exclude_none=True))
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0))
    try:
        request = client.build_request("POST", url, json=payload)
        upstream = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        raise Unavailable(SERVICES("deployment_no_answer", id=deployment_id, url=url, error=str(e))) from None

    async def close() -> None:
        await upstream.aclose()
        await client.aclose()

    if upstream.status_code >= 400:
        content = await upstream.aread()
        await close()
        # The model server's own failure is a bad gateway from the studio's point of view.
        status = 502 if upstream.status_code >= 500 else upstream.status_code
        message = svc.answered_message(deployment_id, upstream.status_code, content)
        return JSONResponse({"message": message, "details": None}, status_code=status)
    if not body.stream:
        content = await upstream.aread()
        await close()
        return Response(content, status_code=200, media_type="application/json")
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        background=BackgroundTask(close),
    )
