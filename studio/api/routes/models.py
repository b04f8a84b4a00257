"""/api/v1/models: base models the studio can train from or deploy."""

from __future__ import annotations

from fastapi import APIRouter

from studio.api.deps import SessionDep, SettingsDep
from studio.schemas import ModelOut
from studio.services.models import list_models

router = APIRouter(prefix="/models", tags=["models"])


@router.get("", response_model=list[ModelOut])
def models(session: SessionDep, settings: SettingsDep) -> list[ModelOut]:
    return [ModelOut(**m) for m in list_models(session, settings)]
