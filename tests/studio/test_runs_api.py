"""Runs through the REST API without a worker: validation, queue positions, cancel / resume / clone /
delete, the ERNIEKit YAML, estimates, compare; and the idempotent metric store on SQLite and PostgreSQL."""

from __future__ import annotations

import yaml
from studio_helpers import DEMO_DPO, DEMO_SFT, upload

from studio.config import Settings
from studio.db import session_factory
from studio.migrate import upgrade
from studio.services import run_lifecycle
from studio.services import runs as runs_svc


def _run(client, dataset_id: int, **hyper) -> dict:
    r = client.post(
        "/api/v1/runs", json={"dataset_ids": [dataset_id], "hyperparameters": {"max_steps": 5, **hyper}}
    )
    assert r.status_code == 201, r.text
    return r.json()


def test_create_validates_against_the_engine_config(client, settings):
    ds = upload(client, DEMO_SFT).json()
    r = client.post("/api/v1/runs", json={"dataset_ids": [ds["id"]], "hyperparameters": {"max_stepz": 5}})
    assert r.status_code == 422 and "did you mean 'max_steps'" in r.json()["message"]
    r = client.post("/api/v1/runs", json={"dataset_ids": [ds["id"]], "stage": "DPO"})
    assert r.status_code == 422 and "needs dpo data" in r.json()["message"]
    r = client.post("/api/v1/runs", json={"dataset_ids": [ds["id"]], "base_model": "/etc"})
    assert r.status_code == 422 and "outside the studio's storage" in r.json()["message"]
    r = client.post("/api/v1/runs", json={"dataset_ids": [999]})
    assert r.status_code == 404 and "dataset 999" in r.json()["message"]
    r = client.post(
        "/api/v1/runs", json={"dataset_ids": [ds["id"]], "hyperparameters": {"output_dir": "/tmp/x"}}
    )
    assert r.status_code == 422 and "output_dir" in r.json()["message"]
    # expert parallelism on the dense default model: refused by its key, nothing queued
    from engine.models.initialize import init_model

    init_model("tiny", settings.models_dir / "tiny", seed=0)
    before = client.get("/api/v1/runs").json()
    r = client.post(
        "/api/v1/runs", json={"dataset_ids": [ds["id"]], "hyperparameters": {"expert_parallel_degree": 2}}
    )
    assert r.status_code == 422 and "expert_parallel_degree: 2 needs an MoE model" in r.json()["message"]
    assert client.get("/api/v1/runs").json() == before
    dpo = upload(client, DEMO_DPO).json()
    r = client.post(
        "/api/v1/runs", json={"dataset_ids": [dpo["id"]], "stage": "DPO", "hyperparameters": {"beta": 0.2}}
    )
    assert r.status_code == 201 and r.json()["config"]["beta"] == 0.2


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_is_refused_and_nothing_is_queued(
    client, settings
):
    from engine.models.initialize import init_model

    init_model("tiny-moe", settings.models_dir / "tiny-moe", seed=0)  # 8 routed experts per MoE layer
    ds = upload(client, DEMO_SFT).json()
    body = {"dataset_ids": [ds["id"]], "base_model": "tiny-moe",
            "hyperparameters": {"max_steps": 5, "expert_parallel_degree": 3}}  # fmt: skip
    r = client.post("/api/v1/runs", json=body)
    assert r.status_code == 422, r.text
    assert "expert_parallel_degree: 3 does not divide the model's 8 experts" in r.json()["message"], r.text
    assert client.get("/api/v1/runs").json() == []
    # the same run without expert parallelism is accepted
    body["hyperparameters"]["expert_parallel_degree"] = 1
    assert client.post("/api/v1/runs", json=body).status_code == 201


def test_sharding_on_one_device_is_refused_and_nothing_is_queued(client):
    ds = upload(client, DEMO_SFT).json()
    body = {"dataset_ids": [ds["id"]], "hyperparameters": {"max_steps": 5, "sharding": "stage1"}}
    r = client.post("/api/v1/runs", json=body)
    assert r.status_code == 422, r.text
    assert "sharding: stage1 splits the optimizer state" in r.json()["message"]
    assert "one device" in r.json()["message"]
    assert client.get("/api/v1/runs").json() == []
    # ERNIEKit's single-GPU recipes: stage1 with sharding_parallel_degree 1 splits nothing and trains
    body["hyperparameters"]["sharding_parallel_degree"] = 1
    assert client.post("/api/v1/runs", json=body).status_code == 201


