"""The pre-flight estimate against hand computations for the official 0.3B, 21B-A3B and VL-28B-A3B configs
(parameters, weight and optimizer bytes by precision), the fit check, epoch steps and the ETA."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from engine.estimate import (
    DatasetTokens,
    NodeFacts,
    count_parameters,
    estimate_run,
    fit_warning,
    recent_step_seconds,
    remaining_seconds,
)
from engine.models.config import ErnieConfig
from engine.models.presets import preset_fields
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.options import LORA_TARGETS

GIB = 1024**3
V = 103424
CPU = NodeFacts(device="cpu", name="cpu-node", memory_bytes=64 * GIB, probe_tokens_per_second=4300)
GPU = NodeFacts(device="gpu", name="gpu-node", memory_bytes=80 * GIB, gpu_name="NVIDIA A100-SXM4-80GB")


def official(name: str, tmp_path) -> ErnieConfig:
    """The preset written as config.json (as a downloaded model holds it) and read back."""
    cfg = ErnieConfig(**preset_fields(name))
    (tmp_path / name).mkdir()
    cfg.save(tmp_path / name)
    return ErnieConfig.from_file(tmp_path / name / "config.json")


def close(value: float, expected: float, tolerance: float) -> bool:
    return abs(value / expected - 1) <= tolerance


# The estimate against the hand counts below (deterministic arithmetic, the same on every CPU). Measured:
# parameters within 0.27 % (VL-28B active, +0.269 %; the vision tower +0.075 %, the rest <= 0.14 %, LoRA
# exact); bytes held within 0.96 % (21B wint4/8 LoRA, +0.962 %; the rest <= 0.41 %). Bounds about 2x those.
COUNTS = 0.005
BYTES = 0.02
# the saved files' and the DPO reference's bytes, against the same hand counts: measured at most +0.02%
SAVED = 0.002


# ---- hand computations (REFERENCE.md shapes) ------------------------------------------------------------


def hand_03b() -> dict:
    h, layers = 1024, 18
    attn = h * (16 + 2 * 2) * 128 + 16 * 128 * h
    ffn = 3 * h * 3072
    total = V * h + layers * (attn + ffn)
    lora = 8 * layers * ((h + 2560) + (2048 + h) + (h + 2 * 3072) + (3072 + h))
    return {"total": total, "active": total, "linears": layers * (attn + ffn), "lora": lora}


def hand_21b() -> dict:
    h, layers, moe_layers = 2560, 28, 27
    attn = h * (20 + 2 * 4) * 128 + 20 * 128 * h
    expert = 3 * h * 1536
    dense = 3 * h * 12288
    routed = moe_layers * 64 * expert
    shared = moe_layers * 2 * expert
    linears = layers * attn + dense + routed + shared
    total = V * h + linears
    active = total - moe_layers * (64 - 6) * expert
    # adapters on qkv, o, up_gate and down of every layer, shared experts and each routed expert
    per_attn = (h + 28 * 128) + (20 * 128 + h)
    lora = 8 * (
        layers * per_attn
        + (h + 2 * 12288)
        + (12288 + h)
        + moe_layers * ((h + 2 * 3072) + (3072 + h))
        + moe_layers * 64 * ((h + 2 * 1536) + (1536 + h))
    )
    return {"total": total, "active": active, "linears": linears, "experts": routed, "lora": lora}


def hand_vl28b() -> dict:
    text = hand_21b()
    h, moe_layers = 2560, 27
    vision_experts = moe_layers * 64 * 3 * h * 512
    d, inner, depth = 1280, 5120, 32
    vit = depth * (4 * d * d + 2 * d * inner) + 3 * 14 * 14 * d
    s = 4 * d
    resampler = 2 * s * s + 2 * s * s + s * s + s * h  # spatial, temporal (x2 frames), projection
    total = text["total"] + vision_experts + vit + resampler
    return {"total": total, "active": text["active"], "vision": vit + resampler}


def train(**values) -> TrainConfig:
    base = {"model_name_or_path": "m", "train_dataset_path": "d.jsonl", "output_dir": "o", "max_steps": 10}
    return config_from_dict(TrainConfig, base | values)


DATA = [DatasetTokens(num_samples=1000, mean_length=250, p95_length=600, max_length=900)]


# ---- parameters ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "hand"),
    [("ernie-4.5-0.3b", hand_03b), ("ernie-4.5-21b-a3b", hand_21b), ("ernie-4.5-vl-28b-a3b", hand_vl28b)],
)
def test_parameters_total_and_active_match_a_hand_count(tmp_path, name, hand):
    """Within COUNTS (0.5 %) of the hand count; measured: total +0.011 / +0.021 / +0.033 %, active +0.011 /
    +0.137 / +0.269 % (0.3B / 21B / VL-28B: the hand counts leave out the norms and the router gates, 27 x
    2560 x 64 per modality group), LoRA +0.000 %, vision +0.075 %."""
    counts = count_parameters(official(name, tmp_path), 8, list(LORA_TARGETS))
    expected = hand()
    assert close(counts.total, expected["total"], COUNTS), (counts.total, expected["total"])
    assert close(counts.active, expected["active"], COUNTS), (counts.active, expected["active"])
    if "lora" in expected:
        assert close(counts.lora, expected["lora"], COUNTS), (counts.lora, expected["lora"])
    if "vision" in expected:
        assert close(counts.vision, expected["vision"], COUNTS), (counts.vision, expected["vision"])
    # the published names, rounded: 0.36B, 21B total / 3B active, 28B total / 3B active (measured 0.361,
    # 21.83 / 3.35 and 29.40 / 3.36: the names leave out the 0.26B embedding and round the VL total down)
    billions = {
        "ernie-4.5-0.3b": (0.36, 0.36),
        "ernie-4.5-21b-a3b": (21.8, 3.0),
        "ernie-4.5-vl-28b-a3b": (28, 3.0),
    }
    total_b, active_b = billions[name]
    assert close(counts.total / 1e9, total_b, 0.1) and close(counts.active / 1e9, active_b, 0.15)


def test_lora_counts_the_experts_and_the_vl_groups(tmp_path):
    moe = official("ernie-4.5-21b-a3b", tmp_path)
    dense_only = count_parameters(moe, 8, ["qkv_proj", "o_proj"]).lora
    with_experts = count_parameters(moe, 8, list(LORA_TARGETS)).lora
    assert with_experts > 20 * dense_only  # 64 experts per layer dwarf the attention adapters
    vl = official("ernie-4.5-vl-28b-a3b", tmp_path)
    text_only = count_parameters(vl, 8, list(LORA_TARGETS)).lora
    with_vision = count_parameters(vl, 8, [*LORA_TARGETS, "vision", "resampler"]).lora
    d, inner = 1280, 5120
    vit_adapters = 8 * 32 * ((d + 3 * d) + (d + d) + (d + inner) + (inner + d))
    assert with_vision - text_only >= vit_adapters


# ---- bytes by precision (what the run holds, without activations) ------------------------------------------


def held(est) -> float:
    m = est.memory
    return m["weights"] + m["adapters"] + m["master_weights"] + m["optimizer"]


@pytest.mark.parametrize("name", ["ernie-4.5-0.3b", "ernie-4.5-21b-a3b", "ernie-4.5-vl-28b-a3b"])
def test_weight_and_optimizer_bytes_match_a_hand_count(tmp_path, name):
    """Within BYTES (2 %) of the hand count; measured at most +0.962 % (wint4/8 LoRA: the scales), +0.413 %
    (VL Full bf16 on a CPU), the rest <= 0.06 %."""
    model = official(name, tmp_path)
    hand = {"ernie-4.5-0.3b": hand_03b, "ernie-4.5-21b-a3b": hand_21b, "ernie-4.5-vl-28b-a3b": hand_vl28b}[
        name
    ]()
    n = hand["total"]
    lora = count_parameters(model, 8, list(LORA_TARGETS)).lora

    # Full bf16 on a GPU (AMP O2): bf16 weights, fp32 masters, two fp32 moments = 14 bytes a weight
    full_gpu = estimate_run(model, train(fine_tuning="Full", compute_type="bf16"), DATA, node=GPU)
    assert close(held(full_gpu), 14 * n, BYTES)
    assert close(full_gpu.memory["gradients"], 2 * n, BYTES)
    # Full bf16 on a CPU (emulated): the same, and the gradient lands on an fp32 master too
    full_cpu = estimate_run(model, train(fine_tuning="Full", compute_type="bf16"), DATA, node=CPU)
    assert close(held(full_cpu), 14 * n, BYTES) and full_cpu.precision == "bf16-emulated"
    # Full fp32: 4 + 8 bytes, fp32 gradients
    full_fp32 = estimate_run(model, train(fine_tuning="Full"), DATA, node=CPU)
    assert close(held(full_fp32), 12 * n, BYTES) and close(full_fp32.memory["gradients"], 4 * n, BYTES)
    # LoRA bf16 on a CPU: the base in bf16 (the vision tower stays fp32), fp32 adapters + moments
    lora_bf16 = estimate_run(model, train(fine_tuning="LoRA", compute_type="bf16"), DATA, node=CPU)
    vision = hand.get("vision", 0)
    assert close(held(lora_bf16), 2 * (n - vision) + 4 * vision + 12 * lora, BYTES)
    assert lora_bf16.trainable == lora
    # wint4/8 LoRA: decoder linears in int8 memory (int4 values too) + scales, embedding and rest fp32
    wint = estimate_run(model, train(fine_tuning="LoRA", compute_type="wint4/8"), DATA, node=CPU)
    linears = hand["linears"] if "linears" in hand else hand_21b()["linears"]
    if name == "ernie-4.5-vl-28b-a3b":
        linears += 27 * 64 * 3 * 2560 * 512
    assert close(held(wint), linears + 4 * (n - linears) + 12 * lora, BYTES)
    assert held(wint) < held(lora_bf16) < held(full_fp32)


def test_activations_follow_the_data_and_recompute(tmp_path):
    model = official("ernie-4.5-0.3b", tmp_path)
    short = estimate_run(model, train(max_seq_len=4096), DATA, node=CPU)
    padded = estimate_run(model, train(max_seq_len=4096), [], node=CPU)  # no statistics: max_seq_len
    assert short.tokens_per_step == 250 and padded.tokens_per_step == 4096
    assert padded.memory["activations"] > 5 * short.memory["activations"]
    recompute = estimate_run(model, train(max_seq_len=4096, recompute=True), [], node=CPU)
    assert recompute.memory["activations"] < padded.memory["activations"]
    assert recompute.time["step_s"] > padded.time["step_s"]


def test_recompute_covers_moe_blocks_in_the_activation_model(tmp_path):
    """21B-A3B LoRA at 32K on one GPU: recompute keeps each MoE block's input only (engine/models/ernie.py
    recomputes the router and experts too), unless use_recompute_moe is off; with expert parallelism the
    router, dispatch and combine stay (the exchange is not replayed) but the experts' FFNs do not."""
    model = official("ernie-4.5-21b-a3b", tmp_path)
    run = dict(fine_tuning="LoRA", compute_type="wint4/8", max_seq_len=32768)

    def memory(**values) -> dict:
        return estimate_run(model, train(**run, **values), [], node=GPU).memory

    plain, full = memory(), memory(recompute=True)
    kept = memory(recompute=True, use_recompute_moe=False)
    assert full["moe_activations"] == 0 and kept["moe_activations"] > 100 * GIB
    assert full["activations"] < 0.5 * kept["activations"] < 0.5 * plain["activations"]
    assert full["peak"] < 0.92 * 80 * GIB < kept["peak"]
    attn = memory(recompute=True, recompute_granularity="full_attn")
    assert full["activations"] <= attn["activations"] < plain["activations"]
    ep = estimate_run(
        model, train(**run, recompute=True, expert_parallel_degree=2), [], node=GPU, num_devices=2
    )
    assert 0 < ep.memory["moe_activations"] < 0.7 * kept["moe_activations"]


