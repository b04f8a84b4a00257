"""Evaluate after training with real processes (API, Celery worker, Redis, PostgreSQL): a tiny model
fine-tuned in the studio on a learnable task (an animal's sound) scores far higher than its base on the
seeded held-out split it never trained on, read through REST; and the base eval, its worker SIGKILLed
mid-way, continues on a new worker with every sample stored exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

from worker_helpers import pid_alive, wait_for

from studio.db import session_factory
from studio.models import Evaluation

SOUNDS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack"}
HOLDOUT = 32


def records(n: int, seed: int) -> list[dict]:
    """tests/engine/test_eval_finetune.py's task (the answer depends on one word of the prompt), every
    prompt distinct."""
    numbers = random.Random(seed).sample(range(100, 1000), n)
    return [
        {"src": [f"Item {k}: what does the {a} say?"], "tgt": [SOUNDS[a]]}
        for k, a in zip(numbers, (list(SOUNDS)[i % 4] for i in range(n)), strict=True)
    ]


def test_fine_tuned_run_beats_its_base_on_the_holdout_and_evals_survive_a_worker_kill(
    studio_factory, pg_url, redis_server, tmp_path
):
    studio = studio_factory(database_url=pg_url, broker_url=redis_server.url)
    studio.start_api()
    studio.start_worker("train@testnode")
    api = studio.client()
    data = tmp_path / "animals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(64 + HOLDOUT, seed=1)))
    with open(data, "rb") as f:
        ds = api.post("/datasets", files={"file": ("animals.jsonl", f)}).json()
    options = {"metrics": ["exact_match"], "max_new_tokens": 16, "max_num_seqs": 2, "bootstrap_samples": 100}
    body = {
        "dataset_ids": [ds["id"]], "base_model": "tiny", "fine_tuning": "Full", "name": "animals",
        "hyperparameters": {
            "max_seq_len": 48, "batch_size": 8, "max_steps": 80, "learning_rate": 3e-3, "save_steps": 1000,
            "logging_steps": 10,
        },
        "evaluate": {"holdout": HOLDOUT, "options": options},
    }  # fmt: skip
    r = api.post("/runs", json=body)
    assert r.status_code == 201, r.text
    run = r.json()
    assert len(Path(run["config"]["train_dataset_path"]).read_text().splitlines()) == 64
    assert studio.wait_status(api, run["id"], {"succeeded", "failed"}, 300)["status"] == "succeeded"

    def evals() -> dict[str, dict]:
        return {e["role"]: e for e in api.get("/evals", params={"run_id": run["id"]}).json()}

    # The base eval is taken first (queued first). Freeze its scorer once 8 or more samples are in its
    # file, let the worker store them, then SIGKILL the worker (the frozen scorer dies with it): a fast
    # machine scores all 32 between two polls, so the kill point is held by the test, not by timing.
    base = wait_for(
        lambda: (b := evals().get("base")) and b["status"] == "running" and b,
        180,
        "the base eval to start",
        interval=0.05,
    )

    def scorer_pid() -> int | None:
        with session_factory(studio.settings)() as s:
            return s.get(Evaluation, base["id"]).pid

    scorer = wait_for(scorer_pid, 30, "the scorer's pid", interval=0.02)
    samples_file = Path(base["output_dir"], "eval_samples.jsonl")

    def complete_lines() -> int:
        try:
            return samples_file.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    wait_for(lambda: complete_lines() >= 8, 180, "the scorer's first 8 samples", interval=0.002)
    os.kill(scorer, signal.SIGSTOP)
    written = complete_lines()
    assert 8 <= written < HOLDOUT, written
    wait_for(lambda: api.get(f"/evals/{base['id']}").json()["samples_done"] == written, 30, "stored samples")
    studio.stop("train@testnode", signal.SIGKILL)
    wait_for(lambda: not pid_alive(scorer), 10, "the orphaned scorer to die")
    killed_at = api.get(f"/evals/{base['id']}").json()
    assert killed_at["status"] == "running" and killed_at["samples_done"] == written, killed_at

    studio.start_worker("train2@testnode")
    done = wait_for(
        lambda: (
            (e := evals())
            and all(v["status"] in ("succeeded", "failed") for v in e.values())
            and len(e) == 2
            and e
        ),
        300,
        "both evals to end",
        interval=0.5,
    )
    base, result = done["base"], done["result"]
    assert base["status"] == result["status"] == "succeeded", (base["error"], result["error"])
    assert base["attempt"] == 2 and base["model"] == "tiny" and result["model"] == f"run:{run['id']}"

    # Every held-out sample exactly once in the store, the same ones the engine wrote.
    rows = api.get(f"/evals/{base['id']}/samples", params={"limit": 1000}).json()
    ids = [i["sample_id"] for i in rows["items"]]
    assert rows["total"] == base["samples_done"] == base["samples_total"] == HOLDOUT == len(set(ids))
    lines = Path(base["output_dir"], "eval_samples.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(ids)
    kinds = [e["kind"] for e in api.get(f"/evals/{base['id']}/events").json()]
    assert kinds == ["eval.queued", "eval.requeued", "eval.succeeded"], kinds

    # The fine-tuned run is clearly better than its base on records it never saw.
    key = "animals.holdout/exact_match"
    assert base["metrics"][key] <= 0.1, base["metrics"]
    assert result["metrics"][key] >= 0.6, result["metrics"]
    held = {
        json.loads(line)["src"][0]
        for line in Path(result["config"]["eval_dataset_path"]).read_text().splitlines()
    }
    trained = {
        json.loads(line)["src"][0]
        for line in Path(run["config"]["train_dataset_path"]).read_text().splitlines()
    }
    assert len(held) == HOLDOUT and not held & trained
    cmp = api.get("/evals/compare", params={"eval_ids": [base["id"], result["id"]]}).json()
    assert cmp["metrics"][key] == {
        str(base["id"]): base["metrics"][key],
        str(result["id"]): result["metrics"][key],
    }
    assert cmp["differ"]["samples"] >= HOLDOUT // 2 and cmp["differ"]["of"] == HOLDOUT
    first = api.get(
        f"/evals/{result['id']}/samples", params={"compare_to": base["id"], "only_differ": True, "limit": 1}
    ).json()["items"][0]
    assert first["differ"] and first["prediction"] != first["other"]["prediction"]
