"""The work of a download task: claim it, run `ernie-studio download` into home/models under the shared
supervisor (workers.process.supervise), report the bytes on disk as progress with every heartbeat, record
the result."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

from sqlalchemy.orm import Session

from engine.models.download import download_progress
from studio.config import Settings
from studio.db import session_factory
from studio.models import ModelDownload, RunStatus
from studio.services import downloads as downloads_svc
from studio.services import jobs
from workers.process import SupervisedJob, engine_command, spawn, supervise, tail

log = logging.getLogger(__name__)

# The command's last line: "downloaded <repo> at <commit> to <dir> (...)".
DONE_RE = re.compile(r"^downloaded \S+ at ([0-9a-f]+) to ", re.M)


def execute_download(settings: Settings, download_id: int, worker: str) -> str | None:
    """Run one download; returns its final status (None when it was not queued, or was given back)."""
    factory = session_factory(settings)
    with factory() as session:
        download = downloads_svc.claim_download(session, download_id, worker)
        if download is None:
            return None
        job = _Download(settings, download, worker)
        job.proc = spawn(
            engine_command("download", download.name, "--out", str(job.model_dir)),
            job.log_file,
            cwd=settings.home,
            niceness=settings.batch_niceness,
        )
        return supervise(session, settings, job.proc, job)


class _Download(SupervisedJob):
    """A download under the supervisor: progress is the bytes on disk; done is a config.json in place."""

    def __init__(self, settings: Settings, download: ModelDownload, worker: str) -> None:
        self.settings, self.id, self.worker, self.commit = settings, download.id, worker, download.commit
        self.model_dir = Path(download.model_dir)
        self.log_file = settings.home / "downloads" / f"{download.id}.log"

    def __repr__(self) -> str:
        return f"download {self.id}"

    def state(self, session: Session) -> str:
        # A deleted download is no longer this worker's, like one requeued elsewhere: its child stops.
        p = download_progress(self.model_dir)
        values = {"bytes_done": p.bytes_done, "bytes_total": p.bytes_total, "commit": p.commit}
        return "ok" if jobs.heartbeat(session, jobs.DOWNLOADS, self.id, self.worker, **values) else "lost"

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        # The next attempt keeps the files already verified (huggingface_hub skips them).
        jobs.release(
            session,
            self.settings,
            jobs.DOWNLOADS,
            self.id,
            f"worker {self.worker} stopped",
            worker=self.worker,
        )

    def finish(self, session: Session, code: int, cancelled: bool) -> str:
        output = tail(self.log_file, 4000).strip()
        if code == 0 and (self.model_dir / "config.json").exists():
            total = sum(f.stat().st_size for f in self.model_dir.rglob("*") if f.is_file())
            found = DONE_RE.findall(output)
            commit = found[-1] if found else self.commit
            downloads_svc.download_heartbeat(session, self.id, total, total, commit)
            downloads_svc.finish_download(session, self.id, RunStatus.SUCCEEDED)
            return RunStatus.SUCCEEDED.value
        error = output.splitlines()[-1] if output else f"ernie-studio download exited with code {code}"
        downloads_svc.finish_download(session, self.id, RunStatus.FAILED, error=error[-2000:])
        return RunStatus.FAILED.value
