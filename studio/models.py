"""SQL schema of the studio: datasets, runs, metric points, checkpoints, deployments, exports, downloads,
evaluations and their sample rows, events, nodes, Train form templates, sweeps."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from engine.messages import MESSAGE_KEYS, restored, with_keys
from engine.train.export_config import ExportConfig
from engine.train.options import config_default


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone; we put it back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class KeyedJSON(TypeDecorator):
    """JSON whose messages keep their keys (engine.messages.with_keys / restored). A list holding keyed
    messages is stored as ``{"items": [...], "message_keys": {...}}`` (a JSON list has no room for the keys)
    and read back as the list; anything else is stored as plain JSON, so rows written before read as they were."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: Any, dialect) -> Any:
        if isinstance(value, list):
            kept = with_keys({"items": value})
            return kept if MESSAGE_KEYS in kept else value
        return with_keys(value) if isinstance(value, dict) else value

    def process_result_value(self, value: Any, dialect) -> Any:
        if isinstance(value, dict) and set(value) == {"items", MESSAGE_KEYS}:
            return restored(value)["items"]
        return restored(value)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UTCDateTime}


class RunStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_RUN_STATUSES = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}


class DeploymentStatus(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    filename: Mapped[str] = mapped_column(String(255))
    # Relative to ERNIE_STUDIO_HOME so the home can move.
    path: Mapped[str] = mapped_column(String(1024))
    format: Mapped[str] = mapped_column(String(32))
    kind: Mapped[str] = mapped_column(String(16))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    num_records: Mapped[int] = mapped_column(Integer, default=0)
    num_valid: Mapped[int] = mapped_column(Integer, default=0)
    # problems keep their keys, so the Datasets tab shows them in the reader's language
    problems: Mapped[list[Any]] = mapped_column(KeyedJSON, default=list)
    stats: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    media_fetches: Mapped[list[MediaFetch]] = relationship(
        order_by="MediaFetch.id", cascade="all, delete-orphan", passive_deletes=True, lazy="selectin"
    )

    @property
    def media_fetch(self) -> MediaFetch | None:
        """The newest fetch of the images the records name by URL (None when they name none)."""
        return self.media_fetches[-1] if self.media_fetches else None


class Sweep(Base):
    """A hyperparameter search (issue 33): a base run spec, a search space and the sweep's settings
    (engine.sweep.SweepSettings); its trials are runs (`runs.sweep_id`, `runs.sweep_trial`). Optuna keeps
    the study (`study_name`) in its own tables of the same database. Driven by a worker like a job
    (studio.services.jobs: claim, heartbeat, requeue when its worker died)."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    # The RunSpec every trial starts from (POST /runs' body) and the searched keys {key: {type, low, ...}}.
    spec: Mapped[dict[str, Any]] = mapped_column()
    parameters: Mapped[dict[str, Any]] = mapped_column()
    # engine.sweep.SweepSettings (objective, direction, n_trials, sampler, pruner, budget, enqueue)
    settings: Mapped[dict[str, Any]] = mapped_column()
    parallelism: Mapped[int] = mapped_column(Integer, default=1)
    study_name: Mapped[str] = mapped_column(String(255), unique=True)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED, index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Why the sweep stopped asking for trials (n_trials, max_wall_s, max_total_steps, cancelled).
    stop_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    estimate: Mapped[dict[str, Any] | None] = mapped_column(KeyedJSON, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_status_queue", "status", "queue"),
        # one run per trial: a driver restarted between asking Optuna and creating the run finds it here
        UniqueConstraint("sweep_id", "sweep_trial", name="uq_runs_sweep_trial"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    stage: Mapped[str] = mapped_column(String(16))
    fine_tuning: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(String(1024))
    dataset_ids: Mapped[list[Any]] = mapped_column(default=list)
    # The ERNIEKit config handed to `ernie-studio train` (output_dir included).
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED, index=True)
    queue: Mapped[str] = mapped_column(String(128))
    # Nodes the run is gang-scheduled over (1: one worker runs it); each takes the devices its queue names,
    # and its parts of each attempt are rows of `run_parts`.
    num_nodes: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    task_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    resume_from: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    parent_run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL"), nullable=True
    )
    # A sweep's trial: the sweep and Optuna's trial number.
    sweep_id: Mapped[int | None] = mapped_column(
        ForeignKey("sweeps.id", ondelete="SET NULL"), nullable=True, index=True
    )
    sweep_trial: Mapped[int | None] = mapped_column(Integer, nullable=True)
    output_dir: Mapped[str] = mapped_column(String(1024))
    model_dir: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    final_metrics: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    # engine.estimate's prediction when the run was queued (memory, time, disk, what it assumed), kept to
    # show against what the run measured
    estimate: Mapped[dict[str, Any] | None] = mapped_column(KeyedJSON, nullable=True)
    # "Evaluate after training": the held-out split and eval choices (studio.services.evals.EvaluateAfter,
    # plus the held-out files written at creation); the base and the result are evaluated once it succeeds.
    evaluate: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    queued_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(nullable=True)

    metrics: Mapped[list[RunMetric]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True, order_by="RunMetric.step"
    )
    checkpoints: Mapped[list[Checkpoint]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True, order_by="Checkpoint.step"
    )

    @property
    def forgetting(self) -> dict[str, Any] | None:
        """The forgetting check's result once the base and the result evals have both succeeded
        (studio.services.forgetting): task gain, general change with intervals, warning."""
        return (self.evaluate or {}).get("forgetting")


class RunPart(Base):
    """One node's part of one attempt of a run over several nodes: reserved when the attempt starts, claimed
    by a worker of that node, launched once every part is claimed and ready (all ranks start or none)."""

    __tablename__ = "run_parts"
    __table_args__ = (UniqueConstraint("run_id", "attempt", "node_rank", name="uq_run_parts_attempt_rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    # Devices (ranks) of this part: global ranks node_rank * nproc ... node_rank * nproc + nproc - 1.
    nproc: Mapped[int] = mapped_column(Integer)
    # open (reserved) | claimed | ready (prepared, at the barrier) | launched | ended | failed | released
    status: Mapped[str] = mapped_column(String(16), default="open")
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The launcher rendezvous (host:port) that node rank 0's worker chose; on node rank 0's row only.
    master: Mapped[str | None] = mapped_column(String(300), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # A rank's Python error (a failed part without one lost its rank: a kill, a dead node).
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    claimed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


class RunMetric(Base):
    __tablename__ = "run_metrics"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_run_metrics_run_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    learning_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The whole metrics.jsonl line, stage-specific keys included.
    values: Mapped[dict[str, Any]] = mapped_column(default=dict)
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)

    run: Mapped[Run] = relationship(back_populates="metrics")


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_checkpoints_run_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    run: Mapped[Run] = relationship(back_populates="checkpoints")


class Deployment(Base):
    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), nullable=True)
    model_dir: Mapped[str] = mapped_column(String(1024))
    backend: Mapped[str] = mapped_column(String(16), default="auto")
    status: Mapped[str] = mapped_column(String(16), default=DeploymentStatus.STARTING, index=True)
    stop_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    url: Mapped[str | None] = mapped_column(String(512), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    stopped_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


def _export_default(key: str) -> Any:
    return config_default(ExportConfig, key)


def _export_defaults(key: str) -> dict[str, Any]:
    """A column's default and server default: the engine's default of the export choice ``key``."""
    return {"default": _export_default(key), "server_default": _export_default(key)}


class Export(Base):
    """`ernie-studio export` of a finished run: LoRA merge, layout conversion, PTQ."""

    __tablename__ = "exports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    # The export's choices (engine.train.export_config.EXPORT_CHOICES), each column's default the engine's
    # (ExportConfig); gguf_types comma-separated, "" for a checkpoint export; layout "gguf" for a GGUF one.
    layout: Mapped[str] = mapped_column(String(16), default=_export_default("layout"))
    quantization: Mapped[str] = mapped_column(String(16), default=_export_default("quantization"))
    dtype: Mapped[str] = mapped_column(String(16), **_export_defaults("dtype"))
    max_shard_size: Mapped[str] = mapped_column(String(32), **_export_defaults("max_shard_size"))
    export_format: Mapped[str] = mapped_column(String(16), **_export_defaults("export_format"))
    gguf_types: Mapped[str] = mapped_column(String(64), default="", server_default="")
    # gguf_files: per file {type, path, size_bytes, perplexity, relative_to_f16} from export_summary.json.
    gguf_files: Mapped[list[Any] | None] = mapped_column(nullable=True)
    # An elastic run's member (d<depth>-e<experts>-k<topk>, engine.models.elastic); "" = the whole model.
    elastic_member: Mapped[str] = mapped_column(String(32), default="", server_default="")
    # A GPAS model's gates: keep or fold (engine.train.export_config.ExportConfig.gpas_gates).
    gpas_gates: Mapped[str] = mapped_column(String(16), **_export_defaults("gpas_gates"))
    # Deploy once it succeeds (the Runs tab's one-click member deploy): the worker finishing the export, or
    # the reconciler when that worker died first, makes the deployment once (deployed_at) and links it.
    deploy_on_success: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    deployed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    deployment_id: Mapped[int | None] = mapped_column(
        ForeignKey("deployments.id", ondelete="SET NULL"), nullable=True
    )
    deployment: Mapped[Deployment | None] = relationship(lazy="joined")
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED, index=True)
    export_dir: Mapped[str] = mapped_column(String(1024))
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    perplexity: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)

    @property
    def deploy_state(self) -> str:
        """Where an export to deploy on success stands: exporting, export_failed, deploying, then its
        deployment's status (removed once that was deleted); "" when no deployment was asked for."""
        if not self.deploy_on_success:
            return ""
        if self.status in (RunStatus.QUEUED, RunStatus.RUNNING):
            return "exporting"
        if self.status != RunStatus.SUCCEEDED:
            return "export_failed"
        if self.deployed_at is None or (
            self.deployment and self.deployment.status == DeploymentStatus.STARTING
        ):
            return "deploying"
        return self.deployment.status if self.deployment else "removed"


class ModelDownload(Base):
    """`ernie-studio download` of an official checkpoint (or a hub repo) into home/models, run by a worker."""

    __tablename__ = "model_downloads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(
        String(255)
    )  # what was asked: a preset such as ernie-4.5-0.3b, or a repo id
    repo_id: Mapped[str] = mapped_column(String(255))
    model_dir: Mapped[str] = mapped_column(String(1024))
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED, index=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Progress: bytes of the repo's listed files on disk so far, and their total (known once listed).
    bytes_done: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    bytes_total: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    commit: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


