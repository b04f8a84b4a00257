"""An ERNIEKit recipe imported through REST (``POST /runs/import``) and launched as it answers (``POST /runs``)
trains on a real worker with the config ``ernie-studio train`` makes of the same file: the run's
train_config.json equals the CLI's ``load_config`` key for key, except the keys the import says the studio
sets (output and logging paths, data types) and the paths it maps by name (model, data: the studio's copies). A few keys are changed first, the same for both, so the run is short
and fits one CPU device (max_steps, max_seq_len, gradient accumulation; ERNIEKit's ``sharding: stage1``
needs two ranks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml
from worker_helpers import DEMO_SFT

from engine.train.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "studio" / "recipes" / "ernie-4.5-0.3b-sft-lora-8k.yaml"
SHORT = {"max_steps": 2, "max_seq_len": 128, "gradient_accumulation_steps": 1, "model_name_or_path": "tiny"}


def test_an_imported_recipe_trains_with_the_config_the_cli_makes_of_it(studio_factory, tmp_path):
    values = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    values.pop("sharding")
    values |= SHORT
    values["train_dataset_path"] = values["eval_dataset_path"] = "./data/sft_demo.jsonl"
    text = yaml.safe_dump(values, sort_keys=False)
    studio = studio_factory()
    studio.start_api()
    studio.start_worker("train@testnode")
    api = studio.client()
    with DEMO_SFT.open("rb") as f:
        assert api.post("/datasets", files={"file": ("sft_demo.jsonl", f)}).status_code == 201
    r = api.post("/runs/import", content=text, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 200, r.text
    imported = r.json()
    assert not [d for d in imported["datasets"] if d["dataset_id"] is None], imported["datasets"]
    spec = {
        k: imported[k]
        for k in ("stage", "fine_tuning", "base_model", "dataset_ids", "dataset_probs", "eval_dataset_ids")
    }
    spec["hyperparameters"] = {"compute_type": imported["compute_type"], **imported["hyperparameters"]}
    r = api.post("/runs", json=spec)
    assert r.status_code == 201, r.text
    run = r.json()
    done = studio.wait_status(api, run["id"], {"succeeded", "failed"}, 300)
    assert done["status"] == "succeeded", done["error"]

    written = json.loads((Path(run["output_dir"]) / "train_config.json").read_text())
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    cli = dataclasses.asdict(load_config(path))
    studio_set = set(imported["studio_set"])
    assert "output_dir" in studio_set, studio_set
    # the paths the import maps by name: the studio's copies of the same model and file
    mapped = {"model_name_or_path", "train_dataset_path", "eval_dataset_path"}
    assert Path(written["model_name_or_path"]).name == "tiny"
    assert (
        Path(written["train_dataset_path"]).name
        == Path(written["eval_dataset_path"]).name
        == "sft_demo.jsonl"
    )
    skip = studio_set | mapped
    differ = {k: (cli[k], written.get(k)) for k in cli if k not in skip and written.get(k) != cli[k]}
    assert differ == {}, differ
    assert set(written) == set(cli)
