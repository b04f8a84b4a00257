"""Expert parallelism on CPU: 2 gloo ranks split each MoE layer's routed experts (the all_gather exchange)
and compute what one process holding every expert and the whole batch computes.

One launch does every multi-rank check (tests/engine/expert_parallel_ranks.py); this file judges what it
wrote, and resumes its un-split checkpoint in one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file

import engine
from engine.train import run_training
from engine.train.build import build_model
from engine.train.config_load import load_config
from engine.train.options import ConfigError
from engine.train.parallel import launch_command
from tests.engine.expert_parallel_ranks import GOLDENS, ROOT, overrides
from tests.engine.test_models_parity import PARITY_ATOL, assert_logits_match_transformers
from tests.engine.test_vl_parity import CASES as VL_CASES
from tests.engine.test_vl_parity import _case as vl_case

# a split step against one process holding every expert: logits, gradients and loss (measured up to 7.2e-7)
SPLIT_ATOL = 5e-6


@pytest.fixture(scope="module")
def ranks(tiny_moe_model_dir, tiny_vl_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_parallel")
    logs = out / "launch_logs"
    cmd = launch_command(
        [
            str(ROOT / "tests/engine/expert_parallel_ranks.py"),
            str(tiny_moe_model_dir),
            str(tiny_vl_model_dir),
            str(out),
        ],
        2,
        str(logs),
        "ep2",
    )
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600
    )
    text = "".join(p.read_text() for p in sorted(logs.glob("*")) if p.is_file())
    assert proc.returncode == 0, text[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_split_experts_give_one_process_logits_and_gradients(ranks, kind):
    _, results = ranks
    for r in results:
        step = r[kind]
        print(
            f"{kind} rank {r['rank']}: |logits diff| {step['logits_diff']:.1e}, |grad diff| {step['grad_diff']:.1e}"
        )
        print(f"{kind} rank {r['rank']}: |loss diff| {abs(step['loss'] - step['one_process_loss']):.1e}")
        # measured (AMD Zen 5): logits 3.0e-7 (moe) / 7.2e-7 (vl), gradients 3.3e-7 / 9.7e-8, loss 4.8e-7
        assert step["logits_diff"] <= SPLIT_ATOL and step["grad_diff"] <= SPLIT_ATOL
        assert step["grads_compared"] > 20 and step["missing_grads"] == []
        assert abs(step["loss"] - step["one_process_loss"]) <= SPLIT_ATOL
        # half the routed experts of every layer (both modality groups of the VL model), counted in bytes
        assert 2 * step["expert_bytes"] == step["full_expert_bytes"]
        assert step["held_experts"] == ([4, 4] if kind == "moe" else [8, 8])


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_recompute_with_split_experts_replays_the_experts_and_changes_no_number(ranks, kind):
    """recompute under expert parallelism: the held and shared experts run again in backward (the exchange
    does not), and the step still equals one process without recompute."""
    _, results = ranks
    for r in results:
        plain, again = r[kind], r[f"{kind}_recompute"]
        assert again["logits_diff"] <= SPLIT_ATOL and again["grad_diff"] <= SPLIT_ATOL
        assert again["grads_compared"] == plain["grads_compared"] and again["missing_grads"] == []
        assert abs(again["loss"] - again["one_process_loss"]) <= SPLIT_ATOL
        assert plain["expert_calls"] > 0 and again["expert_calls"] == 2 * plain["expert_calls"]


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_twenty_steps_follow_the_one_process_losses(ranks, kind):
    out, results = ranks
    assert {r[f"train_{kind}"] for r in results} == {"succeeded"}
    split, one = losses(out / f"ep-{kind}"), losses(out / f"one-{kind}")
    notices = json.loads((out / f"ep-{kind}" / "run_summary.json").read_text())["notices"]
    # the VL run recomputes under expert parallelism, and says what of the MoE blocks it keeps
    assert any(n["key"] == "recompute" and "exchange" in n["message"] for n in notices) == (kind == "vl")
    assert len(split) == len(one) == 20
    print(f"{kind}: 20 steps, max |loss diff| = {np.abs(np.subtract(split, one)).max():.1e}")
    np.testing.assert_allclose(split, one, atol=1e-5, rtol=0)  # measured 9.5e-7 (moe) / 1.2e-6 (vl), Zen 5
    assert one[-1] < one[0]


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_checkpoints_are_written_un_split_and_resume_in_one_process(
    ranks, kind, tiny_moe_model_dir, tiny_vl_model_dir, tmp_path
):
    out, _ = ranks
    # the final model: every expert back, loadable by one process, and the one-process model's logits
    ids = paddle.to_tensor(np.arange(1, 33, dtype=np.int64).reshape(1, 32))
    with paddle.no_grad():
        a = engine.load_model(out / f"one-{kind}")(ids).logits.numpy()
        b = engine.load_model(out / f"ep-{kind}")(ids).logits.numpy()
    print(f"{kind}: final models' logits, split against one process: max |diff| {np.abs(b - a).max():.2e}")
    np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)  # measured 1.9e-6 / 3.5e-6, AVX2 1.7e-6 / 7.2e-6
    # checkpoint-10 holds the same tensors (weights and AdamW state) as one process's, each expert's under
    # its own name: its values are the one-process run's but for 10 steps of float32 rounding (AdamW's
    # normalised step amplifies it on the experts' small gradients), and that rounding differs by CPU kind.
    # Measured (moe / vl) on the weights: 3.2e-5 / 8.1e-6 with AVX-512 (6.7e-5 / 6.3e-6 on a Zen 5), 5.3e-5 /
    # 1.2e-5 on an AVX2-only Zen 3; on the AdamW moments: 3.8e-8 / 5.6e-8 and 2.5e-8 / 2.8e-7. Each bound is
    # 4.5-8x the larger figure; an expert in another's place is ~0.1 away.
    bounds = {
        "model.pdparams": 3e-4 if kind == "moe" else 1e-4,
        "optimizer.pdopt": 3e-7 if kind == "moe" else 1.5e-6,
    }
    for name, bound in bounds.items():
        split = paddle.load(str(out / f"ep-{kind}/checkpoint-10" / name))
        one = paddle.load(str(out / f"one-{kind}/checkpoint-10" / name))
        assert sorted(split) == sorted(one)
        tensors = [k for k, v in one.items() if isinstance(v, paddle.Tensor | np.ndarray)]
        # 2 MoE layers of 8 experts (16 in the VL MoE's two groups), 2 weights each, AdamW's 4 states each
        experts = (32 if name == "model.pdparams" else 128) * (1 if kind == "moe" else 2)
        assert sum(".mlp.experts." in k for k in tensors) == experts
        gap = max(float(np.abs(np.asarray(split[k]) - np.asarray(one[k])).max()) for k in tensors)
        print(f"{kind}: checkpoint-10 {name}, split against one process: max |diff| {gap:.1e}")
        assert gap <= bound
    # ... and one process resumes it: step 11 as the expert-parallel run had it
    resumed = tmp_path / "resumed"
    shutil.copytree(out / f"ep-{kind}/checkpoint-10", resumed / "checkpoint-10")
    model_dir = tiny_moe_model_dir if kind == "moe" else tiny_vl_model_dir
    yaml, over = overrides(kind, str(model_dir), resumed, ["batch_size=4", "max_steps=11"])
    assert run_training(load_config(yaml, over)).status == "succeeded"
    gap = abs(losses(resumed)[-1] - losses(out / f"ep-{kind}")[10])
    print(f"{kind}: step 11 resumed by one process from the split run's checkpoint-10: |loss diff| {gap:.1e}")
    assert gap <= 3e-6  # measured 3.0e-7 (moe) / 2.4e-7 (vl), AMD Zen 5


def test_a_lora_runs_final_adapter_holds_every_experts_adapter_as_one_process_trains_it(ranks):
    """LoRA under expert parallelism: the final save gathers only the experts' adapters (not their frozen
    base weights) to rank 0, and the adapter equals the one-process run's."""
    out, results = ranks
    assert {r["train_moe_lora"] for r in results} == {"succeeded"}
    assert results[0]["reference_moe_lora"] == "succeeded"
    split = load_file(out / "ep-moe-lora/adapter_model.safetensors")
    one = load_file(out / "one-moe-lora/adapter_model.safetensors")
    assert sorted(split) == sorted(one)
    experts = {n.split(".mlp.experts.")[1].split(".")[0] for n in split if ".mlp.experts." in n}
    assert experts == {str(e) for e in range(8)}  # rank 1's experts 4-7 came from rank 1
    gap = max(float(np.abs(split[n] - one[n]).max()) for n in one)
    print(f"LoRA adapters after 6 steps, split against one process: max |diff| {gap:.2e}")
    assert gap <= 5e-6  # measured 5.2e-7
    np.testing.assert_allclose(losses(out / "ep-moe-lora"), losses(out / "one-moe-lora"), atol=1e-5, rtol=0)


