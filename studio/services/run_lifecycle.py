"""A run's life on the queue and in a worker: dispatch, claim, heartbeat, metrics and checkpoints, finish,
requeue, and the runs a reconciler must look at.

Every state change is a conditional UPDATE (a run moves only from the status the change expects, so a
duplicate message or a late worker changes nothing) and every appended point an INSERT that ignores a step
already stored (a resumed attempt replays its metrics harmlessly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Table, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from studio import queue
from studio.config import Settings
from studio.models import Checkpoint, Event, Run, RunMetric, RunPart, RunStatus, utcnow
from studio.services import jobs
from studio.services.events import add_event

log = logging.getLogger(__name__)


def dispatch_run(session: Session, settings: Settings, run: Run) -> None:
    """Publish the run's task on its queue, once per node it runs on (each node's worker takes one part);
    on a broker outage it stays undispatched for the reconciler."""
    task_id = None
    for _ in range(max(run.num_nodes or 1, 1)):
        task_id = queue.send(settings, queue.RUN_TASK, [run.id], run.queue)
        if task_id is None:
            break
    if task_id is not None:
        run.task_id = task_id
        run.dispatched_at = utcnow()
        session.commit()


def withdraw_run(settings: Settings, run: Run) -> int:
    """Take a cancelled or deleted run's waiting messages off its queue, so a worker never has to take and
    drop them (thousands of dead message files slow the embedded broker down); returns how many. When none
    was waiting (a worker has it, or the broker cannot be read) the task is revoked instead."""
    removed = queue.purge_job(settings, queue.RUN_TASK, run.id, run.queue)
    if not removed and run.task_id:
        queue.revoke(settings, run.task_id)
    return removed


@dataclass(frozen=True)
class RunAttempt:
    """One worker's attempt at a run, from its claim to its end: what the worker needs to launch the
    trainer, and the state changes it makes (each applies only while the run is still running)."""

    run_id: int
    number: int
    worker: str
    base_model: str
    config: dict[str, Any]
    output_dir: Path

    @classmethod
    def of(cls, run: Run) -> RunAttempt:
        return cls(
            run.id, run.attempt, run.worker or "", run.base_model, dict(run.config), Path(run.output_dir)
        )

    def heartbeat(self, session: Session, pid: int | None = None) -> str:
        """Record liveness. Returns "ok", "cancel" (a cancel was requested) or "lost" (the run is no longer
        running here: the reconciler gave it to another worker)."""
        values: dict[str, Any] = {"heartbeat_at": utcnow()}
        if pid is not None:
            values["pid"] = pid
        n = session.execute(
            update(Run).where(Run.id == self.run_id, Run.status == RunStatus.RUNNING).values(**values)
        ).rowcount
        session.commit()
        if not n:
            return "lost"
        cancel = session.scalar(select(Run.cancel_requested).where(Run.id == self.run_id))
        return "cancel" if cancel else "ok"

    def record(
        self, session: Session, points: list[dict[str, Any]], checkpoints: list[tuple[int, str]]
    ) -> None:
        """Store new metrics.jsonl points and checkpoints (steps already stored are skipped)."""
        record_metrics(session, self.run_id, points)
        record_checkpoints(session, self.run_id, checkpoints)

    def finish(
        self,
        session: Session,
        status: RunStatus,
        *,
        error: str | None = None,
        final_metrics: dict[str, Any] | None = None,
        model_dir: str | None = None,
    ) -> None:
        """Move the run to a terminal status (only from running in this attempt: a requeued run is left
        alone)."""
        now = utcnow()
        values: dict[str, Any] = {
            "status": status,
            "ended_at": now,
            "heartbeat_at": now,
            "pid": None,
            "error": error,
        }
        if final_metrics is not None:
            values["final_metrics"] = final_metrics
        if model_dir is not None:
            values["model_dir"] = model_dir
        n = session.execute(
            update(Run)
            .where(Run.id == self.run_id, Run.status == RunStatus.RUNNING, Run.attempt == self.number)
            .values(**values)
        ).rowcount
        if n:
            add_event(session, f"run.{status.value}", error or status.value, run_id=self.run_id)
        session.commit()

    def announce(self, session: Session, notices: list[dict[str, str]]) -> int:
        """Record the trainer's notices (config keys accepted without effect) as `run.notice` events, each
        once per run however often the worker reads them or the run is resumed; returns how many are new."""
        if not notices:
            return 0
        known = set(
            session.scalars(
                select(Event.message).where(Event.run_id == self.run_id, Event.kind == "run.notice")
            )
        )
        new = [n for n in notices if n["message"] not in known]
        for n in new:
            add_event(session, "run.notice", n["message"], run_id=self.run_id, data={"key": n.get("key")})
            known.add(n["message"])
        session.commit()
        return len(new)

    def resumed(self, session: Session, checkpoint: str) -> None:
        """Record the checkpoint this attempt resumed from (the trainer's `resume` event)."""
        session.execute(
            update(Run)
            .where(Run.id == self.run_id, Run.status == RunStatus.RUNNING)
            .values(resume_from=checkpoint)
        )
        session.commit()

    def requeue(self, session: Session, settings: Settings, reason: str) -> bool:
        """Give the run back to the queue (this worker is stopping); it resumes from its checkpoint."""
        return requeue_run(session, settings, self.run_id, reason, only_if=(Run.attempt == self.number,))


def start_attempt(session: Session, run_id: int, worker: str, node: str) -> bool:
    """The atomic step of every claim: a queued, uncancelled run becomes running for `worker` with a new
    attempt; False when it is not queued (a duplicate message, another worker first)."""
    now = utcnow()
    return jobs.take(
        session, Run, run_id, worker, only_if=(Run.cancel_requested.is_(False),), node=node,
        attempt=Run.attempt + 1, started_at=func.coalesce(Run.started_at, now), heartbeat_at=now, pid=None,
    )  # fmt: skip


def claim_run(session: Session, run_id: int, worker: str, node: str) -> RunAttempt | None:
    """Atomically move a queued run to running for `worker`; None if it is not queued (duplicate message)."""
    n = start_attempt(session, run_id, worker, node)
    session.commit()
    if not n:
        return None
    run = session.get(Run, run_id)
    session.refresh(run)
    add_event(session, "run.running", f"attempt {run.attempt} on {worker}", run_id=run_id)
    session.commit()
    return RunAttempt.of(run)


def _insert_ignore(session: Session, table: Table, rows: list[dict[str, Any]], keys: list[str]) -> int:
    if not rows:
        return 0
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stmt = insert(table).values(rows).on_conflict_do_nothing(index_elements=keys).returning(table.c.id)
    # RETURNING counts the rows really inserted (rowcount is -1 for multi-row inserts on psycopg).
    return len(session.execute(stmt).all())


def record_metrics(session: Session, run_id: int, points: list[dict[str, Any]]) -> int:
    """Append metrics.jsonl points; a step already stored is skipped, so replays never duplicate."""
    rows = [
        {
            "run_id": run_id,
            "step": p["step"],
            "loss": _float(p.get("loss")),
            "learning_rate": _float(p.get("learning_rate")),
            "values": p,
            "recorded_at": utcnow(),
        }
        for p in points
        if isinstance(p.get("step"), int)
    ]
    n = _insert_ignore(session, RunMetric.__table__, rows, ["run_id", "step"])
    session.commit()
    return n


def record_checkpoints(session: Session, run_id: int, checkpoints: list[tuple[int, str]]) -> int:
    """Append (step, path) checkpoints; a step already stored is skipped."""
    rows = [{"run_id": run_id, "step": s, "path": p, "created_at": utcnow()} for s, p in checkpoints]
    n = _insert_ignore(session, Checkpoint.__table__, rows, ["run_id", "step"])
    session.commit()
    return n


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def requeue_run(
    session: Session,
    settings: Settings,
    run_id: int,
    reason: str,
    *,
    attempt: int | None = None,
    only_if: tuple[Any, ...] = (),
    data: dict[str, Any] | None = None,
) -> bool:
    """Put a running run back to queued (its worker died or is stopping, or a node of a run over several
    lost its rank: then only while it is in `attempt` and not being cancelled) and publish it again; it
    resumes from its newest checkpoint. False when the run was not running (in that attempt, or meeting
    `only_if`: the claim a reconciler found dead, checked again as `jobs.requeue` does). `data` goes on the
    `run.requeued` event (`lost_streak` reads a lost rank's)."""
    where = [Run.id == run_id, Run.status == RunStatus.RUNNING, *only_if]
    if attempt is not None:
        where += [Run.attempt == attempt, Run.cancel_requested.is_(False)]
    n = session.execute(
        update(Run)
        .where(*where)
        .values(status=RunStatus.QUEUED, pid=None, worker=None, queued_at=utcnow(), dispatched_at=None)
    ).rowcount
    if n:
        add_event(session, "run.requeued", reason, run_id=run_id, data=data)
    session.commit()
    if not n:
        return False
    run = session.get(Run, run_id)
    session.refresh(run)
    if run.num_nodes > 1:
        # The attempt's parts free their nodes, and the messages of parts nobody took are withdrawn: the
        # new attempt is published once per node again.
        session.execute(
            update(RunPart)
            .where(
                RunPart.run_id == run_id,
                RunPart.attempt == run.attempt,
                RunPart.status.in_(["open", "claimed", "ready", "launched"]),
            )
            .values(status="released")
        )
        session.commit()
        queue.purge_job(settings, queue.RUN_TASK, run.id, run.queue)
    dispatch_run(session, settings, run)
    return True


def orphaned_runs(
    session: Session, worker: str | None, stale_after_s: float, worker_started: datetime | None = None
) -> list[Run]:
    """Runs marked running that have not heartbeated for a while, or (at start-up) that `worker`, a
    restarted worker of the same name, was running when it died: last heartbeated before this one started
    (`worker_started`). A run this worker claimed since (its doctor may pass, and its queue open, before
    this pass reads) is its own work, not a leftover."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    lost = Run.heartbeat_at < cutoff
    if worker is not None:
        mine = Run.worker == worker
        if worker_started is not None:
            mine = mine & (Run.heartbeat_at < worker_started)
        lost = lost | mine
    return list(session.scalars(select(Run).where(Run.status == RunStatus.RUNNING, lost)).all())


def redispatch_run(session: Session, settings: Settings, run: Run) -> bool:
    """Send a queued run's message again because the broker lost it (a Redis restarted without its data, a
    worker killed between taking the message and claiming the run). The run's dispatch time moves first,
    conditionally, so of several reconcilers seeing the same loss only one sends; False when another did
    (or the run left the queue). A message that turns out to be a duplicate claims nothing."""
    seen = run.dispatched_at
    n = session.execute(
        update(Run)
        .where(Run.id == run.id, Run.status == RunStatus.QUEUED, Run.dispatched_at == seen)
        .values(dispatched_at=utcnow())
    ).rowcount
    session.commit()
    if not n:
        return False
    task_id = queue.send(settings, queue.RUN_TASK, [run.id], run.queue)
    # On a broker outage the run becomes undispatched, and `undispatched_runs` picks it up.
    values = {"task_id": task_id} if task_id is not None else {"dispatched_at": None}
    session.execute(update(Run).where(Run.id == run.id).values(**values))
    session.commit()
    return task_id is not None


def dispatched_runs(session: Session, dispatched_before: datetime) -> list[Run]:
    """Queued runs whose message was sent before `dispatched_before`: the ones whose message the reconciler
    checks the broker for."""
    return list(
        session.scalars(
            select(Run)
            .where(Run.status == RunStatus.QUEUED, Run.dispatched_at < dispatched_before)
            .order_by(Run.id)
        ).all()
    )


def undispatched_runs(session: Session, older_than: datetime | None = None) -> list[Run]:
    """Queued runs whose message never reached the broker (or was lost with it)."""
    q = select(Run).where(Run.status == RunStatus.QUEUED, Run.dispatched_at.is_(None)).order_by(Run.id)
    if older_than is not None:
        q = q.where(Run.queued_at < older_than)
    return list(session.scalars(q).all())


def lost_streak(session: Session, run_id: int, checkpoint: str | None) -> int:
    """How many of the run's latest requeues, one after the other, were for lost ranks while `checkpoint`
    (a name, or None before the first) was already the newest: attempts that lost a rank and saved nothing.
    A requeue for another reason, a new checkpoint, or a person's resume (`run.resumed`) ends the streak."""
    events = session.scalars(
        select(Event.data)
        .where(Event.run_id == run_id, Event.kind.in_(("run.requeued", "run.resumed")))
        .order_by(Event.id.desc())
    )
    n = 0
    for data in events:
        if not data or "lost" not in data or data.get("checkpoint") != checkpoint:
            break
        n += 1
    return n
