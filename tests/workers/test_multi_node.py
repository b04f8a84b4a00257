"""A run over two nodes, played by two real Celery workers on one machine (each a node of one device slot,
gloo on CPU, the rendezvous on 127.0.0.1): it waits until both nodes' workers took their part (all ranks
start or none), trains, stops on both nodes when cancelled, resumes on both, stops on both when one node's
rank is SIGKILLed and resumes from the checkpoint they share; every step is stored once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from worker_helpers import pid_alive, wait_for

HYPER = {
    "max_steps": 30,
    "save_steps": 3,
    "logging_steps": 1,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "max_seq_len": 64,
    "seed": 5,
    "batch_size": 2,
}


def _processes(marker: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose command line names `marker` (the run's config)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and pid_alive(int(entry)):
                found[int(entry)] = cmdline
    return found


def _rank_pid(marker: str, rank: int) -> int | None:
    """The trainer process of global rank `rank` (not its launcher)."""
    for pid, cmdline in _processes(marker).items():
        if "paddle.distributed.launch" in cmdline:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PADDLE_TRAINER_ID={rank}".encode() in environ:
            return pid
    return None


def test_two_nodes_train_cancel_and_resume_after_a_lost_rank(studio_factory, pg_url, shared_redis_url):
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.start_api()
    api = studio.client()
    ds = studio.upload_demo(api)
    body = {"dataset_ids": [ds["id"]], "fine_tuning": "Full", "base_model": "tiny", "hyperparameters": HYPER}
    refused = api.post("/runs", json={**body, "num_devices": 3, "num_nodes": 2})
    assert refused.status_code == 422 and "num_nodes: 3 devices" in refused.json()["message"], refused.text

    def node(name: str) -> dict[str, str]:
        return {"ERNIE_STUDIO_NODE_NAME": name, "ERNIE_STUDIO_NODE_ADDRESS": "127.0.0.1",
                "ERNIE_STUDIO_GANG_TIMEOUT_S": "8"}  # fmt: skip

    # Only node A's worker at first: it claims node rank 0 and waits; nothing starts without node B.
    studio.start_worker("train@nodeA", env=node("nodeA"))
    run = api.post("/runs", json={**body, "num_devices": 2, "num_nodes": 2}).json()
    rid = run["id"]
    assert (run["queue"], run["num_nodes"], run["num_devices"]) == ("train", 2, 2), run
    marker = str(studio.home / "runs" / str(rid) / "config.yaml")

    def placement() -> list[tuple[str | None, list[int], str]]:
        return [(p["node"], p["ranks"], p["status"]) for p in api.get(f"/runs/{rid}").json()["placement"]]

    wait_for(lambda: placement() and placement()[0][0] == "nodeA", 60, "node A to claim node rank 0")
    assert placement()[1][0] is None and not _processes(marker)
    # Alone past the gang timeout: its claim is released and the run queued again for both nodes.
    wait_for(
        lambda: any("took their part" in e["message"] for e in api.get(f"/runs/{rid}/events").json()),
        60,
        "the gang timeout to release the claim",
    )
    assert not _processes(marker)

    studio.start_worker("train@nodeB", env=node("nodeB"))
    wait_for(lambda: len(api.get(f"/runs/{rid}/metrics").json()) >= 2, 180, "two logged steps")
    assert sorted(placement()) == [("nodeA", [0], "launched"), ("nodeB", [1], "launched")], placement()
    holds = {n["name"]: n["holds"] for n in api.get("/nodes").json()}
    assert [h["ranks"] for h in holds["train@nodeA"] + holds["train@nodeB"]] in ([[0], [1]], [[1], [0]])
    assert len(_processes(marker)) >= 4  # two launchers and two ranks

    # Cancel mid-run: both nodes' ranks stop, after rank 0 saved the step they agreed on.
    api.post(f"/runs/{rid}/cancel")
    cancelled = studio.wait_status(api, rid, {"cancelled", "succeeded", "failed"}, 60)
    assert cancelled["status"] == "cancelled", cancelled["error"]
    wait_for(lambda: not _processes(marker), 30, "both launchers and both ranks to exit")
    stopped_at = max(c["step"] for c in api.get(f"/runs/{rid}/checkpoints").json())
    assert stopped_at < HYPER["max_steps"]

    # Resumed on both nodes; then node B's rank is SIGKILLed: node A stops too and the run resumes on both.
    resumed = api.post(f"/runs/{rid}/resume").json()
    assert resumed["resume_from"].endswith(f"checkpoint-{stopped_at}")
    wait_for(lambda: len(api.get(f"/runs/{rid}/metrics").json()) >= stopped_at + 2, 180, "steps after resume")
    killed_attempt = api.get(f"/runs/{rid}").json()["attempt"]
    victim = wait_for(lambda: _rank_pid(marker, 1), 30, "node B's rank")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: api.get(f"/runs/{rid}").json()["attempt"] > killed_attempt, 120, "the next attempt")
    final = studio.wait_status(api, rid, {"succeeded", "failed", "cancelled"}, 240)
    assert final["status"] == "succeeded", final["error"]
    events = api.get(f"/runs/{rid}/events").json()
    lost = [
        e["message"] for e in events if e["kind"] == "run.requeued" and "lost their ranks" in e["message"]
    ]
    assert lost and "node rank(s) 1" in lost[0], [e["message"] for e in events]
    assert {p[0] for p in placement()} == {"nodeA", "nodeB"}

    # Each step once in the store, as rank 0 alone wrote it to metrics.jsonl.
    stored = api.get(f"/runs/{rid}/metrics").json()
    assert [m["step"] for m in stored] == list(range(1, HYPER["max_steps"] + 1))
    rows = [
        json.loads(line) for line in (Path(final["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == list(range(1, HYPER["max_steps"] + 1))
    assert stored[-1]["loss"] < stored[0]["loss"]
    log = api.get(f"/runs/{rid}/logs", params={"limit": 1_000_000}).json()["text"]
    assert "node rank 0 of 2, ranks 0-0, rendezvous 127.0.0.1:" in log
