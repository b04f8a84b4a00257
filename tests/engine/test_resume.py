"""A killed or cancelled run resumes from its last checkpoint and continues exactly where it was."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from engine.train.run_dir import MetricsLog

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, model_dir: Path, name: str, **extra) -> Path:
    cfg = {
        "model_name_or_path": str(model_dir),
        "stage": "SFT",
        "fine_tuning": "Full",
        "train_dataset_path": str(ROOT / "examples/data/sft_demo.jsonl"),
        "max_seq_len": 128,
        "batch_size": 2,
        "learning_rate": 3e-3,
        "warmup_steps": 5,
        "save_steps": 10,
        "logging_steps": 1,
        "seed": 3,
        "output_dir": str(tmp_path / name),
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def metric_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
            rows.append(json.loads(line))
    return rows


def start(config: Path) -> subprocess.Popen:
    # -X faulthandler: a trainer that hangs is made to print every thread's stack (wait_exit) before it goes
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "engine", "train", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_cli(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", "train", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = metric_rows(out)
        if rows and rows[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"training exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout} s")


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """The trainer's exit code; one that does not end in ``timeout`` s fails the test with its threads' stacks
    (SIGABRT makes faulthandler print them), so a hang says where it was."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the trainer did not end within {timeout} s; its stacks:\n{err[-6000:]}")


def test_metrics_log_repairs_a_cut_line_and_never_repeats_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    log = MetricsLog(path)
    assert log.steps == {1, 2}
    assert not log.write({"step": 2, "loss": 9.0})
    assert log.write({"step": 3, "loss": 1.0})
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [2.0, 1.5, 1.0]
    path.write_text('{"step": 1, "loss": 2.0}')  # complete JSON but the newline never made it
    MetricsLog(path).write({"step": 2, "loss": 1.0})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_sigkill_at_step_50_then_rerun_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    # the uninterrupted run is the same command in its own process, as the resumed one is
    reference = run_cli(write_config(tmp_path, tiny_model_dir, "reference", max_steps=70))
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = {r["step"]: r["loss"] for r in metric_rows(tmp_path / "reference")}

    config = write_config(tmp_path, tiny_model_dir, "killed", max_steps=70)
    out = tmp_path / "killed"
    proc = start(config)
    wait_for_step(proc, out, 50)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = metric_rows(out)[-1]["step"]
    assert 50 <= killed_at < 70, killed_at
    assert not (out / "run_summary.json").exists()  # it really died mid-run

    resumed_from = max(
        int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if not p.name.endswith(".tmp")
    )
    rerun = run_cli(config)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rows = metric_rows(out)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 71)), "metrics.jsonl must hold every step exactly once"
    diffs = [abs(r["loss"] - expected[r["step"]]) for r in rows]
    worst = max(diffs)
    first_bad = next((r["step"] for r, d in zip(rows, diffs, strict=True) if d > 1e-6), None)
    print(
        f"killed at step {killed_at}, resumed from checkpoint-{resumed_from}: max |loss diff| = {worst:.2e}"
    )
    assert worst <= 1e-6, (
        f"curves part at step {first_bad} (killed at {killed_at}, resumed from {resumed_from})"
    )
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["final_metrics"]["loss"] == pytest.approx(expected[70], abs=1e-6)


def test_sigterm_saves_a_checkpoint_and_exits_130(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, "term", max_steps=40, save_steps=100)
    out = tmp_path / "term"
    proc = start(config)
    wait_for_step(proc, out, 12)
    os.kill(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 120) == 130
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "cancelled"
    last = metric_rows(out)[-1]["step"]
    assert (out / f"checkpoint-{last}" / "trainer_state.json").exists()
    assert summary["checkpoints"] == [str(out / f"checkpoint-{last}")]
    rerun = run_cli(config)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert [r["step"] for r in metric_rows(out)] == list(range(1, 41))
    assert json.loads((out / "run_summary.json").read_text())["status"] == "succeeded"