class MediaFetch(Base):
    """The images a dataset's records name by URL, fetched into its folder by a worker (never by the request
    that uploaded it); progress in URLs and bytes, and the URLs that could not be fetched with why."""

    __tablename__ = "media_fetches"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED, index=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    urls_done: Mapped[int] = mapped_column(Integer, default=0)
    urls_total: Mapped[int] = mapped_column(Integer, default=0)
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    failed: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)  # {url: why}
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Evaluation(Base):
    """`ernie-studio eval` of one model (a run's result, an export, a deployment's model, a base model) on
    one or more datasets, run by a training worker; its per-sample rows are in `eval_samples`."""

    __tablename__ = "evals"
    __table_args__ = (UniqueConstraint("after_run_id", "role", name="uq_evals_after_run_role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    # What was asked for (`run:3`, `export:2`, `deployment:1`, a /models name) and the directory it resolved to.
    model: Mapped[str] = mapped_column(String(1024))
    model_dir: Mapped[str] = mapped_column(String(1024))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), nullable=True)
    # The run whose "evaluate after training" made this eval, and which side it is ("base" or "result").
    after_run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), nullable=True, index=True
    )
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    dataset_ids: Mapped[list[Any]] = mapped_column(default=list)
    # The `ernie-studio eval` config handed to the engine (output_dir included).
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED, index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    output_dir: Mapped[str] = mapped_column(String(1024))
    samples_total: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # eval_results.json's headline numbers ("<file stem>/<metric>") and per-file metrics with intervals.
    metrics: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    results: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)


