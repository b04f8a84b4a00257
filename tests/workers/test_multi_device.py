"""A run on two devices, launched by a real Celery worker on CPU (two gloo ranks under
`paddle.distributed.launch`): it follows the one-process loss curve with the doubled batch, is cancelled and
resumed as a group from its checkpoint, and each step lands in the store once. A request for more devices
than a worker of the node owns is refused by name."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
from trainer_hold import pid_alive
from worker_helpers import processes_naming, wait_for

from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from studio.cli import worker_command
from studio.queue import devices_of, devices_queue

HYPER = {
    "max_steps": 24,
    "save_steps": 4,
    "logging_steps": 1,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "max_seq_len": 128,
    "seed": 5,
    "batch_size": 2,
}


def test_routing_names_the_devices_queue():
    assert devices_queue(1) == "train" and devices_queue(4) == "train.devices.4"
    assert [devices_of(q) for q in ("train", "gpu.n.0", "train.devices.4")] == [1, 1, 4]


def test_two_device_run_by_a_worker_matches_one_process_and_resumes_as_a_group(
    studio_factory, pg_url, shared_redis_url, tmp_path
):
    """The 24-step loss curve within 2e-6 of one process's (measured 6.0e-7 with a cancel and resume)."""
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    # A CPU node whose training worker may run two gloo processes for one run; the API knows it too.
    studio.env["ERNIE_STUDIO_WORKER_DEVICES"] = "2"
    studio.settings = studio.settings.model_copy(update={"worker_devices": 2})
    cmd, _ = worker_command(studio.settings)
    assert cmd[cmd.index("-Q") + 1] == "train,train.devices.2"  # exports go to the serving worker
    studio.start_api()
    studio.start_worker("train@testnode")
    api = studio.client()
    ds = studio.upload_demo(api)
    body = {"dataset_ids": [ds["id"]], "fine_tuning": "Full", "base_model": "tiny", "hyperparameters": HYPER}

    refused = api.post("/runs", json={**body, "num_devices": 3})
    assert refused.status_code == 422 and "num_devices: 3 devices" in refused.json()["message"], refused.text
    refused = api.post("/runs", json={**body, "num_devices": 2, "gpu": 0})
    assert refused.status_code == 422 and "num_devices" in refused.json()["message"], refused.text

    run = api.post("/runs", json={**body, "num_devices": 2}).json()
    assert (run["queue"], run["num_devices"]) == ("train.devices.2", 2), run
    rid = run["id"]
    marker = str(studio.home / "runs" / str(rid) / "config.yaml")

    # Cancel mid-run: every rank stops, rank 0 having saved a checkpoint at the step they agreed on.
    wait_for(lambda: len(api.get(f"/runs/{rid}/metrics").json()) >= 2, 120, "two logged steps")
    ranks = [pid for pid, cmd in processes_naming(marker).items() if "paddle.distributed.launch" not in cmd]
    assert len(ranks) == 2 and len(processes_naming(marker)) == 3  # the launcher and two ranks
    # However fast the machine, the cancel lands mid-run: both ranks are paused until the cancel's stop
    # (SIGTERM then SIGCONT to each rank's group) ends them; on a quiet machine the 24 steps had ended first.
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        api.post(f"/runs/{rid}/cancel")
        wait_for(lambda: not any(pid_alive(p) for p in ranks), 30, "both held ranks to end by the cancel")
    finally:
        for pid in ranks:
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
    cancelled = studio.wait_status(api, rid, {"cancelled", "succeeded", "failed"}, 30)
    assert cancelled["status"] == "cancelled", cancelled["error"]
    wait_for(lambda: not processes_naming(marker), 10, "the launcher and every rank to exit")
    stopped_at = max(c["step"] for c in api.get(f"/runs/{rid}/checkpoints").json())
    assert 2 <= stopped_at < HYPER["max_steps"]

    resumed = api.post(f"/runs/{rid}/resume").json()
    assert (
        resumed["resume_from"].endswith(f"checkpoint-{stopped_at}") and resumed["queue"] == "train.devices.2"
    )
    final = studio.wait_status(api, rid, {"succeeded", "failed", "cancelled"}, 120)
    assert final["status"] == "succeeded", final["error"]
    assert final["attempt"] == 2

    log = api.get(f"/runs/{rid}/logs").json()["text"]
    assert f"attempt 2 on train@testnode, resuming from checkpoint-{stopped_at} on 2 devices" in log
    assert "training finished: 24 steps" in log  # rank 0's output, echoed by the launcher
    out = Path(final["output_dir"])
    ranks = sorted(p.name for p in (out.parent / "dist_logs").glob("workerlog.*"))
    assert ranks == ["workerlog.0", "workerlog.1"]
    assert (
        f"resuming from {out / f'checkpoint-{stopped_at}'}"
        in (out.parent / "dist_logs/workerlog.1").read_text()
    )

    # Each step once in the store and in metrics.jsonl (only rank 0 writes it), and the same numbers.
    stored = api.get(f"/runs/{rid}/metrics").json()
    assert [m["step"] for m in stored] == list(range(1, 25))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert [m["loss"] for m in stored] == [r["loss"] for r in rows]

    # One process with the doubled batch on the same model and data follows the same curve.
    config = config_from_dict(
        TrainConfig,
        {**final["config"], "batch_size": 4, "output_dir": str(tmp_path / "one"), "disable_tqdm": True},
    )
    assert run_training(config).status == "succeeded"
    one = [json.loads(line)["loss"] for line in (tmp_path / "one/metrics.jsonl").read_text().splitlines()]
    two = [m["loss"] for m in stored]
    print(f"2 ranks x batch 2 (cancelled at step {stopped_at}, resumed) vs 1 process x batch 4: "
          f"max |loss diff| = {np.abs(np.subtract(one, two)).max():.2e}")  # fmt: skip
    # measured 6.0e-7 (AMD EPYC, cancelled at step 4 and resumed); test_distributed.py holds 6 steps to 2e-6
    np.testing.assert_allclose(two, one, atol=2e-6, rtol=0)
