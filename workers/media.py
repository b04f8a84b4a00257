"""The work of a media fetch task: claim it, fetch the images a dataset's records name by URL into its folder
(engine.data.remote: checked addresses, caps, only images kept) with progress at every URL, then record what
could not be fetched as the dataset's problems."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from engine.data import remote
from engine.data.messages import MEDIA
from engine.data.validate import validate_file
from studio.config import Settings
from studio.db import session_factory
from studio.models import Dataset, RunStatus
from studio.services import datasets as datasets_svc
from studio.services import media as media_svc

log = logging.getLogger(__name__)

POLL_S = 2.0  # well inside the reconciler's STALE_AFTER_S (30 s by default)


def execute_media_fetch(settings: Settings, fetch_id: int, worker: str) -> str | None:
    """Run one fetch; returns its final status (None when it was not queued)."""
    with session_factory(settings)() as session:
        job = media_svc.claim_fetch(session, fetch_id, worker)
        if job is None:
            return None
        ds = session.get(Dataset, job.dataset_id)
        if ds is None:
            media_svc.finish_fetch(
                session, fetch_id, RunStatus.FAILED, "dataset deleted", error="dataset deleted"
            )
            return RunStatus.FAILED.value
        path = datasets_svc.dataset_path(settings, ds)
        entries = media_svc.record_urls(path, ds.format)
        beat = _Heartbeat(settings, fetch_id, len({url for _, _, url in entries}))
        beat.start()
        try:
            failed = remote.fetch_all([url for _, _, url in entries], path.parent, beat.progress)
        except remote.FetchError as e:
            media_svc.finish_fetch(session, fetch_id, RunStatus.FAILED, str(e), error=str(e))
            return RunStatus.FAILED.value
        finally:
            beat.stop()
        media_svc.fetch_progress(session, fetch_id, *beat.latest)
        _record_problems(ds, path, datasets_svc.dataset_folder(settings, ds), entries, failed)
        session.commit()
        fetched = len({url for _, _, url in entries}) - len(failed)
        message = f"{fetched} image(s) of dataset {ds.name} fetched"
        if failed:
            message += f", {len(failed)} could not be"
        media_svc.finish_fetch(session, fetch_id, RunStatus.SUCCEEDED, message, failed=failed or None)
        return RunStatus.SUCCEEDED.value


class _Heartbeat(threading.Thread):
    """Beats for the job every ``POLL_S`` with the latest progress while one URL may take up to the fetch
    deadline (longer than a heartbeat may be missed); ``progress`` answers False once the job is no longer
    this worker's (deleted with its dataset, or requeued), which stops the fetch."""

    def __init__(self, settings: Settings, fetch_id: int, total: int) -> None:
        super().__init__(daemon=True, name=f"media-fetch-{fetch_id}")
        self.settings, self.fetch_id = settings, fetch_id
        self.latest = (0, total, 0)
        self.alive, self.stopped = True, threading.Event()

    def progress(self, done: int, total: int, nbytes: int) -> bool:
        self.latest = (done, total, nbytes)
        return self.alive

    def run(self) -> None:
        with session_factory(self.settings)() as session:
            while not self.stopped.wait(POLL_S):
                self.alive = media_svc.fetch_progress(session, self.fetch_id, *self.latest)

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def _record_problems(
    ds: Dataset, path: Path, folder: Path, entries: list[tuple[int, int, str]], failed: dict[str, str]
) -> None:
    """The dataset's problems and valid count once its images are here: the fetched copies are checked as a
    run will read them, and each record naming an image that could not be fetched is one more problem."""
    report = validate_file(path, ds.format, ds.kind, max_problems=datasets_svc.MAX_REPORTED_PROBLEMS)
    name = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else path.name
    found = [(p.line, MEDIA("at_line", file=name, line=p.line, msg=p.message)) for p in report.problems]
    for line, index, url in entries:
        if url in failed:
            why = MEDIA("not_fetched", url=url, msg_why=failed[url])
            problem = MEDIA("located", field=f"image_info[{index}]", msg=why)
            found.append((line, MEDIA("at_line", file=name, line=line, msg=problem)))
    found.sort(key=lambda item: item[0])
    ds.problems = [message for _, message in found[: datasets_svc.MAX_REPORTED_PROBLEMS]]
    ds.num_valid = max(ds.num_records - len({line for line, _ in found}), 0)
