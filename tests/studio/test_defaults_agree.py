"""One source of defaults: the same run created through the REST API with no hyperparameters, from the
Train form's starting values, and with `ernie-studio train` and a minimal YAML has one effective config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml
from studio_helpers import DEMO_DPO, DEMO_SFT, REPO, upload

from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict, load_config
from engine.train.run_checks import defaults_for
from studio.services import runs as runs_svc
from studio.ui.train_tab import form_defaults, run_spec

# Keys the studio fills in for every run (where its files go); they name paths, not choices.
PLACES = ("output_dir", "logging_dir")


def effective(values: dict) -> dict:
    """What the trainer will run with: the engine's TrainConfig built from a config dict."""
    config = dataclasses.asdict(config_from_dict(TrainConfig, values))
    return {k: v for k, v in config.items() if k not in PLACES}


@pytest.mark.parametrize(
    ("stage", "fine_tuning"), [("SFT", "LoRA"), ("SFT", "Full"), ("DPO", "LoRA"), ("DPO", "Full")]
)
def test_rest_form_and_cli_give_one_effective_config(client, settings, session, tmp_path, stage, fine_tuning):
    dataset = upload(client, DEMO_DPO if stage == "DPO" else DEMO_SFT).json()

    # 1. REST, no hyperparameters (stage and fine_tuning as the request names them)
    created = client.post(
        "/api/v1/runs",
        json={
            "dataset_ids": [dataset["id"]],
            "base_model": "tiny",
            "stage": stage,
            "fine_tuning": fine_tuning,
        },
    )
    assert created.status_code == 201, created.text
    stored = created.json()["config"]
    assert set(stored) == set(runs_svc.MANAGED_KEYS)  # the studio stores no defaults of its own
    rest = effective(stored)

    # 2. the Train form's starting values for this stage and fine-tuning, as the Launch button sends them
    form = form_defaults(stage, fine_tuning) | {"base_model": "tiny", "dataset_ids": [str(dataset["id"])]}
    spec = run_spec(form)
    ui = effective(runs_svc.build_config(session, settings, spec, tmp_path / "ui-run"))

    # 3. `ernie-studio train` with a minimal YAML naming the same model and data
    minimal = {
        "model_name_or_path": rest["model_name_or_path"],
        "train_dataset_type": rest["train_dataset_type"],
        "train_dataset_path": rest["train_dataset_path"],
        "stage": stage,
        "fine_tuning": fine_tuning,
        "output_dir": str(tmp_path / "cli-run"),
    }
    path = tmp_path / "minimal.yaml"
    path.write_text(yaml.safe_dump(minimal))
    cli = {k: v for k, v in dataclasses.asdict(load_config(path)).items() if k not in PLACES}

    assert rest == ui == cli
    # and what they agree on is the engine's own schema, not a studio value
    expected = {k: v for k, v in defaults_for(stage, fine_tuning).items() if k not in runs_svc.MANAGED_KEYS}
    assert {k: v for k, v in rest.items() if k not in runs_svc.MANAGED_KEYS} == expected


def test_a_run_without_stage_or_fine_tuning_gets_the_engines(client):
    dataset = upload(client, DEMO_SFT).json()
    config = client.post("/api/v1/runs", json={"dataset_ids": [dataset["id"]]}).json()["config"]
    assert (config["stage"], config["fine_tuning"]) == (TrainConfig.stage, TrainConfig.fine_tuning)


def test_the_cli_reads_yaml_through_load_config(tmp_path):
    """`ernie-studio train` builds its config with the load_config the test above uses (a dry check of
    the real command: a bad key fails with load_config's message)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: x\ntrain_dataset_path: y\nlearning_rat: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unknown key 'learning_rat'; did you mean 'learning_rate'?" in proc.stderr
