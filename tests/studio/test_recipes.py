"""Recipes (studio/recipes/*.yaml): ERNIEKit's example configs, each naming its source; every one loads through
the import service with no unknown key, gives a run spec the engine accepts on the tiny model, and carries the
planner's verdict for the studio's nodes."""

from __future__ import annotations

import json

import pytest
import yaml
from studio_helpers import DEMO_DPO, DEMO_PT, DEMO_SFT, REPO, upload
from test_estimate_api import cpu_node, gpu_node

from engine.estimate import plan_run
from engine.models.presets import preset_config
from engine.train.config import TrainConfig
from studio.services import recipes
from studio.services import runs as runs_svc
from studio.services.errors import NotFound
from studio.services.estimates import studio_nodes

SNAPSHOT = json.loads((REPO / "tests" / "engine" / "data" / "erniekit_keys.json").read_text())
RECIPES = [r.id for r in recipes.list_recipes()]
DEMOS = {"SFT": DEMO_SFT, "DPO": DEMO_DPO, "PT": DEMO_PT}


def test_the_recipes_cover_the_models_and_kinds_erniekit_publishes():
    sources = {r.source_path.removeprefix("examples/configs/") for r in recipes.list_recipes()}
    assert sources == {
        "ERNIE-4.5-0.3B/sft/run_sft_8k.yaml",
        "ERNIE-4.5-0.3B/sft/run_sft_lora_8k.yaml",
        "ERNIE-4.5-0.3B/sft/run_sft_wint8mix_lora_8k.yaml",
        "ERNIE-4.5-0.3B/dpo/run_dpo_8k.yaml",
        "ERNIE-4.5-0.3B/pt/run_pt_8k.yaml",
        "ERNIE-4.5-21B-A3B/sft/run_sft_lora_8k.yaml",
        "ERNIE-4.5-21B-A3B/fc/run_fc_lora_8k.yaml",
        "ERNIE-4.5-21B-A3B-Thinking/sft/run_sft_lora_8k.yaml",
    }


@pytest.mark.parametrize("recipe_id", RECIPES)
def test_a_recipe_is_erniekits_file_at_the_commit_it_names(recipe_id):
    """Same commit and the same keys as the snapshot of ERNIEKit's configs (nothing added or dropped)."""
    recipe = recipes.get_recipe(recipe_id)
    entry = SNAPSHOT["files"][recipe.source_path]
    assert recipe.source_commit == entry["commit"]
    assert recipe.erniekit_version == SNAPSHOT["erniekit_version"]
    assert sorted(yaml.safe_load(recipe.text)) == sorted(entry["keys"])


@pytest.mark.parametrize("recipe_id", RECIPES)
def test_a_recipe_loads_through_the_import_and_the_engine_accepts_it_on_the_tiny_model(
    recipe_id, client, session, settings
):
    imported = recipes.load_recipe(session, settings, recipe_id)
    # ERNIEKit's model is matched by name to the official preset (the Thinking variant is no preset: missing)
    thinking = "thinking" in recipe_id
    assert imported.base_model == (None if thinking else recipes.get_recipe(recipe_id).shape)
    # the datasets are the person's: ERNIEKit's file names, listed as missing
    assert imported.missing and not imported.dataset_ids
    dataset = upload(client, DEMOS[imported.stage]).json()["id"]
    spec = runs_svc.RunSpec(
        base_model="tiny",
        dataset_ids=[dataset],
        stage=imported.stage,
        fine_tuning=imported.fine_tuning,
        hyperparameters={"compute_type": imported.compute_type, **imported.spec_hyperparameters()},
    )
    config = runs_svc.preview_config(session, settings, spec)
    effective = runs_svc.effective_config(config)
    assert (effective.stage, effective.fine_tuning) == (imported.stage, imported.fine_tuning)
    assert effective.learning_rate == imported.hyperparameters["learning_rate"]


def test_an_unknown_recipe_is_not_found_and_never_a_path(session, settings):
    for bad in ("nope", "../../pyproject", "/etc/passwd", "ernie-4.5-0.3b-sft-lora-8k.yaml"):
        with pytest.raises(NotFound, match="no recipe is named"):
            recipes.load_recipe(session, settings, bad)


