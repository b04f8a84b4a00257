"""The planner (engine.estimate.plan_run) against ERNIEKit's hardware table (tests/engine/data/
erniekit_hardware.csv, docs/training.md): each row fits its listed GPUs (or says it needs tensor
parallelism, or tensor and pipeline parallelism, which this engine does not run), and does not fit on half
as many, with the reason and what the what-ifs say there; the pipeline stage's memory; and the planner's
refusals of settings that cannot run."""

from __future__ import annotations

import csv
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from engine.estimate import GIB, Candidate, Layout, NodeFacts, PlanError, count_parameters, plan_run
from engine.estimate.activations import _activation_bytes
from engine.estimate.candidates import _weigh
from engine.estimate.memory import device_memory, stage_layers
from engine.models.config import ErnieConfig
from engine.models.presets import preset_fields
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict

TABLE = Path(__file__).parent / "data" / "erniekit_hardware.csv"
ROWS = list(csv.DictReader(TABLE.open()))


def gpu_nodes(gpus: int, per_node: int = 8, ram_gib: int = 2048) -> list[NodeFacts]:
    """``gpus`` 80 GB GPUs: whole nodes of 8 (fewer on one node)."""
    per = min(gpus, per_node)
    return [
        NodeFacts("gpu", f"node{i}", 80 * GIB, ram_gib * GIB, "NVIDIA H800", devices=per)
        for i in range(gpus // per)
    ]


def plan(row: dict, gpus: int):
    model = ErnieConfig(**preset_fields(row["model"]))
    # ERNIEKit packs a DPO pair (prompt, chosen, rejected) into one row of max_seq_len; this engine trains
    # chosen and rejected as two rows, so its max_seq_len is half the row
    seq = int(row["seq"]) // (2 if row["stage"] == "DPO" else 1)
    return plan_run(model, row["stage"], row["fine_tuning"], seq, gpu_nodes(gpus), model_name=row["model"])


def test_the_table_has_every_model_recipe_and_length():
    assert {r["model"] for r in ROWS} == {"ernie-4.5-0.3b", "ernie-4.5-21b-a3b", "ernie-4.5-300b-a47b"}
    assert {(r["stage"], r["fine_tuning"]) for r in ROWS} == {
        ("SFT", "Full"), ("SFT", "LoRA"), ("DPO", "Full"), ("DPO", "LoRA")
    }  # fmt: skip
    assert {r["seq"] for r in ROWS} == {"8192", "32768"}
    big = [r for r in ROWS if r["model"] == "ernie-4.5-300b-a47b" and r["stage"] == "SFT"]
    assert {r["gpus"] for r in big if r["fine_tuning"] == "Full"} == {"96", "112"}  # 12 and 14 nodes of 8


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['model']}-{r['recipe']}-{r['seq']}-{r['gpus']}")
def test_each_row_on_its_gpus_and_on_half_as_many(row):
    gpus = int(row["gpus"])
    got = plan(row, gpus)
    if row["expected"] == "fits":
        assert got.verdict == "fits", got.reason
        best = got.best
        assert best.candidate.layout.devices <= gpus
        assert best.memory["peak"] <= 0.92 * 80 * GIB
        assert got.to_dict()["proposal"]["settings"]["num_devices"] == best.candidate.layout.devices
    else:
        assert got.verdict == "does not fit" and got.fits == []
        assert f"does not fit on {gpus} device(s)" in got.reason and "GiB per device" in got.reason
        # weighed as ERNIEKit's recipes run it (sequence parallel, whole layers replayed under recompute)
        assert got.needs_tensor_parallel in (2, 4, 8) and "sequence parallel" in got.reason
        option = got.tensor_parallel_option
        settings = option.candidate.settings()
        assert option.memory["peak"] <= 0.92 * 80 * GIB and settings["num_devices"] == gpus
        assert settings["tensor_parallel_degree"] == got.needs_tensor_parallel
        if row["expected"] == "needs tensor parallelism":
            assert "needs tensor parallelism" in got.reason and got.needs_pipeline_parallel is None
            assert "pipeline_parallel_degree" not in settings
        else:
            assert row["expected"] == "needs tensor and pipeline parallelism", row["expected"]
            # tensor parallelism 8 alone still leaves more than a device holds on all of them ...
            assert "even with tensor_parallel_degree 8" in got.reason
            # ... and split over pipeline stages as ERNIEKit's recipes do, the fullest stage fits
            pp = got.needs_pipeline_parallel
            assert (
                pp
                and settings["pipeline_parallel_degree"] == pp
                and settings["gradient_accumulation_steps"] >= pp
            )
            tp = got.needs_tensor_parallel
            said = f"needs tensor and pipeline parallelism: with tensor_parallel_degree {tp} and pipeline_parallel_degree {pp}"
            assert said in got.reason
            assert "1F1B" in got.reason and "this engine has neither" in got.reason
            # 64 experts split at most 16 ways on 112 devices, 32 ways on 32: TP alone fits on fewer of them
            assert f"tensor parallelism alone would fit on 32 of the {gpus} devices" in got.reason
            assert got.to_dict()["needs_pipeline_parallel"] == pp
    if row["half"]:
        half = plan(row, gpus // 2)
        assert half.verdict == row["half"], half.reason
        if row["half"] == "does not fit":
            assert f"does not fit on {gpus // 2} device(s)" in half.reason
            assert "GiB per device against" in half.reason
            # what the what-ifs this engine does not run say on half the GPUs (docs/training.md: most rows'
            # what-ifs fit there too; ERNIEKit's counts are its recipes' layouts, not their least memory)
            said = "none"
            if half.needs_tensor_parallel:
                said = (
                    "tensor and pipeline parallelism"
                    if half.needs_pipeline_parallel
                    else "tensor parallelism"
                )
            assert said == row["half_what_if"], half.reason


def test_a_fitting_plan_says_why_the_cheaper_choices_do_not_fit():
    row = next(
        r for r in ROWS if r["model"] == "ernie-4.5-21b-a3b" and r["recipe"] == "DPO" and r["seq"] == "8192"
    )
    got = plan(row, 8)
    best = got.best.candidate
    # the fewest devices that fit: 8, as ERNIEKit lists it (the frozen reference keeps every expert in each
    # process, so the planner quantizes it: dpo_reference_dtype)
    assert best.layout.devices == 8 and best.layout.expert_parallel > 1 and best.layout.offload
    assert best.reference in ("wint8", "wint4")
    settings = got.to_dict()["proposal"]["settings"]
    assert settings["expert_parallel_degree"] == best.layout.expert_parallel
    assert settings["tensorwise_offload_optimizer"] is True and settings["nodes"] == 1
    # on 4 devices nothing fits, and each cheaper choice at 8 is rejected with its figure
    assert any(v.candidate.layout.devices == 4 and "GiB per device" in v.reason for v in got.rejected)
    at_four = [v for v in got.rejected if v.candidate.layout.devices == 8]
    assert at_four and all(not v.fits and "against 73.6 GiB" in v.reason for v in at_four)
    assert any(not v.candidate.layout.offload for v in at_four)
    assert any(not v.candidate.recompute for v in at_four)


def _full_bf16_21b_on_8_gpus(**keys):
    """ERNIE-4.5-21B-A3B, a Full bf16 run with `keys`, its parameter counts, and one node of 8 GPUs."""
    model = ErnieConfig(**preset_fields("ernie-4.5-21b-a3b"))
    base = {"model_name_or_path": "m", "train_dataset_path": "d", "output_dir": "o", "compute_type": "bf16"}
    cfg = config_from_dict(TrainConfig, {**base, "fine_tuning": "Full", **keys})
    return model, cfg, count_parameters(model), gpu_nodes(8)


def test_memory_by_part_follows_sharding_expert_parallel_offload_and_the_dpo_reference():
    model, cfg, counts, pool = _full_bf16_21b_on_8_gpus()

    def mem(layout: Layout, stage: str = "SFT") -> dict:
        c = Candidate("bf16", False, layout, 1)
        from dataclasses import replace

        return _weigh(model, counts, replace(cfg, stage=stage), counts.total, 1, 1024, c, pool, "gpu").memory

    plain = mem(Layout(8))
    ep = mem(Layout(8, expert_parallel=8))
    experts = counts.expert_linears
    # experts split over 8: 7/8 of their bf16 bytes, gradients and fp32 state leave each device
    assert ep["weights"] == pytest.approx(plain["weights"] - 2 * experts * 7 / 8, rel=1e-3)
    assert ep["optimizer"] == pytest.approx(plain["optimizer"] - 8 * experts * 7 / 8, rel=1e-3)
    stage1 = mem(Layout(8, sharding_stage=1))
    assert stage1["optimizer"] == pytest.approx(plain["optimizer"] / 8)
    assert stage1["master_weights"] == pytest.approx(plain["master_weights"] / 8)
    assert stage1["gradients"] == plain["gradients"]
    stage2 = mem(Layout(8, sharding_stage=2))
    assert stage2["gradients"] == pytest.approx(plain["gradients"] / 8)
    offload = mem(Layout(8, offload=True))
    assert offload["optimizer"] == 0 and offload["master_weights"] == 0
    dpo = mem(Layout(8), stage="DPO")
    assert dpo["reference_model"] == pytest.approx(dpo["weights"])  # the reference in storage precision
    lora = _weigh(
        model, counts, replace(cfg, fine_tuning="LoRA", stage="DPO"), counts.lora, 2, 1024,
        Candidate("bf16", False, Layout(1), 1), pool, "gpu",
    ).memory  # fmt: skip
    assert lora["reference_model"] == 0  # LoRA-DPO's reference is the base with its adapters off


def test_the_tensor_parallel_what_if_runs_as_erniekit_runs_it():
    """The planner's tensor parallelism (which this engine does not have) is weighed as ERNIEKit's recipes
    run it: whole layers replayed under recompute, the MoE exchange included (this engine keeps the split
    MoE blocks' router, dispatch and combine activations instead), and a Full DPO reference split like the
    model; the engine's own layouts keep their figures."""
    model, cfg, counts, pool = _full_bf16_21b_on_8_gpus(recompute=True)

    def mem(layout: Layout, stage: str = "SFT") -> dict:
        c = Candidate("bf16", True, layout, 1)
        return _weigh(model, counts, replace(cfg, stage=stage), counts.total, 1, 4096, c, pool, "gpu").memory

    split = mem(Layout(8, expert_parallel=8))
    replayed = mem(Layout(8, expert_parallel=8, replay_exchange=True))
    assert split["moe_activations"] > 0 and replayed["moe_activations"] == 0
    # a rebuilt MoE block keeps its bf16 input alone, in place of its router, dispatch and combine values
    inputs = 2 * model.hidden_size * 4096 * sum(model.is_moe_layer(i) for i in range(model.num_hidden_layers))
    assert replayed["activations"] == pytest.approx(split["activations"] - split["moe_activations"] + inputs)
    assert replayed["weights"] == split["weights"]
    assert mem(Layout(8))["activations"] == pytest.approx(replayed["activations"])  # one expert group
    # sequence parallel splits the activations over the tensor-parallel group
    tp = mem(Layout(8, expert_parallel=4, tensor_parallel=2))
    assert tp["moe_activations"] == 0
    assert tp["activations"] == pytest.approx(replayed["activations"] / 2)
    # Full DPO: the engine's reference keeps every expert; under the tensor-parallel what-if it is split
    whole_ref = mem(Layout(8), "DPO")["reference_model"]
    assert mem(Layout(8, expert_parallel=4), "DPO")["reference_model"] == pytest.approx(whole_ref)
    dpo_tp = mem(Layout(8, expert_parallel=4, tensor_parallel=2), "DPO")
    assert dpo_tp["reference_model"] == pytest.approx(dpo_tp["weights"]) and dpo_tp["weights"] < whole_ref / 3


def test_pipeline_stages_split_the_layers_as_fleet_does():
    """The what-if's stages are fleet's uniform segmentation (the remainder on the last stages)."""
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import SegmentLayers

    for layers, stages in ((54, 14), (54, 7), (54, 5), (28, 4), (18, 5), (8, 8)):
        bounds = SegmentLayers.uniform(None, layers, stages)
        assert [stage_layers(layers, stages, s) for s in range(stages)] == [
            range(a, b) for a, b in itertools.pairwise(bounds)
        ]


def test_a_pipeline_stage_counts_its_layers_and_the_ends_hold_the_embedding_and_head():
    model = ErnieConfig(**preset_fields("ernie-4.5-300b-a47b"))
    targets = ["qkv_proj", "o_proj", "up_gate_proj", "down_proj"]
    whole = count_parameters(model, 8, targets)
    stages = [count_parameters(model, 8, targets, stage_layers(54, 7, s)) for s in range(7)]
    for part in (
        "total",
        "embedding",
        "head",
        "decoder_linears",
        "expert_linears",
        "other",
        "lora",
        "expert_lora",
    ):
        assert sum(getattr(s, part) for s in stages) == getattr(whole, part), part
    assert stages[0].embedding == whole.embedding and stages[-1].head == whole.head > 0
    assert stages[3].embedding == stages[3].head == 0
    # a tied head is the embedding: a last stage that is not the first holds its copy (fleet's shared layer)
    tied = ErnieConfig(**preset_fields("ernie-4.5-0.3b"))
    assert count_parameters(tied).head == 0
    assert count_parameters(tied, layers=stage_layers(18, 2, 1)).head == tied.vocab_size * tied.hidden_size


def test_a_pipeline_stage_holds_its_share_and_the_micro_batches_in_flight():
    """Under the pipeline what-if a device holds its stage's weights (split further by tensor and expert
    parallelism) and the activations of the micro-batches 1F1B keeps in flight on it: stages - stage."""
    model = ErnieConfig(**preset_fields("ernie-4.5-300b-a47b"))
    base = {"model_name_or_path": "m", "train_dataset_path": "d", "output_dir": "o", "compute_type": "bf16"}
    cfg = config_from_dict(TrainConfig, {**base, "fine_tuning": "Full", "recompute": True})
    counts = count_parameters(model)
    lay = Layout(112, expert_parallel=8, offload=True, tensor_parallel=2, pipeline_parallel=7)

    def mem(layout: Layout, stage: str = "SFT") -> dict:
        return device_memory(
            model, counts, replace(cfg, stage=stage), "bf16-amp", True, counts.total, 1, 8192, layout
        )

    stages = [mem(replace(lay, pipeline_stage=s)) for s in range(7)]
    flat = mem(replace(lay, pipeline_parallel=1))
    # no stage repeats or drops a layer: their weights add up to the unpipelined device's
    assert sum(s["weights"] for s in stages) == pytest.approx(flat["weights"], rel=1e-6)
    assert sum(s["gradients"] for s in stages) == pytest.approx(flat["gradients"], rel=1e-6)
    assert max(s["weights"] for s in stages) < flat["weights"] / 5
    # the logits only on the last stage
    assert all(s["logits"] == 0 for s in stages[:-1]) and stages[-1]["logits"] == flat["logits"] > 0
    # the first stage keeps 7 micro-batches' layer inputs: 2 a layer (attention and FFN block), bf16, split
    # over the tensor-parallel group (sequence parallel); the rebuilt layer once
    first = stage_layers(54, 7, 0)
    one = _activation_bytes(model, "full", 1, 8192, True, "bf16-amp", 2, "block", first, 1)
    seven = _activation_bytes(model, "full", 1, 8192, True, "bf16-amp", 2, "block", first, 7)
    assert seven["layers"] - one["layers"] == pytest.approx(
        6 * len(first) * 2 * 2 * model.hidden_size * 8192 / 2
    )
    assert stages[0]["activations"] == pytest.approx(seven["total"])
    kept = _activation_bytes(model, None, 1, 8192, True, "bf16-amp", 2, None, first, 1)["layers"]
    assert _activation_bytes(model, None, 1, 8192, True, "bf16-amp", 2, None, first, 3)["layers"] == 3 * kept
    # a Full DPO reference is split like the model: over the stages too
    dpo = mem(replace(lay, pipeline_stage=3), "DPO")
    assert dpo["reference_model"] == pytest.approx(dpo["weights"])


@pytest.mark.parametrize(
    ("model_name", "pins", "key"),
    [
        (
            "ernie-4.5-21b-a3b",
            {"expert_parallel_degree": 3, "num_devices": 3},
            "expert_parallel_degree: 3 does not divide",
        ),
        (
            "ernie-4.5-0.3b",
            {"expert_parallel_degree": 2, "num_devices": 2},
            "expert_parallel_degree: 2 splits routed experts",
        ),
        (
            "ernie-4.5-0.3b",
            {"num_devices": 9},
            "num_devices: 9 devices are more than the studio's nodes hold (8",
        ),
        (
            "ernie-4.5-0.3b",
            {"num_devices": 1, "sharding": "stage1"},
            "sharding: stage1 splits the optimizer state",
        ),
    ],
)
def test_the_planner_refuses_settings_that_cannot_run(model_name, pins, key):
    model = ErnieConfig(**preset_fields(model_name))
    with pytest.raises(PlanError, match=key.replace("(", r"\(")):
        plan_run(model, "SFT", "Full", 1024, gpu_nodes(8), **pins)


def test_a_cpu_node_plans_its_processes_in_its_ram():
    model = ErnieConfig(**preset_fields("ernie-4.5-0.3b"))
    node = NodeFacts("cpu", "laptop", 16 * GIB, 16 * GIB, devices=2)
    got = plan_run(model, "SFT", "Full", 1024, [node])
    assert got.verdict == "fits" and got.device == "cpu"
    assert got.best.candidate.compute_type == "fp32" and not got.best.candidate.layout.offload
    small = plan_run(model, "SFT", "Full", 1024, [NodeFacts("cpu", "tiny", 4 * GIB, 4 * GIB, devices=2)])
    assert small.verdict == "fits" or "per process" in small.reason
    with pytest.raises(PlanError, match="sharding: stage2 needs GPUs"):
        plan_run(model, "SFT", "Full", 1024, [node], num_devices=2, sharding="stage2")


def test_ernie_studio_estimate_prints_the_plan(tiny_moe_model_dir, tmp_path, capsys):
    from engine.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"src": ["hi"], "tgt": ["hello there"]}\n' * 4)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model_name_or_path: {tiny_moe_model_dir}\ntrain_dataset_path: {data}\noutput_dir: {tmp_path / 'o'}\n"
        "fine_tuning: Full\nmax_seq_len: 256\nmax_steps: 2\n"
    )
    args = ["estimate", str(cfg), "--gpu", "H800", "--memory-gib", "80", "--node-devices", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "plan for SFT Full at 256 tokens a row on 8 GPU device(s) of 80 GiB: fits" in out
    assert "fits: 1 device(s), bf16" in out and "compute_type=bf16" in out
    with pytest.raises(SystemExit, match="num_devices: 16 devices are more than the studio's nodes hold"):
        main([*args, "--devices", "16"])
