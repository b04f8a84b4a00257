"""The life of a worker job other than a training run (exports, model downloads, evaluations): dispatch,
claim, heartbeat, finish, and what the reconciler does with a job whose worker died or whose message the
broker lost. One copy for every kind; each kind is a `JobKind` naming its table, task, queue and what a
worker's death means for it.

As for runs (`studio.services.run_lifecycle`), every state change is a conditional UPDATE: a job moves only
from the status the change expects, so a duplicate message, a late worker or two reconcilers racing change
nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from studio import queue
from studio.config import Settings
from studio.models import Evaluation, Export, MediaFetch, ModelDownload, RunStatus, Sweep, utcnow
from studio.services.events import add_event


@dataclass(frozen=True)
class JobKind:
    model: type  # a table with id, status, worker, dispatched_at, started_at, ended_at, heartbeat_at, error
    task: str
    queue: str
    name: str  # event kinds are "<name>.<status>", event data carries "<name>_id"
    # At a worker's start, its own jobs left running: "fail" (done again by hand) or "requeue" (the next
    # attempt continues: a download keeps its verified files, an eval its scored samples).
    when_worker_died: str

    def event(self, session: Session, job: Any, status: str, message: str) -> None:
        add_event(
            session,
            f"{self.name}.{status}",
            message,
            run_id=getattr(job, "run_id", None),
            data={f"{self.name}_id": job.id},
        )


# Exports and downloads go to the serving workers (they never wait behind a training run); evaluations load
# a model and generate like training does, so the training workers take them.
EXPORTS = JobKind(Export, queue.EXPORT_TASK, queue.EXPORT_QUEUE, "export", "fail")
DOWNLOADS = JobKind(ModelDownload, queue.DOWNLOAD_TASK, queue.EXPORT_QUEUE, "download", "requeue")
EVALS = JobKind(Evaluation, queue.EVAL_TASK, queue.TRAIN_QUEUE, "eval", "requeue")
# Fetching a dataset's images named by URL: network work like a download (a requeued fetch keeps its copies).
MEDIA = JobKind(MediaFetch, queue.MEDIA_TASK, queue.EXPORT_QUEUE, "media", "requeue")
# A sweep's driver asks Optuna for trials and reads their evaluations; it only waits, so it takes a serving
# worker's spare thread (never a training slot its own trials need). A requeued driver continues: every step
# of a sweep is idempotent (studio.services.sweeps.advance).
SWEEPS = JobKind(Sweep, queue.SWEEP_TASK, queue.EXPORT_QUEUE, "sweep", "requeue")
KINDS = (EXPORTS, DOWNLOADS, EVALS, MEDIA, SWEEPS)


def dispatch(session: Session, settings: Settings, kind: JobKind, job: Any) -> None:
    """Publish the job; on a broker outage it stays undispatched and the reconciler sends it."""
    if queue.send(settings, kind.task, [job.id], kind.queue) is not None:
        job.dispatched_at = utcnow()
        session.commit()


def claim(session: Session, kind: JobKind, job_id: int, worker: str, **values: Any) -> Any | None:
    """Atomically move a queued job to running for `worker`; None when it is not queued (a duplicate)."""
    n = take(session, kind.model, job_id, worker, **{"started_at": utcnow(), **values})
    session.commit()
    return session.get(kind.model, job_id) if n else None


def take(
    session: Session,
    model: type,
    job_id: int,
    worker: str,
    *,
    held_in: Any = RunStatus.QUEUED,
    only_if: tuple[Any, ...] = (),
    **values: Any,
) -> bool:
    """The one conditional UPDATE behind every claim (jobs, runs, deployments): the row `job_id` of `model`
    still in status `held_in` (and meeting `only_if`: not cancelled, no worker yet) becomes
    running for `worker` (status, worker, heartbeat); `values` add to or replace those columns. Not committed (a run's claim adds
    its parts in the same transaction); False when another message or worker took it first."""
    claimed = {"status": RunStatus.RUNNING, "worker": worker, "heartbeat_at": utcnow(), **values}
    n = session.execute(
        update(model).where(model.id == job_id, model.status == held_in, *only_if).values(**claimed)
    ).rowcount
    return bool(n)


def heartbeat(session: Session, kind: JobKind, job_id: int, worker: str | None = None, **values: Any) -> bool:
    """Record liveness (and progress `values`); False when the job is no longer running (for `worker`)."""
    m = kind.model
    where = [m.id == job_id, m.status == RunStatus.RUNNING]
    if worker is not None:
        where.append(m.worker == worker)
    n = session.execute(update(m).where(*where).values(heartbeat_at=utcnow(), **values)).rowcount
    session.commit()
    return bool(n)


def finish(
    session: Session,
    kind: JobKind,
    job_id: int,
    status: RunStatus,
    message: str,
    *,
    only_if: tuple[Any, ...] = (),
    **values: Any,
) -> bool:
    """Move a running job (meeting `only_if`) to a terminal status with an event; False (nothing changed)
    when it was not running any more."""
    m = kind.model
    n = session.execute(
        update(m)
        .where(m.id == job_id, m.status == RunStatus.RUNNING, *only_if)
        .values(status=status, ended_at=utcnow(), **values)
    ).rowcount
    if n:
        kind.event(session, session.get(m, job_id), status.value, message)
    session.commit()
    return bool(n)


def requeue(
    session: Session,
    settings: Settings,
    kind: JobKind,
    job_id: int,
    reason: str,
    *,
    only_if: tuple[Any, ...] = (),
) -> bool:
    """A running job goes back to the queue (its worker died or is stopping) and is published again.

    `only_if` names the claim the caller found dead (a stale heartbeat, a worker's claim from before its
    restart). The UPDATE checks it again, so a job requeued by another reconciler and claimed afresh since
    the caller looked is left to its new driver: a second requeue there would start a second driver beside
    the first (a sweep of 3 trials asked for 4)."""
    m = kind.model
    n = session.execute(
        update(m)
        .where(m.id == job_id, m.status == RunStatus.RUNNING, *only_if)
        .values(status=RunStatus.QUEUED, worker=None, dispatched_at=None)
    ).rowcount
    session.commit()
    if not n:
        return False
    job = session.get(m, job_id)
    kind.event(session, job, "requeued", reason)
    session.commit()
    dispatch(session, settings, kind, job)
    return True


def requeue_stale(session: Session, settings: Settings, kind: JobKind, stale_after_s: float) -> int:
    """Jobs whose worker stopped heartbeating go back to the queue."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    m = kind.model
    is_stale = m.heartbeat_at < cutoff
    stale = session.scalars(select(m.id).where(m.status == RunStatus.RUNNING, is_stale)).all()
    return sum(requeue(session, settings, kind, i, "its worker is gone", only_if=(is_stale,)) for i in stale)


