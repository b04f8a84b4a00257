"""The work of an eval task: claim it, run `ernie-studio eval` on its config, import eval_samples.jsonl into
the store as the engine appends it, act on cancel, record the results. Testable without Celery.

A worker killed mid-eval leaves the eval running with a stale heartbeat; the reconciler requeues it and
the next attempt runs the engine again in the same output directory, which continues after the samples
already in eval_samples.jsonl. The import reads that file from its start on every attempt and stores each
sample once ((eval, sample id) is unique), so nothing is lost or stored twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
from pathlib import Path

import yaml
from sqlalchemy.orm import Session

from studio.config import Settings
from studio.db import session_factory
from studio.models import Evaluation, RunStatus
from studio.services import evals as evals_svc
from studio.services import jobs
from studio.services.models import BUILDABLE_PRESETS, build_preset
from workers.process import MetricsTail, SupervisedJob, engine_command, log_line, spawn, supervise, tail

log = logging.getLogger(__name__)

SAMPLES_FILE = "eval_samples.jsonl"
RESULTS_FILE = "eval_results.json"


def execute_eval(settings: Settings, eval_id: int, worker: str) -> str | None:
    """Run one attempt of an eval; returns its final status (None when it was not queued or was given away)."""
    with session_factory(settings)() as session:
        ev = jobs.claim(session, jobs.EVALS, eval_id, worker, attempt=Evaluation.attempt + 1, pid=None)
        if ev is None:
            log.debug("eval %s is not queued any more; dropping this message", eval_id)
            return None
        return _attempt(session, settings, ev, worker)


def _attempt(session: Session, settings: Settings, ev: Evaluation, worker: str) -> str | None:
    directory = evals_svc.eval_dir(settings, ev.id)
    directory.mkdir(parents=True, exist_ok=True)
    log_file = evals_svc.log_path(settings, ev.id)
    config_file = directory / "eval.yaml"
    config_file.write_text(yaml.safe_dump(ev.config, sort_keys=False))
    try:
        if ev.model in BUILDABLE_PRESETS:
            build_preset(settings, ev.model)
    except Exception as e:
        evals_svc.finish_eval(session, ev.id, RunStatus.FAILED, error=f"could not build {ev.model}: {e}")
        return RunStatus.FAILED.value
    log_line(log_file, f"attempt {ev.attempt} on {worker}")
    job = _Eval(settings, ev.id, worker, Path(ev.output_dir), log_file)
    job.proc = spawn(
        engine_command("eval", str(config_file)), log_file, cwd=directory,
        env=evals_svc.judge_environment(settings, ev.id), niceness=settings.batch_niceness,
    )  # fmt: skip
    return supervise(session, settings, job.proc, job)


class _Eval(SupervisedJob):
    """An eval under the supervisor: progress is eval_samples.jsonl (each sample stored once); done is the
    scorer's eval_results.json; a stopping worker requeues the eval, which continues after its samples."""

    def __init__(
        self, settings: Settings, eval_id: int, worker: str, output_dir: Path, log_file: Path
    ) -> None:
        self.settings, self.id, self.worker, self.output_dir, self.log_file = (
            settings, eval_id, worker, output_dir, log_file
        )  # fmt: skip
        self.samples = MetricsTail(output_dir / SAMPLES_FILE)  # complete JSON lines from a byte offset

    def __repr__(self) -> str:
        return f"eval {self.id}"

    def collect(self, session: Session) -> None:
        evals_svc.record_samples(session, self.id, self.samples.read())

    def state(self, session: Session) -> str:
        state = evals_svc.eval_heartbeat(session, self.id, self.worker, self.proc.pid if self.proc else None)
        session.expire_all()
        return state

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        log_line(self.log_file, "requeued: worker stopped")
        jobs.release(
            session,
            self.settings,
            jobs.EVALS,
            self.id,
            f"worker {self.worker} stopped; continues",
            worker=self.worker,
        )

    def finish(self, session: Session, code: int, cancelled: bool) -> str:
        return _finish(session, self.id, code, cancelled, self.output_dir, self.log_file)


def _finish(
    session: Session, eval_id: int, code: int, cancelled: bool, output_dir: Path, log_file: Path
) -> str:
    results: dict | None = None
    with contextlib.suppress(OSError, ValueError):
        results = json.loads((output_dir / RESULTS_FILE).read_text())
    if code == 0 and results and results.get("status") == "succeeded":
        status, error = RunStatus.SUCCEEDED, None
    elif cancelled:
        status, error = RunStatus.CANCELLED, None
    else:
        status = RunStatus.FAILED
        error = (results or {}).get(
            "error"
        ) or f"ernie-studio eval exited with code {code}:\n{tail(log_file, 2000)}"
    evals_svc.finish_eval(
        session, eval_id, status, error=error, results=results if status == RunStatus.SUCCEEDED else None
    )
    log_line(log_file, f"{status.value} (exit code {code})")
    return status.value
