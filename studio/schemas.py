"""Response shapes of the REST API (the service layer returns ORM objects; these say what is public), and
the base of every request body."""

from __future__ import annotations

import difflib
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, create_model, model_validator
from pydantic_core import PydanticCustomError

from engine.train.export_config import EXPORT_CHOICES, ExportConfig
from engine.train.options import config_default, field_info
from studio.queue import devices_of


class RequestModel(BaseModel):
    """A request body: a key it does not know is refused (a typo would otherwise be ignored silently), with
    the closest valid key in the message."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = list(cls.model_fields)
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), fields, n=1)
                    hint = f"did you mean {close[0]!r}?" if close else f"the keys are {', '.join(fields)}"
                    raise PydanticCustomError(
                        "extra_forbidden",
                        "unknown key '{key}'; {hint}",
                        {"key": str(key)[:100], "hint": hint},
                    )
        return data


class ORM(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorOut(BaseModel):
    message: str = Field(description="what went wrong and what to do about it")
    details: Any = None


class MediaFetchOut(ORM):
    id: int
    status: str = Field(description="queued, running, succeeded or failed")
    urls_done: int
    urls_total: int
    bytes_done: int
    failed: dict[str, str] | None = Field(description="{url: why} of the images that could not be fetched")
    error: str | None


class DatasetOut(ORM):
    id: int
    name: str
    filename: str
    format: str
    kind: str
    size_bytes: int
    num_records: int
    num_valid: int
    problems: list[str]
    created_at: datetime
    media_fetch: MediaFetchOut | None = Field(
        default=None,
        description="the worker job fetching the images the records name by URL (None when they name none)",
    )


class RunProgressOut(BaseModel):
    step: int | None = Field(description="last logged step")
    total_steps: int | None = Field(
        description="steps the run trains: the trainer's count (epoch runs too), else max_steps or the estimate's"
    )
    fraction: float | None
    elapsed_s: float | None
    step_s: float | None = Field(description="median seconds per step over the last few logged rows")
    loss: float | None
    peak_rss_gib: float | None = Field(description="the trainer's peak resident memory so far")
    peak_device_gib: float | None = Field(default=None, description="a GPU run's peak device memory so far")


class PlacementOut(BaseModel):
    """One node's part of a run over several nodes (its current or last attempt)."""

    node_rank: int
    ranks: list[int] = Field(description="the global ranks this node holds")
    node: str | None = Field(description="the node (ERNIE_STUDIO_NODE_NAME) whose worker took the part")
    worker: str | None
    status: str = Field(description="open | claimed | ready | launched | ended | failed | released")


class RunOut(ORM):
    id: int
    name: str
    stage: str
    fine_tuning: str
    base_model: str
    dataset_ids: list[int]
    status: str
    queue: str
    queue_position: int | None = None
    attempt: int
    worker: str | None
    node: str | None
    cancel_requested: bool
    resume_from: str | None
    parent_run_id: int | None
    output_dir: str
    model_dir: str | None
    error: str | None
    final_metrics: dict[str, Any] | None
    forgetting: dict[str, Any] | None = Field(
        default=None,
        description="evaluate.general's forgetting check once both evals succeeded: task and general "
        "(base, result, change, each with a paired bootstrap interval), margin, warning",
    )
    config: dict[str, Any]
    created_at: datetime
    queued_at: datetime
    dispatched_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    heartbeat_at: datetime | None
    cancel_requested_at: datetime | None
    estimate: dict[str, Any] | None = Field(
        default=None,
        description="the pre-flight estimate recorded when the run was queued (POST /runs/estimate)",
    )
    progress: RunProgressOut | None = None
    eta_seconds: float | None = Field(
        default=None,
        description="seconds until the run ends (remaining steps, evaluations, checkpoints and the final "
        "save); after the last step the final save still running; null while unknown or not running",
    )

    sweep_id: int | None = Field(default=None, description="the sweep this run is a trial of")
    sweep_trial: int | None = Field(default=None, description="its trial number in that sweep")
    num_nodes: int = Field(default=1, description="nodes the run is gang-scheduled over")
    placement: list[PlacementOut] = Field(
        default_factory=list, description="which node holds which ranks (runs over several nodes)"
    )

    @computed_field(description="devices the run trains on: its queue's devices per node, times num_nodes")
    @property
    def num_devices(self) -> int:
        return devices_of(self.queue) * self.num_nodes