def test_flops_use_active_parameters(tmp_path):
    moe = official("ernie-4.5-21b-a3b", tmp_path)
    est = estimate_run(moe, train(fine_tuning="Full"), DATA, node=GPU)
    counts = est.parameters
    assert counts.matmul_per_token < 0.2 * counts.total
    assert close(est.flops_per_step, 3 * 2 * counts.matmul_per_token * 250, 0.01)  # measured +0.535 %


def test_saves_and_disk(tmp_path):
    model = official("ernie-4.5-0.3b", tmp_path)
    n = hand_03b()["total"]
    est = estimate_run(model, train(fine_tuning="Full", max_steps=1000, save_steps=300), DATA, node=CPU)
    assert est.time["checkpoints"] == 4  # 300, 600, 900 and the last step
    assert close(est.disk["checkpoint_bytes"], 12 * n, SAVED) and close(est.disk["final_bytes"], 4 * n, SAVED)
    assert est.time["final_save_s"] > est.time["checkpoint_s"] > 0
    assert est.memory["save_peak"] > est.memory["training"]
    # the load streams into the storage precision: a bf16 run never holds the fp32 weights (4 bytes each)
    lora = estimate_run(model, train(compute_type="bf16"), DATA, node=CPU)
    fp32 = estimate_run(model, train(), DATA, node=CPU)
    assert lora.memory["load_peak"] - lora.memory["baseline"] < 1.35 * lora.memory["weights"] < 4 * n
    assert fp32.memory["load_peak"] - fp32.memory["baseline"] >= 4 * n
    assert lora.memory["peak"] >= lora.memory["load_peak"]


