"""A model fine-tuned on a learnable task scores clearly higher than its base on a held-out split, through
``ernie-studio eval``: the answer (an animal's sound) depends on one word of the prompt, and the held-out
prompts carry item numbers the run never saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from animal_sounds import sound_records, write_jsonl

from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict

ROOT = Path(__file__).resolve().parents[2]


def cli_eval(model: Path, data: Path, out: Path) -> dict:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(
        f"model_name_or_path: {model}\noutput_dir: {out}\neval_dataset_type: erniekit\n"
        f"eval_dataset_path: {data}\nmetrics: exact_match,rouge_l,loss\nmax_new_tokens: 8\nmax_seq_len: 64\n"
        "bootstrap_samples: 200\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "eval", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "eval_results.json").read_text())


def test_fine_tuned_model_beats_its_base_on_held_out_prompts(tiny_model_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", sound_records(64, seed=1))
    held = write_jsonl(tmp_path / "held.jsonl", sound_records(16, seed=2))
    trained_prompts = {r["src"][0] for r in sound_records(64, seed=1)}
    assert not trained_prompts & {r["src"][0] for r in sound_records(16, seed=2)}
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "run"), fine_tuning="Full",
            train_dataset_path=str(train), max_seq_len=48, batch_size=8, max_steps=30, learning_rate=3e-3,
            save_steps=1000, disable_tqdm=True, report_to="none", logging_steps=10,
        ),
    )  # fmt: skip
    assert run_training(cfg).status == "succeeded"
    base = cli_eval(tiny_model_dir, held, tmp_path / "eval_base")
    tuned = cli_eval(tmp_path / "run", held, tmp_path / "eval_tuned")
    b, t = base["metrics"], tuned["metrics"]
    assert b["held/exact_match"] <= 0.1
    assert t["held/exact_match"] >= 0.6, tuned["datasets"]
    assert t["held/eval_loss"] < b["held/eval_loss"] / 2
    em = tuned["datasets"]["held.jsonl"]["metrics"]["exact_match"]
    assert em["n"] == 16 and em["ci_low"] <= em["mean"] <= em["ci_high"]
    lines = (tmp_path / "eval_tuned" / "eval_samples.jsonl").read_text().splitlines()
    sample = json.loads(lines[0])
    assert {"prompt", "reference", "prediction", "scores"} <= set(sample) and sample["reference"] == "meow"