class MetricOut(ORM):
    step: int
    loss: float | None
    learning_rate: float | None
    values: dict[str, Any]


class CheckpointOut(ORM):
    step: int
    path: str
    created_at: datetime


class EventOut(ORM):
    id: int
    at: datetime
    kind: str
    message: str
    run_id: int | None
    deployment_id: int | None


class LogsOut(BaseModel):
    run_id: int
    text: str
    offset: int
    next_offset: int
    size: int


class DeploymentOut(ORM):
    id: int
    name: str
    run_id: int | None
    model_dir: str
    backend: str
    status: str
    stop_requested: bool
    node: str | None
    port: int | None
    url: str | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    stopped_at: datetime | None


def _export_choice(key: str) -> tuple[Any, Any]:
    """(type, Field) of one export choice (engine.train.export_config.EXPORT_CHOICES) from ExportConfig: its help,
    choices and default. A key whose default is empty or a list takes None (the engine's default)."""
    info = field_info(ExportConfig, key)
    default = config_default(ExportConfig, key)
    choices = [c for c in info.get("choices") or () if c]
    help_text = info["help"] + (f" One of {', '.join(choices)}." if choices else "")
    if isinstance(default, list):
        help_text += f" Default: {', '.join(default)}."
        return list[str] | None, Field(default=None, max_length=len(choices), description=help_text)
    if default == "":
        return str | None, Field(default=None, max_length=32, description=help_text + " Default: none.")
    return str, Field(default=default, max_length=32, description=help_text)


# The body of POST /runs/{id}/export: ExportConfig's EXPORT_CHOICES, then what the studio adds to them.
ExportIn = create_model(
    "ExportIn",
    __base__=RequestModel,
    __doc__="An export of a succeeded run: the engine's export choices (ExportConfig), an elastic member, "
    "and whether to deploy it.",
    **{key: _export_choice(key) for key in EXPORT_CHOICES},
    ptq=(
        str | None,
        Field(
            default=None,
            max_length=32,
            deprecated=True,
            description="The former name of quantization, still read; give one of the two.",
        ),
    ),
    elastic_member=(
        str | None,
        Field(
            default=None,
            max_length=32,
            description="An elastic run's member to export as a model of its own (d<depth>-e<experts>-k<topk>, "
            "from GET /runs/{id}/elastic); empty exports the whole model.",
        ),
    ),
    deploy_on_success=(
        bool,
        Field(
            default=False,
            description="Start a deployment of the export once it is written (the worker does it; poll the "
            "export's deploy_state and deployment_id).",
        ),
    ),
)


class ElasticDeployIn(RequestModel):
    member: str = Field(
        max_length=32,
        description="The member to export and deploy (d<depth>-e<experts>-k<topk>, from GET /runs/{id}/elastic).",
    )


class ExportOut(ORM):
    id: int
    run_id: int
    layout: str
    quantization: str
    dtype: str
    max_shard_size: str
    export_format: str
    gguf_types: str
    gguf_files: list[dict[str, Any]] | None
    elastic_member: str
    gpas_gates: str
    status: str
    export_dir: str
    worker: str | None
    error: str | None
    perplexity: dict[str, Any] | None
    # deploy_on_success's chain: exporting, export_failed, deploying, then the deployment's status
    # (running, failed, stopping, stopped; removed once it was deleted); "" when no deployment was asked for.
    deploy_on_success: bool
    deploy_state: str
    deployment_id: int | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None


class ElasticMemberOut(BaseModel):
    """One member of an elastic run's family (engine.train.elastic.ElasticTraining.family_table)."""

    member: str
    depth: int
    experts: int
    topk: int
    depth_pattern: str
    parameters: int
    active_parameters: int
    steps_trained: int
    eval_loss: float | None
    decode_tokens_per_second: float | None = None  # greedy, batch 1, on the node that trained the run


class ElasticFamilyOut(BaseModel):
    run_id: int
    depth_pattern: str
    full_share: float
    members: list[ElasticMemberOut]


class ModelOut(BaseModel):
    name: str
    kind: str
    path: str | None
    available: bool
    model_type: str | None
    num_parameters: int | None
    # Per token (a MoE model's k routed experts + shared ones), and the weights' size in bf16.
    active_parameters: int | None = None
    weights_bf16_bytes: int | None = None
    run_id: int | None = None
    run_name: str | None = None
    # A LoRA run: the base model directory its adapter goes on (model_type and num_parameters are the
    # base's) and the adapter's r, lora_alpha, target_modules and compute_type.
    base_model: str | None = None
    adapter: dict[str, Any] | None = None
    # An official model being fetched into home/models: {id, status, bytes_done, bytes_total}.
    download: dict[str, Any] | None = None