def test_the_writer_alone_receives_what_other_ranks_hold(ranks):
    """``gather_to_writer`` (every checkpoint's experts and sharded optimizer state): rank 0 gets rank 1's
    tensors with their dtypes, numpy stays numpy, names rank 0 holds are not sent, and rank 1 keeps none."""
    _, results = ranks
    assert results[1]["gather"] == {"got": None}
    got = results[0]["gather"]["got"]
    assert got == {
        "both": ["Tensor", "paddle.float32", [0.0, 0.0]],
        "only0.bf16": ["Tensor", "paddle.bfloat16", [1.5, 1.5, 1.5]],
        "only0.int8": ["Tensor", "paddle.int8", [[7, 7], [7, 7]]],
        "only0.numpy": ["ndarray", "float32", [2.5] * 4],
        "only1.bf16": ["Tensor", "paddle.bfloat16", [2.5, 2.5, 2.5]],
        "only1.int8": ["Tensor", "paddle.int8", [[8, 8], [8, 8]]],
        "only1.numpy": ["ndarray", "float32", [3.5] * 4],
        "scheduler": {"last_epoch": 0},
    }


def assert_vl_logits_match_transformers(model_dir) -> None:
    """test_vl_parity's check on the model in ``model_dir``: every golden case (text, images, a video)."""
    model = engine.load_model(str(model_dir), dtype="float32")
    golden = np.load(ROOT / GOLDENS["vl"] / "expected.npz")
    for case in VL_CASES:
        ids, pix, grids = vl_case(golden, case)
        images = {"pixel_values": paddle.to_tensor(pix), "grid_thw": grids} if pix is not None else {}
        with paddle.no_grad():
            logits = model(paddle.to_tensor(ids), **images).logits.numpy()
        gap = float(np.abs(logits - golden[f"{case}/logits"]).max())
        print(
            f"golden vl {case} from {Path(model_dir).name}: max |logit diff| against transformers {gap:.2e}"
        )
        assert gap <= PARITY_ATOL


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_a_golden_model_split_and_written_back_keeps_transformers_parity(ranks, kind):
    out, results = ranks
    # the split model itself: each rank holds its half of every modality group's experts ...
    held = [r["golden"][kind]["held_experts"] for r in results]
    assert held == (
        [[[0, 1, 2]] * 2, [[3, 4, 5]] * 2] if kind == "moe" else [[[0, 1, 4, 5]] * 2, [[2, 3, 6, 7]] * 2]
    )
    # ... and gives transformers' logits on every golden case: measured 1.55e-6 (moe), 1.0e-6 (vl text) to
    # 2.0e-6 (vl image), as un-split
    gaps = {
        case: max(r["golden"][kind]["logits_diff"][case] for r in results)
        for case in results[0]["golden"][kind]["logits_diff"]
    }
    print(f"golden {kind} split over 2 ranks: max |logit diff| against transformers {gaps}")
    assert len(gaps) == (1 if kind == "moe" else 4) and max(gaps.values()) <= PARITY_ATOL
    written = out / f"golden-{kind}-unsplit"
    if kind == "moe":
        assert_logits_match_transformers("moe", written)
    else:
        assert_vl_logits_match_transformers(written)
    # gathered back bit for bit: every expert from the rank that held it
    back = load_file(written / "model.safetensors")
    golden = load_file(ROOT / GOLDENS[kind] / "paddle/model.safetensors")
    assert sorted(back) == sorted(golden) and any(".mlp.experts.5." in n for n in back)
    for name, value in golden.items():
        np.testing.assert_array_equal(back[name], value.astype(np.float32), err_msg=name)


