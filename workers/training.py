"""The work of a training task: claim the run, launch `ernie-studio train`, follow metrics.jsonl,
checkpoints and the cancel flag, and record how it ended. Testable without Celery."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select
from sqlalchemy.orm import Session

from studio import queue
from studio.config import Settings
from studio.db import session_factory
from studio.models import Run, RunStatus
from studio.services import runs as runs_svc
from studio.services.eval_after import evaluate_after
from studio.services.models import BUILDABLE_PRESETS, build_preset
from studio.services.run_lifecycle import RunAttempt, claim_run
from workers.process import (
    MetricsTail,
    SupervisedJob,
    engine_command,
    log_line,
    spawn,
    supervise,
    tail,
)

log = logging.getLogger(__name__)

POLL_S = 0.25

# Files of the run directory the worker follows (docs/internals.md: engine/train).
METRICS_FILE = "metrics.jsonl"
NOTICES_FILE = "notices.json"
HEARTBEAT_S = 1.0
# Where `paddle.distributed.launch` writes each rank's output (workerlog.<rank>) in a run's directory.
DIST_LOGS = "dist_logs"


class NoticesFile:
    """The trainer's notices.json (config keys accepted without effect here), read again when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: float | None = None

    def read(self) -> list[dict[str, str]]:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return []
        if mtime == self.seen:
            return []
        self.seen = mtime
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # replaced while read: the next poll reads it whole
            self.seen = None
            return []
        return [n for n in data.get("notices", []) if isinstance(n, dict) and n.get("message")]


def _checkpoints(output_dir: Path) -> list[tuple[int, str]]:
    from engine.train.run_dir import list_checkpoints

    return [(int(p.name.split("-")[1]), str(p)) for p in list_checkpoints(output_dir)]


class Heartbeat(threading.Thread):
    """Beats for a claimed run every second from claim to finish, also while the base model is built."""

    def __init__(self, settings: Settings, attempt: RunAttempt) -> None:
        super().__init__(name=f"heartbeat-{attempt.run_id}", daemon=True)
        self.factory = session_factory(settings)
        self.attempt = attempt
        self.pid: int | None = None
        self.state = "ok"
        self.changed = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        with self.factory() as session:
            while not self.done.is_set():
                try:
                    state = self.beat(session)
                except Exception:  # a database blip: try again next beat
                    log.exception("heartbeat of run %s failed", self.attempt.run_id)
                    session.rollback()
                    state = self.state
                if state != self.state:
                    self.state = state
                    self.changed.set()
                self.done.wait(HEARTBEAT_S)

    def beat(self, session: Session) -> str:
        return self.attempt.heartbeat(session, pid=self.pid)


def execute_run(settings: Settings, run_id: int, worker: str) -> str | None:
    """Run one attempt of the one-node run `run_id` on this worker; returns the final status (None if not
    claimed). A run over several nodes goes through `workers.gang.execute_training`."""
    with session_factory(settings)() as session:
        attempt = claim_run(session, run_id, worker, settings.node_name)
    if attempt is None:
        # A duplicate (a re-sent message whose original turned up, a redelivery): acknowledged, no trace.
        log.debug("run %s is not queued any more; dropping this message", run_id)
        return None
    beat = Heartbeat(settings, attempt)
    beat.start()
    try:
        return _attempt(settings, attempt, beat)
    finally:
        beat.done.set()


def _attempt(settings: Settings, attempt: RunAttempt, beat: Heartbeat) -> str | None:
    """Prepare the run directory and the base model, start the trainer, follow it to its end."""
    factory = session_factory(settings)
    directory = runs_svc.run_dir(settings, attempt.run_id)
    directory.mkdir(parents=True, exist_ok=True)
    config_file = directory / "config.yaml"
    config_file.write_text(yaml.safe_dump(attempt.config, sort_keys=False))
    try:
        if attempt.base_model in BUILDABLE_PRESETS:
            build_preset(settings, attempt.base_model)
    except Exception as e:
        with factory() as session:
            attempt.finish(session, RunStatus.FAILED, error=f"could not build {attempt.base_model}: {e}")
        return RunStatus.FAILED.value

    from engine.train.run_dir import latest_checkpoint

    # The trainer resumes from this same checkpoint: it calls `latest_checkpoint` on the directory it alone
    # writes, and the previous attempt's trainer died with its worker.
    resume = latest_checkpoint(attempt.output_dir)
    if resume is not None:
        with factory() as session:
            attempt.resumed(session, str(resume))
    log_file = runs_svc.log_path(settings, attempt.run_id)
    with factory() as session:
        run_queue = session.scalar(select(Run.queue).where(Run.id == attempt.run_id)) or queue.TRAIN_QUEUE
    launch = trainer_launch(settings, attempt.run_id, run_queue, config_file)
    if isinstance(launch, str):
        with factory() as session:
            attempt.finish(session, RunStatus.FAILED, error=launch)
        return RunStatus.FAILED.value
    cmd, env, ranks = launch
    where = f", resuming from {resume.name}" if resume else ""
    on = f" on {ranks} devices (rank 0's output; every rank's in {DIST_LOGS}/)" if ranks > 1 else ""
    log_line(log_file, f"attempt {attempt.number} on {attempt.worker}{where}{on}")
    proc = spawn(cmd, log_file, cwd=directory, env=env, niceness=settings.batch_niceness)
    beat.pid = proc.pid
    log.info("run %s attempt %d: started trainer pid %d", attempt.run_id, attempt.number, proc.pid)
    with factory() as session:
        status = supervise(session, settings, proc, Training(settings, attempt, beat, log_file))
    if ranks > 1 and status != RunStatus.SUCCEEDED.value:
        _rank_tails(directory / DIST_LOGS, ranks, log_file)
    return status


