"""The node registry: each worker registers at start, records its start-up doctor, and heartbeats; readers
see every worker with what it holds and whether it is ready, failed its self-test, or offline."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.doctor.report import failure_reason
from studio import queue
from studio.config import Settings
from studio.models import Deployment, Node, NodeStatus, Run, RunStatus, utcnow
from studio.services.deployments import ACTIVE as ACTIVE_DEPLOYMENTS
from studio.services.errors import NotFound
from studio.services.run_parts import held_parts

OFFLINE = "offline"


@dataclass
class NodeView:
    """A worker as readers see it: `state` is ready | checking | failed | offline."""

    name: str
    node: str
    hostname: str
    state: str
    queues: list[str]
    # The queues it consumes now: work queues only once its doctor passed.
    accepting: list[str]
    devices: list[dict[str, Any]]
    memory_bytes: int | None
    cpu_count: int | None
    busy: bool
    # What it holds: {"kind": "run" | "deployment", "id", "name"}, and "ranks" for a part of a run over
    # several nodes
    holds: list[dict[str, Any]]
    reason: str | None
    doctor: dict[str, Any] | None
    doctor_at: datetime | None
    started_at: datetime
    heartbeat_at: datetime
    checks: list[dict[str, Any]] = field(default_factory=list)


def register_node(session: Session, *, name: str, node: str, hostname: str, queues: list[str]) -> Node:
    """A worker starting (again): its row is reset to `checking` until its doctor reports."""
    now = utcnow()
    row = session.get(Node, name) or Node(name=name)
    row.node, row.hostname, row.queues = node, hostname, list(queues)
    row.status, row.reason, row.doctor, row.doctor_at = NodeStatus.CHECKING, None, None, None
    row.started_at = row.heartbeat_at = now
    row.devices = row.devices or []
    session.add(row)
    session.commit()
    return row


OPENING = (
    "the doctor passed; waiting for the worker's consumer to open its work queues (it has not answered the "
    "request yet)"
)


def record_doctor(session: Session, name: str, report: dict[str, Any], *, queues_open: bool = True) -> Node:
    """Store a doctor report (`ernie-studio doctor --json`, or `{"passed": false, "error": ...}` when it
    could not run): the node's facts, and ready or failed with the failed checks as the reason. A passing
    worker whose work queues are not open yet (`queues_open`) stays `checking`, with that as the reason, until
    `mark_open`: it takes no work before then, and readers must not be told it does."""
    row = session.get(Node, name)
    if row is None:
        raise NotFound(f"node {name} is not registered")
    facts = report.get("facts") or {}
    passed = bool(report.get("passed"))
    row.devices = facts.get("devices") or []
    row.memory_bytes = (facts.get("memory") or {}).get("total_bytes")
    row.cpu_count = facts.get("cpu_count")
    row.doctor, row.doctor_at = report, utcnow()
    if not passed:
        row.status, row.reason = (
            NodeStatus.FAILED,
            failure_reason(report) or "the doctor failed without a reason",
        )
    elif queues_open:
        row.status, row.reason = NodeStatus.READY, None
    else:
        row.status, row.reason = NodeStatus.CHECKING, OPENING
    row.heartbeat_at = utcnow()
    session.commit()
    return row


def mark_open(session: Session, name: str) -> None:
    """The worker's consumer opened its work queues after its doctor passed: it takes work now."""
    session.execute(
        update(Node)
        .where(Node.name == name, Node.status == NodeStatus.CHECKING, Node.reason == OPENING)
        .values(status=NodeStatus.READY, reason=None, heartbeat_at=utcnow())
    )
    session.commit()


def beat(session: Session, name: str) -> bool:
    """The worker is alive; False when its row is gone (the worker registers again)."""
    n = session.execute(update(Node).where(Node.name == name).values(heartbeat_at=utcnow())).rowcount
    session.commit()
    return bool(n)


def mark_stopped(session: Session, name: str) -> None:
    """A worker that shuts down gracefully says so (shown offline at once)."""
    session.execute(update(Node).where(Node.name == name).values(status=NodeStatus.STOPPED))
    session.commit()


def list_nodes(session: Session, settings: Settings) -> list[NodeView]:
    rows = session.scalars(select(Node).order_by(Node.node, Node.name)).all()
    return _views(session, settings, rows)


def get_node(session: Session, settings: Settings, name: str) -> NodeView:
    row = session.get(Node, name)
    if row is None:
        raise NotFound(f"no worker named {name!r} has reported; GET /api/v1/nodes lists the known ones")
    return _views(session, settings, [row])[0]


def node_state(row: Node, now: datetime, offline_after_s: float) -> str:
    if row.status == NodeStatus.STOPPED or row.heartbeat_at < now - timedelta(seconds=offline_after_s):
        return OFFLINE
    return str(row.status)


def _views(session: Session, settings: Settings, rows: list[Node]) -> list[NodeView]:
    holds = _holdings(session, [r.name for r in rows])
    now = utcnow()
    views = []
    for row in rows:
        state = node_state(row, now, settings.node_offline_after_s)
        queues = list(row.queues or [])
        if state == NodeStatus.READY:
            accepting = queues
        elif state == OFFLINE:
            accepting = []
        else:
            accepting = [q for q in queues if not queue.is_work_queue(q)]
        held = holds.get(row.name, [])
        views.append(
            NodeView(
                name=row.name,
                node=row.node,
                hostname=row.hostname,
                state=state,
                queues=queues,
                accepting=accepting,
                devices=list(row.devices or []),
                memory_bytes=row.memory_bytes,
                cpu_count=row.cpu_count,
                busy=bool(held),
                holds=held,
                reason=row.reason,
                doctor=row.doctor,
                doctor_at=row.doctor_at,
                started_at=row.started_at,
                heartbeat_at=row.heartbeat_at,
                checks=list((row.doctor or {}).get("checks") or []),
            )
        )
    return views


def _holdings(session: Session, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """{worker: the running runs and active deployments it holds}."""
    held: dict[str, list[dict[str, Any]]] = {}
    if not names:
        return held
    runs = session.execute(
        select(Run.worker, Run.id, Run.name).where(
            Run.status == RunStatus.RUNNING, Run.worker.in_(names), Run.num_nodes == 1
        )
    ).all()
    deps = session.execute(
        select(Deployment.worker, Deployment.id, Deployment.name).where(
            Deployment.status.in_([s.value for s in ACTIVE_DEPLOYMENTS]), Deployment.worker.in_(names)
        )
    ).all()
    for kind, rows in (("run", runs), ("deployment", deps)):
        for worker, id_, name in rows:
            held.setdefault(worker, []).append({"kind": kind, "id": id_, "name": name})
    # A run over several nodes: each node's worker holds its part, with the global ranks it runs.
    for worker, id_, name, ranks in held_parts(session, names):
        held.setdefault(worker, []).append({"kind": "run", "id": id_, "name": name, "ranks": ranks})
    return held
