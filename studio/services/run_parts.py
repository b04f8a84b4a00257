"""A run over several nodes (`num_nodes` > 1) in the store: each attempt reserves one part per node, the
nodes' workers claim them through their queues, and the parts start their launchers only when every part is
claimed and ready (all ranks start or none). A part that loses its rank (a kill, a dead node or worker, no
Python error) fails the attempt, which goes back to the queue and resumes from the shared checkpoint.

Every change is a conditional UPDATE, as in `run_lifecycle`: a part is claimed only while open, and only
the attempt the run is still in can be requeued or finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from studio import queue
from studio.models import Run, RunPart, RunStatus, utcnow
from studio.services import jobs
from studio.services.events import add_event
from studio.services.run_lifecycle import RunAttempt, start_attempt

OPEN, CLAIMED, READY, LAUNCHED, ENDED, FAILED, RELEASED = (
    "open", "claimed", "ready", "launched", "ended", "failed", "released",
)  # fmt: skip
# Parts a worker holds (its node's devices are taken) and parts that finished their work.
HELD = (CLAIMED, READY, LAUNCHED)
DONE = (ENDED, FAILED, RELEASED)


# paddle.distributed.launch exits with its failed rank's code, so a rank killed by SIGKILL (a kill, the OOM
# killer) or SIGTERM ends the launcher with -9 / -15, which the shell and Popen see as 247 / 241.
KILLED_CODES = frozenset({-9, -15, 247, 241, 137, 143})


def killed(exit_code: int) -> bool:
    """Whether a launcher's exit code says its rank was killed (rather than failing or aborting)."""
    return exit_code in KILLED_CODES


@dataclass(frozen=True)
class PartClaim:
    """One worker's part of an attempt: node `node_rank` of `nnodes`, with `nproc` ranks."""

    attempt: RunAttempt
    part_id: int
    node_rank: int
    nproc: int
    nnodes: int

    @property
    def ranks(self) -> list[int]:
        return list(range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc))