def trainer_launch(
    settings: Settings, run_id: int, run_queue: str, config_file: Path
) -> tuple[list[str], dict[str, str], int] | str:
    """(command, extra environment, ranks) that train a run from its queue: `ernie-studio train` for one
    device, under `paddle.distributed.launch` for several; a message when this worker cannot run it."""
    entry = engine_command("train", str(config_file))
    visible = visible_gpus()
    if run_queue.startswith("gpu.") and visible:
        # one GPU of a worker owning several: the run was pinned to this one
        return entry, {"CUDA_VISIBLE_DEVICES": run_queue.rsplit(".", 1)[1]}, 1
    ranks = queue.devices_of(run_queue)
    if ranks == 1:
        return entry, {}, 1
    if ranks > settings.worker_devices:
        return (
            f"run {run_id} asks for {ranks} devices and this worker owns {settings.worker_devices} "
            "(ERNIE_STUDIO_WORKER_DEVICES); start workers owning as many (`ernie-studio worker --gpus ...`)"
        )
    if entry[1:3] == ["-m", "engine"]:  # the launcher runs a program or a .py file, never `-m`
        return "a multi-device run needs the ernie-studio script in the worker's environment (pip install)"
    import paddle  # only a multi-device launch needs Paddle in the worker

    from engine.train.parallel import launch_command

    devices = launcher_devices(visible, ranks, paddle.is_compiled_with_cuda())
    log_dir = str(runs_svc.run_dir(settings, run_id) / DIST_LOGS)
    return launch_command(entry, ranks, log_dir, f"run{run_id}", devices), {}, ranks


def visible_gpus() -> list[str]:
    """This worker's GPUs as CUDA_VISIBLE_DEVICES names them: indices, or UUIDs (`GPU-...`, `MIG-...`, as
    container runtimes and device plugins set them)."""
    return [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def launcher_devices(visible: list[str], ranks: int, cuda: bool) -> list[str] | None:
    """The first `ranks` GPUs this worker owns, for the launcher's `--devices`: named as CUDA_VISIBLE_DEVICES
    names them, since the launcher looks each up among those same entries (Paddle 3.3.1
    paddle/distributed/launch/context/device.py `Device.get_selected_devices`); none on a CPU build
    (`cuda` false), where the ranks talk over gloo."""
    if not cuda:
        return None
    return visible[:ranks] if visible else [str(i) for i in range(ranks)]


def _rank_tails(dist_logs: Path, ranks: int, log_file: Path) -> None:
    """The last lines of every rank's log into train.log: the launcher stops echoing rank 0 when it is
    signalled, and a failing rank's error is in its own log."""
    with open(log_file, "a", encoding="utf-8") as out:
        for rank in range(ranks):
            text = tail(dist_logs / f"workerlog.{rank}", 1500)
            if text:
                out.write(f"--- last lines of rank {rank} ({DIST_LOGS}/workerlog.{rank}) ---\n{text}")
                out.write("" if text.endswith("\n") else "\n")


class Training(SupervisedJob):
    """A one-node run under the supervisor: progress is metrics.jsonl, checkpoints and notices; the state is
    the heartbeat thread's; done is the trainer's run_summary.json; a stopping worker requeues the run."""

    def __init__(self, settings: Settings, attempt: RunAttempt, beat: Heartbeat, log_file: Path) -> None:
        self.settings, self.attempt, self.beat, self.log_file = settings, attempt, beat, log_file
        self.metrics = MetricsTail(attempt.output_dir / METRICS_FILE)
        self.notices = NoticesFile(attempt.output_dir / NOTICES_FILE)

    def __repr__(self) -> str:
        return f"run {self.attempt.run_id} attempt {self.attempt.number}"

    def collect(self, session: Session) -> None:
        self.attempt.record(session, self.metrics.read(), _checkpoints(self.attempt.output_dir))
        self.attempt.announce(session, self.notices.read())

    def state(self, session: Session) -> str:
        return self.beat.state

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        # The trainer saved a checkpoint on SIGTERM: the next worker resumes from it.
        log_line(self.log_file, "requeued: worker stopped")
        reason = f"worker {self.attempt.worker} stopped; resumes from its checkpoint"
        self.attempt.requeue(session, self.settings, reason)

    def finish(self, session: Session, code: int, cancelled: bool) -> str:
        return _finish(
            session, self.settings, self.attempt, code, cancelled, self.attempt.output_dir, self.log_file
        )

    def wait(self) -> None:
        self.beat.changed.wait(POLL_S)
        self.beat.changed.clear()


def _finish(
    session: Session,
    settings: Settings,
    attempt: RunAttempt,
    code: int,
    cancelled: bool,
    output_dir: Path,
    log_file: Path,
) -> str:
    """Record how the trainer ended, from its exit code and run_summary.json; returns the status."""
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
    attempt.finish(
        session,
        status,
        error=error,
        final_metrics=final_metrics,
        model_dir=summary.get("model_dir") if status == RunStatus.SUCCEEDED else None,
    )
    log_line(log_file, f"{status.value} (exit code {code})")
    log.info("run %s %s (exit code %s)", attempt.run_id, status.value, code)
    if status == RunStatus.SUCCEEDED:
        # "Evaluate after training": the base and the result are queued now (the reconciler does it if this
        # worker dies first).
        run = session.get(Run, attempt.run_id)
        session.refresh(run)
        evaluate_after(session, settings, run)
    return status.value
