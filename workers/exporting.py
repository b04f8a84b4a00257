"""The work of an export task: claim it, run `ernie-studio export` on the run's config under the shared
supervisor (workers.process.supervise), record the result."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path

import yaml
from sqlalchemy.orm import Session

from studio.config import Settings
from studio.db import session_factory
from studio.models import Export, Run, RunStatus
from studio.services import exports as exports_svc
from studio.services import jobs
from workers.process import SupervisedJob, engine_command, spawn, supervise, tail

log = logging.getLogger(__name__)

PERPLEXITY_RE = re.compile(r"^perplexity: (\{.*\})$", re.M)


def execute_export(settings: Settings, export_id: int, worker: str) -> str | None:
    """Run one export; returns its final status (None when it was not queued, or was given back)."""
    factory = session_factory(settings)
    with factory() as session:
        export = exports_svc.claim_export(session, export_id, worker)
        if export is None:
            return None
        run = session.get(Run, export.run_id)
        directory = Path(run.output_dir).parent / "exports" / str(export_id)
        directory.mkdir(parents=True, exist_ok=True)
        config_file = directory / "export.yaml"
        config_file.write_text(yaml.safe_dump(exports_svc.export_config(run, export), sort_keys=False))
        job = _Export(settings, export, worker, directory / "export.log")
        job.proc = spawn(
            engine_command("export", str(config_file)),
            job.log_file,
            cwd=directory,
            niceness=settings.batch_niceness,
        )
        return supervise(session, settings, job.proc, job)


class _Export(SupervisedJob):
    """An export under the supervisor: done is an exported config.json (or a GGUF summary) in place."""

    def __init__(self, settings: Settings, export: Export, worker: str, log_file: Path) -> None:
        self.settings, self.id, self.worker, self.log_file = settings, export.id, worker, log_file
        self.export_dir, self.format = Path(export.export_dir), export.export_format

    def __repr__(self) -> str:
        return f"export {self.id}"

    def state(self, session: Session) -> str:
        # Deleting the run deletes its exports: that one is no longer this worker's, and its child stops.
        return "ok" if jobs.heartbeat(session, jobs.EXPORTS, self.id, self.worker) else "lost"

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        jobs.release(
            session, self.settings, jobs.EXPORTS, self.id, f"worker {self.worker} stopped", worker=self.worker
        )

    def finish(self, session: Session, code: int, cancelled: bool) -> str:
        output = tail(self.log_file, 8000)
        summary_file = self.export_dir / "export_summary.json"
        if code == 0 and self.format == "gguf" and summary_file.exists():
            summary = json.loads(summary_file.read_text())
            exports_svc.finish_export(
                session, self.settings, self.id, RunStatus.SUCCEEDED,
                perplexity=summary.get("perplexity") or None, gguf_files=summary.get("gguf"),
            )  # fmt: skip
            return RunStatus.SUCCEEDED.value
        if code == 0 and (self.export_dir / "config.json").exists():
            found = PERPLEXITY_RE.findall(output)
            ppl = json.loads(found[-1]) if found else None
            exports_svc.finish_export(session, self.settings, self.id, RunStatus.SUCCEEDED, perplexity=ppl)
            return RunStatus.SUCCEEDED.value
        error = f"ernie-studio export exited with code {code}:\n{output[-2000:]}"
        exports_svc.finish_export(session, self.settings, self.id, RunStatus.FAILED, error=error)
        return RunStatus.FAILED.value
