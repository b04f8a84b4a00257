"""The forgetting check with real processes (API, Celery worker, Redis, PostgreSQL): a run that overfits a
narrow task on purpose shows its general score falling, with the warning; a gentle run shows no warning.

The tiny model's random weights are at chance on any general set, so nothing could fall. The base is given
general ability first, by a short pre-training in the test: multiple-choice questions whose right letter
follows from one word of the question (north -> A, east -> B, south -> C, west -> D, the options are random
words). The general set is fresh questions of that pattern (other item numbers and options), uploaded as the
person's own benchmark file and scored by option log-likelihood, so the base scores well above chance
(measured with 80 pre-training steps: 1.0 of 32; 40 steps gave 0.5 to 0.75 depending on the draw). The
narrow task (an animal's sound) is then trained from that base: 60 steps at a learning rate of 1e-2 unlearn
the pattern (measured: the general score falls to 0.31, about chance); 6 steps at 1e-5 leave every answer as
it was (change 0).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from worker_helpers import wait_for

from engine.train import run_training
from engine.train.config import TrainConfig, config_from_dict

SOUNDS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack"}
WAYS = ["north", "east", "south", "west"]
LETTERS = "ABCD"
HOLDOUT = 16


def general_items(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "question": f"Item {rng.randint(100, 999)}: the {WAYS[i % 4]} answer?",
            "choices": [f"w{rng.randint(10, 99)}" for _ in range(4)],
            "answer": i % 4,
        }
        for i in range(n)
    ]


def as_chat(item: dict) -> dict:
    """A general item as the chat turn `benchmark_prompt: chat` scores it in (the answer is its letter)."""
    options = "\n".join(f"{LETTERS[k]}. {c}" for k, c in enumerate(item["choices"]))
    return {"src": [f"{item['question']}\n{options}"], "tgt": [LETTERS[item["answer"]]]}


def narrow(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"src": [f"Item {rng.randint(100, 999)}: what does the {a} say?"], "tgt": [SOUNDS[a]]}
        for a in (list(SOUNDS)[i % 4] for i in range(n))
    ]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pretrain(tiny: Path, out: Path, tmp: Path) -> Path:
    data = write(tmp / "pretrain.jsonl", [as_chat(it) for it in general_items(64, seed=2)])
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(tiny), output_dir=str(out), fine_tuning="Full", train_dataset_path=str(data),
            max_seq_len=64, batch_size=8, max_steps=80, learning_rate=3e-3, save_steps=1000, disable_tqdm=True,
            report_to="none", logging_steps=10,
        ),
    )  # fmt: skip
    assert run_training(cfg).status == "succeeded"
    return out


def test_overfit_run_warns_of_forgetting_and_a_gentle_run_does_not(
    studio_factory, pg_url, shared_redis_url, tiny_model_dir, tmp_path
):
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    base = pretrain(tiny_model_dir, studio.home / "general-base", tmp_path)
    studio.start_api()
    studio.start_worker("train@testnode")
    api = studio.client()

    def upload(name: str, rows: list[dict]) -> dict:
        with open(write(tmp_path / name, rows), "rb") as f:
            r = api.post("/datasets", files={"file": (name, f)})
        assert r.status_code == 201, r.text
        return r.json()

    task = upload("animals.jsonl", narrow(48 + HOLDOUT, seed=1))
    general = upload("directions.jsonl", general_items(32, seed=1))
    assert general["kind"] == "benchmark" and general["format"] == "multiple_choice"

    def run(name: str, steps: int, lr: float) -> dict:
        body = {
            "dataset_ids": [task["id"]], "base_model": str(base), "fine_tuning": "Full", "name": name,
            "hyperparameters": {
                "max_seq_len": 64, "batch_size": 8, "max_steps": steps, "learning_rate": lr, "save_steps": 1000,
                "logging_steps": 10,
            },
            "evaluate": {
                "holdout": HOLDOUT,
                "options": {"metrics": ["exact_match"], "max_new_tokens": 4, "benchmark_prompt": "chat",
                            "bootstrap_samples": 100},
                "general": {"dataset_ids": [general["id"]], "margin": 0.1},
            },
        }  # fmt: skip
        r = api.post("/runs", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    overfit, gentle = run("overfit", 60, 1e-2), run("gentle", 6, 1e-5)

    def checked(run_id: int) -> dict | None:
        got = api.get(f"/runs/{run_id}").json()
        assert got["status"] not in ("failed", "cancelled"), got["error"]
        failed = [e for e in api.get("/evals", params={"run_id": run_id}).json() if e["status"] == "failed"]
        assert not failed, failed[0]["error"]
        return got["forgetting"]

    over = wait_for(lambda: checked(overfit["id"]), 600, "the overfit run's forgetting check", interval=0.5)
    calm = wait_for(lambda: checked(gentle["id"]), 600, "the gentle run's forgetting check", interval=0.5)

    g = over["general"]
    assert g["n"] == 32 and g["base"] >= 0.8 and g["result"] <= 0.5, g
    assert g["change_ci"][1] < -0.1 and g["change_ci"][0] <= g["change"] <= g["change_ci"][1], g
    assert set(g["sets"]) == {"directions.jsonl"}
    assert over["warning"] is True and over["margin"] == 0.1
    t = over["task"]
    assert t["n"] == HOLDOUT and set(t["sets"]) == {"animals.holdout.jsonl"}
    assert t["base"] <= 0.1 and t["change"] >= 0.2, t  # it learnt some of its task (measured: 0 -> 0.25)

    g = calm["general"]
    assert g["base"] == over["general"]["base"] and abs(g["change"]) <= 0.05, g
    assert calm["warning"] is False

    kinds = {e["kind"] for e in api.get(f"/runs/{overfit['id']}/events").json()}
    assert "run.forgetting_warning" in kinds, kinds
    kinds = {e["kind"] for e in api.get(f"/runs/{gentle['id']}/events").json()}
    assert "run.forgetting_checked" in kinds and "run.forgetting_warning" not in kinds, kinds
