"""GPAS: the gate's gradient against a hand computation, gates through save / load / export, a GPAS run that
trains its gates, logs them and whose model serves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.models.gpas import GPASGate, add_gates, gate_parameters
from engine.models.saving import save_model
from engine.train import run_export, run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict, load_export_config
from engine.train.export_config import ExportConfig
from engine.train.options import ConfigError
from engine.train.serving_export import serving_problems
from tests.engine.serve_support import complete_in_process

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def silu(a: float) -> float:
    return a / (1 + math.exp(-a))


def silu_grad(a: float) -> float:
    s = 1 / (1 + math.exp(-a))
    return s * (1 + a * (1 - s))


@pytest.mark.parametrize("a", [0.0, 0.7, -1.3])
def test_gate_gradient_matches_the_formula(a):
    rng = np.random.default_rng(3)
    x_np = rng.normal(size=(2, 5, 8)).astype(np.float32)
    w_np = rng.normal(size=(2, 5, 8)).astype(np.float32)  # dL/dx' of the loss sum(w * x')
    gate = GPASGate()
    gate.gate.set_value(paddle.to_tensor([a], dtype="float32"))
    x = paddle.to_tensor(x_np, stop_gradient=False)
    y = gate(x)
    (y * paddle.to_tensor(w_np)).sum().backward()
    # forward: the stream scaled by 1 - SiLU(a); backward: the stream's gradient untouched, and
    # dL/da = -SiLU'(a) * sum(g * x) by hand
    np.testing.assert_allclose(y.numpy(), (1 - silu(a)) * x_np, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), w_np, rtol=0, atol=0)
    expected = -silu_grad(a) * float((w_np.astype(np.float64) * x_np).sum())
    np.testing.assert_allclose(float(gate.gate.grad.item()), expected, rtol=1e-5)


def random_ids(n: int = 24) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(1).integers(3, 500, (2, n)), dtype="int64")


def test_fresh_gates_are_the_plain_model_and_set_gates_survive_save_and_load(tiny_model_dir, tmp_path):
    model = engine.load_model(tiny_model_dir)
    ids = random_ids()
    plain = model(ids).logits.numpy()
    assert add_gates(model) == 2 * model.config.num_hidden_layers
    np.testing.assert_array_equal(model(ids).logits.numpy(), plain)  # SiLU(0) = 0: nothing changes
    for i, p in enumerate(gate_parameters(model).values()):
        p.set_value(paddle.to_tensor([0.3 + 0.2 * i], dtype="float32"))
    gated = model(ids).logits.numpy()
    assert np.abs(gated - plain).max() > 1e-3
    for layout in ("paddle", "hf"):
        out = save_model(model, tmp_path / layout, layout=layout)
        assert json.loads((out / "config.json").read_text())["gpas"] is True
        again = engine.load_model(out)
        assert sorted(gate_parameters(again)) == sorted(gate_parameters(model))
        np.testing.assert_allclose(again(ids).logits.numpy(), gated, atol=1e-5)
    assert "gpas" not in json.loads((tiny_model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def gpas_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpas") / "run"
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(tiny_model_dir),
            stage="PT",
            fine_tuning="Full",
            output_dir=str(out),
            train_dataset_path=str(DATA / "pt_demo.jsonl"),
            max_seq_len=64,
            batch_size=2,
            learning_rate=3e-3,
            max_steps=12,
            save_steps=100,
            logging_steps=4,
            disable_tqdm=True,
            report_to="none",
            gpas=True,
            gpas_gate_grad_clip=0.01,
        ),
    )
    assert run_training(cfg).status == "succeeded"
    return out


def test_gpas_run_trains_and_logs_its_gates(gpas_run):
    rows = [json.loads(line) for line in (gpas_run / "metrics.jsonl").read_text().splitlines()]
    sites = [k for k in rows[-1] if k.startswith("gpas/")]
    assert sorted(sites) == ["gpas/0.attn", "gpas/0.mlp", "gpas/1.attn", "gpas/1.mlp"]
    assert "gpas_scale_mean" in rows[-1]
    model = engine.load_model(gpas_run)
    gates = {n: float(p.item()) for n, p in gate_parameters(model).items()}
    assert len(gates) == 4 and all(g != 0.0 for g in gates.values())  # they trained (and were saved)
    # the logged value is SiLU of the saved gate
    assert rows[-1]["gpas/1.mlp"] == pytest.approx(silu(gates["ernie.layers.1.gpas_mlp.gate"]), rel=1e-5)


def test_gpas_model_serves(gpas_run):
    answer = complete_in_process(gpas_run)
    assert answer["usage"]["completion_tokens"] >= 1


def test_export_keeps_folds_or_refuses_the_gates(gpas_run, tmp_path):
    ids = random_ids()
    reference = engine.load_model(gpas_run)(ids).logits.numpy()
    kept = run_export(
        config_from_dict(ExportConfig, dict(output_dir=str(gpas_run), export_dir=str(tmp_path / "k")))
    )
    assert kept.gpas == "kept"
    np.testing.assert_allclose(engine.load_model(tmp_path / "k")(ids).logits.numpy(), reference, atol=1e-5)
    assert any("GPAS" in p for p in serving_problems(tmp_path / "k"))  # FastDeploy's export folds them
    with pytest.raises(ValueError, match=r"gpas: .*hf layout.*gpas_gates=fold"):
        run_export(config_from_dict(ExportConfig, dict(output_dir=str(gpas_run), layout="hf")))
    folded = run_export(
        config_from_dict(
            ExportConfig,
            dict(output_dir=str(gpas_run), export_dir=str(tmp_path / "f"), layout="hf", gpas_gates="fold"),
        )
    )
    assert folded.gpas == "folded" and folded.gpas_fold_deviation < 1e-3
    # a GPAS / elastic training config works as an export config: its training keys are announced
    cfg = load_export_config(None, [f"output_dir={gpas_run}", "gpas=true", "elastic_depth_choices=2"])
    assert {"gpas", "elastic_depth_choices"} <= {n.key for n in cfg.notices} and cfg.gpas_gates == "keep"
    config = json.loads((tmp_path / "f" / "config.json").read_text())
    assert "gpas" not in config
    plain = engine.load_model(tmp_path / "f")
    assert not gate_parameters(plain)
    np.testing.assert_allclose(plain(ids).logits.numpy(), reference, atol=1e-3 * np.abs(reference).max())


def test_gpas_refuses_lora_on_a_model_without_gates(tiny_model_dir, tmp_path):
    from engine.train.build import build_model

    cfg = config_from_dict(
        TrainConfig,
        dict(model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path), fine_tuning="LoRA", gpas=True)
        | {"train_dataset_path": str(DATA / "pt_demo.jsonl"), "stage": "PT"},
    )
    with pytest.raises(ValueError, match="gpas: a LoRA run"):
        build_model(cfg)
    with pytest.raises(ConfigError, match="gpas_gate_grad_clip must be >= 0"):
        config_from_dict(
            TrainConfig, dict(model_name_or_path="x", train_dataset_path="y", gpas_gate_grad_clip=-1)
        )
