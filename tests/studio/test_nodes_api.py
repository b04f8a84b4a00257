"""The node registry's services and /api/v1/nodes: a worker's doctor result, what it holds, offline when silent."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from studio.models import Node, Run, RunStatus, utcnow
from studio.services import nodes as svc

PASSED = {
    "schema_version": 1,
    "passed": True,
    "facts": {
        "devices": [{"index": 0, "name": "A100", "total_memory_bytes": 80 * 2**30}],
        "memory": {"total_bytes": 64 * 2**30},
        "cpu_count": 16,
    },
    "checks": [{"name": "training_probe", "passed": True, "detail": "loss fell 80%", "duration_s": 0.8}],
}
FAILED = {
    **PASSED,
    "passed": False,
    "checks": [
        *PASSED["checks"],
        {"name": "throughput", "passed": False, "detail": "12 tokens/s, below the floor", "duration_s": 0.4},
    ],
}


def _register(session, name: str, queues: list[str]) -> None:
    svc.register_node(session, name=name, node="n1", hostname="host1", queues=queues)


def test_doctor_results_decide_which_queues_a_worker_takes(session, settings):
    _register(session, "train0@n1", ["train", "gpu.n1.0", "cpu"])
    checking = svc.get_node(session, settings, "train0@n1")
    assert checking.state == "checking" and checking.accepting == ["cpu"] and checking.doctor is None
    svc.record_doctor(session, "train0@n1", FAILED)
    failed = svc.get_node(session, settings, "train0@n1")
    assert failed.state == "failed" and failed.accepting == ["cpu"]
    assert failed.reason == "throughput: 12 tokens/s, below the floor"
    assert (
        failed.devices[0]["name"] == "A100" and failed.memory_bytes == 64 * 2**30 and failed.cpu_count == 16
    )
    svc.record_doctor(session, "train0@n1", PASSED)
    ready = svc.get_node(session, settings, "train0@n1")
    assert ready.state == "ready" and ready.reason is None and ready.accepting == ["train", "gpu.n1.0", "cpu"]
    # A doctor that could not run at all fails with its error.
    svc.record_doctor(session, "train0@n1", {"passed": False, "error": "`ernie-studio doctor` timed out"})
    assert svc.get_node(session, settings, "train0@n1").reason == "`ernie-studio doctor` timed out"


def test_a_passed_worker_whose_queues_are_not_open_yet_is_not_shown_taking_work(session, settings):
    """The doctor passed, but the worker's consumer has not answered the request to open its work queues (a
    serve worker once stayed so for 15 minutes): it is `checking`, says why, and holds its work queues."""
    _register(session, "serve@n1", ["serve", "export"])
    svc.record_doctor(session, "serve@n1", PASSED, queues_open=False)
    opening = svc.get_node(session, settings, "serve@n1")
    assert opening.state == "checking" and opening.reason == svc.OPENING
    assert opening.accepting == ["export"] and opening.doctor["passed"] is True
    svc.mark_open(session, "serve@n1")
    ready = svc.get_node(session, settings, "serve@n1")
    assert ready.state == "ready" and ready.reason is None and ready.accepting == ["serve", "export"]
    # A failed doctor is never turned ready by a late reply.
    svc.record_doctor(session, "serve@n1", FAILED, queues_open=False)
    svc.mark_open(session, "serve@n1")
    assert svc.get_node(session, settings, "serve@n1").state == "failed"


def test_silent_or_stopped_workers_are_offline_and_busy_ones_name_their_run(session, settings):
    _register(session, "train@n1", ["train", "cpu"])
    svc.record_doctor(session, "train@n1", PASSED)
    run = Run(name="r", stage="SFT", fine_tuning="LoRA", base_model="tiny", queue="train", output_dir="/x")
    run.status, run.worker = RunStatus.RUNNING, "train@n1"
    session.add(run)
    session.commit()
    view = svc.get_node(session, settings, "train@n1")
    assert view.busy and view.holds == [{"kind": "run", "id": run.id, "name": "r"}]
    late = utcnow() - timedelta(seconds=settings.node_offline_after_s + 1)
    session.execute(update(Node).where(Node.name == "train@n1").values(heartbeat_at=late))
    session.commit()
    assert svc.get_node(session, settings, "train@n1").state == "offline"
    assert svc.beat(session, "train@n1") and svc.get_node(session, settings, "train@n1").state == "ready"
    svc.mark_stopped(session, "train@n1")
    stopped = svc.get_node(session, settings, "train@n1")
    assert stopped.state == "offline" and stopped.accepting == []
    assert not svc.beat(session, "gone@n1")


def test_nodes_routes(client, session, settings):
    assert client.get("/api/v1/nodes").json() == []
    _register(session, "train@n1", ["train", "cpu"])
    svc.record_doctor(session, "train@n1", FAILED)
    listed = client.get("/api/v1/nodes").json()
    assert [n["name"] for n in listed] == ["train@n1"]
    one = client.get("/api/v1/nodes/train@n1").json()
    assert one["state"] == "failed" and one["busy"] is False and one["accepting"] == ["cpu"]
    assert [(c["name"], c["passed"]) for c in one["checks"]] == [
        ("training_probe", True),
        ("throughput", False),
    ]
    assert one["doctor"]["schema_version"] == 1 and one["heartbeat_at"]
    missing = client.get("/api/v1/nodes/nope@n1")
    assert missing.status_code == 404 and "GET /api/v1/nodes" in missing.json()["message"]


def test_every_queue_of_runs_and_servers_waits_for_the_doctor():
    from studio.queue import devices_queue, gpu_queue, is_work_queue

    for name in ("train", devices_queue(2), devices_queue(8), gpu_queue("n1", 0), "serve"):
        assert is_work_queue(name), name
    assert not is_work_queue("cpu")
