"""POST /api/v1/sweeps refuses bad input with the key named (a key the schema does not know, an empty range,
bounds outside the schema's, an objective no eval produces, parallelism above the workers, no eval data),
queues a good sweep with its Optuna study in the studio's own database and its planner estimate; Optuna's
tables sit beside the studio's without disturbing Alembic, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from studio_helpers import DEMO_SFT, upload

from studio.config import Settings
from studio.migrate import check, upgrade
from studio.models import Run
from studio.services import jobs
from studio.services import nodes as nodes_svc
from studio.services import sweeps as sweeps_svc
from studio.sweep_storage import OPTUNA_TABLES, dispose_storages, optuna_storage

LR = {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}


@pytest.fixture
def body(client) -> dict:
    ds = upload(client, DEMO_SFT).json()["id"]
    run = {"dataset_ids": [ds], "eval_dataset_ids": [ds], "hyperparameters": {"max_steps": 4}}
    return {"run": run, "parameters": {"learning_rate": LR}, "n_trials": 3}


def _refused(client, body: dict) -> str:
    r = client.post("/api/v1/sweeps", json=body)
    assert r.status_code == 422, r.text
    return r.json()["message"]


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"learning_rat": LR}, "learning_rat: not a training key (did you mean learning_rate?)"),
        ({"learning_rate": {**LR, "low": 1e-3, "high": 1e-3}}, "learning_rate: the range is empty"),
        (
            {"lora_rank": {"type": "int", "low": 0, "high": 8}},
            "lora_rank: low 0 is below the key's minimum 1",
        ),
        ({"lora_rank": {"type": "int", "low": 2.5, "high": 8}}, "lora_rank: low must be an integer"),
        ({"learning_rate": {**LR, "low": 0}}, "learning_rate: a log range needs low > 0"),
        (
            {"lr_scheduler_type": {"choices": ["cosine", "cosyne"]}},
            "lr_scheduler_type: choice 'cosyne' is not",
        ),
        ({"train_dataset_path": {"choices": ["a"]}}, "train_dataset_path: set by the sweep itself"),
        (
            {"lr_scheduler_type": {"type": "float", "low": 0, "high": 1}},
            "lr_scheduler_type: a float range needs",
        ),
        ({}, "give at least one key to search"),
    ],
)
def test_space_errors_name_the_key(client, body, parameters, says):
    assert says in _refused(client, {**body, "parameters": parameters})


def test_settings_errors_name_the_key(client, body, session):
    assert (
        "objective: 'eval_accuracy' is no metric a SFT evaluation reports (eval_loss, eval_ppl)"
        in _refused(client, {**body, "objective": "eval_accuracy"})
    )
    no_eval = {**body, "run": {**body["run"], "eval_dataset_ids": None}}
    assert "objective: eval_loss comes from the evaluation every eval_steps" in _refused(client, no_eval)
    no_eval = {**body, "run": {**body["run"], "hyperparameters": {"do_eval": False}}}
    assert "run.hyperparameters: do_eval: false evaluates nothing, so no trial reports eval_loss" in _refused(
        client, no_eval
    )
    assert "sampler: must be one of tpe, random" in _refused(client, {**body, "sampler": "grid"})
    assert "enqueue[0]: give values of the searched keys only" in _refused(
        client, {**body, "enqueue": [{"lora_rank": 8}]}
    )
    nodes_svc.register_node(session, name="train@n1", node="n1", hostname="h", queues=["train"])
    nodes_svc.register_node(session, name="serve@n1", node="n1", hostname="h", queues=["serve", "export"])
    assert "parallelism: 2 trials at once, but 1 training worker(s) take runs of queue train" in _refused(
        client, {**body, "parallelism": 2}
    )


def test_a_sweep_is_queued_with_its_study_and_estimate(client, body, settings):
    r = client.post("/api/v1/sweeps", json={**body, "enqueue": [{"learning_rate": 3e-3}]})
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert sweep["status"] == "queued" and sweep["dispatched_at"] and sweep["leaderboard"] == []
    # the enqueued trial waits in the study, kept in the studio's database
    assert [(t["state"], t["params"], t["run_id"]) for t in sweep["trials"]] == [
        ("waiting", {"learning_rate": 3e-3}, None)
    ]
    est = sweep["estimate"]
    assert est["n_trials"] == 3 and est["steps"] == 3 * est["run"]["steps"] == 12
    assert est["total_s"] == pytest.approx(3 * est["run"]["time"]["total_s"])
    study = __import__("optuna").load_study(study_name=sweep["study_name"], storage=optuna_storage(settings))
    assert len(study.get_trials()) == 1
    assert client.post(f"/api/v1/sweeps/{sweep['id']}/promote").status_code == 409
    cancelled = client.post(f"/api/v1/sweeps/{sweep['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["stop_reason"] == "cancelled"
    assert client.post(f"/api/v1/sweeps/{sweep['id']}/cancel").status_code == 409
    assert [s["id"] for s in client.get("/api/v1/sweeps").json()] == [sweep["id"]]
    assert client.get("/api/v1/sweeps/999").status_code == 404


def test_enqueued_trials_up_to_n_trials_all_start(client, body, session, settings):
    """Waiting enqueued trials are not yet asked: a sweep whose `enqueue` lists all of its n_trials starts
    them (it once counted them as asked, started none and ended at once)."""
    values = [{"learning_rate": 1e-3}, {"learning_rate": 3e-3}]
    r = client.post("/api/v1/sweeps", json={**body, "n_trials": 2, "parallelism": 2, "enqueue": values})
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    assert jobs.claim(session, jobs.SWEEPS, sweep_id, "train@n1") is not None  # a worker drives it
    assert sweeps_svc.advance(session, settings, sweep_id) is False  # still going: both trials run
    runs = session.query(Run).filter(Run.sweep_id == sweep_id).order_by(Run.sweep_trial).all()
    assert [(run.sweep_trial, run.config["learning_rate"]) for run in runs] == [(0, 1e-3), (1, 3e-3)]
    got = client.get(f"/api/v1/sweeps/{sweep_id}").json()
    assert got["status"] == "running" and [t["state"] for t in got["trials"]] == ["running", "running"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_optuna_tables_beside_the_studios(tmp_path, backend, request):
    from optuna.storages._rdb import models

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else ""
    s = Settings(home=tmp_path / "home", database_url=url)
    upgrade(s)
    try:
        storage = optuna_storage(s)
        study = __import__("optuna").create_study(storage=storage, study_name="beside")
        study.enqueue_trial({"x": 1.0})
        assert set(models.BaseModel.metadata.tables) == OPTUNA_TABLES
        check(s)  # the studio's autogenerate sees no difference: Optuna's tables are left out
        upgrade(s)  # and the studio's revision is still the one in alembic_version
        with storage.engine.connect() as conn:
            revision = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one()
        assert (
            revision
            == __import__("tests.studio.test_migrations_with_rows", fromlist=["REVISIONS"]).REVISIONS[-1]
        )
    finally:
        dispose_storages()
