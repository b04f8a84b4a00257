"""report_to: TensorBoard's, VisualDL's and MLflow's own readers see the loss curve metrics.jsonl holds."""

from __future__ import annotations

import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict, load_config
from engine.train.options import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """A local MLflow file store for this module's runs (MLflow's own environment variables), when MLflow's
    client is installed (the dev extra has it)."""
    if find_spec("mlflow") is None:
        yield None
        return
    store = tmp_path_factory.mktemp("mlruns")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", store.as_uri())
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database unless told
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "scalars-test")
        yield store.as_uri()


def train_six_steps(out: Path, model: Path, report_to: str) -> Path:
    """A 6-step Full run of ``model`` evaluated at steps 3 and 6, its scalars sent to ``report_to``."""
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(model),
            output_dir=str(out),
            logging_dir=str(out / "logs"),
            report_to=report_to,
            fine_tuning="Full",
            train_dataset_path=str(DATA / "sft_demo.jsonl"),
            eval_dataset_path=str(DATA / "sft_demo.jsonl"),
            eval_steps=3,
            max_evaluate_steps=1,
            max_seq_len=128,
            batch_size=2,
            max_steps=6,
            learning_rate=3e-3,
            save_steps=1000,
            disable_tqdm=True,
        ),
    )
    assert run_training(cfg).status == "succeeded"
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir, mlflow_uri) -> Path:
    report_to = "tensorboard,visualdl" + (",mlflow" if mlflow_uri else "")
    return train_six_steps(tmp_path_factory.mktemp("scalars") / "run", tiny_model_dir, report_to)


def _metrics(out: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def test_tensorboard_reads_the_loss_curve_of_metrics_jsonl(run_dir):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(run_dir / "logs" / "tensorboard"))
    acc.Reload()
    for key, tag in (
        ("loss", "train/loss"),
        ("eval_loss", "eval/loss"),
        ("learning_rate", "train/learning_rate"),
    ):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        want = _metrics(run_dir, key)
        assert len(want) >= (2 if key == "eval_loss" else 6)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # stored as float32


def test_visualdl_reads_the_loss_curve_of_metrics_jsonl(run_dir):
    from visualdl import LogReader

    logdir = run_dir / "logs" / "visualdl"
    (log_file,) = list(logdir.glob("vdlrecords.*.log"))
    reader = LogReader(file_path=str(log_file))
    for key, tag in (("loss", "train/loss"), ("eval_loss", "eval/loss")):
        got = [(r.id, r.value) for r in reader.get_data("scalar", tag)]
        want = _metrics(run_dir, key)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def _mlflow_run(uri: str, experiment: str = "scalars-test"):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def test_mlflow_reads_the_loss_curve_of_metrics_jsonl(run_dir, mlflow_uri):
    pytest.importorskip("mlflow")
    client, run = _mlflow_run(mlflow_uri)
    assert run.info.run_name == f"{run_dir.parent.name}/run" and run.info.status == "FINISHED"
    for key, tag in (
        ("loss", "train/loss"),
        ("eval_loss", "eval/loss"),
        ("learning_rate", "train/learning_rate"),
    ):
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)]
        want = _metrics(run_dir, key)
        assert len(want) >= 2 and got == want  # MLflow keeps float64: the very values


def test_a_resumed_run_adds_no_duplicate_points(tmp_path, tiny_model_dir, mlflow_uri, monkeypatch):
    """A run of its own, in an MLflow experiment of its own: resuming the module's run added a step 7 that the
    other readers' tests, run after it in a random order (seed 155644), did not find in VisualDL's log."""
    from tensorboard.backend.event_processing import event_accumulator

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "scalars-resume")
    run_dir = train_six_steps(
        tmp_path / "run", tiny_model_dir, "tensorboard" + (",mlflow" if mlflow_uri else "")
    )
    cfg = load_config(
        None,
        [
            f"{k}={v}"
            for k, v in json.loads((run_dir / "train_config.json").read_text()).items()
            if k
            in (
                "model_name_or_path",
                "output_dir",
                "logging_dir",
                "train_dataset_path",
                "max_seq_len",
                "batch_size",
                "fine_tuning",
                "disable_tqdm",
            )
        ]
        + [f"report_to=tensorboard{',mlflow' if mlflow_uri else ''}", "max_steps=7", "save_steps=1000"],
    )
    run_training(cfg)
    acc = event_accumulator.EventAccumulator(str(run_dir / "logs" / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [s for s, _ in _metrics(run_dir, "loss")] == list(range(1, 8))
    if mlflow_uri:  # the same MLflow run goes on (the only run there), with step 7 added once
        client, run = _mlflow_run(mlflow_uri, "scalars-resume")
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == steps


@pytest.mark.parametrize("value", ["wandb", "tensorboard,wandb"])
def test_wandb_is_refused_not_ignored(value, tmp_path):
    with pytest.raises(ConfigError, match=r"report_to wandb: .* not built in yet"):
        load_config(None, ["model_name_or_path=m", "train_dataset_path=x.jsonl", f"report_to={value}"])


def test_mlflow_without_its_client_is_refused_at_config_time(monkeypatch):
    from engine.eval import eval_config_from_dict

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if the package were not installed
    want = r"report_to mlflow: the mlflow package is not installed; pip install 'ernie-studio\[tracking\]'"
    with pytest.raises(ConfigError, match=want):
        load_config(
            None, ["model_name_or_path=m", "train_dataset_path=x.jsonl", "report_to=tensorboard,mlflow"]
        )
    with pytest.raises(ConfigError, match=want):
        eval_config_from_dict(
            {"model_name_or_path": "m", "eval_dataset_path": "x.jsonl", "report_to": "mlflow"}
        )


def test_report_to_reads_erniekit_spellings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\ntrain_dataset_path: x.jsonl\nreport_to: none\n")
    assert load_config(path).report_to == ["none"]
    assert load_config(path, ["report_to=none"]).report_to == ["none"]
    assert load_config(path, ["report_to=all"]).report_to == ["all"]
    assert TrainConfig().report_to == ["visualdl"]  # ERNIEKit's (PaddleNLP's) default
