"""Keeping the queue and the store in agreement: runs whose worker died go back to `queued` (they resume
from their newest checkpoint), runs the broker never received or lost are sent again, deployments of a
dead worker are marked stopped, finished work whose follow-up a dead worker never started (evaluate after
training, deploy an export once it succeeded) gets it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.serve.fastdeploy import PIDS_FILE
from engine.serve.process_records import kill_recorded
from studio import queue
from studio.config import Settings
from studio.db import session_factory
from studio.models import Deployment, DeploymentStatus, Run, utcnow
from studio.services import eval_after
from studio.services import exports as exports_svc
from studio.services import jobs as jobs_svc
from studio.services import runs as runs_svc
from studio.services.events import add_event
from studio.services.run_lifecycle import (
    dispatch_run,
    dispatched_runs,
    orphaned_runs,
    redispatch_run,
    requeue_run,
    undispatched_runs,
)
from workers.process import kill_stale_group

log = logging.getLogger(__name__)


def reconcile(
    settings: Settings,
    worker: str | None,
    lost: LostMessages | None = None,
    worker_started: datetime | None = None,
) -> dict[str, int]:
    """One pass. `worker` is this worker's name at start-up (its own leftovers are orphans for sure, those
    of its jobs claimed before `worker_started`); None for the periodic pass, which only trusts stale
    heartbeats. `lost` remembers, from one pass to the next, which messages the broker was missing (a fresh
    one resends nothing in its first pass)."""
    with session_factory(settings)() as session:
        requeued = requeue_orphaned_runs(session, settings, worker, worker_started)
        dispatched = dispatch_lost_runs(session, settings)
        stopped = stop_orphaned_deployments(session, settings, worker)
        for kind in jobs_svc.KINDS:  # exports, downloads, evaluations
            jobs_svc.reconcile(session, settings, kind, worker, worker_started)
        eval_after.evaluate_finished_runs(session, settings)
        exports_svc.deploy_finished_exports(session, settings)
        resent = (lost or LostMessages()).resend(session, settings)
        session.commit()
    return {"requeued": requeued, "dispatched": dispatched, "deployments_stopped": stopped, "resent": resent}


def requeue_orphaned_runs(
    session: Session, settings: Settings, worker: str | None, worker_started: datetime | None = None
) -> int:
    """Runs of dead workers go back to the queue (their leftover trainer on this node is killed first)."""
    requeued = 0
    for run in orphaned_runs(session, worker, settings.stale_after_s, worker_started):
        if run.node == settings.node_name:
            kill_stale_group(run.pid, str(runs_svc.run_dir(settings, run.id)))
        reason = f"worker {run.worker} is gone; resuming from the newest checkpoint"
        # The attempt found dead, not one a worker claimed since another reconciler requeued it.
        if requeue_run(session, settings, run.id, reason, only_if=(Run.attempt == run.attempt,)):
            requeued += 1
            log.warning("run %s: %s", run.id, reason)
    return requeued


def dispatch_lost_runs(session: Session, settings: Settings) -> int:
    """Queued runs the broker never got are sent again; returns how many reached it."""
    dispatched = 0
    # Give the API a moment to publish what it just created before treating it as lost.
    for run in undispatched_runs(session, older_than=utcnow() - timedelta(seconds=2)):
        dispatch_run(session, settings, run)
        if run.dispatched_at is not None:
            dispatched += 1
    return dispatched


def stop_orphaned_deployments(session: Session, settings: Settings, worker: str | None) -> int:
    """Deployments whose worker stopped heartbeating (or, at start-up, was this worker) are marked stopped."""
    cutoff = utcnow() - timedelta(seconds=settings.stale_after_s)
    active = [DeploymentStatus.RUNNING, DeploymentStatus.STARTING, DeploymentStatus.STOPPING]
    lost = Deployment.heartbeat_at < cutoff
    if worker is not None:
        lost = lost | (Deployment.worker == worker)
    deps = session.scalars(
        select(Deployment).where(
            Deployment.status.in_([s.value for s in active]), Deployment.worker.is_not(None), lost
        )
    ).all()
    for dep in deps:
        if dep.node == settings.node_name:
            kill_stale_group(dep.pid, "serve")
            # FastDeploy's api_server and its setsid workers are outside that group: end every one recorded
            kill_recorded(settings.deployments_dir / str(dep.id) / "fastdeploy" / PIDS_FILE)
        session.execute(
            update(Deployment)
            .where(Deployment.id == dep.id)
            .values(
                status=DeploymentStatus.STOPPED, pid=None, stopped_at=utcnow(), error="its worker stopped"
            )
        )
        add_event(session, "deployment.stopped", "its worker stopped; deploy again", deployment_id=dep.id)
    # Committed here: a later step of the pass that loses a race rolls back, and must not undo this.
    session.commit()
    return len(deps)


class LostMessages:
    """Sends again the jobs (queued runs, queued exports, downloads and evaluations, deployments no serving worker has taken) whose
    message the broker no longer holds, e.g. after Redis restarted without its data or a worker was killed
    between taking a message and claiming its job.

    The broker is asked (`studio.queue.held_jobs`): a job is held while its message waits on its queue
    (Redis lists, the embedded transport's message files) or was handed to a worker less than
    STALE_AFTER_S ago and is not yet acknowledged (Redis' `unacked` hash, which is how a Redis worker's
    prefetched message stays visible; the embedded transport keeps no such record, but a worker that takes
    a message claims its job at once, since prefetch is one task per free slot). A job is only suspected
    when it was dispatched more than STALE_AFTER_S ago and is missing from the broker, and only resent when
    it is still missing in the next pass, so a message moving from a queue to a worker in between is never
    mistaken for a lost one. Runs waiting behind a long run keep their message on the queue and are left
    alone; an unreadable broker (down, or a transport other than Redis and the filesystem) resends nothing.
    A resend that duplicates a message after all is harmless: the worker's claim is a conditional update.
    """

    def __init__(self) -> None:
        self.suspects: set[queue.Job] = set()

    def resend(self, session: Session, settings: Settings) -> int:
        """One look at the broker; returns how many jobs were sent again."""
        grace = settings.stale_after_s
        jobs = waiting_jobs(session, settings, utcnow() - timedelta(seconds=grace))
        held = queue.held_jobs(settings, {q for q, _ in jobs.values()}, grace) if jobs else None
        if held is None:
            self.suspects = set()
            return 0
        missing = set(jobs) - held
        confirmed, self.suspects = missing & self.suspects, missing - self.suspects
        resent = 0
        for job in sorted(confirmed):
            if jobs[job][1]():
                resent += 1
                log.warning("%s %s: its message is no longer in the broker; sent it again", *job)
        return resent


def waiting_jobs(
    session: Session, settings: Settings, dispatched_before: datetime
) -> dict[queue.Job, tuple[str, Callable[[], bool]]]:
    """{job: (its queue, how to send it again)} for every job dispatched before `dispatched_before` that no
    worker has claimed yet."""
    jobs: dict[queue.Job, tuple[str, Callable[[], bool]]] = {}
    for run in dispatched_runs(session, dispatched_before):
        jobs[(queue.RUN_TASK, run.id)] = (run.queue, partial(redispatch_run, session, settings, run))
    for kind in jobs_svc.KINDS:
        for job in jobs_svc.waiting(session, kind, dispatched_before):
            jobs[(kind.task, job.id)] = (
                kind.queue,
                partial(jobs_svc.redispatch, session, settings, kind, job),
            )
    for dep in session.scalars(
        select(Deployment).where(
            Deployment.status == DeploymentStatus.STARTING,
            Deployment.worker.is_(None),
            Deployment.stop_requested.is_(False),
            Deployment.created_at < dispatched_before,
        )
    ).all():
        resend = partial(_send_deployment, settings, dep.id)
        jobs[(queue.DEPLOYMENT_TASK, dep.id)] = (queue.SERVE_QUEUE, resend)
    return jobs


def _send_deployment(settings: Settings, deployment_id: int) -> bool:
    # A deployment records no dispatch time; the broker holding the new message keeps it from being resent.
    return queue.send(settings, queue.DEPLOYMENT_TASK, [deployment_id], queue.SERVE_QUEUE) is not None


class Reconciler(threading.Thread):
    """Runs `reconcile` at start-up and then every `reconcile_interval_s` in the worker process."""

    def __init__(self, settings: Settings, worker: str, started: datetime | None = None) -> None:
        super().__init__(name="ernie-reconciler", daemon=True)
        self.settings = settings
        self.worker = worker
        self.started = started or utcnow()  # when the worker started (before its consumer took anything)
        self.stopped = threading.Event()
        self.lost = LostMessages()

    def run(self) -> None:
        first = True
        while not self.stopped.is_set():
            try:
                result = reconcile(self.settings, self.worker if first else None, self.lost, self.started)
                if any(result.values()):
                    log.info("reconciled: %s", result)
                first = False
            except Exception:  # the database may be briefly unreachable; try again next round
                log.exception("reconcile pass failed")
            self.stopped.wait(self.settings.reconcile_interval_s)