def test_epoch_runs_count_steps_like_the_trainer(tmp_path):
    model = official("ernie-4.5-0.3b", tmp_path)
    est = estimate_run(
        model, train(max_steps=-1, num_train_epochs=2, batch_size=4, gradient_accumulation_steps=2), DATA
    )
    assert est.steps_per_epoch == 1000 // 4 // 2 and est.steps == 2 * est.steps_per_epoch
    two = estimate_run(model, train(max_steps=-1, batch_size=4), DATA, num_devices=2)
    assert two.steps == 1000 // 8 and two.num_devices == 2


def test_cpu_time_scales_with_the_node_probe(tmp_path):
    model = official("ernie-4.5-0.3b", tmp_path)
    fast = estimate_run(model, train(), DATA, node=CPU)
    slow = estimate_run(model, train(), DATA, node=NodeFacts(probe_tokens_per_second=4300 / 4))
    quiet = estimate_run(model, train(), DATA, node=NodeFacts(probe_tokens_per_second=4300 * 2.5))
    # a node whose probe runs at a quarter of the reference runs the matmuls at about a quarter of the speed
    # (the 0.3B step followed the probe in proportion across loads: docs/benchmarks.md); at 2.5 times it, as a
    # quiet box reads, at 2.2 times (p / (1 + p / 10), 1 at the reference: the big matmuls gain less)
    assert close(slow.time["compute_s"], fast.time["compute_s"] / (0.25 / 1.025 * 1.1), 0.01)
    assert close(quiet.time["compute_s"], fast.time["compute_s"] / (2.5 / 1.25 * 1.1), 0.01)
    assert slow.time["step_s"] > 3 * fast.time["step_s"]
    assert any("throughput probe against the reference (1,075" in a for a in slow.assumptions)
    lo, hi = fast.time["step_s_range"]
    assert lo < fast.time["step_s"] < hi


