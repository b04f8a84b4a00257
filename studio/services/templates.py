"""Train form templates: a run spec saved under a name, checked as ``POST /runs`` checks it, to start from later.

A template keeps the spec the form would launch (base model, datasets, stage, fine-tuning, devices, the
evaluation after training and every training option it holds); its name is a label, never a path. A dataset
deleted since is named when the template is read, and left out of the form it fills.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, ValidationError
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from studio.config import Settings
from studio.models import Dataset, TrainTemplate
from studio.schemas import RequestModel
from studio.services.errors import Conflict, InvalidInput, NotFound
from studio.services.messages import SERVICES
from studio.services.runs import RunSpec, spec_problems

MAX_TEMPLATE_NAME = 100  # the train_templates.name column
# A person keeps a handful of templates; a list past this is a script filling the table.
MAX_TEMPLATES = 500


class TemplateIn(RequestModel):
    """A template to save: its name and the run spec (as POST /runs takes it)."""

    name: str = Field(description=f"unique, 1 to {MAX_TEMPLATE_NAME} printable characters")
    spec: RunSpec


@dataclass
class TemplateView:
    """A template as read back: its spec, and the datasets it names that no longer exist (by spec field)."""

    template: TrainTemplate
    spec: RunSpec
    missing_datasets: dict[str, list[int]] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        return [
            f"{key}: dataset #{i} was deleted since the template was saved; pick another"
            for key, ids in self.missing_datasets.items()
            for i in ids
        ]


def template_name(name: Any) -> str:
    """The name as stored (spaces around it dropped), or ``InvalidInput`` saying what is wrong with it."""
    if not isinstance(name, str):
        raise InvalidInput("name: a template's name is text")
    name = name.strip()
    if not name:
        raise InvalidInput(SERVICES("template_name_empty", n=MAX_TEMPLATE_NAME))
    if len(name) > MAX_TEMPLATE_NAME:
        raise InvalidInput(SERVICES("template_name_long", n=len(name), max=MAX_TEMPLATE_NAME))
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise InvalidInput(SERVICES("template_name_unprintable"))
    return name


def create_template(session: Session, settings: Settings, name: Any, spec: RunSpec) -> TrainTemplate:
    """Save ``spec`` as template ``name``; refused (each problem named, as ``POST /runs`` names it) when a run
    of it would be, and when the name is taken."""
    name = template_name(name)
    problems = spec_problems(session, settings, spec)
    if problems:
        head = SERVICES("template_refused")
        raise InvalidInput(
            SERVICES("with_problems", head=head, problems="\n".join(problems)), details={"problems": problems}
        )
    if _named(session, name) is not None:
        raise Conflict(SERVICES("template_name_taken", name=name))
    if session.scalar(select(func.count(TrainTemplate.id))) >= MAX_TEMPLATES:
        raise Conflict(SERVICES("templates_full", n=MAX_TEMPLATES))
    template = TrainTemplate(name=name, spec=spec.model_dump(mode="json"))
    session.add(template)
    try:
        session.commit()
    except IntegrityError:  # saved under the same name at the same moment
        session.rollback()
        raise Conflict(SERVICES("template_name_taken_now", name=name)) from None
    return template


def list_templates(session: Session) -> list[TrainTemplate]:
    return list(session.scalars(select(TrainTemplate).order_by(TrainTemplate.name)))


def get_template(session: Session, template_id: int) -> TemplateView:
    """The template with its spec, and the datasets it names that were deleted."""
    template = session.get(TrainTemplate, template_id)
    if template is None:
        raise NotFound(SERVICES("template_not_found", id=template_id))
    try:
        spec = RunSpec.model_validate(template.spec)
    except ValidationError as e:  # saved by a studio whose run spec had other fields
        first = e.errors()[0]
        where = ".".join(["spec", *(str(x) for x in first["loc"])])
        raise InvalidInput(
            SERVICES(
                "template_unusable", id=template.id, name=template.name, problem=f"{where}: {first['msg']}"
            )
        ) from None
    named = {
        "dataset_ids": spec.dataset_ids,
        "eval_dataset_ids": spec.eval_dataset_ids or [],
        "evaluate.dataset_ids": (spec.evaluate.dataset_ids or []) if spec.evaluate else [],
    }
    wanted = {i for ids in named.values() for i in ids}
    present = set(session.scalars(select(Dataset.id).where(Dataset.id.in_(wanted)))) if wanted else set()
    missing = {key: [i for i in ids if i not in present] for key, ids in named.items()}
    return TemplateView(template, spec, {k: v for k, v in missing.items() if v})


def delete_template(session: Session, template_id: int) -> None:
    template = session.get(TrainTemplate, template_id)
    if template is None:
        raise NotFound(SERVICES("template_not_found", id=template_id))
    session.delete(template)
    session.commit()


def _named(session: Session, name: str) -> TrainTemplate | None:
    return session.scalar(select(TrainTemplate).where(TrainTemplate.name == name))
