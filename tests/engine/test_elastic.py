"""Elastic MoE: bad options are errors naming the key, an extracted member computes exactly what the masked
full model computes (both layouts, loadable and servable), an elastic run resumes exactly, and its members
beat the same members cut out of a plain run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.models.elastic import ElasticError, SubModel, extract_submodel, kept_layers, use_submodel
from engine.train import run_export, run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.elastic import ElasticTraining
from engine.train.export_config import ExportConfig
from engine.train.options import ConfigError
from engine.train.serving_export import export_for_serving, serving_problems
from tests.engine.serve_support import complete_in_process

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
ELASTIC = dict(elastic=True, elastic_depth_choices="2", elastic_experts_choices="4", elastic_topk_choices="1")


def pt_config(model_dir: Path, out: Path, **values) -> TrainConfig:
    base = dict(
        model_name_or_path=str(model_dir),
        stage="PT",
        fine_tuning="Full",
        output_dir=str(out),
        train_dataset_path=str(DATA / "pt_demo.jsonl"),
        max_seq_len=64,
        packing=True,
        batch_size=2,
        learning_rate=3e-3,
        logging_steps=1,
        disable_tqdm=True,
        report_to="none",
        moe_correction_bias_rate=0.01,
    )
    return config_from_dict(TrainConfig, base | values)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"elastic_experts_choices": "0"}, "elastic_experts_choices: 0 is too small"),
        ({"elastic_depth_choices": "1"}, "elastic_depth_choices: 1 is too small"),
        ({"elastic_topk_choices": "a,b"}, "elastic_topk_choices must be whole numbers"),
        (
            {"elastic_depth_choices": "", "elastic_experts_choices": "", "elastic_topk_choices": ""},
            "needs at least one of elastic_depth_choices",
        ),
        ({"elastic": False}, "elastic_depth_choices is set but elastic is false"),
        ({"stage": "DPO"}, "elastic: stage DPO is not supported"),
    ],
)
def test_impossible_options_are_refused_by_the_config(tmp_path, values, message):
    with pytest.raises(ConfigError, match=message):
        pt_config(Path("m"), tmp_path, **(ELASTIC | values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"elastic_topk_choices": "3"},
            r"elastic_topk_choices 3: k' must be between 1 and the model's moe_k \(2\)",
        ),
        (
            {"elastic_experts_choices": "9"},
            "elastic_experts_choices 9: a member keeps between 1 and the model's 8",
        ),
        ({"elastic_depth_choices": "4"}, "elastic_depth_choices 4: .* between 2 and the model's 3 layers"),
    ],
)
def test_impossible_members_are_refused_against_the_model(tiny_moe_model_dir, tmp_path, values, message):
    model = engine.load_model(tiny_moe_model_dir)
    with pytest.raises(ConfigError, match=message):
        ElasticTraining(pt_config(tiny_moe_model_dir, tmp_path, **(ELASTIC | values)), model)


def test_elastic_on_a_dense_model_is_refused(tiny_model_dir, tmp_path):
    cfg = pt_config(tiny_model_dir, tmp_path / "run", **ELASTIC, max_steps=2)
    with pytest.raises(
        ConfigError, match="elastic_\\*: elastic sub-models need an MoE model; this model is dense"
    ):
        run_training(cfg)
    with pytest.raises(ElasticError, match=r"elastic_\*: .*dense"):
        run_export(
            config_from_dict(ExportConfig, dict(model_name_or_path=str(tiny_model_dir), elastic_depth=1))
        )


def test_export_refuses_topk_above_experts(tiny_moe_model_dir, tmp_path):
    values = dict(model_name_or_path=str(tiny_moe_model_dir), export_dir=str(tmp_path), elastic_experts=1)
    with pytest.raises(ElasticError, match="elastic_topk 2 exceeds elastic_experts 1"):
        run_export(config_from_dict(ExportConfig, values | {"elastic_topk": 2}))


# ---- extraction --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp_moe(tiny_moe_model_dir, tmp_path_factory) -> Path:
    """tiny-moe with std 0.2 weights and non-zero correction biases: every layer and expert matters."""
    from engine.models.initialize import init_weights
    from engine.models.saving import save_model
    from engine.tokenizer import copy_tokenizer_files

    out = tmp_path_factory.mktemp("elastic") / "sharp-moe"
    model = engine.load_model(tiny_moe_model_dir)
    init_weights(model, 5, std=0.2)
    rng = np.random.default_rng(0)
    for m in model.sublayers():
        if hasattr(m, "moe_statics"):
            bias = m.moe_statics.e_score_correction_bias
            bias.set_value(paddle.to_tensor(rng.normal(0, 0.05, bias.shape), dtype="float32"))
    save_model(model, out)
    copy_tokenizer_files(tiny_moe_model_dir, out)
    return out


@pytest.mark.parametrize(
    "member",
    [
        SubModel(2, 4, 1),
        SubModel(3, 5, 2),
        SubModel(2, 8, 2),
        SubModel(3, 8, 1),
        SubModel(2, 3, 1, "strided"),
    ],
    ids=lambda m: f"{m.name}-{m.pattern}",
)
def test_extracted_member_equals_the_masked_full_model(sharp_moe, member):
    model = engine.load_model(sharp_moe)
    ids = paddle.to_tensor(np.random.default_rng(2).integers(3, 500, (2, 32)), dtype="int64")
    full = model(ids).logits.numpy()
    with use_submodel(model, member):
        masked = model(ids).logits.numpy()
    small = extract_submodel(model, member)
    assert small.config.num_hidden_layers == member.depth
    assert np.abs(masked - full).max() > 1e-2  # the member is a different network, not the full one
    print(
        f"{member}: extracted vs masked, max |logits diff| {np.abs(small(ids).logits.numpy() - masked).max():.1e}"
    )
    # measured 0.0 for every member here (the same weights, the same ops); 2e-6 is a few float32 ulps of the
    # logits, room for a CPU whose GEMM kernel changes with the smaller expert count
    np.testing.assert_allclose(small(ids).logits.numpy(), masked, rtol=0, atol=2e-6)


def test_export_writes_a_loadable_servable_member_in_both_layouts(sharp_moe, tmp_path):
    member = SubModel(2, 4, 1)
    model = engine.load_model(sharp_moe)
    ids = paddle.to_tensor(np.random.default_rng(4).integers(3, 500, (1, 20)), dtype="int64")
    with use_submodel(model, member):
        masked = model(ids).logits.numpy()
    for layout in ("paddle", "hf"):
        out = tmp_path / layout
        values = dict(model_name_or_path=str(sharp_moe), export_dir=str(out), layout=layout)
        summary = run_export(
            config_from_dict(ExportConfig, values | dict(elastic_depth=2, elastic_experts=4, elastic_topk=1))
        )
        assert summary.elastic_member == "d2-e4-k1"
        config = json.loads((out / "config.json").read_text())
        assert (config["num_hidden_layers"], config["moe_num_experts"], config["moe_k"]) == (2, 4, 1)
        assert (config["moe_layer_start_index"], config["moe_layer_end_index"]) == (1, 1)
        assert (config["model_type"], "mlp_layer_types" in config) == ("ernie4_5_moe", False)
        loaded = engine.load_model(out)
        assert sum(int(np.prod(p.shape)) for p in loaded.parameters()) < 0.6 * sum(
            int(np.prod(p.shape)) for p in model.parameters()
        )
        print(
            f"{layout} export of the member: max |logits diff| {np.abs(loaded(ids).logits.numpy() - masked).max():.1e}"
        )
        np.testing.assert_allclose(loaded(ids).logits.numpy(), masked, rtol=0, atol=2e-6)  # measured 0.0
    assert complete_in_process(tmp_path / "paddle")["usage"]["completion_tokens"] >= 1
    # FastDeploy's loader conventions: its serving export of the member needs nothing but the dtype
    assert all("dtype" in p or "weights stored" in p for p in serving_problems(tmp_path / "paddle"))
    served = export_for_serving(tmp_path / "paddle", tmp_path / "fastdeploy")
    assert serving_problems(served) == []


def test_depth_patterns_keep_first_and_last():
    assert kept_layers(28, 24) == [*range(23), 27]
    assert kept_layers(9, 5, "strided") == [0, 2, 4, 6, 8]
    assert kept_layers(4, 4, "strided") == [0, 1, 2, 3]


# ---- training ----------------------------------------------------------------------------------------------


def test_elastic_run_reports_members_and_resumes_exactly(tiny_moe_model_dir, tmp_path):
    first = tmp_path / "first"
    values = dict(
        ELASTIC,
        max_steps=8,
        save_steps=4,
        eval_dataset_path=str(DATA / "pt_demo.jsonl"),
        max_evaluate_steps=2,
    )
    assert run_training(pt_config(tiny_moe_model_dir, first, **values)).status == "succeeded"
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(first / "checkpoint-4", again / "checkpoint-4")
    assert run_training(pt_config(tiny_moe_model_dir, again, **values)).status == "succeeded"
    a, b = rows(first), rows(again)
    members = [[k for k in r if k.startswith("elastic_loss/")] for r in a]
    assert {m[0] for m in members} == {"elastic_loss/d3-e8-k2", "elastic_loss/d2-e4-k1"}
    assert all(len(m) == 1 for m in members)
    assert [(r["step"], r["loss"]) for r in b] == [(r["step"], r["loss"]) for r in a[4:]]
    assert members[4:] == [[k for k in r if k.startswith("elastic_loss/")] for r in b]
    assert "eval_loss/d2-e4-k1" in a[-1] and "eval_loss" in a[-1]
    family = json.loads((first / "elastic_family.json").read_text())
    assert [m["member"] for m in family["members"]] == ["d3-e8-k2", "d2-e4-k1"]
    assert sum(m["steps_trained"] for m in family["members"]) == 8
    assert family["members"][1]["eval_loss"] == a[-1]["eval_loss/d2-e4-k1"]
    assert all(m["decode_tokens_per_second"] > 0 for m in family["members"])
    assert family["members"][1]["active_parameters"] < family["members"][0]["active_parameters"]
    # a run with another family cannot continue from the checkpoint
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copytree(first / "checkpoint-4", plain / "checkpoint-4")
    with pytest.raises(ConfigError, match="elastic family"):
        run_training(pt_config(tiny_moe_model_dir, plain, **(values | {"elastic_experts_choices": "2"})))


def test_elastic_lora_sft_trains_members_and_leaves_the_base_untouched(tiny_moe_model_dir, tmp_path):
    out = tmp_path / "lora"
    cfg = pt_config(
        tiny_moe_model_dir,
        out,
        **(ELASTIC | {"stage": "SFT", "fine_tuning": "LoRA", "packing": False, "elastic_full_share": 0.0}),
        train_dataset_path=str(DATA / "sft_demo.jsonl"),
        max_seq_len=128,
        max_steps=4,
        save_steps=4,
    )
    assert run_training(cfg).status == "succeeded"
    assert all("elastic_loss/d2-e4-k1" in r for r in rows(out))  # share 0: every step a sub-model
    assert (out / "adapter_model.safetensors").exists() and not (out / "config.json").exists()


@pytest.mark.slow
def test_members_of_an_elastic_run_lose_less_than_members_cut_from_a_plain_run(tiny_moe_model_dir, tmp_path):
    """The cheap form of bench/bench_elastic.py (which shows lower absolute eval loss over 3 seeds at 300
    steps): after 150 steps of batch 2, a member cut from the plain run loses clearly more against its own
    full model than the same member of the elastic run does against its full model."""
    from engine.train.sft import evaluate_lm

    lines = (DATA / "pt_demo.jsonl").read_text().splitlines()
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("\n".join(lines[:-20]) + "\n")
    held_out.write_text("\n".join(lines[-20:]) + "\n")
    member, losses = SubModel(2, 4, 1), {}
    values = dict(train_dataset_path=str(train), batch_size=2, learning_rate=3e-3, warmup_steps=10)
    values |= dict(max_steps=150, save_steps=150, logging_steps=50, seed=0)
    for kind, extra in (("plain", {}), ("elastic", ELASTIC)):
        out = tmp_path / kind
        run_training(pt_config(tiny_moe_model_dir, out, **(values | extra)))
        model = engine.load_model(out)
        from engine.data import build_train_data

        batches = list(
            build_train_data(
                {"train_dataset_path": str(held_out)},
                engine.load_tokenizer(out),
                stage="PT",
                max_seq_len=64,
                packing=True,
                batch_size=8,
            ).one_pass()
        )
        losses[kind] = {
            "full": evaluate_lm(model, batches)["eval_loss"],
            "member": evaluate_lm(extract_submodel(model, member), batches)["eval_loss"],
        }
    print(f"held-out eval loss after 150 steps (full, {member.name}): {losses}")
    plain_gap = losses["plain"]["member"] - losses["plain"]["full"]
    elastic_gap = losses["elastic"]["member"] - losses["elastic"]["full"]
    # One seed's trajectory moves with the CPU's arithmetic: the plain member's gap measured 0.091 (AMD EPYC,
    # AVX-512 BF16, seed 0), 0.076 (same, seed 1) and 0.049 (Intel Xeon AVX-512, seed 0), the elastic member's
    # 0.017 and 0.010. The property is the ratio (0.14 to 0.18 measured on the AMD EPYC; 0.40 on an Intel
    # Xeon with AMX, 2026-11-28: plain gap 0.044, elastic 0.018, seed 0; the same 0.0441 / 0.0176 on an Intel
    # Xeon with AVX-512 but neither BF16 nor AMX, the same day; 0.061 / 0.010, ratio 0.16, on an Intel Xeon
    # model 207 with AVX512_BF16 and no AMX, 2026-11-30, and on an AMD EPYC Zen 5 the same day); the floor only
    # says the cut member loses clearly, at half the lowest gap seen so that no CPU's rounding sits at the bound.
    assert plain_gap > 0.025
    assert elastic_gap < 0.5 * plain_gap
    # the full model trains on half the steps; early on it stays within 20 % of the plain run's. Measured at
    # this budget (AMD EPYC, 2026-11-27): seed 0 +6.2 % (1 thread), +2.5 % (2 threads); seeds 1-4 +14.7,
    # +10.8, +7.6 and -12.4 %. The docs' 10 % is bench_elastic's margin (3-seed mean after 300 steps, +6.7 %);
    # one seed at 150 steps spans -12 to +15 %, so 20 % (1.36x the largest) is as tight as any CPU allows.
    assert losses["elastic"]["full"] < 1.20 * losses["plain"]["full"]
