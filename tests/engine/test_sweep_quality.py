"""What a sweep buys: on the tiny model and the demo SFT task, a 12-trial TPE sweep with successive-halving
pruning finds a learning rate about as good as a 12-point grid over the same range, for well under the grid's
training steps. The grid runs in the test, so the best learning rate is known, not assumed.

Measured (AMD EPYC, 2 cores; seed 0): grid best eval loss 4.048 (lr 1.0e-2 of 1e-4 .. 1e-1), 216 steps; the
sweep 4.024 (lr 9.5e-3), 81 steps (38%); seeds 1 and 2 gave 4.042 / 81 and 4.075 / 102 (47%). The median
pruner spent 81-126 steps (up to 58%), so the sweep uses ASHA. Bounds: within 10% of the grid's best loss
and at most 60% of its steps (the issue's figures)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.sweep import run_local_sweep, settings_from_dict
from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict

DEMO = Path(__file__).resolve().parents[2] / "examples" / "data" / "sft_demo.jsonl"
STEPS, LOW, HIGH, POINTS = 18, 1e-4, 1e-1, 12


def _base(tmp_path: Path, model_dir: Path) -> dict:
    lines = DEMO.read_text().splitlines(keepends=True)
    (tmp_path / "eval.jsonl").write_text("".join(lines[:16]))
    (tmp_path / "train.jsonl").write_text("".join(lines[16:]))
    return {
        "model_name_or_path": str(model_dir),
        "stage": "SFT",
        "fine_tuning": "Full",
        "train_dataset_type": "erniekit",
        "train_dataset_path": str(tmp_path / "train.jsonl"),
        "eval_dataset_type": "erniekit",
        "eval_dataset_path": str(tmp_path / "eval.jsonl"),
        "max_seq_len": 128,
        "batch_size": 4,
        "max_steps": STEPS,
        "eval_steps": 3,
        "logging_steps": 3,
        "save_steps": 1000,
        "warmup_steps": 0,
        "seed": 1,
        "report_to": "none",
    }


def _train(cfg: TrainConfig) -> list[float]:
    """Train; the eval losses it reported, in order."""
    evals: list[float] = []
    run_training(cfg, lambda e: evals.append(e["eval_loss"]) if "eval_loss" in e else None)
    return evals


def _steps_trained(out: Path) -> int:
    """Steps the trainers took, from each run's summary (a pruned trial counts the steps it made past its
    last evaluation too, until its stop's checkpoint)."""
    return sum(json.loads((d / "run_summary.json").read_text())["steps"] for d in out.iterdir() if d.is_dir())


def test_a_pruned_sweep_matches_the_grid_for_a_fraction_of_its_steps(tmp_path, tiny_model_dir):
    base = _base(tmp_path, tiny_model_dir)
    grid: dict[float, float] = {}
    for k in range(POINTS):
        lr = LOW * (HIGH / LOW) ** (k / (POINTS - 1))
        cfg = config_from_dict(
            TrainConfig, {**base, "learning_rate": lr, "output_dir": str(tmp_path / "grid" / str(k))}
        )
        evals = _train(cfg)
        assert len(evals) == STEPS // 3, evals
        grid[lr] = evals[-1]
    best_lr = min(grid, key=grid.get)
    # the best is inside the range, so the search has something to find
    assert LOW < best_lr < HIGH, grid
    grid_steps = _steps_trained(tmp_path / "grid")
    assert grid_steps == POINTS * STEPS

    space = {
        "n_trials": POINTS,
        "pruner": "asha",
        "seed": 0,
        "parameters": {"learning_rate": {"type": "float", "low": LOW, "high": HIGH, "log": True}},
    }
    settings, params = settings_from_dict(space, "space")
    study = run_local_sweep(
        config_from_dict(TrainConfig, {**base, "output_dir": str(tmp_path / "sweep")}), settings, params
    )
    states = [t.state.name for t in study.trials]
    assert len(states) == POINTS and "PRUNED" in states, states
    sweep_steps = _steps_trained(tmp_path / "sweep")
    assert study.best_value <= 1.10 * grid[best_lr], (study.best_value, grid)
    assert sweep_steps <= 0.60 * grid_steps, (sweep_steps, grid_steps, states)