class EvalSample(Base):
    """One line of an eval's eval_samples.jsonl; (eval, sample id) is unique, so an import after a worker
    was killed and the eval continued never stores a sample twice."""

    __tablename__ = "eval_samples"
    __table_args__ = (UniqueConstraint("eval_id", "sample_id", name="uq_eval_samples_eval_sample"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    eval_id: Mapped[int] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"), index=True)
    # The engine's sample id, "<eval file name>:<line>": the same sample of two evals on one dataset.
    sample_id: Mapped[str] = mapped_column(String(512))
    dataset: Mapped[str] = mapped_column(String(255))
    line: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text, default="")
    reference: Mapped[str] = mapped_column(Text, default="")
    prediction: Mapped[str] = mapped_column(Text, default="")
    scores: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # The whole sample line (option log-probabilities, judge replies, ...).
    values: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(64))
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), nullable=True, index=True
    )
    deployment_id: Mapped[int | None] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), nullable=True, index=True
    )
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)


class NodeStatus(enum.StrEnum):
    """What a worker's node row says of its self-test; `offline` is derived from the heartbeat when read."""

    CHECKING = "checking"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class Node(Base):
    """One worker (named `train@<node>`, `serve@<node>`, ...) as it reported itself: its node's facts, the
    queues it was started for, its doctor result, and a heartbeat. Which run or deployment it holds is read
    from those tables, not stored here."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    hostname: Mapped[str] = mapped_column(String(255))
    queues: Mapped[list[Any]] = mapped_column(default=list)
    devices: Mapped[list[Any]] = mapped_column(default=list)
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cpu_count: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default=NodeStatus.CHECKING)
    # Why the worker takes no runs (its failed checks), shown as is.
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    doctor: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    doctor_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)


class TrainTemplate(Base):
    """A Train form saved under a name: the run spec it would launch (every option it holds), to start from."""

    __tablename__ = "train_templates"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    spec: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