class DownloadIn(RequestModel):
    name: str = Field(
        min_length=1,
        max_length=200,
        description="an official model (ernie-4.5-0.3b, ...) or a hub repo id such as baidu/ERNIE-4.5-0.3B-PT",
    )


class DownloadOut(ORM):
    id: int
    name: str
    repo_id: str
    model_dir: str
    status: str
    worker: str | None
    error: str | None
    bytes_done: int | None
    bytes_total: int | None
    commit: str | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None


class PreviewOut(BaseModel):
    dataset_id: int
    offset: int
    limit: int
    records: list[Any]
    total: int | None
    next_offset: int | None
    rendered: list[list[dict[str, Any]]] | None = None


class CompareOut(BaseModel):
    runs: list[dict[str, Any]]
    steps: list[int]
    metrics: dict[str, dict[str, list[float | None]]]
    config_diff: dict[str, dict[str, Any]]


class CloneIn(RequestModel):
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="hyperparameters or spec fields to change"
    )


class ChatIn(BaseModel):
    """An OpenAI chat completion request; extra fields (temperature, top_p, ...) pass through."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1, le=32768)


class NodeCheckOut(BaseModel):
    name: str
    passed: bool
    detail: str
    duration_s: float = 0.0


class NodeOut(ORM):
    """A worker and its node: what it reported at start (facts, doctor) and since (heartbeat)."""

    name: str = Field(description="the worker's name, e.g. train0@gpu-node-1")
    node: str = Field(description="ERNIE_STUDIO_NODE_NAME of its machine")
    hostname: str
    state: str = Field(
        description="ready (takes work) | checking (doctor running) | failed (doctor failed: takes no runs "
        "or deployments) | offline (no heartbeat for ERNIE_STUDIO_NODE_OFFLINE_AFTER_S, or stopped)"
    )
    queues: list[str] = Field(description="the queues it was started for")
    accepting: list[str] = Field(description="the queues it consumes now")
    devices: list[dict[str, Any]] = Field(description="GPUs: index, name, compute_capability, memory bytes")
    memory_bytes: int | None = Field(description="host RAM")
    cpu_count: int | None
    busy: bool
    holds: list[dict[str, Any]] = Field(description="the run or deployments it holds: kind, id, name")
    reason: str | None = Field(description="why it takes no runs (its failed checks)")
    checks: list[NodeCheckOut]
    doctor: dict[str, Any] | None = Field(description="the whole `ernie-studio doctor --json` report")
    doctor_at: datetime | None
    started_at: datetime
    heartbeat_at: datetime


class EvalOut(ORM):
    id: int
    name: str
    model: str = Field(
        description="what was evaluated: run:<id>, export:<id>, deployment:<id> or a /models name"
    )
    model_dir: str
    run_id: int | None
    after_run_id: int | None = Field(description="the run whose evaluate-after-training queued this eval")
    role: str | None = Field(description="base or result (evaluate after training)")
    dataset_ids: list[int]
    config: dict[str, Any] = Field(description="the ernie-studio eval config handed to the engine")
    status: str
    attempt: int
    worker: str | None
    cancel_requested: bool
    output_dir: str
    samples_total: int
    samples_done: int = Field(default=0, description="sample rows stored so far")
    error: str | None
    metrics: dict[str, Any] | None = Field(description='headline numbers, "<file stem>/<metric>": value')
    results: dict[str, Any] | None = Field(description="per eval file: every metric with n and its interval")
    created_at: datetime
    dispatched_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    heartbeat_at: datetime | None


class EvalSampleOut(BaseModel):
    sample_id: str
    dataset: str
    line: int
    prompt: str
    reference: str
    prediction: str
    scores: dict[str, Any]
    other: dict[str, Any] | None = Field(default=None, description="compare_to's prediction and scores")
    differ: bool | None = None


class EvalSamplesOut(BaseModel):
    eval_id: int
    compare_to: int | None
    total: int
    offset: int
    items: list[EvalSampleOut]


class EvalCompareOut(BaseModel):
    evals: list[dict[str, Any]]
    metrics: dict[str, dict[str, float | None]]
    intervals: dict[str, dict[str, list[float]]]
    pairwise: dict[str, dict[str, Any]]
    differ: dict[str, Any] | None = None


class ImportedDatasetOut(BaseModel):
    key: str = Field(description="the file's key: train_dataset_path, eval_dataset_path or text_dataset_path")
    path: str = Field(description="the path as the file writes it (never opened)")
    line: int | None = Field(description="its line in the YAML")
    dataset_id: int | None = Field(
        description="the uploaded dataset of that file name or name; null: missing"
    )
    dataset_name: str | None
    note: str = Field(description="why it is missing, or how the dataset differs from what the file says")


class ConfigImportOut(BaseModel):
    """An ERNIEKit training YAML mapped onto the studio: the run's choices (POST /runs takes them once the
    missing datasets are uploaded and base_model is set) and what the file says that a run here does not use."""

    stage: str
    fine_tuning: str
    compute_type: str
    base_model: str | None = Field(
        description="the model /models lists under the file's model name; null: none"
    )
    model_path: str | None = Field(description="model_name_or_path as the file writes it")
    dataset_ids: list[int]
    dataset_probs: list[float] | None
    eval_dataset_ids: list[int]
    hyperparameters: dict[str, Any] = Field(
        description="every other training key of the file that has an effect on this run, as POST /runs takes "
        "it (the engine's value; lists comma-separated)"
    )
    datasets: list[ImportedDatasetOut]
    notices: dict[str, str] = Field(description="ERNIEKit keys the engine accepts without effect, and why")
    not_applied: dict[str, list[str]] = Field(
        description="keys without effect on a run of this stage, fine-tuning and compute type, and why"
    )
    studio_set: dict[str, str] = Field(description="keys the studio sets itself, and what it uses instead")


class TemplateOut(BaseModel):
    """A saved Train form: the run spec it launches (POST /runs takes it as is once its datasets exist)."""

    id: int
    name: str
    created_at: datetime
    spec: dict[str, Any] = Field(description="the run spec, as POST /runs takes it")
    missing_datasets: dict[str, list[int]] = Field(
        default_factory=dict, description="datasets the spec names that were deleted since, by spec field"
    )
    notes: list[str] = Field(default_factory=list, description="what to do about them")


class RecipeOut(BaseModel):
    """One of ERNIEKit's example configs the studio ships (studio/recipes), and the planner's verdict for it."""

    id: str
    title: str
    source_path: str = Field(description="its path in github.com/PaddlePaddle/ERNIE")
    source_commit: str
    erniekit_version: str
    shape: str = Field(description="the official model whose published shape the verdict uses")
    verdict: dict[str, Any] = Field(
        description="status (fits, proposal, does_not_fit, cannot_plan, no_nodes), the recipe's own problems "
        "on the studio's nodes, the planner's plan and reason"
    )


class SweepTrialOut(BaseModel):
    number: int
    state: str = Field(description="Optuna's: running, complete, pruned, fail")
    params: dict[str, Any]
    value: float | None = Field(description="the objective of its last evaluation (complete trials)")
    run_id: int | None
    run_status: str | None
    last_step: int | None = Field(description="the step of its newest reported evaluation")
    last_value: float | None
    stopped: str | None = Field(description="why the driver stopped its run: pruned, a budget, cancelled")
    general_change: float | None = Field(
        default=None, description="its run's forgetting check: the general score's change (result - base)"
    )
    ineligible: str | None = Field(
        default=None, description="under max_general_drop: why it cannot be the best (None: it can)"
    )


class SweepOut(ORM):
    id: int
    name: str
    status: str
    spec: dict[str, Any] = Field(description="the base run spec (POST /runs' body)")
    parameters: dict[str, Any]
    settings: dict[str, Any] = Field(description="objective, direction, n_trials, sampler, pruner, budget")
    parallelism: int
    study_name: str
    cancel_requested: bool
    stop_reason: str | None
    estimate: dict[str, Any] | None
    worker: str | None
    error: str | None
    created_at: datetime
    dispatched_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    heartbeat_at: datetime | None
    trials: list[SweepTrialOut] | None = Field(default=None, description="GET /sweeps/{id} only")
    leaderboard: list[SweepTrialOut] | None = Field(
        default=None, description="completed trials, best first (under max_general_drop, eligible ones first)"
    )


class SweepBestOut(SweepTrialOut):
    objective: str
    model_dir: str | None = Field(description="the best trial's model: deploy or export its run_id")