@dataclass
class Gang:
    """The parts of one attempt as one of them sees them."""

    parts: list[RunPart]
    master: str | None
    # Node ranks whose part lost its rank (killed, or silent past stale_after_s).
    lost: list[int] = field(default_factory=list)
    # Node ranks whose ranks ended with neither a Python error nor a kill: most often a peer's loss broke
    # their collective (gloo aborts), so they are named as lost only when nobody else is.
    stopped: list[int] = field(default_factory=list)
    # (node rank, error) of parts whose ranks failed with a Python error.
    errors: list[tuple[int, str]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return all(p.status in (READY, LAUNCHED, ENDED) for p in self.parts)

    @property
    def go(self) -> bool:
        """Node rank 0 saw every part ready and launched: the one decision that starts the attempt, so a
        part never launches while node rank 0 gives the attempt up."""
        return any(p.node_rank == 0 and p.status in (LAUNCHED, ENDED) for p in self.parts)

    @property
    def claimed(self) -> int:
        return sum(p.worker is not None for p in self.parts)


def claim_part(session: Session, run_id: int, worker: str, node: str, master: str) -> PartClaim | None:
    """Take a part of a queued or starting run over several nodes. The first worker moves the run to
    running, reserves the attempt's parts and takes node rank 0 (its launcher serves the rendezvous at
    `master`); the next take the open parts in rank order. None when there is nothing to take."""
    now = utcnow()
    n = start_attempt(session, run_id, worker, node)
    run = session.get(Run, run_id)
    if run is None:
        session.commit()
        return None
    session.refresh(run)
    nproc = queue.devices_of(run.queue)
    if n:
        # In the same transaction as the move to running: a second worker sees the parts with the run.
        for rank in range(run.num_nodes):
            mine = rank == 0
            session.add(
                RunPart(
                    run_id=run_id,
                    attempt=run.attempt,
                    node_rank=rank,
                    nproc=nproc,
                    status=CLAIMED if mine else OPEN,
                    worker=worker if mine else None,
                    node=node if mine else None,
                    master=master if mine else None,
                    claimed_at=now if mine else None,
                    heartbeat_at=now if mine else None,
                )
            )
        session.flush()
        add_event(
            session,
            "run.running",
            f"attempt {run.attempt} on {worker}: node rank 0 of {run.num_nodes}, waiting for the other nodes",
            run_id=run_id,
        )
        session.commit()
        part = _part(session, run_id, run.attempt, 0)
        return PartClaim(_attempt_of(run, worker), part.id, 0, nproc, run.num_nodes)
    session.commit()
    if run.status != RunStatus.RUNNING or run.num_nodes < 2:
        return None
    parts = _parts(session, run_id, run.attempt)
    if any(p.worker == worker for p in parts):
        return None  # a redelivered message of a part this worker already holds
    for part in parts:
        if part.status != OPEN:
            continue
        taken = jobs.take(
            session, RunPart, part.id, worker, held_in=OPEN, status=CLAIMED, node=node, claimed_at=utcnow()
        )
        session.commit()
        if taken:
            add_event(
                session,
                "run.part",
                f"attempt {run.attempt}: node rank {part.node_rank} on {worker}",
                run_id=run_id,
            )
            session.commit()
            return PartClaim(_attempt_of(run, worker), part.id, part.node_rank, nproc, run.num_nodes)
    return None


def _attempt_of(run: Run, worker: str) -> RunAttempt:
    return RunAttempt(run.id, run.attempt, worker, run.base_model, dict(run.config), Path(run.output_dir))


def _parts(session: Session, run_id: int, attempt: int) -> list[RunPart]:
    q = (
        select(RunPart)
        .where(RunPart.run_id == run_id, RunPart.attempt == attempt)
        .order_by(RunPart.node_rank)
    )
    return list(session.scalars(q.execution_options(populate_existing=True)).all())


def _part(session: Session, run_id: int, attempt: int, rank: int) -> RunPart:
    return next(p for p in _parts(session, run_id, attempt) if p.node_rank == rank)


def beat_part(session: Session, claim: PartClaim, pid: int | None = None) -> str:
    """Record the part's liveness (node rank 0 also beats the run, which the reconciler watches). Returns
    "ok", "cancel" or "lost" (the attempt is over: requeued, finished or cancelled by another part)."""
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if pid is not None:
        values["pid"] = pid
    session.execute(update(RunPart).where(RunPart.id == claim.part_id).values(**values))
    session.commit()
    if claim.node_rank == 0:
        return claim.attempt.heartbeat(session, pid=pid)
    row = session.execute(
        select(Run.status, Run.attempt, Run.cancel_requested).where(Run.id == claim.attempt.run_id)
    ).first()
    if row is None or row.status != RunStatus.RUNNING or row.attempt != claim.attempt.number:
        return "lost"
    return "cancel" if row.cancel_requested else "ok"


def set_part(session: Session, claim: PartClaim, status: str, **values: Any) -> None:
    """Move this part on (ready, launched, ended, failed); a released part stays released."""
    session.execute(
        update(RunPart)
        .where(RunPart.id == claim.part_id, RunPart.status != RELEASED)
        .values(status=status, heartbeat_at=utcnow(), **values)
    )
    session.commit()


def gang(session: Session, claim: PartClaim, stale_after_s: float) -> Gang:
    """The attempt's parts, the rendezvous, and the parts that lost or failed their ranks."""
    parts = _parts(session, claim.attempt.run_id, claim.attempt.number)
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    out = Gang(parts, next((p.master for p in parts if p.node_rank == 0), None))
    for p in parts:
        if p.status == FAILED:
            if p.error:
                out.errors.append((p.node_rank, p.error))
            elif p.exit_code is None or killed(p.exit_code):
                out.lost.append(p.node_rank)
            else:
                out.stopped.append(p.node_rank)
        elif p.status in HELD and p.heartbeat_at is not None and p.heartbeat_at < cutoff:
            out.lost.append(p.node_rank)
    return out


def placement(session: Session, run: Run) -> list[dict[str, Any]]:
    """Which node holds which ranks in the run's current (or last) attempt; [] for a one-node run."""
    if run.num_nodes < 2 or not run.attempt:
        return []
    return [
        {
            "node_rank": p.node_rank,
            "ranks": list(range(p.node_rank * p.nproc, (p.node_rank + 1) * p.nproc)),
            "node": p.node,
            "worker": p.worker,
            "status": p.status,
        }
        for p in _parts(session, run.id, run.attempt)
    ]


def placement_of(session: Session, run_id: int) -> list[dict[str, Any]]:
    """`placement` of the run with id `run_id` ([] when there is no such run)."""
    run = session.get(Run, run_id)
    return placement(session, run) if run is not None else []


def held_parts(session: Session, workers: list[str]) -> list[tuple[str, int, str, list[int]]]:
    """(worker, run id, run name, ranks) of the parts of running runs' current attempts these workers hold."""
    rows = session.execute(
        select(RunPart.worker, Run.id, Run.name, RunPart.node_rank, RunPart.nproc)
        .join(Run, Run.id == RunPart.run_id)
        .where(
            Run.status == RunStatus.RUNNING,
            RunPart.attempt == Run.attempt,
            RunPart.status.in_(HELD),
            RunPart.worker.in_(workers),
        )
    ).all()
    return [(w, rid, name, list(range(r * n, (r + 1) * n))) for w, rid, name, r, n in rows]
