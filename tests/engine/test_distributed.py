"""Data parallel on CPU: two processes under paddle.distributed.launch (gloo) follow the same loss curve as
one process with the doubled batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.doctor.gpu_checks import run_sum_grads_ranks
from engine.train import run_training
from engine.train.config_load import load_config
from engine.train.parallel import LAUNCH_FLAGS, NodeGroup, launch_command

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_match_one_process_with_double_batch(tiny_model_dir, tmp_path):
    common = [
        f"model_name_or_path={tiny_model_dir}",
        f"train_dataset_path={ROOT / 'examples/data/sft_demo.jsonl'}",
        "max_seq_len=128",
        "max_steps=6",
        "learning_rate=3e-3",
        "warmup_steps=2",
        "save_steps=100",
        "logging_steps=1",
        "seed=5",
    ]
    runner = tmp_path / "run_engine.py"
    runner.write_text("import sys\nfrom engine.cli import run\nrun(sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = launch_command(
        [
            str(runner),
            "train",
            str(ROOT / "examples/sft_full.yaml"),
            *common,
            "batch_size=2",
            f"output_dir={tmp_path / 'dp2'}",
        ],
        2,
        str(tmp_path / "launch_logs"),
        "dp2",
    )
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = "".join(p.read_text() for p in sorted((tmp_path / "launch_logs").glob("*")) if p.is_file())
    assert proc.returncode == 0, logs[-3000:]

    single = load_config(
        ROOT / "examples/sft_full.yaml",
        [*common, "batch_size=4", f"output_dir={tmp_path / 'dp1'}", "disable_tqdm=true"],
    )
    assert run_training(single).status == "succeeded"

    def losses(d):
        return [
            json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
        ]

    one, two = losses("dp1"), losses("dp2")
    assert len(one) == len(two) == 6
    print(
        f"1 process x batch 4 vs 2 ranks x batch 2: max |loss diff| = {np.abs(np.subtract(one, two)).max():.2e}"
    )
    np.testing.assert_allclose(two, one, atol=2e-6, rtol=0)  # measured 2.4e-7 (AMD Zen 5)
    assert one[-1] < one[0]
    ids = paddle.to_tensor(np.arange(1, 33, dtype=np.int64).reshape(1, 32))
    with paddle.no_grad():
        a = engine.load_model(tmp_path / "dp1")(ids).logits.numpy()
        b = engine.load_model(tmp_path / "dp2")(ids).logits.numpy()
    print(f"final models' logits: max |diff| = {np.abs(b - a).max():.2e}")
    np.testing.assert_allclose(b, a, atol=5e-5, rtol=0)  # measured 7.2e-6 (AMD EPYC): 7x


def test_the_launcher_flags_we_use_are_those_of_the_installed_paddle():
    # launch_command relies on these flags (Paddle 3.x, python/paddle/distributed/launch/context/
    # args_envs.py); its training script is a program or a .py file: there is no `-m`.
    help_text = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    options = {word.strip("[],") for word in help_text.split() if word.startswith(("--", "[--", "-"))}
    assert set(LAUNCH_FLAGS) <= options, sorted(options)
    assert "-m" not in options
    assert "--elastic_level ELASTIC_LEVEL" in help_text  # default -1: a failed rank stops the job, no restart
    cmd = launch_command(["/bin/ernie-studio", "train", "c.yaml"], 2, "/r/dist_logs", "run7", devices=[2, 3])
    assert cmd[1:] == [
        "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--devices", "2,3",
        "--log_dir", "/r/dist_logs", "--job_id", "run7", "--max_restart", "0",
        "/bin/ernie-studio", "train", "c.yaml",
    ]  # fmt: skip
    node = NodeGroup("10.0.0.5:6170", 2, 1)
    cmd = launch_command(
        ["/bin/ernie-studio", "train", "c.yaml"], 1, "/r/dist_logs/node1", "run7", nodes=node
    )
    assert cmd[1:] == [
        "-m", "paddle.distributed.launch", "--nproc_per_node", "1",
        "--master", "10.0.0.5:6170", "--nnodes", "2", "--rank", "1",
        "--log_dir", "/r/dist_logs/node1", "--job_id", "run7", "--max_restart", "0",
        "/bin/ernie-studio", "train", "c.yaml",
    ]  # fmt: skip
    assert NodeGroup("10.0.0.5:6170", 2, 0, host="10.0.0.5").flags()[-2:] == ["--host", "10.0.0.5"]
    for bad in (("10.0.0.5", 2, 0), ("h:0", 2, 0), ("h:1", 1, 0), ("h:1", 2, 2), ("h:1", 2, 0, "node-a")):
        with pytest.raises(ValueError):
            NodeGroup(*bad)


def test_two_launchers_as_two_nodes_match_one_process(tiny_model_dir, tmp_path):
    """Two launchers of one node rank each (--nnodes 2, the master on 127.0.0.1) are one data-parallel job:
    the loss curve is one process's with the doubled batch, and rank 0 alone writes metrics.jsonl."""
    common = [
        f"model_name_or_path={tiny_model_dir}",
        f"train_dataset_path={ROOT / 'examples/data/sft_demo.jsonl'}",
        "max_seq_len=64",
        "max_steps=3",
        "learning_rate=3e-3",
        "warmup_steps=1",
        "save_steps=100",
        "logging_steps=1",
        "seed=5",
    ]
    runner = tmp_path / "run_engine.py"
    runner.write_text("import sys\nfrom engine.cli import run\nrun(sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    entry = [str(runner), "train", str(ROOT / "examples/sft_full.yaml"), *common, "batch_size=2",
             f"output_dir={tmp_path / 'nodes2'}"]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [
        subprocess.Popen(
            launch_command(entry, 1, str(tmp_path / f"node{r}"), "nodes2", nodes=NodeGroup(master, 2, r)),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in (1, 0)  # the joining node first: it waits for the master
    ]
    codes = [p.wait(timeout=300) for p in procs]
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("node*/workerlog.*")))
    assert codes == [0, 0], logs[-3000:]
    # one local rank per node, each writing its own node's log
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("node*/workerlog.*")) == [
        "node0/workerlog.0", "node1/workerlog.0",
    ]  # fmt: skip

    single = load_config(
        ROOT / "examples/sft_full.yaml",
        [*common, "batch_size=4", f"output_dir={tmp_path / 'one'}", "disable_tqdm=true"],
    )
    assert run_training(single).status == "succeeded"
    rows = [json.loads(line) for line in (tmp_path / "nodes2/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    one = [json.loads(line)["loss"] for line in (tmp_path / "one/metrics.jsonl").read_text().splitlines()]
    gap = np.abs(np.subtract([r["loss"] for r in rows], one)).max()
    print(f"two launchers as two nodes vs 1 process x batch 4: max |loss diff| = {gap:.2e}")
    np.testing.assert_allclose([r["loss"] for r in rows], one, atol=2e-6, rtol=0)  # measured 4.8e-7 (Zen 5)


def test_gradient_accumulation_matches_one_big_batch(tiny_model_dir, tmp_path):
    common = [
        f"model_name_or_path={tiny_model_dir}",
        f"train_dataset_path={ROOT / 'examples/data/sft_demo.jsonl'}",
        "max_seq_len=128",
        "max_steps=5",
        "logging_steps=1",
        "disable_tqdm=true",
    ]
    curves = []
    for name, extra in (
        ("big", ["batch_size=4"]),
        ("accum", ["batch_size=2", "gradient_accumulation_steps=2"]),
    ):
        cfg = load_config(ROOT / "examples/sft_full.yaml", [*common, *extra, f"output_dir={tmp_path / name}"])
        assert run_training(cfg).status == "succeeded"
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        curves.append([json.loads(line)["loss"] for line in rows])
    # micro-batches pad to their own length, but the loss is normalised over the whole step's tokens
    print(f"accumulated vs one big batch: max |loss diff| = {np.abs(np.subtract(*curves)).max():.2e}")
    np.testing.assert_allclose(curves[1], curves[0], atol=2e-6, rtol=0)  # measured 1.2e-6 (Zen 5)


def test_sum_grads_all_reduces_fp32_gates_beside_bf16_weights(tiny_moe_model_dir, tmp_path):
    # AMP keeps the MoE router gates in fp32 and the other weights in bf16; one concat of every gradient
    # raised "data_type of input tensor in list isn't consistent" on the first step of 2 ranks. The ranks
    # run the doctor's script (engine/doctor/sum_grads_rank.py), which it runs on 2 GPUs.
    code, results, logs = run_sum_grads_ranks(tiny_moe_model_dir, tmp_path, "bfloat16")
    assert code == 0, logs[-3000:]
    assert len(results) == 2
    for result in results:
        assert result["world"] == 2
        assert {"paddle.bfloat16", "paddle.float32"} <= set(result["dtypes"]), result
        assert result["max_diff"] == 0.0, result
