"""/api/v1/templates: Train forms saved under a name (create, list, get, delete)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from studio.api.deps import ID, SessionDep, SettingsDep
from studio.schemas import ErrorOut, TemplateOut
from studio.services import templates as svc
from studio.services.errors import InvalidInput

router = APIRouter(prefix="/templates", tags=["templates"])
ERRORS = {404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut}}


def _out(view: svc.TemplateView) -> TemplateOut:
    t = view.template
    return TemplateOut(
        id=t.id,
        name=t.name,
        created_at=t.created_at,
        spec=view.spec.model_dump(mode="json"),
        missing_datasets=view.missing_datasets,
        notes=view.notes,
    )


@router.post("", status_code=201, response_model=TemplateOut, responses=ERRORS)
def create_template(body: svc.TemplateIn, session: SessionDep, settings: SettingsDep) -> TemplateOut:
    """Save a run spec under a name; refused when a run of it would be (POST /runs's checks) or the name is
    taken (409)."""
    template = svc.create_template(session, settings, body.name, body.spec)
    return _out(svc.get_template(session, template.id))


@router.get("", response_model=list[TemplateOut])
def list_templates(session: SessionDep) -> list[TemplateOut]:
    """Every template, by name."""
    out = []
    for t in svc.list_templates(session):
        try:
            out.append(_out(svc.get_template(session, t.id)))
        except (
            InvalidInput
        ) as e:  # one an older studio saved: listed with why it cannot be used, never hidden
            out.append(
                TemplateOut(id=t.id, name=t.name, created_at=t.created_at, spec=t.spec, notes=[e.message])
            )
    return out


@router.get("/{template_id}", response_model=TemplateOut, responses=ERRORS)
def get_template(template_id: ID, session: SessionDep) -> TemplateOut:
    """One template, with the datasets it names that were deleted since it was saved."""
    return _out(svc.get_template(session, template_id))


@router.delete("/{template_id}", status_code=204, responses=ERRORS)
def delete_template(template_id: ID, session: SessionDep) -> Response:
    svc.delete_template(session, template_id)
    return Response(status_code=204)
