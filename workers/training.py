"""The work of a training task: claim the run, launch `ernie-studio train`, follow metrics.jsonl,
checkpoints and the cancel flag, and record how it ended. Testable without Celery."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from studio.config import Settings
from studio.db import session_factory
from studio.models import RunStatus
from studio.services import runs as runs_svc
from studio.services.models import BUILDABLE_PRESETS, build_preset
from workers.process import engine_command, spawn, stop_group, tail

log = logging.getLogger(__name__)

POLL_S = 0.25
HEARTBEAT_S = 1.0
# Set when the Celery worker begins a warm shutdown (workers.tasks connects it).
SHUTTING_DOWN = threading.Event()


class MetricsTail:
    """Reads complete new lines of metrics.jsonl from a byte offset (a partly written line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # the trainer rewrote the file on resume (dropping a torn line)
            self.offset = 0
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        points = []
        for line in data[: end + 1].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                points.append(row)
        return points


def _checkpoints(output_dir: Path) -> list[tuple[int, str]]:
    from engine.train.run_dir import list_checkpoints

    return [(int(p.name.split("-")[1]), str(p)) for p in list_checkpoints(output_dir)]


class Heartbeat(threading.Thread):
    """Beats for a claimed run every second from claim to finish, also while the base model is built."""

    def __init__(self, settings: Settings, run_id: int) -> None:
        super().__init__(name=f"heartbeat-{run_id}", daemon=True)
        self.factory = session_factory(settings)
        self.run_id = run_id
        self.pid: int | None = None
        self.state = "ok"
        self.changed = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        with self.factory() as session:
            while not self.done.is_set():
                try:
                    state = runs_svc.heartbeat(session, self.run_id, pid=self.pid)
                except Exception:  # a database blip: try again next beat
                    log.exception("heartbeat of run %s failed", self.run_id)
                    session.rollback()
                    state = self.state
                if state != self.state:
                    self.state = state
                    self.changed.set()
                self.done.wait(HEARTBEAT_S)


def execute_run(settings: Settings, run_id: int, worker: str) -> str | None:
    """Run one attempt of `run_id` on this worker; returns the final status (None if not claimed)."""
    factory = session_factory(settings)
    with factory() as session:
        run = runs_svc.claim_run(session, run_id, worker, settings.node_name)
        if run is None:
            log.info("run %s is not queued any more; skipping this message", run_id)
            return None
        attempt, config, base_model = run.attempt, dict(run.config), run.base_model
        output_dir = Path(run.output_dir)
        log_file = runs_svc.log_path(settings, run)
    beat = Heartbeat(settings, run_id)
    beat.start()
    try:
        return _attempt(settings, run_id, worker, attempt, config, base_model, output_dir, log_file, beat)
    finally:
        beat.done.set()


def _attempt(settings, run_id, worker, attempt, config, base_model, output_dir: Path, log_file: Path, beat):
    factory = session_factory(settings)
    directory = runs_svc.run_dir(settings, run_id)
    directory.mkdir(parents=True, exist_ok=True)
    config_file = directory / "config.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        if base_model in BUILDABLE_PRESETS:
            build_preset(settings, base_model)
    except Exception as e:
        with factory() as session:
            runs_svc.finish_run(session, run_id, RunStatus.FAILED, error=f"could not build {base_model}: {e}")
        return RunStatus.FAILED.value

    from engine.train.run_dir import latest_checkpoint

    resume = latest_checkpoint(output_dir)
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    with open(log_file, "a", encoding="utf-8") as f:
        where = f", resuming from {resume.name}" if resume else ""
        f.write(f"=== {stamp} attempt {attempt} on {worker}{where} ===\n")
    proc = spawn(engine_command("train", str(config_file)), log_file, cwd=directory)
    beat.pid = proc.pid
    log.info("run %s attempt %d: started trainer pid %d", run_id, attempt, proc.pid)

    metrics = MetricsTail(output_dir / "metrics.jsonl")
    cancelled = False
    with factory() as session:
        while True:
            code = proc.poll()
            runs_svc.record_metrics(session, run_id, metrics.read())
            runs_svc.record_checkpoints(session, run_id, _checkpoints(output_dir))
            if code is not None:
                break
            if beat.state == "lost":
                # The reconciler gave the run to another worker: two trainers must never share a directory.
                log.warning("run %s was requeued elsewhere; stopping this attempt", run_id)
                stop_group(proc, settings.kill_grace_s)
                return None
            if SHUTTING_DOWN.is_set() and not cancelled:
                # A graceful worker stop (deploying a new version, scaling down): the trainer saves a
                # checkpoint on SIGTERM and the run goes back to the queue for the next worker.
                log.info("run %s: worker shutting down, checkpointing and requeueing", run_id)
                stop_group(proc, settings.kill_grace_s)
                runs_svc.record_metrics(session, run_id, metrics.read())
                runs_svc.record_checkpoints(session, run_id, _checkpoints(output_dir))
                with open(log_file, "a", encoding="utf-8") as f:
                    f.write(
                        f"=== {datetime.now(UTC).isoformat(timespec='seconds')} requeued: worker stopped ===\n"
                    )
                if runs_svc.requeue_run(
                    session, run_id, f"worker {worker} stopped; resumes from its checkpoint"
                ):
                    run = runs_svc.get_run(session, run_id)
                    runs_svc.dispatch_run(session, settings, run)
                return None
            if beat.state == "cancel" and not cancelled:
                cancelled = True
                log.info("run %s: cancel requested, stopping process group %d", run_id, proc.pid)
                code = stop_group(proc, settings.kill_grace_s)
                continue
            beat.changed.wait(POLL_S)
            beat.changed.clear()
        return _finish(session, settings, run_id, code, cancelled, output_dir, log_file)


def _finish(
    session, settings: Settings, run_id: int, code: int, cancelled: bool, output_dir: Path, log_file: Path
):
    summary: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((output_dir / "run_summary.json").read_text())
    final_metrics = summary.get("final_metrics") or None
    if code == 0 and summary.get("status") == "succeeded":
        # Checked first: a cancel that arrives after the trainer's last step must not hide a finished run.
        status, error = RunStatus.SUCCEEDED, None
    elif cancelled:
        status, error = RunStatus.CANCELLED, None
    else:
        status = RunStatus.FAILED
        error = (
            summary.get("error")
            or f"the trainer exited with code {code}; last output:\n{tail(log_file, 2000)}"
        )
    runs_svc.finish_run(
        session,
        run_id,
        status,
        error=error,
        final_metrics=final_metrics,
        model_dir=summary.get("model_dir") if status == RunStatus.SUCCEEDED else None,
    )
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(
            f"=== {datetime.now(UTC).isoformat(timespec='seconds')} {status.value} (exit code {code}) ===\n"
        )
    log.info("run %s %s (exit code %s)", run_id, status.value, code)
    return status.value