def test_without_nodes_there_is_no_verdict(session, settings):
    verdict = recipes.recipe_verdict(session, settings, RECIPES[0])
    assert (verdict["status"], verdict["plan"]) == ("no_nodes", None)


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        # 8 x 80 GiB GPUs: every recipe fits one device; three set sharding stage1 with sharding_parallel_degree
        # left at -1, which one device cannot do (the engine refuses it too): the planner's settings instead
        (
            "gpu",
            {
                "ernie-4.5-0.3b-dpo-full-8k": "fits",
                "ernie-4.5-0.3b-pt-full-8k": "fits",
                "ernie-4.5-0.3b-sft-full-8k": "proposal",
                "ernie-4.5-0.3b-sft-lora-8k": "proposal",
                "ernie-4.5-0.3b-sft-wint8mix-lora-8k": "fits",
                "ernie-4.5-21b-a3b-fc-lora-8k": "fits",
                "ernie-4.5-21b-a3b-sft-lora-8k": "proposal",
                "ernie-4.5-21b-a3b-thinking-sft-lora-8k": "fits",
            },
        ),
        # a 16 GiB CPU node holds none of them at 8k tokens
        ("cpu", dict.fromkeys(RECIPES, "does_not_fit")),
    ],
)
def test_each_verdict_is_the_planners_for_the_studios_nodes(session, settings, node, expected):
    if node == "gpu":
        gpu_node(session, "train@gpu1", gpus=8)
    else:
        cpu_node(session, "train@small", ram_gib=16)
    session.commit()
    nodes = studio_nodes(session, settings)
    got = {}
    for recipe_id in RECIPES:
        verdict = recipes.recipe_verdict(session, settings, recipe_id)
        got[recipe_id] = verdict["status"]
        imported = recipes.load_recipe(session, settings, recipe_id)
        shape = recipes.get_recipe(recipe_id).shape
        lora = imported.fine_tuning == "LoRA"
        plan = plan_run(
            preset_config(shape),
            imported.stage,
            imported.fine_tuning,
            imported.hyperparameters["max_seq_len"],
            nodes,
            model_name=shape,
            lora_rank=imported.hyperparameters.get("lora_rank", 8),
            lora_targets=None if not lora else verdict_targets(imported),
            batch_size=imported.hyperparameters.get("batch_size", 1),
        )
        assert verdict["plan"] == plan.to_dict(), recipe_id
        if verdict["status"] == "does_not_fit":
            assert verdict["reason"].startswith("does not fit on 1 device(s)"), verdict["reason"]
        if verdict["status"] == "proposal":
            assert verdict["plan"]["proposal"] is not None
            assert any("sharding: stage1" in p for p in verdict["problems"]), verdict["problems"]
    assert got == expected


def test_the_verdicts_refusal_and_warning_are_chinese_by_key(session, settings, monkeypatch):
    """What the planner refuses (sharding on one device) and the estimate's warning keep their keys into
    the verdict, and the Train tab shows the refusal in Chinese with the old patterns gone."""
    from studio.ui import i18n
    from studio.ui.train_templates import format_verdict

    recipe = "ernie-4.5-0.3b-sft-lora-8k"
    gpu_node(session, "train@gpu1", gpus=8)
    session.commit()
    verdict = recipes.recipe_verdict(session, settings, recipe)
    [problem] = verdict["problems"]
    assert problem.key == "estimate.sharding_one_device" and problem.startswith("sharding: stage1 splits")
    shown = format_verdict(recipes.get_recipe(recipe), verdict, "zh")
    assert "- sharding：stage1 把优化器状态切分到各数据并行进程，而该任务只有一个设备" in shown, shown
    cpu_node(session, "train@gpu1", ram_gib=16)
    session.commit()
    warning = recipes.recipe_verdict(session, settings, recipe)["warning"]
    assert warning.key == "estimate.will_not_fit" and warning.startswith("will not fit: the run needs about")
    assert i18n.localize_message(warning, "zh").startswith("放不下：任务峰值约需 ")


def verdict_targets(imported) -> list[str]:
    return list(TrainConfig(stage=imported.stage, fine_tuning="LoRA").lora_target_modules)


def test_the_recipes_through_rest(client, session, settings):
    listed = client.get("/api/v1/recipes").json()
    assert [r["id"] for r in listed] == RECIPES
    assert {r["verdict"]["status"] for r in listed} == {"no_nodes"}
    gpu_node(session, "train@gpu1", gpus=8)
    session.commit()
    one = client.get("/api/v1/recipes/ernie-4.5-21b-a3b-sft-lora-8k").json()
    assert one["source_path"] == "examples/configs/ERNIE-4.5-21B-A3B/sft/run_sft_lora_8k.yaml"
    assert one["verdict"] == recipes.recipe_verdict(session, settings, one["id"])
    assert one["verdict"]["status"] == "proposal"
    imported = client.get("/api/v1/recipes/ernie-4.5-0.3b-dpo-full-8k/import").json()
    assert (imported["stage"], imported["fine_tuning"], imported["base_model"]) == (
        "DPO",
        "Full",
        "ernie-4.5-0.3b",
    )
    assert [d["path"] for d in imported["datasets"]] == [
        "./examples/data/dpo-train.jsonl",
        "./examples/data/dpo-eval.jsonl",
    ]
    r = client.get("/api/v1/recipes/no-such-recipe")
    assert r.status_code == 404 and "no recipe is named 'no-such-recipe'" in r.json()["message"]
    for bad in ("..%2F..%2Fpyproject", "A", "x" * 101):
        assert client.get(f"/api/v1/recipes/{bad}").status_code in (404, 422)
