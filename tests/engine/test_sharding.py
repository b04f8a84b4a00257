"""Sharded optimizer state (ERNIEKit's `sharding`): fleet's stage 1 on 2 gloo ranks trains like plain data
parallel, holds half the AdamW state per rank, and its checkpoints resume with another number of ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.train import run_training
from engine.train.config_load import load_config
from engine.train.options import ConfigError
from engine.train.parallel import launch_command
from engine.train.run_checks import sharding_device_problems
from engine.train.sharding import gpu_sharding_problem
from engine.train.trainer import check_devices

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def _common(model_dir: Path) -> list[str]:
    return [
        f"model_name_or_path={model_dir}",
        f"train_dataset_path={ROOT / 'examples/data/sft_demo.jsonl'}",
        "max_seq_len=64",
        f"max_steps={STEPS}",
        "learning_rate=3e-3",
        "warmup_steps=2",
        "save_steps=10",
        "logging_steps=1",
        "seed=5",
        "max_grad_norm=0.5",  # low enough that clipping by the norm over both shards takes part
        "disable_tqdm=true",
        "report_to=none",
    ]


def _launch(tmp_path: Path, runs: dict[str, list[str]]) -> None:
    """The ``runs`` (output dir name: overrides) one after another on the same 2 gloo ranks: one launch,
    one start-up of Paddle per rank."""
    runner = tmp_path / "run_engine.py"
    runner.write_text(
        "import json, sys\nfrom engine.cli import main\nfrom engine.startup import end_rank\n"
        "code = 0\nfor args in json.loads(sys.argv[1]):\n    code = main(args)\n    if code:\n        break\n"
        "end_rank(1 if code else 0)\n"
    )
    config = str(ROOT / "examples/sft_full.yaml")
    todo = [["train", config, *args, f"output_dir={tmp_path / name}"] for name, args in runs.items()]
    cmd = launch_command([str(runner), json.dumps(todo)], 2, str(tmp_path / "logs"), "sharding")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*")) if p.is_file())
    assert proc.returncode == 0, text[-4000:]


def _one_process(tmp_path: Path, name: str, args: list[str]) -> None:
    cfg = load_config(ROOT / "examples/sft_full.yaml", [*args, f"output_dir={tmp_path / name}"])
    assert run_training(cfg).status == "succeeded"


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _resume_dir(src: Path, dst: Path, step: int) -> None:
    """A run directory holding only ``src``'s checkpoint-<step>: the next run resumes there."""
    dst.mkdir()
    shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")


def test_stage1_on_two_ranks_trains_like_data_parallel_and_resumes_on_other_rank_counts(
    tiny_model_dir, tmp_path
):
    common = _common(tiny_model_dir)
    # 1 process with batch 2 (the same global batch as 2 ranks x 1): the run 1 -> 2 resumes from
    _one_process(tmp_path, "one", [*common, "batch_size=2"])
    _resume_dir(tmp_path / "one", tmp_path / "one_to_two", 10)
    sharded = [*common, "batch_size=1", "sharding=stage1"]
    _launch(tmp_path, {"dp": [*common, "batch_size=1"], "sharded": sharded, "one_to_two": sharded})
    _resume_dir(tmp_path / "sharded", tmp_path / "two_to_one", 10)
    _one_process(tmp_path, "two_to_one", [*common, "batch_size=2"])

    dp, sharded = _losses(tmp_path / "dp"), _losses(tmp_path / "sharded")
    assert sorted(sharded) == list(range(1, STEPS + 1))
    diff = max(abs(sharded[s] - dp[s]) for s in dp)
    print(f"stage1 vs plain data parallel, {STEPS} steps: max |loss diff| = {diff:.2e}")
    assert diff <= 1e-6
    assert sharded[STEPS] < sharded[1]

    summaries = {n: json.loads((tmp_path / n / "run_summary.json").read_text()) for n in ("dp", "sharded")}
    full, split = summaries["dp"]["optimizer_state_bytes"], summaries["sharded"]["optimizer_state_bytes"]
    assert summaries["sharded"]["sharding"] == {
        "stage": 1,
        "degree": 2,
        "data_parallel_degree": 1,
    }
    print(f"optimizer state per rank: plain {full}, stage1 {split} bytes")
    assert len(full) == len(split) == 2 and full[0] == full[1]
    for b in split:
        assert abs(b / (full[0] / 2) - 1) <= 0.05
    assert sum(split) == pytest.approx(full[0], rel=1e-3)

    # saved by 2 sharded ranks at step 10, resumed by 1 process; and saved by 1, resumed by 2 sharded ranks
    two_to_one, one, one_to_two = (_losses(tmp_path / n) for n in ("two_to_one", "one", "one_to_two"))
    assert min(two_to_one) == min(one_to_two) == 11
    print(
        f"step 11: 2->1 {abs(two_to_one[11] - sharded[11]):.2e} from the sharded run, "
        f"1->2 {abs(one_to_two[11] - one[11]):.2e} from the 1-process run"
    )
    assert abs(two_to_one[11] - sharded[11]) <= 1e-6
    assert abs(one_to_two[11] - one[11]) <= 1e-6


def test_sharding_on_one_device_is_refused_naming_the_key(tiny_model_dir, tmp_path):
    cfg = load_config(
        ROOT / "examples/sft_full.yaml",
        [*_common(tiny_model_dir), "sharding=stage1", f"output_dir={tmp_path / 'out'}"],
    )
    with pytest.raises(ConfigError, match=r"sharding: stage1 splits the optimizer state .* one device"):
        run_training(cfg)
    assert not (tmp_path / "out" / "checkpoint-10").exists()
    # ERNIEKit's single-GPU recipes say `sharding: stage1` with `sharding_parallel_degree: 1`: no split
    assert sharding_device_problems("stage1", 1, 1) == []
    assert "sharding_parallel_degree: 4 must divide" in sharding_device_problems("stage1", 4, 2)[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sharding=stage3"], "sharding: stage3 .* is not supported"),
        (["sharding=stage2 offload"], "sharding: offload: Paddle's stage-2 offload runs with fp16"),
        (["sharding=stage1 stage2"], "sharding: name one stage"),
        (["sharding=zero1"], "sharding: 'zero1' is not one of stage1, stage2, offload"),
        (["sharding_parallel_degree=2"], "sharding_parallel_degree: 2 needs sharding: stage1 or stage2"),
        (["sharding=stage1", "compute_type=fp16"], "sharding: compute_type fp16"),
    ],
)
def test_bad_sharding_values_are_clear_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model_name_or_path=m", "train_dataset_path=d.jsonl", *overrides])


def test_stage2_is_refused_on_cpu_before_training(tiny_model_dir):
    # GPU only: Paddle's group_sharded_parallel asserts a gpu / xpu device
    if gpu_sharding_problem("stage2") is None:
        pytest.skip("this node has a GPU: stage 2 runs")
    cfg = load_config(ROOT / "examples/sft_full.yaml", [*_common(tiny_model_dir), "sharding=stage2"])
    with pytest.raises(ConfigError, match=r"sharding: stage2 needs a GPU .*; use sharding: stage1"):
        check_devices(cfg, 2)
    smaller = load_config(
        ROOT / "examples/sft_full.yaml",
        [*_common(tiny_model_dir), "sharding=stage2", "sharding_parallel_degree=2"],
    )
    with pytest.raises(ConfigError, match="stage2 spans all of the run's 4 devices"):
        check_devices(smaller, 4)
    check_devices(
        load_config(ROOT / "examples/sft_full.yaml", [*_common(tiny_model_dir), "sharding=stage1"]), 2
    )
