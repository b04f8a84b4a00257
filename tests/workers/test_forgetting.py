"""The forgetting check on real models. A run that overfits a narrow task on purpose goes through the real
processes (API, Celery worker, Redis, PostgreSQL, the trainer and both eval processes) and shows its general
score falling, with the warning. A gentle run goes through the studio's services in this process (the API
makes it, the trainer and the scorer run on the configs the worker would hand them, the scored samples are
recorded as the worker records them) and shows no warning.

The tiny model's random weights are at chance on any general set, so nothing could fall. The base is given
general ability first, by a short pre-training (once for the module): multiple-choice questions whose right
letter follows from one word of the question (north -> A, east -> B, south -> C, west -> D, the options are
random words). The general set is fresh questions of that pattern (other item numbers and options), uploaded
as the person's own benchmark file and scored by option log-likelihood, so the base scores well above chance
(measured with 80 pre-training steps: 1.0 of 32; 60 or 50 steps gave 0.5, 40 steps 0.5 to 0.75 depending on
the draw). The narrow task (an animal's sound) is then trained from that base: 30 steps at a learning rate
of 2e-2 unlearn the pattern (measured: the general score falls to 0.25, about chance, and the task's exact
match rises from 0 to 0.25 on an Intel Xeon, stays 0 on an AMD EPYC: the test holds the task's loss, not its
answers); 6 steps at 1e-5 leave every answer as it was (change 0).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from animal_sounds import sound_records, write_jsonl
from fastapi.testclient import TestClient
from worker_helpers import wait_for

from engine.eval.config import EvalConfig
from engine.eval.runner import run_eval
from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from studio.app import create_app
from studio.config import Settings
from studio.db import dispose_engines, session_factory
from studio.migrate import upgrade
from studio.models import Run, RunStatus
from studio.services import eval_after, jobs
from studio.services import evals as evals_svc
from studio.services.run_lifecycle import claim_run

WAYS = ["north", "east", "south", "west"]
LETTERS = "ABCD"
HOLDOUT = 16
MARGIN = 0.1
PRETRAIN_ITEMS = 64
PRETRAIN_STEPS = 120


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


def pretrain(tiny: Path, out: Path, tmp: Path) -> Path:
    data = write_jsonl(tmp / "pretrain.jsonl", [as_chat(it) for it in general_items(PRETRAIN_ITEMS, seed=2)])
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(tiny), output_dir=str(out), fine_tuning="Full", train_dataset_path=str(data),
            max_seq_len=64, batch_size=8, max_steps=PRETRAIN_STEPS, learning_rate=3e-3, save_steps=1000,
            disable_tqdm=True, report_to="none", logging_steps=10,
        ),
    )  # fmt: skip
    assert run_training(cfg).status == "succeeded"
    return out


@pytest.fixture(scope="module")
def general_base(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model given general ability (the pattern), shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("general-base")
    return pretrain(tiny_model_dir, tmp / "model", tmp)


def run_body(task_id: int, general_id: int, base: Path, name: str, steps: int, lr: float) -> dict:
    return {
        "dataset_ids": [task_id], "base_model": str(base), "fine_tuning": "Full", "name": name,
        "hyperparameters": {
            "max_seq_len": 64, "batch_size": 8, "max_steps": steps, "learning_rate": lr, "save_steps": 1000,
            "logging_steps": 1,
        },
        "evaluate": {
            "holdout": HOLDOUT,
            "options": {"metrics": ["exact_match"], "max_new_tokens": 4, "benchmark_prompt": "chat",
                        "bootstrap_samples": 100},
            "general": {"dataset_ids": [general_id], "margin": MARGIN},
        },
    }  # fmt: skip


def upload(api, tmp: Path, name: str, rows: list[dict], prefix: str = "") -> dict:
    with open(write_jsonl(tmp / name, rows), "rb") as f:
        r = api.post(f"{prefix}/datasets", files={"file": (name, f)})
    assert r.status_code == 201, r.text
    return r.json()


def test_overfit_run_warns_of_forgetting(studio_factory, pg_url, shared_redis_url, general_base, tmp_path):
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.env["ERNIE_STUDIO_MODEL_ROOTS"] = str(general_base.parent)  # the module's base, outside its home
    # the suite's nice 0 and 1 CPU thread (tests/conftest.py) for the trainer and evals: Studio passes on no
    # ERNIE_STUDIO_* variable, and at nice 10 they wait on every other test's processes
    studio.env |= {k: os.environ[k] for k in ("ERNIE_STUDIO_BATCH_NICENESS", "ERNIE_STUDIO_CPU_THREADS")}
    studio.start_worker("train@testnode", wait=False)  # starts beside the API; the run's task waits in Redis
    studio.start_api()
    api = studio.client()

    task = upload(api, tmp_path, "animals.jsonl", sound_records(48 + HOLDOUT, seed=1))
    general = upload(api, tmp_path, "directions.jsonl", general_items(32, seed=1))
    assert general["kind"] == "benchmark" and general["format"] == "multiple_choice"
    r = api.post("/runs", json=run_body(task["id"], general["id"], general_base, "overfit", 30, 2e-2))
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    studio.wait_ready("train@testnode")

    def checked() -> dict | None:
        got = api.get(f"/runs/{run_id}").json()
        assert got["status"] not in ("failed", "cancelled"), got["error"]
        failed = [e for e in api.get("/evals", params={"run_id": run_id}).json() if e["status"] == "failed"]
        assert not failed, failed[0]["error"]
        return got["forgetting"]

    over = wait_for(checked, 600, "the overfit run's forgetting check", interval=0.5)

    g = over["general"]
    assert g["n"] == 32 and g["base"] >= 0.8 and g["result"] <= 0.5, g
    assert g["change_ci"][1] < -MARGIN and g["change_ci"][0] <= g["change"] <= g["change_ci"][1], g
    assert set(g["sets"]) == {"directions.jsonl"}
    assert over["warning"] is True and over["margin"] == MARGIN
    t = over["task"]
    assert t["n"] == HOLDOUT and set(t["sets"]) == {"animals.holdout.jsonl"}
    # Its task: the exact match is reported beside the general score and does not fall. How much of it 30
    # steps teach moves with the CPU's arithmetic (measured: 0 -> 0.25 on an Intel Xeon, one animal's sound
    # learnt; 0 -> 0 on an AMD EPYC for this seed, 0.19-0.25 for others), so the test holds that the run
    # trained on its task instead: its loss over the last 5 steps is under half its loss over the first 5.
    assert t["base"] <= 0.1 and t["result"] >= t["base"] and t["change_ci"][0] <= t["change"], t
    losses = [m["loss"] for m in api.get(f"/runs/{run_id}/metrics").json() if m.get("loss") is not None]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses  # measured: 0.28
    kinds = {e["kind"] for e in api.get(f"/runs/{run_id}/events").json()}
    assert "run.forgetting_warning" in kinds and "run.forgetting_checked" not in kinds, kinds


def test_gentle_run_does_not_warn(general_base, tmp_path):
    """The gentle run through the studio's services, without the worker: its run is made by the API, trained
    in this process on the config the worker would hand the trainer, its base and result evals claimed and
    scored in this process on their own configs, and the scored sample lines recorded as the worker does."""
    settings = Settings(home=tmp_path / "home", model_roots=str(general_base.parent))
    upgrade(settings)
    with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as api:
        task = upload(api, tmp_path, "animals.jsonl", sound_records(48 + HOLDOUT, seed=1), "/api/v1")
        general = upload(api, tmp_path, "directions.jsonl", general_items(32, seed=1), "/api/v1")
        r = api.post(
            "/api/v1/runs", json=run_body(task["id"], general["id"], general_base, "gentle", 6, 1e-5)
        )
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        with session_factory(settings)() as session:
            attempt = claim_run(session, run_id, "train@n1", "n1")
            trained = run_training(config_from_dict(TrainConfig, attempt.config))
            assert trained.status == "succeeded" and trained.steps == 6
            attempt.finish(session, RunStatus.SUCCEEDED, model_dir=trained.model_dir)
            made = eval_after.evaluate_after(session, settings, session.get(Run, run_id))
            assert {ev.role for ev in made} == {"base", "result"}
            for ev in made:
                assert jobs.claim(session, jobs.EVALS, ev.id, "train@n1") is not None
                scored = run_eval(config_from_dict(EvalConfig, ev.config))
                assert scored.status == "succeeded", scored
                out = Path(ev.config["output_dir"])
                lines = (out / "eval_samples.jsonl").read_text().splitlines()
                evals_svc.record_samples(session, ev.id, [json.loads(line) for line in lines])
                results = json.loads((out / "eval_results.json").read_text())
                evals_svc.finish_eval(session, ev.id, RunStatus.SUCCEEDED, results=results)
        calm = api.get(f"/api/v1/runs/{run_id}").json()["forgetting"]
        kinds = {e["kind"] for e in api.get(f"/api/v1/runs/{run_id}/events").json()}
    dispose_engines()

    g = calm["general"]
    assert g["n"] == 32 and g["base"] >= 0.8 and abs(g["change"]) <= 0.05, g
    assert calm["task"]["n"] == HOLDOUT and calm["warning"] is False and calm["margin"] == MARGIN
    assert "run.forgetting_checked" in kinds and "run.forgetting_warning" not in kinds, kinds