def recover_worker(
    session: Session, settings: Settings, kind: JobKind, worker: str, started_before: datetime | None = None
) -> int:
    """At a worker's start: the jobs it was running when it died are failed or requeued, as the kind says.
    ``started_before`` is when this worker started: a job it claimed since (its queue is consumed from the
    start, and this very pass may have requeued the job) is its own work, not a leftover."""
    m = kind.model
    mine = (m.worker == worker,)
    if started_before is not None:
        mine += (m.started_at < started_before,)
    ids = session.scalars(select(m.id).where(m.status == RunStatus.RUNNING, *mine)).all()
    return sum(release(session, settings, kind, i, f"worker {worker} restarted", only_if=mine) for i in ids)


def release(
    session: Session,
    settings: Settings,
    kind: JobKind,
    job_id: int,
    reason: str,
    *,
    worker: str | None = None,
    only_if: tuple[Any, ...] = (),
) -> bool:
    """A running job whose worker stopped (gracefully, or died and restarted) is requeued or failed, as the
    kind says; False when it was not running any more (or no longer meets `only_if`, as `requeue` says).
    A stopping worker names itself: a job the reconciler has given to another worker is not its to release."""
    if worker is not None:
        only_if += (kind.model.worker == worker,)
    if kind.when_worker_died == "requeue":
        return requeue(session, settings, kind, job_id, reason, only_if=only_if)
    message = f"its worker stopped; {kind.name} again"
    return finish(session, kind, job_id, RunStatus.FAILED, message, only_if=only_if, error=message)


def dispatch_undispatched(session: Session, settings: Settings, kind: JobKind) -> int:
    """Queued jobs the broker never got are sent; returns how many reached it."""
    m = kind.model
    sent = 0
    for job in session.scalars(
        select(m).where(m.status == RunStatus.QUEUED, m.dispatched_at.is_(None))
    ).all():
        dispatch(session, settings, kind, job)
        sent += job.dispatched_at is not None
    return sent


def waiting(session: Session, kind: JobKind, dispatched_before: datetime) -> list[Any]:
    """Queued jobs whose message went out before `dispatched_before` (the reconciler asks the broker for them)."""
    m = kind.model
    return list(
        session.scalars(
            select(m).where(m.status == RunStatus.QUEUED, m.dispatched_at < dispatched_before).order_by(m.id)
        ).all()
    )


def redispatch(session: Session, settings: Settings, kind: JobKind, job: Any) -> bool:
    """Send a queued job's message again because the broker lost it; like `run_lifecycle.redispatch_run`,
    only the reconciler that moves its dispatch time sends it."""
    m = kind.model
    n = session.execute(
        update(m)
        .where(m.id == job.id, m.status == RunStatus.QUEUED, m.dispatched_at == job.dispatched_at)
        .values(dispatched_at=utcnow())
    ).rowcount
    session.commit()
    if not n:
        return False
    if queue.send(settings, kind.task, [job.id], kind.queue) is not None:
        return True
    session.execute(update(m).where(m.id == job.id).values(dispatched_at=None))
    session.commit()
    return False


def reconcile(
    session: Session,
    settings: Settings,
    kind: JobKind,
    worker: str | None,
    worker_started: datetime | None = None,
) -> None:
    """One reconciler pass over a kind: stale jobs requeued, (at start-up) this worker's own leftovers
    (claimed before ``worker_started``) failed or requeued, undelivered jobs sent."""
    requeue_stale(session, settings, kind, settings.stale_after_s)
    if worker is not None:
        recover_worker(session, settings, kind, worker, worker_started)
    dispatch_undispatched(session, settings, kind)
