"""Every model name `/api/v1/models` lists is accepted back wherever a model is asked for (dataset stats,
preview, estimate, runs, deployments), through one resolver whose errors name the parameter used; a LoRA
run is listed as available with its base's size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from studio_helpers import DEMO_SFT, upload

from studio.config import Settings
from studio.db import session_factory
from studio.migrate import upgrade
from studio.models import Run, RunStatus

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture
def settings(tmp_path) -> Settings:
    """A home whose models folder holds a local model, plus a second model root outside home."""
    s = Settings(home=tmp_path / "home", model_roots=str(tmp_path / "shared-models"))
    upgrade(s)
    return s


@pytest.fixture
def client(settings) -> TestClient:
    from studio.app import create_app

    with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as c:
        yield c


def _lora_run_dir(path: Path, base: Path) -> Path:
    """What a LoRA run leaves at its output root: adapter config naming the base, tokenizer, no config.json."""
    path.mkdir(parents=True)
    adapter = {"base_model": str(base), "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, path / name)
    return path


@pytest.fixture
def models(settings, tiny_model_dir, tmp_path) -> dict[str, Path]:
    """tiny (built already), a local model in home/models, one in the extra root, a full and a LoRA run."""
    shutil.copytree(tiny_model_dir, settings.models_dir / "tiny")
    local = shutil.copytree(tiny_model_dir, settings.models_dir / "ernie-0.3b-random")
    shared = shutil.copytree(tiny_model_dir, tmp_path / "shared-models" / "team-model")
    full = shutil.copytree(tiny_model_dir, settings.runs_dir / "1" / "output")
    lora = _lora_run_dir(settings.runs_dir / "2" / "output", local)
    with session_factory(settings)() as s:
        for i, (out, tuning) in enumerate(((full, "Full"), (lora, "LoRA")), 1):
            s.add(Run(id=i, name=f"r{i}", stage="SFT", fine_tuning=tuning, base_model="tiny", dataset_ids=[],
                      config={}, status=RunStatus.SUCCEEDED, queue="train", output_dir=str(out),
                      model_dir=str(out)))  # fmt: skip
        s.commit()
    return {"ernie-0.3b-random": local, "team-model": shared, "run:1": full, "run:2": lora}


def test_every_listed_name_works_in_stats_estimate_runs_and_deployments(client, models):
    listed = {m["name"]: m for m in client.get("/api/v1/models").json()}
    usable = [name for name, m in listed.items() if m["available"]]
    assert {"tiny", "ernie-0.3b-random", "team-model", "run:1", "run:2"} <= set(usable)
    assert listed["team-model"]["path"] == str(models["team-model"])
    ds = upload(client, DEMO_SFT).json()["id"]
    for name in usable:
        r = client.get(f"/api/v1/datasets/{ds}/stats", params={"model": name, "max_seq_len": 64})
        assert r.status_code == 200 and r.json()["num_records"] == 400, (name, r.text)
        r = client.get(f"/api/v1/datasets/{ds}/preview", params={"limit": 1, "render_with": name})
        assert r.status_code == 200 and r.json()["rendered"], (name, r.text)
        spec = {"base_model": name, "dataset_ids": [ds], "hyperparameters": {"max_steps": 2}}
        r = client.post("/api/v1/runs/estimate", json=spec)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["num_parameters"] == listed[name]["num_parameters"], name
        r = client.post("/api/v1/runs", json=spec)
        assert r.status_code == 201, (name, r.text)
        assert r.json()["config"]["model_name_or_path"] == listed[name]["path"], name
        r = client.post("/api/v1/deployments", json={"model": name})
        assert r.status_code == 201 and r.json()["model_dir"] == listed[name]["path"], (name, r.text)


def test_a_lora_run_is_listed_available_with_its_bases_size(client, models):
    listed = {m["name"]: m for m in client.get("/api/v1/models").json()}
    lora, base = listed["run:2"], listed["ernie-0.3b-random"]
    assert lora["available"] is True and lora["kind"] == "run" and lora["run_id"] == 2
    assert lora["num_parameters"] == base["num_parameters"] > 0
    assert lora["model_type"] == base["model_type"]
    assert lora["base_model"] == str(models["ernie-0.3b-random"])
    assert lora["adapter"] == {"r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"], "compute_type": None}
    assert listed["run:1"]["adapter"] is None and listed["run:1"]["base_model"] is None
    # The base gone: still listed, no longer available.
    shutil.rmtree(models["ernie-0.3b-random"])
    lora = {m["name"]: m for m in client.get("/api/v1/models").json()}["run:2"]
    assert lora["available"] is False and lora["num_parameters"] is None


def test_errors_name_the_parameter_that_named_the_model(client, models, settings):
    ds = upload(client, DEMO_SFT).json()["id"]
    asks = {
        "model": client.get(f"/api/v1/datasets/{ds}/stats", params={"model": "no-such-model"}),
        "render_with": client.get(f"/api/v1/datasets/{ds}/preview", params={"render_with": "no-such-model"}),
        "base_model": client.post("/api/v1/runs/estimate", json={"base_model": "no-such-model", "dataset_ids": [ds]}),
        "model ": client.post("/api/v1/deployments", json={"model": "no-such-model"}),
    }  # fmt: skip
    for field, r in asks.items():
        message = r.json()["message"]
        assert r.status_code == 422 and message.startswith(f"{field.strip()}: no model is named"), message
        assert str(settings.models_dir) in message and "ERNIE_STUDIO_MODEL_ROOTS" in message
    r = client.get(f"/api/v1/datasets/{ds}/stats", params={"model": "run:99"})
    assert r.status_code == 404 and r.json()["message"].startswith("model: run 99"), r.text
    r = client.post("/api/v1/deployments", json={"model": "/etc"})
    assert r.status_code == 422 and r.json()["message"].startswith("model: '/etc' is outside"), r.text
    # a name the file system cannot hold (schemathesis found a 500 here: ENAMETOOLONG from exists())
    r = client.get(f"/api/v1/datasets/{ds}/preview", params={"render_with": "x" * 300})
    assert r.status_code == 422 and "too long for a model name" in r.json()["message"], r.text


def test_a_name_in_two_roots_is_listed_once_by_name_and_once_by_path(
    client, models, tiny_model_dir, tmp_path
):
    twin = shutil.copytree(tiny_model_dir, tmp_path / "shared-models" / "ernie-0.3b-random")
    listed = {m["name"]: m for m in client.get("/api/v1/models").json()}
    assert listed["ernie-0.3b-random"]["path"] == str(models["ernie-0.3b-random"])
    assert listed[str(twin)]["path"] == str(twin)
    r = client.post("/api/v1/deployments", json={"model": str(twin)})
    assert r.status_code == 201 and r.json()["model_dir"] == str(twin)


def test_the_train_tab_picks_models_by_their_listed_name_and_shows_the_model_folders(settings, models):
    from studio.services.models import list_models
    from studio.ui.context import UIContext, model_choices
    from studio.ui.i18n import Texts
    from studio.ui.train_tab import TrainHandlers

    ctx = UIContext(settings=settings, texts=Texts(), demo=None)
    choices = dict((ref, label) for label, ref in model_choices(ctx.read(list_models, settings, default=[])))
    assert {"ernie-0.3b-random", "team-model", "run:1", "run:2"} <= set(choices)
    assert "LoRA" in choices["run:2"] and "not downloaded" not in choices["run:2"]
    roots = TrainHandlers(ctx, []).model_roots()
    assert roots.split("  ·  ") == [str(settings.models_dir), str(models["team-model"].parent)]