def test_fit_warning_names_the_node_and_what_to_change(tmp_path):
    model = official("ernie-4.5-21b-a3b", tmp_path)
    est = estimate_run(model, train(fine_tuning="Full", compute_type="bf16"), DATA, node=GPU)
    warning = fit_warning(est, GPU)
    assert warning.startswith("will not fit") and "gpu-node" in warning and "LoRA" in warning
    small = estimate_run(official("ernie-4.5-0.3b", tmp_path), train(), DATA, node=GPU)
    assert fit_warning(small, GPU) is None
    assert fit_warning(est, None) is None  # no node known: nothing to check


def test_from_doctor_reads_devices_ram_and_probe():
    report = {
        "facts": {
            "memory": {"total_bytes": 128 * GIB},
            "devices": [
                {"name": "NVIDIA H100", "total_memory_bytes": 80 * GIB},
                {"name": "NVIDIA H100", "total_memory_bytes": 40 * GIB},
            ],
        },
        "checks": [{"name": "throughput", "values": {"tokens_per_second": 9000.0}}],
    }
    node = NodeFacts.from_doctor(report, "w1")
    assert (node.device, node.memory_bytes, node.ram_bytes) == ("gpu", 40 * GIB, 128 * GIB)
    assert node.probe_tokens_per_second == 9000.0
    cpu = NodeFacts.from_doctor({"facts": {"memory": {"total_bytes": 8 * GIB}, "devices": []}}, "w2")
    assert (cpu.device, cpu.memory_bytes, cpu.probe_tokens_per_second) == ("cpu", 8 * GIB, None)


