"""A run over several nodes in the store: its parts are claimed once each and in rank order, the barrier
opens only when every part is ready, a requeue releases the attempt and publishes the run once per node,
and REST, the run page and the Nodes view show which node holds which ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from studio_helpers import DEMO_SFT

from studio import queue
from studio.config import Settings
from studio.db import session_factory
from studio.models import Run, RunPart
from studio.services.run_lifecycle import requeue_run
from studio.services.run_parts import LAUNCHED, READY, beat_part, claim_part, gang, placement, set_part
from studio.ui.nodes_tab import holds_text
from studio.ui.run_views import placement_text
from studio.ui.train_tab import run_spec


def _messages(settings, run_id: int) -> int:
    """The run's messages waiting on the `train` queue."""
    with queue.broker_messages(settings) as messages:
        return sum(job == (queue.RUN_TASK, run_id) for _, job in messages.waiting([queue.TRAIN_QUEUE]))


def _run(client) -> dict:
    with open(DEMO_SFT, "rb") as f:
        ds = client.post("/api/v1/datasets", files={"file": ("d.jsonl", f)}).json()
    body = {"dataset_ids": [ds["id"]], "base_model": "tiny", "num_devices": 2, "num_nodes": 2}
    r = client.post("/api/v1/runs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_parts_are_claimed_once_in_rank_order_and_requeued_together(client, settings):
    run = _run(client)
    rid = run["id"]
    # 1 device on each of 2 nodes: the queue of one device, one message per node.
    assert (run["queue"], run["num_nodes"], run["num_devices"], run["placement"]) == ("train", 2, 2, [])
    assert _messages(settings, rid) == 2

    with session_factory(settings)() as s:
        first = claim_part(s, rid, "train@a", "a", "10.0.0.1:6170")
        assert (first.node_rank, first.ranks, first.attempt.number) == (0, [0], 1)
        assert claim_part(s, rid, "train@a", "a", "x:1") is None  # a redelivery to the same worker
        second = claim_part(s, rid, "train@b", "b", "10.0.0.2:6170")
        assert (second.node_rank, second.ranks) == (1, [1])
        assert claim_part(s, rid, "train@c", "c", "10.0.0.3:6170") is None  # nothing left to take
        g = gang(s, second, stale_after_s=30)
        assert g.master == "10.0.0.1:6170" and not g.ready and not g.lost
        set_part(s, first, READY)
        set_part(s, second, READY)
        assert gang(s, first, stale_after_s=30).ready and not gang(s, second, stale_after_s=30).go
        set_part(s, first, LAUNCHED)  # node rank 0's go: only now do the other parts launch
        assert gang(s, second, stale_after_s=30).go
        set_part(s, first, READY)
        assert beat_part(s, second) == "ok"
        row = s.get(Run, rid)
        assert [(p["node"], p["ranks"], p["status"]) for p in placement(s, row)] == [
            ("a", [0], "ready"), ("b", [1], "ready"),
        ]  # fmt: skip

    out = client.get(f"/api/v1/runs/{rid}").json()
    assert [(p["node_rank"], p["worker"], p["ranks"]) for p in out["placement"]] == [
        (0, "train@a", [0]), (1, "train@b", [1]),
    ]  # fmt: skip
    assert placement_text(out["placement"]) == ("nodes: a holds ranks 0 (ready); b holds ranks 1 (ready)")
    node = SimpleNamespace(busy=True, holds=[{"kind": "run", "id": rid, "name": "r", "ranks": [2, 3]}])
    assert holds_text(node) == f"run #{rid} r (ranks 2-3)"

    # A lost rank: only the attempt it belongs to is requeued, its parts released, and the run published
    # once per node again (the messages nobody took withdrawn first).
    with session_factory(settings)() as s:
        assert not requeue_run(s, settings, rid, "stale attempt", attempt=7)
        assert requeue_run(s, settings, rid, "node rank 1 lost", attempt=1)
        assert beat_part(s, first) == "lost"
        statuses = {p.status for p in s.query(RunPart).filter_by(run_id=rid, attempt=1)}
        assert statuses == {"released"}
        third = claim_part(s, rid, "train@b", "b", "10.0.0.2:6170")
        assert (third.node_rank, third.attempt.number) == (0, 2)
    assert _messages(settings, rid) == 2


def test_the_train_form_asks_for_nodes():
    spec = run_spec({"base_model": "tiny", "dataset_ids": [1], "num_devices": 4, "num_nodes": 2})
    assert (spec.num_devices, spec.num_nodes) == (4, 2)


def test_uneven_split_is_refused_by_name(client):
    with open(DEMO_SFT, "rb") as f:
        ds = client.post("/api/v1/datasets", files={"file": ("d.jsonl", f)}).json()
    body = {"dataset_ids": [ds["id"]], "base_model": "tiny", "num_devices": 3, "num_nodes": 2}
    r = client.post("/api/v1/runs", json=body)
    assert r.status_code == 422 and r.json()["message"].startswith("num_nodes: 3 devices"), r.text
    assert client.get("/api/v1/runs").json() == []


def test_a_node_address_that_is_no_ipv4_address_is_refused_by_name():
    # the launcher's --host takes an IPv4 address only (paddle/distributed/launch/plugins: rewrite_host_ip)
    with pytest.raises(ValidationError, match="ERNIE_STUDIO_NODE_ADDRESS: 'node-a'"):
        Settings(node_address="node-a")
