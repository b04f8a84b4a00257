"""``report_to``: a run's scalars also go to TensorBoard event files and VisualDL logs under ``logging_dir``,
and to MLflow when asked for.

Each tool's own writer writes them (``tensorboard``'s EventFileWriter with classic ``simple_value`` scalars,
which TensorBoard and its EventAccumulator read as scalars; VisualDL's LogWriter; MLflow's MlflowClient), so
each tool reads them as it reads its own. metrics.jsonl stays the record: a row goes to the writers only when
it is new there, so a resumed run adds no duplicate points. W&B is refused by the config, not ignored.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# ERNIEKit's (PaddleNLP's) report_to values; "all" = the writers every install has (TensorBoard, VisualDL).
REPORT_TO = ("none", "visualdl", "tensorboard", "all", "mlflow", "wandb")
WRITERS = ("tensorboard", "visualdl")
OPTIONAL_WRITERS = ("mlflow",)
NOT_SUPPORTED = {"wandb": "Weights & Biases logging is not built in yet"}
# report_to value -> (module, what to install): optional writers the config checks before a run starts.
PACKAGES = {"mlflow": ("mlflow", "pip install 'ernie-studio[tracking]' (the mlflow-skinny package)")}
MLFLOW_EXPERIMENT = "ernie-studio"  # when MLFLOW_EXPERIMENT_NAME is not set
# Row keys that are positions, not curves.
NOT_SCALARS = frozenset({"step"})


def report_to_problems(values: list[str]) -> list[str]:
    """What is wrong with a report_to list beyond its choices (mlflow / wandb, none mixed with others)."""
    problems = []
    for name in values:
        if name in PACKAGES and not _installed(PACKAGES[name][0]):
            problems.append(
                f"report_to {name}: the {PACKAGES[name][0]} package is not installed; {PACKAGES[name][1]}, "
                f"or take {name} out of report_to"
            )
        if name in NOT_SUPPORTED:
            problems.append(
                f"report_to {name}: {NOT_SUPPORTED[name]}; use report_to: tensorboard and/or visualdl (written "
                f"under logging_dir) or import the run's metrics.jsonl, one JSON object per logged step"
            )
    if "none" in values and len(values) > 1:
        problems.append(
            f"report_to none cannot be combined with {', '.join(v for v in values if v != 'none')}"
        )
    return problems


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # a module in sys.modules without a spec: imported, so there
        return module in sys.modules and sys.modules[module] is not None


def writer_names(values: Iterable[str]) -> list[str]:
    values = set(values)
    always = list(WRITERS) if "all" in values else [w for w in WRITERS if w in values]
    return always + [w for w in OPTIONAL_WRITERS if w in values]


def scalar_tag(key: str) -> str:
    """``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss`` (the grouping ERNIEKit's VisualDL logs use)."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_") :]
    return "train/" + key


def scalars_of(row: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics row, by tag."""
    out = {}
    for key, value in row.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[scalar_tag(key)] = float(value)
    return out


class TensorBoardWriter:
    def __init__(self, logdir: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(str(logdir))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        self.writer.add_event(
            self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        )
        self.writer.flush()  # a killed run keeps every point it logged

    def close(self) -> None:
        self.writer.close()


class VisualDLWriter:
    def __init__(self, logdir: Path):
        from visualdl import LogWriter

        self.writer = LogWriter(logdir=str(logdir))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            if math.isfinite(value):  # VisualDL's reader rejects NaN / inf records
                self.writer.add_scalar(tag=tag, step=step, value=value)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowWriter:
    """One MLflow run through MLflow's own client. The tracking URI is MLflow's MLFLOW_TRACKING_URI, else a
    SQLite store in this folder; the experiment MLFLOW_EXPERIMENT_NAME, else ``ernie-studio``. The run's id is
    kept in ``run.json`` here, so a resumed training run goes on in the same MLflow run."""

    def __init__(self, logdir: Path, run_name: str):
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        logdir.mkdir(parents=True, exist_ok=True)
        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{logdir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        marker = logdir / "run.json"
        self.run_id = self._resumed(marker, uri)
        if self.run_id is None:
            experiment = self._experiment(logdir, local=not os.environ.get("MLFLOW_TRACKING_URI"))
            run = self.client.create_run(experiment, run_name=run_name, tags={"ernie_studio.run": run_name})
            self.run_id = run.info.run_id
            marker.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        print(f"report_to mlflow: run {self.run_id} at {uri}", flush=True)

    def _resumed(self, marker: Path, uri: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            kept = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if kept.get("tracking_uri") != uri:
            return None
        try:
            self.client.update_run(kept["run_id"], status="RUNNING")
        except MlflowException:  # the store was reset or the run deleted: start a new one
            return None
        return kept["run_id"]

    def _experiment(self, logdir: Path, local: bool) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or MLFLOW_EXPERIMENT
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        artifacts = (logdir.resolve() / "artifacts").as_uri() if local else None
        return self.client.create_experiment(name, artifact_location=artifacts)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(tag, v, now, step) for tag, v in scalars.items() if math.isfinite(v)]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as e:  # a tracking server that is away must not end a training run
            log.warning("report_to mlflow: step %d not logged: %s", step, e)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class ScalarWriters:
    """The writers ``report_to`` asks for, each in its own folder of ``logging_dir``; ``run_name`` names the
    run where the tool keeps several (MLflow)."""

    def __init__(self, logging_dir: str | Path, report_to: Iterable[str], run_name: str = ""):
        self.dir = Path(logging_dir)
        self.writers: list[Any] = []
        for name in writer_names(report_to):
            if name == "mlflow":
                self.writers.append(MLflowWriter(self.dir / name, run_name or self.dir.resolve().name))
            else:
                cls = TensorBoardWriter if name == "tensorboard" else VisualDLWriter
                self.writers.append(cls(self.dir / name))

    def write(self, row: dict[str, Any]) -> None:
        scalars = scalars_of(row)
        if not scalars:
            return
        for writer in self.writers:
            writer.write(int(row.get("step", 0)), scalars)

    def close(self, failed: bool = False) -> None:
        for writer in self.writers:
            try:
                writer.close(failed) if isinstance(writer, MLflowWriter) else writer.close()
            except Exception as e:  # closing a log must never fail the run it logged
                log.warning("closing %s: %s", type(writer).__name__, e)
        self.writers = []


def run_name(output_dir: str | Path) -> str:
    """A run's name in a tracking tool: the last two parts of its output directory (``runs/5/output`` ->
    ``5/output``, ``./output/sft`` -> ``output/sft``)."""
    return "/".join(Path(output_dir).resolve().parts[-2:])
