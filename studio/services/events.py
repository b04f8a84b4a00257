"""The events table: a timeline of what happened to runs, datasets and deployments."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from studio.models import Event


def add_event(
    session: Session,
    kind: str,
    message: str,
    *,
    run_id: int | None = None,
    deployment_id: int | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    ev = Event(kind=kind, message=message, run_id=run_id, deployment_id=deployment_id, data=data)
    session.add(ev)
    return ev


def list_events(
    session: Session, *, run_id: int | None = None, deployment_id: int | None = None, limit: int = 200
) -> list[Event]:
    q = select(Event).order_by(Event.id.desc()).limit(limit)
    if run_id is not None:
        q = q.where(Event.run_id == run_id)
    if deployment_id is not None:
        q = q.where(Event.deployment_id == deployment_id)
    return list(reversed(session.scalars(q).all()))