def test_estimate_to_dict_is_json(tmp_path):
    est = estimate_run(official("ernie-4.5-0.3b", tmp_path), train(), DATA, node=CPU).to_dict()
    assert json.loads(json.dumps(est))["memory_gib"]["range"][0] < est["memory_gib"]["peak"]
    assert est["trainable_parameters"] < est["num_parameters"]
    assert close(est["num_parameters"], hand_03b()["total"], 0.001)  # the hand count leaves out the norms


def test_the_estimate_imports_no_paddle():
    code = "import sys, engine.estimate; print('paddle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- ETA -----------------------------------------------------------------------------------------------


def test_recent_step_seconds_ignores_a_slow_first_step_and_follows_a_change():
    assert recent_step_seconds([30.0, 10.0, 10.5, 9.5]) == 10.0
    assert recent_step_seconds([10.0] * 5 + [20.0] * 3) == 20.0
    assert recent_step_seconds([]) is None


def test_remaining_seconds_counts_evals_and_saves_and_never_says_zero_while_saving():
    eta = remaining_seconds(
        step=8,
        total=10,
        step_s=5.0,
        eval_s=3.0,
        evals_left=1,
        checkpoint_s=4.0,
        checkpoints_left=1,
        final_save_s=20.0,
    )
    assert eta == 2 * 5 + 3 + 4 + 20
    assert remaining_seconds(step=10, total=10, step_s=5.0, final_save_s=20.0, since_last_step_s=5.0) == 15.0
    assert remaining_seconds(step=10, total=10, step_s=5.0, final_save_s=20.0, since_last_step_s=60.0) == 1.0


def test_full_dpo_counts_its_reference_as_dpo_reference_dtype_holds_it(tmp_path):
    model = official("ernie-4.5-0.3b", tmp_path)
    n = hand_03b()["total"]
    est = {
        ref: estimate_run(
            model,
            train(stage="DPO", fine_tuning="Full", compute_type="bf16", dpo_reference_dtype=ref),
            DATA,
            node=CPU,
        ).memory["reference_model"]
        for ref in ("run", "fp32", "wint8")
    }
    # a bf16 run's reference in bf16 is half of the fp32 one; wint8 holds its linears in int8
    assert close(est["fp32"], 4 * n, SAVED) and close(est["run"], 2 * n, SAVED)
    assert close(est["run"] - est["wint8"], hand_03b()["linears"] * (2 - 1.01), SAVED)


# ---- against the runs recorded in docs/benchmarks.md ("Pre-flight estimate ... 2026-11-26 evening") -----

# bench/bench_estimate.py's synthetic SFT file (64 samples, mean 270 / p95 387 / max 422 tokens)
BENCH_DATA = [DatasetTokens(num_samples=64, mean_length=270, p95_length=387, max_length=422)]


def test_bf16_lora_03b_peak_holds_the_measured_run(tmp_path):
    # measured: a bf16 LoRA r8 run of the 0.3B shape, max_seq_len 1024, 8 steps: whole-run peak 2.51 GiB
    model = official("ernie-4.5-0.3b", tmp_path)
    est = estimate_run(model, train(compute_type="bf16", max_seq_len=1024, max_steps=8), BENCH_DATA, node=CPU)
    assert close(est.memory["peak"], 2.51 * GIB, 0.01)  # the estimate: 2.50 GiB, -0.3% (docs: within 1%)


# Every one-process run of the 0.3B shape recorded in docs/benchmarks.md ("Pre-flight estimate against a real
# run", 2026-11-24 runs A-C, 2026-11-26 runs D-E and the evening's bf16 / wint8 runs): (variant, steps, whole-run
# peak RSS in GiB). The runs at 4 steps of LoRA stop before the data's long rows (their longest is 299 tokens,
# the estimate sizes the p95 row, 387), so they are not held here. Each group is held to the figure the docs
# give for it: runs A-C "within 7%" (est. / meas. 1.04-1.07), the later runs "within 10%".
MEASURED_PEAKS = {
    0.07: [
        ("LoRA fp32", 8, 3.00), ("LoRA fp32", 8, 3.02), ("LoRA fp32", 8, 2.97),
        ("Full fp32", 4, 10.39), ("Full fp32", 4, 10.38), ("Full fp32", 4, 10.32),
    ],
    0.10: [
        ("LoRA fp32", 8, 3.52), ("LoRA fp32", 8, 3.52), ("Full fp32", 4, 10.27), ("Full fp32", 4, 10.22),
        ("LoRA bf16", 8, 2.51), ("LoRA bf16", 8, 2.50), ("LoRA wint8", 8, 2.41), ("LoRA wint8", 8, 2.26),
    ],
}  # fmt: skip


