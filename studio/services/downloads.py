"""Official checkpoints (or any hub model repo) fetched by a worker into home/models (`ernie-studio download`):
the model then shows up in /models like any other. One download per model directory at a time."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.models.download import resolve_name
from studio.config import Settings
from studio.models import ModelDownload, RunStatus, utcnow
from studio.services import jobs
from studio.services.errors import Conflict, InvalidInput
from studio.services.events import add_event
from studio.services.store import get_or_404

ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING)


def create_download(session: Session, settings: Settings, name: str) -> ModelDownload:
    """Queue a download of `name` (an official preset such as ernie-4.5-0.3b, or a hub repo id) into
    home/models/<its name>; refused when that directory already holds something or is being downloaded."""
    try:
        repo_id, dir_name = resolve_name(name)
    except ValueError as e:
        raise InvalidInput(f"name: {e}") from None
    model_dir = settings.models_dir / dir_name
    busy = session.scalars(
        select(ModelDownload).where(
            ModelDownload.model_dir == str(model_dir), ModelDownload.status.in_(ACTIVE)
        )
    ).first()
    if busy is not None:
        raise Conflict(f"name: {dir_name} is already being downloaded (download {busy.id})")
    if model_dir.exists() and any(model_dir.iterdir()):
        raise Conflict(f"name: {model_dir} already holds a model; remove it to download {repo_id} again")
    download = ModelDownload(
        name=name.strip(), repo_id=repo_id, model_dir=str(model_dir), status=RunStatus.QUEUED
    )
    session.add(download)
    session.flush()
    add_event(session, "download.queued", f"download of {repo_id} queued", data={"download_id": download.id})
    session.commit()
    dispatch_download(session, settings, download)
    return download


def dispatch_download(session: Session, settings: Settings, download: ModelDownload) -> None:
    # Downloads go with exports: serving workers take them, so they never wait behind a training run.
    jobs.dispatch(session, settings, jobs.DOWNLOADS, download)


def list_downloads(session: Session) -> list[ModelDownload]:
    return list(session.scalars(select(ModelDownload).order_by(ModelDownload.id.desc())).all())


def get_download(session: Session, download_id: int) -> ModelDownload:
    return get_or_404(session, ModelDownload, download_id, "download")


def active_download(session: Session, model_dir: Path) -> ModelDownload | None:
    """The queued or running download into `model_dir`, if any (the model picker shows its progress)."""
    return session.scalars(
        select(ModelDownload).where(
            ModelDownload.model_dir == str(model_dir), ModelDownload.status.in_(ACTIVE)
        )
    ).first()


# ---- state transitions made by the worker (studio.services.jobs holds the life cycle) --------------------


def claim_download(session: Session, download_id: int, worker: str) -> ModelDownload | None:
    return jobs.claim(session, jobs.DOWNLOADS, download_id, worker)


def download_heartbeat(
    session: Session, download_id: int, bytes_done: int, bytes_total: int | None, commit: str | None
) -> None:
    # Progress is recorded even after the end (the final byte count of a finished download).
    session.execute(
        update(ModelDownload)
        .where(ModelDownload.id == download_id)
        .values(heartbeat_at=utcnow(), bytes_done=bytes_done, bytes_total=bytes_total, commit=commit)
    )
    session.commit()


def finish_download(
    session: Session, download_id: int, status: RunStatus, *, error: str | None = None
) -> None:
    download = session.get(ModelDownload, download_id)
    message = error or f"{download.repo_id} downloaded to {Path(download.model_dir).name}"
    jobs.finish(session, jobs.DOWNLOADS, download_id, status, message, error=error)
