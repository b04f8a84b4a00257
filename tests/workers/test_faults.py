"""Faults on Redis + PostgreSQL with real processes: a worker SIGKILLed mid-run (the run resumes on a new
worker from its checkpoint with no duplicated metric steps), the API restarted mid-run (nothing lost),
Redis stopped with runs queued (none lost), and the 5 runs queued around the outage (4 before, 1 during) run
in order on one worker."""

from __future__ import annotations

import signal
from datetime import datetime
from pathlib import Path

from worker_helpers import pid_alive, trainer_pid, wait_for


def test_worker_sigkill_and_api_restart_mid_run(studio_factory, pg_url, redis_server):
    studio = studio_factory(database_url=pg_url, broker_url=redis_server.url)
    studio.start_api()
    studio.start_worker("train@testnode")
    api = studio.client()
    ds = studio.upload_demo(api)
    run = studio.create_run(api, ds["id"], max_steps=80, save_steps=10, logging_steps=1)
    rid = run["id"]

    def steps() -> list[int]:
        return [m["step"] for m in api.get(f"/runs/{rid}/metrics").json()]

    wait_for(
        lambda: any(c["step"] >= 10 for c in api.get(f"/runs/{rid}/checkpoints").json()), 120, "checkpoint-10"
    )
    trainer = trainer_pid(studio, rid)
    assert trainer and pid_alive(trainer), repr((trainer, api.get(f"/runs/{rid}").json()))
    studio.stop("train@testnode", signal.SIGKILL)
    # The trainer dies with its worker (PR_SET_PDEATHSIG), so it cannot keep writing the run directory.
    wait_for(lambda: not pid_alive(trainer), 10, "the orphaned trainer to die")
    assert api.get(f"/runs/{rid}").json()["status"] == "running"  # nobody has noticed yet

    studio.start_worker("train2@testnode")
    wait_for(lambda: api.get(f"/runs/{rid}").json()["attempt"] == 2, 60, "the second attempt")
    second = wait_for(lambda: api.get(f"/runs/{rid}").json()["resume_from"], 30, "resume_from of attempt 2")
    assert Path(second).parent == Path(run["output_dir"]) and Path(second).name.startswith("checkpoint-")
    # A graceful stop (SIGTERM, e.g. a new worker version): the worker stops the trainer (which saves a
    # checkpoint when it is already stepping) and puts the run back on the queue at once.
    studio.stop("train2@testnode", signal.SIGTERM, timeout=30)
    requeued = api.get(f"/runs/{rid}").json()
    assert requeued["status"] == "queued" and requeued["attempt"] == 2 and requeued["worker"] is None
    newest = max(
        int(p.name.split("-")[1]) for p in Path(run["output_dir"]).glob("checkpoint-*") if "." not in p.name
    )

    studio.start_worker("train3@testnode")
    wait_for(lambda: api.get(f"/runs/{rid}").json()["attempt"] == 3, 60, "the third attempt")
    # Restart the API while the third attempt trains: state lives in the store, the worker keeps writing.
    before_restart = steps()
    studio.stop_api()
    studio.start_api()
    api = studio.client()
    assert steps()[: len(before_restart)] == before_restart

    final = studio.wait_status(api, rid, {"succeeded", "failed", "cancelled"}, 180)
    assert final["status"] == "succeeded", final["error"]
    assert final["attempt"] == 3 and final["worker"] == "train3@testnode"
    all_steps = steps()
    assert all_steps == list(range(1, 81)), all_steps  # every step once: no gaps, no duplicates
    events = [e["kind"] for e in api.get(f"/runs/{rid}/events").json()]
    assert events == [
        "run.queued", "run.running", "run.requeued", "run.running", "run.requeued", "run.running", "run.succeeded",
    ]  # fmt: skip
    log_text = api.get(f"/runs/{rid}/logs", params={"limit": 1_000_000}).json()["text"]
    resumed = [line for line in log_text.splitlines() if "attempt 2 on train2@testnode" in line]
    assert resumed and "resuming from checkpoint-" in resumed[0]
    resumed_step = int(resumed[0].split("resuming from checkpoint-")[1].split()[0])
    assert second.endswith(f"checkpoint-{resumed_step}")
    assert resumed_step % 10 == 0 and 10 <= resumed_step < 80  # a save_steps checkpoint, not the end
    assert "requeued: worker stopped" in log_text
    third = [line for line in log_text.splitlines() if "attempt 3 on train3@testnode" in line]
    assert third and f"resuming from checkpoint-{newest}" in third[0]
    # The run records the checkpoint its last attempt resumed from, as its log says.
    assert final["resume_from"] == str(Path(run["output_dir"]) / f"checkpoint-{newest}")
    checkpoints = [c["step"] for c in api.get(f"/runs/{rid}/checkpoints").json()]
    assert set(range(10, 81, 10)) <= set(checkpoints) and newest in checkpoints


def test_redis_outage_loses_no_run_and_queued_runs_run_in_order(studio_factory, pg_url, redis_server):
    studio = studio_factory(database_url=pg_url, broker_url=redis_server.url)
    studio.start_api()
    api = studio.client()
    ds = studio.upload_demo(api)
    # 4 queued before the outage and 1 during it (20, 12, then 7 cost the suite minutes and showed no more:
    # each run is a trainer process of its own, ~5 s of Paddle import alone)
    runs = [studio.create_run(api, ds["id"], max_steps=1, save_steps=100) for _ in range(4)]
    assert all(r["dispatched_at"] for r in runs)

    redis_server.stop()
    down = studio.create_run(api, ds["id"], max_steps=1, save_steps=100)
    assert down["status"] == "queued" and down["dispatched_at"] is None  # accepted, sent later
    assert api.get("/runs", params={"status": "queued"}).status_code == 200
    redis_server.start()

    studio.start_worker("train@testnode")
    runs.append(down)
    ids = [r["id"] for r in runs]

    def last_finished() -> bool:
        r = api.get(f"/runs/{ids[-1]}")
        assert r.status_code == 200, f"{r.status_code} {r.text}\n{studio.log('api')[-3000:]}"
        return r.json()["status"] in ("succeeded", "failed")

    wait_for(last_finished, 400, "the last run to finish", interval=0.5)
    done = [api.get(f"/runs/{i}").json() for i in ids]
    assert [r["status"] for r in done] == ["succeeded"] * len(ids), [(r["id"], r["error"]) for r in done]
    assert all(r["attempt"] == 1 for r in done)  # each ran exactly once
    started = [datetime.fromisoformat(r["started_at"]) for r in done]
    ended = [datetime.fromisoformat(r["ended_at"]) for r in done]
    assert started == sorted(started)  # in the order they were queued
    assert all(ended[i] <= started[i + 1] for i in range(len(ids) - 1))  # one at a time on the single worker
    assert api.get(f"/runs/{down['id']}").json()["dispatched_at"] is not None