def test_queue_positions_cancel_resume_clone_delete(client, settings):
    ds = upload(client, DEMO_SFT).json()
    runs = [_run(client, ds["id"], learning_rate=lr) for lr in (1e-4, 2e-4, 3e-4)]
    assert [r["status"] for r in runs] == ["queued"] * 3
    assert [r["queue_position"] for r in runs] == [1, 2, 3]
    assert all(r["dispatched_at"] for r in runs)  # the embedded broker took the messages

    cancelled = client.post(f"/api/v1/runs/{runs[0]['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["ended_at"] and cancelled["cancel_requested_at"]
    assert client.get(f"/api/v1/runs/{runs[1]['id']}").json()["queue_position"] == 1
    again = client.post(f"/api/v1/runs/{runs[0]['id']}/cancel")
    assert again.status_code == 409 and "already ended" in again.json()["message"]

    resumed = client.post(f"/api/v1/runs/{runs[0]['id']}/resume").json()
    assert resumed["status"] == "queued" and resumed["queue_position"] == 3 and resumed["resume_from"] is None
    assert client.post(f"/api/v1/runs/{runs[1]['id']}/resume").status_code == 409

    clone = client.post(
        f"/api/v1/runs/{runs[2]['id']}/clone", json={"overrides": {"learning_rate": 5e-4}}
    ).json()
    assert clone["parent_run_id"] == runs[2]["id"] and clone["config"]["learning_rate"] == 5e-4
    assert clone["config"]["output_dir"] != runs[2]["config"]["output_dir"]

    text = client.get(f"/api/v1/runs/{clone['id']}/config").text
    cfg = yaml.safe_load(text)
    assert (
        cfg["fine_tuning"] == "LoRA" and cfg["max_steps"] == 5 and cfg["model_name_or_path"].endswith("tiny")
    )
    from engine.train.config_load import load_config

    path = settings.home / "cfg.yaml"
    path.write_text(text)
    assert load_config(path, []).max_steps == 5  # `ernie-studio train` accepts the YAML as is

    kinds = [e["kind"] for e in client.get(f"/api/v1/runs/{runs[0]['id']}/events").json()]
    assert kinds == ["run.queued", "run.cancelled", "run.resumed"]

    busy = client.delete(f"/api/v1/datasets/{ds['id']}")
    assert busy.status_code == 409 and "cancel them first" in busy.json()["message"]
    assert client.delete(f"/api/v1/runs/{clone['id']}").status_code == 204
    assert client.get(f"/api/v1/runs/{clone['id']}").status_code == 404
    queued = client.get("/api/v1/runs", params={"status": "queued"}).json()
    assert [r["id"] for r in queued] == [runs[2]["id"], runs[1]["id"], runs[0]["id"]]
    assert [r["queue_position"] for r in queued] == [2, 1, 3]
    assert client.get("/api/v1/runs", params={"status": "bogus"}).status_code == 422


def test_estimate_scales_with_the_model(client):
    ds = upload(client, DEMO_SFT).json()
    spec = {"dataset_ids": [ds["id"]], "hyperparameters": {"max_steps": 10, "max_seq_len": 512}}
    lora = client.post("/api/v1/runs/estimate", json=spec).json()
    full = client.post("/api/v1/runs/estimate", json={**spec, "fine_tuning": "Full"}).json()
    assert lora["num_parameters"] == full["num_parameters"] == full["trainable_parameters"]
    assert 0 < lora["trainable_parameters"] < full["trainable_parameters"]
    assert lora["memory_gib"]["optimizer"] < full["memory_gib"]["optimizer"]
    assert full["tokens"] == 10 * 512


def test_compare_aligns_steps_and_diffs_configs(client, settings, session):
    ds = upload(client, DEMO_SFT).json()
    a, b = _run(client, ds["id"], learning_rate=1e-4), _run(client, ds["id"], learning_rate=3e-4)
    for run_id in (a["id"], b["id"]):
        run_lifecycle.claim_run(session, run_id, "test-worker", "node")
    run_lifecycle.record_metrics(session, a["id"], [{"step": s, "loss": 3.0 - s * 0.1} for s in (1, 2, 3)])
    run_lifecycle.record_metrics(session, b["id"], [{"step": s, "loss": 2.0 - s * 0.1} for s in (2, 4)])
    out = client.get("/api/v1/compare", params=[("run_ids", a["id"]), ("run_ids", b["id"])]).json()
    assert out["steps"] == [1, 2, 3, 4]
    assert out["metrics"]["loss"][str(a["id"])] == [2.9, 2.8, 2.7, None]
    assert out["metrics"]["loss"][str(b["id"])] == [None, 1.8, None, 1.6]
    assert out["config_diff"] == {"learning_rate": {str(a["id"]): 1e-4, str(b["id"]): 3e-4}}
    assert client.get("/api/v1/compare", params={"run_ids": 12345}).status_code == 404
    metrics = client.get(f"/api/v1/runs/{a['id']}/metrics", params={"after_step": 1}).json()
    assert [m["step"] for m in metrics] == [2, 3]


def _metrics_are_idempotent(settings: Settings) -> None:
    upgrade(settings)
    with session_factory(settings)() as s:
        from studio.models import Dataset

        ds = Dataset(
            name="d", filename="d.jsonl", path="d.jsonl", format="erniekit", kind="sft", size_bytes=1
        )
        s.add(ds)
        s.commit()
        from studio.models import Run

        run = Run(
            name="r", stage="SFT", fine_tuning="LoRA", base_model="tiny", queue="train", output_dir="/x"
        )
        s.add(run)
        s.commit()
        points = [{"step": i, "loss": 1.0 / i, "learning_rate": 1e-4} for i in range(1, 6)]
        assert run_lifecycle.record_metrics(s, run.id, points[:3]) == 3
        # A resumed attempt replays steps 2..5: only 4 and 5 are new.
        assert run_lifecycle.record_metrics(s, run.id, points[1:]) == 2
        assert [m.step for m in runs_svc.get_metrics(s, run.id)] == [1, 2, 3, 4, 5]
        assert run_lifecycle.record_checkpoints(s, run.id, [(2, "/x/checkpoint-2")]) == 1
        assert (
            run_lifecycle.record_checkpoints(s, run.id, [(2, "/x/checkpoint-2"), (4, "/x/checkpoint-4")]) == 1
        )


def test_metric_points_are_idempotent_on_sqlite(tmp_path):
    _metrics_are_idempotent(Settings(home=tmp_path))


def test_metric_points_are_idempotent_on_postgresql(tmp_path, pg_url):
    _metrics_are_idempotent(Settings(home=tmp_path, database_url=pg_url))
