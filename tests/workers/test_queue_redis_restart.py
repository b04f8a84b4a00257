"""Redis killed and restarted empty (no persistence) while run A trains and runs B and C wait behind it, run
D created during the outage: on real Redis + PostgreSQL with a real worker process, every run finishes
exactly once: one claim each, every metrics step once, nothing left on the queue."""

from __future__ import annotations

import ast
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import redis
from trainer_hold import hold_after_steps
from worker_helpers import trainer_pid, wait_for

# Run A is held (SIGSTOP) at its second step while Redis restarts, so it is mid-run however fast the machine
# (300 steps used to stand in for that).
STEPS = {"A": 20, "B": 5, "C": 5, "D": 5}


def _restart_redis_under_run_a(studio, api, ds, rid: dict, volatile_redis) -> tuple[float, redis.Redis]:
    """With run A held mid-run and B, C queued: Redis killed (its messages gone), D created while it is down,
    Redis started again empty. Returns when it came back, and a client of it."""
    wait_for(lambda: len(api.get(f"/runs/{rid['A']}/metrics").json()) >= 2, 120, "run A to be training")
    waiting = [api.get(f"/runs/{rid[n]}").json() for n in "BC"]
    assert [r["status"] for r in waiting] == ["queued", "queued"]
    assert all(r["dispatched_at"] for r in waiting)  # their messages were in Redis

    assert api.get(f"/runs/{rid['A']}").json()["status"] == "running"
    volatile_redis.stop(signal.SIGKILL)
    down = studio.create_run(api, ds["id"], max_steps=STEPS["D"], save_steps=100, logging_steps=1)
    assert down["status"] == "queued" and down["dispatched_at"] is None
    rid["D"] = down["id"]
    volatile_redis.start()
    restarted = time.time()
    client = redis.Redis.from_url(volatile_redis.url)
    # B's and C's messages are gone with the old Redis; only D's may be there already, sent the moment Redis
    # answered again (a fresh clone's run caught it there: the queue held 1 message)
    assert _queued_runs(client) <= {rid["D"]}, (_queued_runs(client), rid)
    return restarted, client


def _queued_runs(client: redis.Redis) -> set[int]:
    """The runs whose messages wait on the train queue (kombu keeps each as JSON, the task's arguments in
    its ``argsrepr`` header)."""
    return {ast.literal_eval(json.loads(m)["headers"]["argsrepr"])[0] for m in client.lrange("train", 0, -1)}


def test_queued_runs_survive_a_redis_restart_without_persistence(studio_factory, pg_url, volatile_redis):
    studio = studio_factory(database_url=pg_url, broker_url=volatile_redis.url)
    studio.start_api()
    studio.start_worker("train@testnode")
    api = studio.client()
    ds = studio.upload_demo(api)
    runs = {
        name: studio.create_run(api, ds["id"], max_steps=STEPS[name], save_steps=100, logging_steps=1)
        for name in "ABC"
    }
    rid = {name: run["id"] for name, run in runs.items()}

    trainer = wait_for(lambda: trainer_pid(studio, rid["A"]), 120, "run A's trainer")
    hold_after_steps(trainer, Path(runs["A"]["output_dir"]) / "metrics.jsonl", 2)
    try:
        restarted, client = _restart_redis_under_run_a(studio, api, ds, rid, volatile_redis)
    finally:
        os.kill(trainer, signal.SIGCONT)

    def all_finished() -> bool:
        statuses = [api.get(f"/runs/{i}").json()["status"] for i in rid.values()]
        return all(s in ("succeeded", "failed", "cancelled") for s in statuses)

    wait_for(all_finished, 300, "every run to finish", interval=0.5)
    for name, run_id in rid.items():
        run = api.get(f"/runs/{run_id}").json()
        assert run["status"] == "succeeded", (name, run["error"], studio.log("train@testnode")[-3000:])
        assert run["attempt"] == 1, (name, run)  # claimed once
        kinds = [e["kind"] for e in api.get(f"/runs/{run_id}/events").json()]
        assert kinds == ["run.queued", "run.running", "run.succeeded"], (name, kinds)
        steps = [m["step"] for m in api.get(f"/runs/{run_id}/metrics").json()]
        assert steps == list(range(1, STEPS[name] + 1)), (name, steps)

    worker_log = studio.log("train@testnode")
    resends = {
        name: worker_log.count(
            f"run_training {run_id}: its message is no longer in the broker; sent it again"
        )
        for name, run_id in rid.items()
    }
    # B's and C's messages died with Redis, so each was re-sent; A was running (never a suspect); D was sent
    # by the plain reconciler. On a loaded machine a message can sit unclaimed past the grace period and be
    # sent once more: harmless, which is what the single claim and single events of every run above prove.
    assert resends["A"] == 0 and resends["B"] >= 1 and resends["C"] >= 1, resends
    for name in "BC":
        resent = datetime.fromisoformat(api.get(f"/runs/{rid[name]}").json()["dispatched_at"]).timestamp()
        print(f"run {name} re-sent {resent - restarted:.1f} s after Redis came back")
    wait_for(lambda: client.llen("train") == 0, 10, "the train queue to be empty")
    client.close()
