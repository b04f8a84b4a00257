"""A run over two nodes, played by two real Celery workers on one machine (each a node of one device slot,
gloo on CPU, the rendezvous on 127.0.0.1): it waits until both nodes' workers took their part (all ranks
start or none), trains, stops on both nodes when one node's rank is SIGKILLed and resumes on both from the
checkpoint they share, stops on both when cancelled; every step is stored once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from worker_helpers import processes_naming, wait_for

HYPER = {
    "max_steps": 60,
    "save_steps": 2,
    "logging_steps": 1,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "max_seq_len": 64,
    "seed": 5,
    "batch_size": 2,
}


def _rank_pid(marker: str, rank: int) -> int | None:
    """The trainer process of global rank `rank` (not its launcher)."""
    for pid, cmdline in processes_naming(marker).items():
        if "paddle.distributed.launch" in cmdline:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PADDLE_TRAINER_ID={rank}".encode() in environ:
            return pid
    return None


def _both_launched(placement: list[tuple[str | None, list[int], str]]) -> bool:
    """Each node holds one of the two ranks (either may be node rank 0) and both launched."""
    return sorted((node, ranks) for node, ranks, _ in placement) in (
        [("nodeA", [0]), ("nodeB", [1])], [("nodeA", [1]), ("nodeB", [0])],
    ) and all(status == "launched" for *_, status in placement)  # fmt: skip


def _assert_both_nodes_launched(placement: list[tuple[str | None, list[int], str]]) -> None:
    assert _both_launched(placement), placement


def test_two_nodes_train_resume_after_a_lost_rank_and_cancel(studio_factory, pg_url, shared_redis_url):
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

    # The run is queued before any node has reported (once node A alone has, the studio refuses 2 devices
    # as more than its nodes hold: check_known_devices). Only node A's worker at first: it claims node
    # rank 0 and waits; nothing starts without node B. (Posting after node A's start raced its doctor.)
    run = api.post("/runs", json={**body, "num_devices": 2, "num_nodes": 2}).json()
    studio.start_worker("train@nodeA", env=node("nodeA"))
    rid = run["id"]
    assert (run["queue"], run["num_nodes"], run["num_devices"]) == ("train", 2, 2), run
    marker = str(studio.home / "runs" / str(rid) / "config.yaml")

    def placement() -> list[tuple[str | None, list[int], str]]:
        return [(p["node"], p["ranks"], p["status"]) for p in api.get(f"/runs/{rid}").json()["placement"]]

    wait_for(lambda: placement() and placement()[0][0] == "nodeA", 60, "node A to claim node rank 0")
    assert placement()[1][0] is None and not processes_naming(marker)
    # Alone past the gang timeout: its claim is released and the run queued again for both nodes.
    wait_for(
        lambda: any("took their part" in e["message"] for e in api.get(f"/runs/{rid}/events").json()),
        60,
        "the gang timeout to release the claim",
    )
    assert not processes_naming(marker)

    studio.start_worker("train@nodeB", env=node("nodeB"))
    wait_for(lambda: len(api.get(f"/runs/{rid}/checkpoints").json()) >= 1, 240, "a first checkpoint")
    _assert_both_nodes_launched(placement())
    holds = {n["name"]: n["holds"] for n in api.get("/nodes").json()}
    assert sorted(h["ranks"] for h in holds["train@nodeA"] + holds["train@nodeB"]) == [[0], [1]], holds
    assert len(processes_naming(marker)) >= 4  # two launchers and two ranks

    # Global rank 1's process is SIGKILLed: the other node stops too, and the run resumes on both nodes
    # from the newest checkpoint they share.
    killed_attempt = api.get(f"/runs/{rid}").json()["attempt"]
    victim = wait_for(lambda: _rank_pid(marker, 1), 30, "the process of global rank 1")
    recorded = max(c["step"] for c in api.get(f"/runs/{rid}/checkpoints").json())
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: api.get(f"/runs/{rid}").json()["attempt"] > killed_attempt, 120, "the next attempt")
    events = api.get(f"/runs/{rid}/events").json()
    lost = [
        e["message"] for e in events if e["kind"] == "run.requeued" and "lost their ranks" in e["message"]
    ]
    assert lost and "node rank(s) 1" in lost[0], [e["message"] for e in events]
    resumed = wait_for(lambda: api.get(f"/runs/{rid}").json()["resume_from"], 30, "resume_from")
    shared = int(Path(resumed).name.split("-")[1])
    assert Path(resumed).parent == Path(run["output_dir"]) and shared >= recorded
    wait_for(lambda: _both_launched(placement()), 120, "both nodes to launch again")

    def logged_steps() -> list[int]:
        text = (Path(run["output_dir"]) / "metrics.jsonl").read_text()
        return [json.loads(line)["step"] for line in text.splitlines()]

    # The killed attempt's last logged step, read from metrics.jsonl (rank 0 fsyncs each row) and not from
    # the store, whose worker may still be reading that attempt's last rows: the resumed attempt trains the
    # steps after the shared checkpoint again (their rows are not stored again), and only steps past this
    # one show it training on.
    before = max(logged_steps())
    wait_for(lambda: len(api.get(f"/runs/{rid}/metrics").json()) >= before + 2, 240, "steps after the resume")

    # Cancel mid-run: both nodes' ranks stop, after rank 0 saved the step they agreed on.
    api.post(f"/runs/{rid}/cancel")
    cancelled = studio.wait_status(api, rid, {"cancelled", "succeeded", "failed"}, 60)
    assert cancelled["status"] == "cancelled", cancelled["error"]
    wait_for(lambda: not processes_naming(marker), 30, "both launchers and both ranks to exit")
    stopped_at = max(c["step"] for c in api.get(f"/runs/{rid}/checkpoints").json())
    assert before + 2 <= stopped_at < HYPER["max_steps"]

    # It trained, and each step is stored once, as rank 0 alone wrote it to metrics.jsonl (the steps the
    # killed attempt logged after the shared checkpoint were trained again, not stored again).
    stored = api.get(f"/runs/{rid}/metrics").json()
    assert [m["step"] for m in stored] == list(range(1, stopped_at + 1))
    assert logged_steps() == list(range(1, stopped_at + 1))
    assert stored[-1]["loss"] < stored[0]["loss"]
    log = api.get(f"/runs/{rid}/logs", params={"limit": 1_000_000}).json()["text"]
    assert f"resuming from checkpoint-{shared}: node rank 0 of 2, ranks 0-0, rendezvous 127.0.0.1:" in log