def test_bad_expert_parallel_settings_name_the_key(tiny_model_dir, tiny_moe_model_dir, tmp_path):
    def build(model, *extra):
        yaml, over = overrides("moe", str(model), tmp_path / "out", list(extra))
        return build_model(load_config(yaml, over))

    with pytest.raises(ValueError, match=r"expert_parallel_degree: 3 does not divide the model's 8 experts"):
        build(tiny_moe_model_dir, "expert_parallel_degree=3")
    with pytest.raises(ValueError, match=r"expert_parallel_degree: 2 needs an MoE model.*dense"):
        build(tiny_model_dir, "expert_parallel_degree=2")
    with pytest.raises(ConfigError, match=r"expert_parallel_degree: 2 does not divide the 1 rank"):
        build(tiny_moe_model_dir, "expert_parallel_degree=2")
    with pytest.raises(ConfigError, match=r"moe_group"):
        build(tiny_moe_model_dir, "moe_group=sharding")
    with pytest.raises(ConfigError, match=r"elastic training"):
        build(tiny_moe_model_dir, "expert_parallel_degree=2", "elastic=true", "elastic_topk_choices=1")
    # ERNIEKit's dp group is every rank: one process splits nothing
    yaml, over = overrides("moe", str(tiny_moe_model_dir), tmp_path / "out", ["moe_group=dp"])
    assert load_config(yaml, over).expert_degree(1) == 1
    assert load_config(yaml, over).expert_degree(4) == 4


def test_a_rank_reads_only_the_experts_it_holds(tiny_moe_model_dir):
    """Loading under expert parallelism: the split comes before any weight is read, so the other rank's
    experts stay on disk (one process, as rank 1 of 2 would load)."""
    from engine.models.checkpoint import TensorStore
    from engine.models.config import ErnieConfig
    from engine.models.expert_parallel import ExpertGroup, split_experts
    from engine.models.streaming import lazy_model, stream_state

    model = lazy_model(ErnieConfig.from_file(tiny_moe_model_dir))
    split_experts(model, ExpertGroup(size=2, rank=1, world=2))
    report = stream_state(model, tiny_moe_model_dir)
    stored = [k for k in TensorStore(tiny_moe_model_dir) if ".mlp.experts." in k]
    others = [k for k in stored if int(k.split(".mlp.experts.")[1].split(".")[0]) < 4]
    assert others and len(others) == len(stored) // 2
    assert int(report["unused"]) == len(others)  # exactly rank 0's experts were left unread
    held = {n for n in model.state_dict() if ".mlp.experts." in n}
    assert held and all(int(n.split(".mlp.experts.")[1].split(".")[0]) >= 4 for n in held)