def test_every_measured_one_process_peak_is_within_its_bound_of_the_estimate(tmp_path):
    """Issue 26: the per-device memory prediction within 15% of every case this machine measured; each group
    within the figure docs/benchmarks.md gives for it. Measured: runs A-C 4.0-6.7% (LoRA fp32 at 2.97 GiB
    against 3.17); the later runs' widest gaps are LoRA fp32 at 3.52 GiB (estimate 3.17, -9.8%) and wint8
    LoRA at 2.26 (2.47, +9.1%). The estimate is deterministic, so the bounds sit at the docs' figures."""
    model = official("ernie-4.5-0.3b", tmp_path)
    for bound, peaks in MEASURED_PEAKS.items():
        gaps = []
        for variant, steps, measured in peaks:
            method, dtype = variant.split()
            cfg = train(fine_tuning=method, compute_type=dtype, max_seq_len=1024, max_steps=steps)
            peak = estimate_run(model, cfg, BENCH_DATA, node=CPU).memory["peak"] / GIB
            gaps.append((variant, measured, round(peak / measured - 1, 3)))
        assert max(abs(gap) for *_, gap in gaps) <= bound, gaps


# The runs with a throughput probe docs/benchmarks.md records (AMD EPYC 2026-11-26 runs D-E at loads 7-16 and
# the quiet evening runs; Intel Xeon quiet 2026-11-28): (variant, max_seq_len, steps, ranks, probe before,
# probe after, measured s / step). Left out: run D's Full, whose load arrived mid-run (probe 4,843 -> 766).
MEASURED_STEPS = [
    ("LoRA fp32", 1024, 8, 1, 2461, 3066, 11.29), ("LoRA fp32", 1024, 8, 1, 887, 634, 40.95),
    ("Full fp32", 1024, 4, 1, 727, 1212, 58.59), ("LoRA bf16", 1024, 8, 1, 12059, 10968, 4.35),
    ("LoRA wint8", 1024, 8, 1, 4079, 10379, 6.39), ("Full fp32", 512, 2, 2, 11685, 11785, 12.80),
    ("LoRA fp32", 1024, 8, 1, 10662, 10746, 3.77), ("LoRA bf16", 1024, 8, 1, 10773, 10874, 4.40),
    ("LoRA wint8", 1024, 8, 1, 10853, 10417, 5.61),
]  # fmt: skip


def test_every_measured_step_time_is_within_its_bound_of_the_estimate(tmp_path):
    """Issue 26: the time per step within 25% of the measured figure. With the node's probe (the mean of the
    bench's before and after) the estimate is 0.84 to 1.18 of each run (widest: stage1 on 2 ranks, +18%;
    Full fp32 at load 16, -16%); the bound is 20%."""
    model = official("ernie-4.5-0.3b", tmp_path)
    ratios = []
    for variant, seq, steps, ranks, before, after, measured in MEASURED_STEPS:
        method, dtype = variant.split()
        values = dict(fine_tuning=method, compute_type=dtype, max_seq_len=seq, max_steps=steps)
        cfg = train(**values, **({"sharding": "stage1"} if ranks > 1 else {}))
        node = dataclasses.replace(CPU, probe_tokens_per_second=(before + after) / 2)
        step = estimate_run(model, cfg, BENCH_DATA, node=node, num_devices=ranks).time["step_s"]
        ratios.append((variant, ranks, measured, round(step / measured, 2)))
    assert max(abs(ratio - 1) for *_, ratio in ratios) <= 0.20, ratios


