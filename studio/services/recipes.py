"""Recipes: ERNIEKit's own example configs (studio/recipes/*.yaml, each naming its source) as starting points.

A recipe is read by the import service exactly as a person's YAML is (``config_import.import_train_yaml``):
its model and dataset paths map to the studio's by name or are listed as missing. Its verdict is the planner's
(``engine.estimate``) for the studio's nodes, from the model's published shape (the official preset of the
recipe's source folder): nothing is downloaded and no dataset is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from engine.estimate import PlanError, check_settings, estimate_run, plan_config
from engine.models.presets import OFFICIAL, preset_config
from engine.train.config import TrainConfig
from studio.config import Settings
from studio.services.config_import import ImportedConfig, import_train_yaml
from studio.services.errors import NotFound
from studio.services.estimates import studio_nodes, with_fit
from studio.services.messages import SERVICES

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
# The header every recipe file starts with: its title, then where ERNIEKit publishes it.
_TITLE = re.compile(r"^# ERNIEKit (?P<title>.+)$")
_SOURCE = re.compile(
    r"^# source: PaddlePaddle/ERNIE (?P<path>examples/configs/(?P<model>[^/]+)/\S+\.yaml) "
    r"at (?P<commit>[0-9a-f]{40}) \(ERNIEKit (?P<version>[0-9.]+)\)$"
)
# ERNIEKit's folders of a model variant with the same shape as an official preset.
_VARIANT_SUFFIXES = ("-Thinking",)


@dataclass(frozen=True)
class Recipe:
    """One recipe file: its id (the file name without .yaml), title, ERNIEKit source and text."""

    id: str
    title: str
    source_path: str
    source_commit: str
    erniekit_version: str
    model_folder: str
    text: str

    @property
    def shape(self) -> str:
        """The official preset whose shape the recipe's model has (ERNIE-4.5-21B-A3B-Thinking: 21b-a3b)."""
        name = self.model_folder
        for suffix in _VARIANT_SUFFIXES:
            name = name.removesuffix(suffix)
        return name.lower()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "source_path": self.source_path,
            "source_commit": self.source_commit,
            "erniekit_version": self.erniekit_version,
            "shape": self.shape,
        }


def read_recipe_file(path: Path) -> Recipe:
    """A recipe file with its header read; a file without the header is a packaging mistake (ValueError)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    title = _TITLE.match(lines[0]) if lines else None
    source = _SOURCE.match(lines[1]) if len(lines) > 1 else None
    if title is None or source is None:
        raise ValueError(f"{path}: the first two lines must be '# ERNIEKit <title>' and '# source: ...'")
    recipe = Recipe(
        id=path.stem,
        title=title["title"],
        source_path=source["path"],
        source_commit=source["commit"],
        erniekit_version=source["version"],
        model_folder=source["model"],
        text=text,
    )
    if recipe.shape not in OFFICIAL:
        raise ValueError(
            f"{path}: {recipe.model_folder} is not the shape of an official preset ({', '.join(OFFICIAL)})"
        )
    return recipe


@cache
def list_recipes() -> tuple[Recipe, ...]:
    """Every recipe the studio ships, by file name."""
    return tuple(read_recipe_file(p) for p in sorted(RECIPES_DIR.glob("*.yaml")))


def get_recipe(recipe_id: str) -> Recipe:
    """The recipe of this id; the id is looked up among the shipped ones, never used as a path."""
    for recipe in list_recipes():
        if recipe.id == recipe_id:
            return recipe
    known = ", ".join(r.id for r in list_recipes())
    raise NotFound(SERVICES("recipe_not_found", name=str(recipe_id)[:80], names=known))


def load_recipe(session: Session, settings: Settings, recipe_id: str) -> ImportedConfig:
    """The recipe as an import: its keys, and its model and datasets matched to the studio's by name."""
    recipe = get_recipe(recipe_id)
    return import_train_yaml(session, settings, recipe.text, f"recipe {recipe.id}.yaml")


def recipe_verdict(session: Session, settings: Settings, recipe_id: str) -> dict[str, Any]:
    """Whether the recipe as written fits the studio's nodes, and the planner's proposal.

    ``status`` is ``no_nodes`` (no node has reported: nothing to judge), ``fits`` (the recipe's own settings fit
    the most constrained node), ``proposal`` (they do not, or the nodes refuse one of them, and the planner
    has settings that fit), ``does_not_fit`` (nothing the planner weighs fits; ``reason`` says why) or
    ``cannot_plan`` (the planner refused the request; ``reason``)."""
    recipe = get_recipe(recipe_id)
    imported = load_recipe(session, settings, recipe_id)
    model = preset_config(recipe.shape)
    hyper = {"compute_type": imported.compute_type, **imported.spec_hyperparameters()}
    train = TrainConfig(stage=imported.stage, fine_tuning=imported.fine_tuning, **hyper)
    out: dict[str, Any] = {"recipe": recipe.id, "shape": recipe.shape, "seq_len": train.max_seq_len}
    nodes = studio_nodes(session, settings)
    if not nodes:
        return out | {"status": "no_nodes", "fits": None, "plan": None, "problems": [], "reason": ""}
    node = min(nodes, key=lambda n: n.memory_bytes or float("inf"))
    est = with_fit(estimate_run(model, train, [], [], node=node, num_devices=1), node, len(nodes))
    problems = []
    try:
        # sharding counts where the engine applies it: sharding_parallel_degree 0 or 1 turns it off
        sharding = train.sharding if train.sharding_parallel_degree not in (0, 1) else None
        check_settings(model, nodes, 1, getattr(train, "expert_parallel_degree", None), sharding or None)
    except PlanError as e:
        problems.append(str(e))
    try:
        plan = plan_config(model, train, nodes, model_name=recipe.shape).to_dict()
    except PlanError as e:
        return out | {
            "status": "cannot_plan",
            "fits": est["fits"],
            "plan": None,
            "problems": problems,
            "reason": str(e),
        }
    fits = bool(est["fits"]) and not problems
    if fits:
        status = "fits"
    elif plan["fits"]:
        status = "proposal"
    else:
        status = "does_not_fit"
    return out | {
        "status": status,
        "fits": est["fits"],
        "peak_gib": est["memory_gib"]["peak"],
        "node": est["node"],
        "warning": est["warning"],
        "problems": problems,
        "plan": plan,
        "reason": plan["reason"],
    }
