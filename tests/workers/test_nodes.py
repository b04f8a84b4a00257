"""Workers check their node before they take work: one whose doctor fails (an operator floor it cannot meet)
records why and takes no runs, while a healthy worker beside it takes the shared queue's runs."""

from __future__ import annotations

from worker_helpers import DEMO_SFT, wait_for

from studio.db import session_factory
from studio.models import RunStatus
from studio.queue import is_work_queue
from studio.services import nodes as nodes_svc
from studio.services.datasets import upload_dataset
from studio.services.runs import RunSpec, create_run, get_run

FLOOR = {"ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S": "1e12"}  # no node trains this fast


def test_a_failed_doctor_keeps_a_worker_from_taking_runs(studio_factory):
    studio = studio_factory()
    # The degraded worker owns GPU 0's queue (and the shared `train`); the healthy one only `train`.
    studio.start_worker("train0@testnode", gpu=0, env=FLOOR, wait=False)
    studio.start_worker("train@testnode", wait=False)
    settings = studio.settings.model_copy(update={"gpus": "0"})
    factory = session_factory(settings)
    with factory() as session:
        ds = upload_dataset(session, settings, DEMO_SFT, "sft_demo.jsonl", name="demo")
        hyper = {"max_steps": 200, "save_steps": 100}
        pinned = create_run(
            session, settings, RunSpec(dataset_ids=[ds.id], fine_tuning="LoRA", gpu=0, hyperparameters=hyper)
        ).id
        shared = create_run(
            session, settings, RunSpec(dataset_ids=[ds.id], fine_tuning="LoRA", hyperparameters=hyper)
        ).id

    def node(name: str):
        with factory() as session:
            views = {n.name: n for n in nodes_svc.list_nodes(session, settings)}
        return views.get(name)

    failed = wait_for(
        lambda: (n := node("train0@testnode")) and n.state == "failed" and n,
        180,
        "the degraded node's doctor",
    )
    assert "throughput" in failed.reason and "ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S" in failed.reason
    # It takes nothing of its run queues (a training worker has no other queue since exports moved to the
    # serving workers).
    assert not any(is_work_queue(q) for q in failed.accepting) and "gpu.testnode.0" in failed.queues
    assert {c["name"]: c["passed"] for c in failed.checks}["throughput"] is False

    def taken() -> str | None:
        with factory() as session:
            run = get_run(session, shared)
            return run.status != RunStatus.QUEUED and run.worker

    assert wait_for(taken, 180, "the healthy worker to take the shared run") == "train@testnode"
    # Ready once its consumer answered the request to open the queues, which can come just after the run
    # was taken from them.
    healthy = wait_for(
        lambda: (n := node("train@testnode")) and n.state == "ready" and n, 30, "the healthy node to be ready"
    )
    assert "train" in healthy.accepting and healthy.busy
    assert healthy.holds == [{"kind": "run", "id": shared, "name": healthy.holds[0]["name"]}]
    # The degraded worker, the only one serving GPU 0's queue, has had as long as the healthy one took.
    with factory() as session:
        assert get_run(session, pinned).status == RunStatus.QUEUED
    assert "Started consuming from" not in studio.log("train0@testnode")
    assert "node doctor FAILED" in studio.log("train0@testnode")


def test_work_queues_are_held_until_the_doctor_passed(tmp_path):
    from studio.config import Settings
    from studio.queue import make_celery
    from workers.nodes import hold_work_queues

    app = make_celery(Settings(home=tmp_path))
    app.amqp.queues.select(["train", "gpu.n1.0", "cpu"])
    assert hold_work_queues(app) == ["train", "gpu.n1.0", "cpu"]
    assert list(app.amqp.queues.consume_from) == ["cpu"]
    # Still declared, so the consumer can be told to take them later.
    assert {"train", "gpu.n1.0"} <= set(app.amqp.queues)


def test_a_worker_whose_remote_control_binding_was_lost_gets_it_back(tmp_path):
    """A serve worker whose `celery.pidbox` binding the embedded broker lost never hears the request to open
    its queues. When no reply comes, the node agent declares the worker's remote-control queue again, which
    writes the binding back, so the next heartbeat's request reaches it. (No worker runs here: the request
    goes unanswered, as it did for the worker that lost its binding.)"""
    from kombu import Connection

    from studio.config import Settings
    from studio.queue import embedded_transport, make_celery
    from workers.nodes import NodeAgent

    settings = Settings(home=tmp_path)
    app = make_celery(settings)
    agent = NodeAgent(settings, app, "serve@testnode", ["serve", "export"])
    with Connection(
        "filesystem://", transport=embedded_transport(), transport_options=app.conf.broker_transport_options
    ) as conn:
        assert conn.default_channel.get_table("celery.pidbox") == []  # lost (here: never written)
        agent.open_work_queues()
        assert not agent.opened
        bound = [b.queue for b in conn.default_channel.get_table("celery.pidbox")]
    assert bound == ["serve@testnode.celery.pidbox"]