def test_stage1_save_peak_counts_the_optimizer_state_rank0_gathers(tmp_path):
    # measured: Full fp32, sharding stage1 on 2 gloo ranks, max_seq_len 512: rank 0 peaked at 10.30 GiB while
    # saving (it gathers rank 1's AdamW moments before writing the checkpoint), rank 1 at 5.44 GiB
    model = official("ernie-4.5-0.3b", tmp_path)
    cfg = train(fine_tuning="Full", max_seq_len=512, max_steps=2, sharding="stage1")
    est = estimate_run(model, cfg, BENCH_DATA, node=CPU, num_devices=2)
    n = hand_03b()["total"]
    assert close(est.memory["optimizer"], 8 * n / 2, 0.01)  # this rank's half of the moments
    assert est.memory["save_peak"] - est.memory["training"] >= 0.9 * est.disk["checkpoint_bytes"] + 4 * n
    assert close(est.memory["peak"], 10.30 * GIB, 0.06)  # estimate +4.6%
    assert close(est.memory["training"], 5.44 * GIB, 0.08)  # estimate +6.6%


# bench/bench_estimate.py's MOE_SHAPE: the ERNIE-4.5-21B-A3B layout at 4 layers, hidden 1024, experts of width 256
SMALL_21B = dict(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=3072, moe_intermediate_size=256, moe_layer_end_index=3)  # fmt: skip


def test_expert_parallel_save_peak_is_the_writers_and_stays_under_one_process():
    # measured (docs/benchmarks.md, 2026-11-28): Full fp32 of SMALL_21B, max_seq_len 1024, 3 steps. With
    # expert_parallel_degree 2 on 2 gloo ranks, rank 0 (it writes the un-split checkpoint and final model,
    # receiving rank 1's experts one tensor at a time) peaked at 8.13 GiB, rank 1 at 4.76, both 4.77 before
    # the saves; one process, every expert: 8.22 GiB. (Before the gather went to the writer alone: 9.01 / 8.23.)
    model = ErnieConfig(**(preset_fields("ernie-4.5-21b-a3b") | SMALL_21B))
    one = estimate_run(model, train(fine_tuning="Full", max_seq_len=1024, max_steps=3), BENCH_DATA, node=CPU)
    cfg = train(fine_tuning="Full", max_seq_len=1024, max_steps=3, expert_parallel_degree=2)
    ep2 = estimate_run(model, cfg, BENCH_DATA, node=CPU, num_devices=2)
    experts = 3 * (3 * 1024 * 256 * 64)  # routed expert weights of the 3 MoE layers
    assert close(one.memory["optimizer"] - ep2.memory["optimizer"], 8 * experts / 2, 0.01)
    # the checkpoint: its serialised copy, and the other rank's half of the experts' weights and moments
    received = 12 * experts / 2
    assert close(
        ep2.memory["save_peak"] - ep2.memory["training"], 0.9 * ep2.disk["checkpoint_bytes"] + received, 1e-6
    )
    assert close(ep2.memory["peak"], 8.13 * GIB, 0.02)  # estimate -0.8%
    assert close(ep2.memory["training"], 4.77 * GIB, 0.11)  # estimate -9.8%
    assert close(one.memory["peak"], 8.22 * GIB, 0.03)  # estimate +1.5%
    assert ep2.memory["peak"] < one.memory["peak"]


def test_expert_parallel_lora_gathers_only_the_adapters_and_peaks_in_training():
    # measured (docs/benchmarks.md, 2026-11-28): LoRA r8 fp32 of SMALL_21B, max_seq_len 1024, 3 steps. With
    # expert_parallel_degree 2 on 2 gloo ranks the ranks peaked at 1.96 / 1.94 GiB, as before the saves: the
    # final save gathers only the experts' adapters. One process: 2.08. (Before: 3.97 / 3.97, the final save
    # all_gathered the experts' fp32 base weights.)
    model = ErnieConfig(**(preset_fields("ernie-4.5-21b-a3b") | SMALL_21B))
    one = estimate_run(model, train(max_seq_len=1024, max_steps=3), BENCH_DATA, node=CPU)
    cfg = train(max_seq_len=1024, max_steps=3, expert_parallel_degree=2)
    ep2 = estimate_run(model, cfg, BENCH_DATA, node=CPU, num_devices=2)
    assert close(ep2.memory["peak"], 1.96 * GIB, 0.04)  # estimate +2.6%
    assert close(ep2.memory["training"], 1.96 * GIB, 0.02)  # estimate -1.0%
    assert close(one.memory["peak"], 2.08 * GIB, 0.12)  # estimate +10.6%
    assert ep2.memory["peak"] < one.memory["peak"]
