"""`ernie-studio sweep CONFIG.yaml --space SPACE.yaml`: three tiny trials trained one after another, the one
whose evaluation stays above the median stopped as Ctrl-C stops a run (its checkpoint written, no model),
the best trial named; run again on the same --storage, the study is resumed with nothing trained twice. A
bad space is refused with its key named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from engine.cli import main

DEMO = Path(__file__).resolve().parents[2] / "examples" / "data" / "sft_demo.jsonl"
CLI = str(Path(sys.executable).parent / "ernie-studio")


def _files(tmp_path: Path, model_dir: Path, space: dict) -> tuple[Path, Path]:
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(DEMO.read_text().splitlines(keepends=True)[:16]))
    cfg = {
        "model_name_or_path": str(model_dir),
        "stage": "SFT",
        "fine_tuning": "Full",
        "train_dataset_type": "erniekit",
        "train_dataset_path": str(DEMO),
        "eval_dataset_type": "erniekit",
        "eval_dataset_path": str(held_out),
        "max_seq_len": 128,
        "batch_size": 4,
        "max_steps": 6,
        "eval_steps": 3,
        "logging_steps": 3,
        "save_steps": 1000,
        "warmup_steps": 0,
        "report_to": "none",
        "output_dir": str(tmp_path / "out"),
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    return tmp_path / "cfg.yaml", tmp_path / "space.yaml"


def test_local_sweep_prunes_names_the_best_and_resumes(tmp_path, tiny_model_dir):
    space = {
        "n_trials": 3,
        "pruner": "median",
        "prune_after_trials": 1,
        "parameters": {"learning_rate": {"type": "float", "low": 2e-3, "high": 8e-3, "log": True}},
        "enqueue": [{"learning_rate": 5e-3}, {"learning_rate": 1e-9}],
    }
    cfg, space_file = _files(tmp_path, tiny_model_dir, space)
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    cmd = [CLI, "sweep", str(cfg), "--space", str(space_file), "--storage", storage]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    study = optuna.load_study(study_name=f"local:{(tmp_path / 'out').resolve()}", storage=storage)
    states = [t.state.name for t in study.trials]
    assert len(states) == 3 and states[:2] == ["COMPLETE", "PRUNED"] and states[2] in ("COMPLETE", "PRUNED")
    pruned = tmp_path / "out" / "trial-1"
    assert study.trials[1].last_step == 3 and (pruned / "checkpoint-3").is_dir()
    assert (
        not (pruned / "model.safetensors").exists()
        and (tmp_path / "out" / "trial-0" / "config.json").exists()
    )
    best = study.best_trial
    assert f"best trial {best.number}: eval_loss={best.value}" in first.stdout
    assert "trial 1: pruned {'learning_rate': 1e-09}" in first.stdout

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trial " not in again.stdout.replace(f"best trial {best.number}", "")  # nothing trained again
    assert len(optuna.load_study(study_name=study.study_name, storage=storage).trials) == 3


@pytest.mark.parametrize(
    ("space", "says"),
    [
        ({"parameters": {"lora_rnk": {"type": "int", "low": 4, "high": 8}}}, "lora_rnk: not a training key"),
        ({"parameters": {"learning_rate": {"low": 1e-3, "high": 1e-4}}}, "learning_rate: the range is empty"),
        (
            {"objective": "eval_rouge", "parameters": {"seed": {"choices": [1, 2]}}},
            "objective: 'eval_rouge' is no",
        ),
        ({"trials": 3, "parameters": {"seed": {"choices": [1, 2]}}}, "trials: not a sweep key"),
    ],
)
def test_a_bad_space_names_its_key(tmp_path, tiny_model_dir, capsys, space, says):
    cfg, space_file = _files(tmp_path, tiny_model_dir, space)
    assert main(["sweep", str(cfg), "--space", str(space_file)]) == 2
    err = capsys.readouterr().err
    assert f"{space_file}" in err and says in err, err
