"""/api/v1/recipes: ERNIEKit's example configs as starting points (list with verdicts, one as an import)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from studio.api.deps import SessionDep, SettingsDep
from studio.api.routes.runs import imported_out
from studio.schemas import ConfigImportOut, ErrorOut, RecipeOut
from studio.services import recipes as svc

router = APIRouter(prefix="/recipes", tags=["recipes"])
# Recipe ids are file names without .yaml (ernie-4.5-0.3b-sft-lora-8k); looked up, never used as a path.
RecipeID = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9.-]*$")]


def _out(session, settings, recipe: svc.Recipe) -> RecipeOut:
    return RecipeOut(**recipe.to_dict(), verdict=svc.recipe_verdict(session, settings, recipe.id))


@router.get("", response_model=list[RecipeOut])
def list_recipes(session: SessionDep, settings: SettingsDep) -> list[RecipeOut]:
    """Every recipe with the planner's verdict for the studio's nodes (from the model's shape: no download)."""
    return [_out(session, settings, r) for r in svc.list_recipes()]


@router.get("/{recipe_id}", response_model=RecipeOut, responses={404: {"model": ErrorOut}})
def get_recipe(recipe_id: RecipeID, session: SessionDep, settings: SettingsDep) -> RecipeOut:
    return _out(session, settings, svc.get_recipe(recipe_id))


@router.get("/{recipe_id}/import", response_model=ConfigImportOut, responses={404: {"model": ErrorOut}})
def import_recipe(recipe_id: RecipeID, session: SessionDep, settings: SettingsDep) -> ConfigImportOut:
    """The recipe as POST /runs/import maps it: the run's choices, its model and datasets matched by name."""
    return imported_out(svc.load_recipe(session, settings, recipe_id))
