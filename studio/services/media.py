"""Images a dataset's records name by URL (ERNIEKit's VL demo data does): the upload only queues their fetch;
a worker job (workers/media.py) fetches them into the dataset's folder with progress, and its failures become
the dataset's problems. No request and no preview ever fetches (docs/deploy.md, "Security")."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.data import remote
from engine.data.records import iter_raw
from studio.config import Settings
from studio.models import Dataset, MediaFetch, RunStatus
from studio.services import jobs
from studio.services.errors import InvalidInput
from studio.services.events import add_event

# Only these formats' records are read for images (a text dataset's stray image_info is never fetched).
URL_FORMATS = ("erniekit_vl",)


def record_urls(path: Path, fmt: str) -> list[tuple[int, int, str]]:
    """(line, image_info index, URL) of every image an ``fmt`` record of ``path`` names by http(s) URL."""
    if fmt not in URL_FORMATS:
        return []
    out: list[tuple[int, int, str]] = []
    for raw in iter_raw(path):
        infos = raw.record.get("image_info") if isinstance(raw.record, dict) else None
        for i, info in enumerate(infos if isinstance(infos, list) else []):
            url = info.get("image_url") if isinstance(info, dict) else None
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                out.append((raw.line, i, url))
    return out


def check_url_count(path: Path, fmt: str, label: str) -> None:
    """Refuse at upload a data file naming more image URLs than one dataset may fetch."""
    count = len({url for _, _, url in record_urls(path, fmt)})
    if count > remote.MAX_URLS:
        raise InvalidInput(
            f"file: {label} names {count:,} image URLs; at most {remote.MAX_URLS:,} are fetched per dataset: "
            "save the images next to the data file and upload a .zip"
        )


def queue_fetch(session: Session, settings: Settings, ds: Dataset, path: Path) -> MediaFetch | None:
    """Queue the fetch of the images ``ds`` (its data file at ``path``) names by URL; None when it names none."""
    total = len({url for _, _, url in record_urls(path, ds.format)})
    if not total:
        return None
    job = MediaFetch(dataset_id=ds.id, status=RunStatus.QUEUED, urls_total=total)
    session.add(job)
    session.flush()
    add_event(
        session,
        "media.queued",
        f"fetching {total} image URL(s) of dataset {ds.name}",
        data={"media_id": job.id},
    )
    session.commit()
    jobs.dispatch(session, settings, jobs.MEDIA, job)
    return job


def latest_fetch(session: Session, dataset_id: int) -> MediaFetch | None:
    return session.scalars(
        select(MediaFetch).where(MediaFetch.dataset_id == dataset_id).order_by(MediaFetch.id.desc())
    ).first()


def claim_fetch(session: Session, fetch_id: int, worker: str) -> MediaFetch | None:
    return jobs.claim(session, jobs.MEDIA, fetch_id, worker)


def fetch_progress(session: Session, fetch_id: int, done: int, total: int, nbytes: int) -> bool:
    return jobs.heartbeat(session, jobs.MEDIA, fetch_id, urls_done=done, urls_total=total, bytes_done=nbytes)


def finish_fetch(
    session: Session, fetch_id: int, status: RunStatus, message: str, *, error: str | None = None, **values
) -> bool:
    return jobs.finish(session, jobs.MEDIA, fetch_id, status, message, error=error, **values)
