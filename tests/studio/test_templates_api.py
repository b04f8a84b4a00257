"""/api/v1/templates: a Train form saved under a name, checked as POST /runs checks it; read back with every
option; a dataset deleted since is named; bad names, duplicates and unknown ids are refused clearly."""

from __future__ import annotations

import pytest
from studio_helpers import DEMO_SFT, upload

API = "/api/v1/templates"


@pytest.fixture
def dataset(client) -> int:
    return upload(client, DEMO_SFT).json()["id"]


def _spec(dataset: int, **hyper) -> dict:
    return {
        "name": "lora-run",
        "base_model": "tiny",
        "dataset_ids": [dataset],
        "stage": "SFT",
        "fine_tuning": "LoRA",
        "hyperparameters": {"lora_rank": 16, "learning_rate": 0.0002, "max_steps": 3, **hyper},
    }


def test_a_template_is_saved_listed_read_back_whole_and_deleted(client, dataset):
    r = client.post(API, json={"name": "  my lora  ", "spec": _spec(dataset, lora_alpha=64)})
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["name"] == "my lora" and made["missing_datasets"] == {} and made["notes"] == []
    assert made["spec"]["hyperparameters"] == {
        "lora_rank": 16,
        "learning_rate": 0.0002,
        "max_steps": 3,
        "lora_alpha": 64,
    }
    assert [t["name"] for t in client.get(API).json()] == ["my lora"]
    got = client.get(f"{API}/{made['id']}").json()
    assert got == made
    # the spec launches as it is
    run = client.post("/api/v1/runs", json=got["spec"])
    assert run.status_code == 201, run.text
    assert (run.json()["config"]["lora_rank"], run.json()["config"]["lora_alpha"]) == (16, 64)
    assert client.delete(f"{API}/{made['id']}").status_code == 204
    assert client.get(API).json() == []
    assert client.get(f"{API}/{made['id']}").status_code == 404


@pytest.mark.parametrize(
    ("name", "says"),
    [("", "name: empty"), ("   ", "name: empty"), ("x" * 101, "name: 101 characters"), ("a\x00b", "control")],
)
def test_a_bad_name_is_refused_naming_the_field(client, dataset, name, says):
    r = client.post(API, json={"name": name, "spec": _spec(dataset)})
    assert r.status_code == 422 and says in r.json()["message"], r.text
    assert client.get(API).json() == []


def test_a_taken_name_is_a_conflict(client, dataset):
    assert client.post(API, json={"name": "same", "spec": _spec(dataset)}).status_code == 201
    r = client.post(API, json={"name": "same", "spec": _spec(dataset, max_steps=5)})
    assert r.status_code == 409 and "a template named 'same' exists" in r.json()["message"]


def test_a_spec_a_run_would_be_refused_for_is_refused_with_the_engines_messages(client, dataset):
    r = client.post(API, json={"name": "bad", "spec": _spec(dataset, lora_rank=0)})
    assert r.status_code == 422 and "lora_rank" in r.json()["message"], r.text
    r = client.post(API, json={"name": "typo", "spec": _spec(dataset, learnig_rate=0.1)})
    assert r.status_code == 422 and "learning_rate" in r.json()["message"], r.text  # the closest key
    r = client.post(API, json={"name": "no data", "spec": _spec(987654)})
    assert r.status_code in (404, 422) and "987654" in r.json()["message"], r.text
    r = client.post(API, json={"name": "extra", "spec": _spec(dataset), "colour": "red"})
    assert r.status_code == 422 and "unknown key 'colour'" in r.text
    assert client.get(API).json() == []


def test_unknown_ids_are_not_found(client):
    for r in (client.get(f"{API}/424242"), client.delete(f"{API}/424242")):
        assert r.status_code == 404 and "template 424242 not found" in r.json()["message"]
    assert client.get(f"{API}/0").status_code == 422


def test_a_deleted_dataset_is_named_when_the_template_is_read(client, dataset):
    spec = _spec(dataset) | {"eval_dataset_ids": [dataset]}
    made = client.post(API, json={"name": "will lose data", "spec": spec}).json()
    assert client.delete(f"/api/v1/datasets/{dataset}").status_code == 204
    got = client.get(f"{API}/{made['id']}").json()
    assert got["missing_datasets"] == {"dataset_ids": [dataset], "eval_dataset_ids": [dataset]}
    assert f"dataset_ids: dataset #{dataset} was deleted" in got["notes"][0]


def test_a_template_an_older_studio_saved_is_listed_with_why_it_cannot_be_used(client, dataset, session):
    from studio.models import TrainTemplate

    made = client.post(API, json={"name": "old", "spec": _spec(dataset)}).json()
    stored = session.get(TrainTemplate, made["id"])
    stored.spec = {**stored.spec, "learning_rate": 0.1}  # a field RunSpec no longer has
    session.commit()
    r = client.get(f"{API}/{made['id']}")
    assert r.status_code == 422 and "unknown key 'learning_rate'" in r.json()["message"], r.text
    [listed] = client.get(API).json()
    assert listed["name"] == "old" and "delete it and save the form again" in listed["notes"][0]
    assert client.delete(f"{API}/{made['id']}").status_code == 204
