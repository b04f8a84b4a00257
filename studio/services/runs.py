"""Training runs as a person handles them: create / list / cancel / resume / clone / delete, the ERNIEKit
config, queue position, estimates. What the workers do to a run is in `studio.services.run_lifecycle`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError
from pydantic_core import to_json
from sqlalchemy import Select, func, select, update
from sqlalchemy.orm import Session

from engine.train.config import (
    FINE_TUNING,
    MAX_DEVICES,
    STAGES,
    ConfigError,
    TrainConfig,
    check_expert_parallel,
    config_from_dict,
    elastic_model_problems,
    sharding_device_problems,
)
from engine.train.stages import PADDLEOCR_VL, family_stage, find_stage, stage_info, stage_names
from studio import queue
from studio.config import Settings
from studio.models import TERMINAL_RUN_STATUSES, Checkpoint, Dataset, Run, RunMetric, RunStatus, utcnow
from studio.schemas import RequestModel
from studio.services import metric_series
from studio.services.datasets import BENCHMARK, dataset_path, get_dataset
from studio.services.errors import Conflict, InvalidInput, ServiceError
from studio.services.estimates import check_known_devices, estimate_spec
from studio.services.evals import check_model_reads, check_options, engine_config, eval_datasets, hold_out
from studio.services.events import add_event
from studio.services.exports import create_export as queue_export
from studio.services.forgetting import GeneralCheck, check_names, general_files
from studio.services.models import is_ocr_model, model_config, model_dir_for
from studio.services.paths import PATH_KEYS, confine_config_paths
from studio.services.run_lifecycle import dispatch_run, withdraw_run
from studio.services.store import RowId, get_or_404

log = logging.getLogger(__name__)

# Keys the studio fills in itself; users set everything else through `hyperparameters`. Every key left out
# takes the engine's default (engine.train.config), as it would in a YAML passed to `ernie-studio train`.
MANAGED_KEYS = (
    "model_name_or_path",
    "stage",
    "fine_tuning",
    "train_dataset_type",
    "train_dataset_path",
    "train_dataset_prob",
    "output_dir",
    "logging_dir",
)
# Filled in by the studio only when the spec names evaluation sets (`eval_dataset_ids`).
EVAL_KEYS = ("eval_dataset_type", "eval_dataset_path", "eval_dataset_prob")
STUDIO_KEYS = (*MANAGED_KEYS, *EVAL_KEYS)
_INSTEAD = {
    "model_name_or_path": "pick the model with `base_model` (a preset, a model dir under ERNIE_STUDIO_HOME or "
    "ERNIE_STUDIO_MODEL_ROOTS, or run:<id>)",
    "train_dataset_path": "upload the data as a dataset and pass its id in `dataset_ids`",
    "dataset_name_or_path": "upload the data as a dataset and pass its id in `dataset_ids`",
    "eval_dataset_path": "upload the evaluation set as a dataset and pass its id in `eval_dataset_ids`",
    "output_dir": "the studio writes every run under runs/<id>/output",
    "logging_dir": "the studio writes every run under runs/<id>/output",
}
# What the Train tab's YAML preview shows as the output dir; the real one (runs/<id>/output) exists once
# the run is created.
PREVIEW_OUTPUT_DIR = Path("<run dir>/output")
_ENGINE_DEFAULTS = TrainConfig()
MAX_DATASETS = 16
MAX_NAME = 200  # the runs.name column
# Nodes one run may be gang-scheduled over (num_nodes).
MAX_NODES = 64
# A whole-series metrics read returns at most this many points (about a plot's width in pixels); the full
# resolution is read in pages of at most METRICS_PAGE points by `after_step`.
METRICS_MAX_POINTS = 1000
METRICS_PAGE = 10000


# Stages whose runs "evaluate after training" scores: SFT on chat records, OCR-VL-SFT on OCR sets (CER).
EVALUATED_STAGES = stage_names(lambda s: s.evaluated_after_training)


class EvaluateAfter(RequestModel):
    """ "Evaluate after training": once the run succeeds, its base and its result are evaluated (as two evals)
    on a held-out split of its training data and / or chosen eval datasets."""

    holdout: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="records drawn at random (seeded by the run's seed) from the training datasets and kept "
        "out of training; the evals score them",
    )
    dataset_ids: list[RowId] | None = Field(
        default=None, max_length=MAX_DATASETS, description="eval datasets (chat records) scored as well"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="ernie-studio eval keys (metrics, max_new_tokens, ...), as for POST /evals",
    )
    general: GeneralCheck | None = Field(
        default=None,
        description="the forgetting check: general sets scored too, and the margin the general score may "
        "fall by before the run warns (docs/evaluation.md)",
    )


class RunSpec(RequestModel):
    """What a person chooses for a run; the studio turns it into an ERNIEKit config."""

    name: str | None = Field(default=None, max_length=MAX_NAME)
    base_model: str = Field(
        default="tiny",
        max_length=1024,
        description="a name /api/v1/models lists (preset, local model, run:<id>), or a model directory",
    )
    dataset_ids: list[RowId] = Field(min_length=1, max_length=MAX_DATASETS)
    dataset_probs: list[Annotated[float, Field(gt=0, le=1e6)]] | None = None
    eval_dataset_ids: list[RowId] | None = Field(
        default=None,
        max_length=MAX_DATASETS,
        description="datasets evaluated every eval_steps (and at the end); same kind as the training data",
    )
    stage: str = Field(default=_ENGINE_DEFAULTS.stage, description=f"one of {', '.join(STAGES)}")
    fine_tuning: str = Field(
        default=_ENGINE_DEFAULTS.fine_tuning, description=f"one of {', '.join(FINE_TUNING)}"
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="any other training key; left out means the engine's default. Paths are not taken "
        "here: datasets go by id (dataset_ids, eval_dataset_ids), the model by base_model",
    )
    gpu: int | None = Field(
        default=None, ge=0, le=1023, description="pin to one GPU of node_name (one of ERNIE_STUDIO_GPUS)"
    )
    num_devices: int = Field(
        default=1,
        ge=1,
        le=MAX_DEVICES,
        description="GPUs (CPU node: gloo processes) of one node the run trains on, data-parallel; each "
        "takes batch_size rows per step. A worker owning at least this many devices runs it and holds them "
        "all until it ends (ERNIE_STUDIO_WORKER_DEVICES)",
    )
    num_nodes: int = Field(
        default=1,
        ge=1,
        le=MAX_NODES,
        description="nodes the run's num_devices are split over, num_devices / num_nodes on each; a run "
        "over several nodes is gang-scheduled (all nodes' workers start their ranks together or none does) "
        "and needs its run directory on storage every node shares (docs/training.md)",
    )
    evaluate: EvaluateAfter | None = Field(
        default=None,
        description="evaluate the base and the result once the run has succeeded "
        f"({' and '.join(EVALUATED_STAGES)} runs)",
    )


def build_config(session: Session, settings: Settings, spec: RunSpec, output_dir: Path) -> dict[str, Any]:
    """The ERNIEKit config for `spec`: studio-managed keys plus the user's hyperparameters."""
    _check_choices(spec)
    datasets = _datasets_for(session, spec, spec.dataset_ids, "dataset_ids")
    probs = spec.dataset_probs or [round(1.0 / len(datasets), 6)] * len(datasets)
    if len(probs) != len(datasets) or any(p <= 0 for p in probs):
        raise InvalidInput("dataset_probs: give one positive probability per dataset")
    model_dir = model_dir_for(session, settings, spec.base_model)
    _check_model_family(spec.base_model, spec.stage, model_dir)
    cfg: dict[str, Any] = {
        "model_name_or_path": str(model_dir),
        "stage": spec.stage,
        "fine_tuning": spec.fine_tuning,
        **_dataset_keys(settings, "train", datasets, probs),
        **spec.hyperparameters,
        "output_dir": str(output_dir),
        "logging_dir": str(output_dir / "logs"),
    }
    if spec.eval_dataset_ids:
        evals = _datasets_for(session, spec, spec.eval_dataset_ids, "eval_dataset_ids")
        cfg.update(_dataset_keys(settings, "eval", evals, [round(1.0 / len(evals), 6)] * len(evals)))
    effective = effective_config(cfg)
    try:  # expert parallelism against the model and the devices, before anything is queued
        check_expert_parallel(effective, spec.num_devices)
    except ConfigError as e:
        raise InvalidInput(f"hyperparameters: {e}", details={"problems": e.problems}) from None
    _check_elastic(session, settings, spec, effective)
    return cfg


def _check_model_family(base_model: str, stage: str, model_dir: Path) -> None:
    """Stage OCR-VL-SFT trains PaddleOCR-VL models and no other stage trains them (the trainer's rule,
    before the run waits in a queue)."""
    ocr = is_ocr_model(base_model, model_dir)
    known = find_stage(stage)  # an unknown stage is _check_choices' to refuse
    trains_ocr = known is not None and known.trains_paddleocr_vl
    if trains_ocr and not ocr:
        raise InvalidInput(
            f"stage: {stage} fine-tunes PaddleOCR-VL models, and base_model {base_model!r} is not one; "
            "pick a PaddleOCR-VL model (such as the tiny-ocr-vl preset) or another stage"
        )
    if ocr and not trains_ocr:
        raise InvalidInput(
            f"stage: base_model {base_model!r} is a PaddleOCR-VL model, which trains with stage "
            f"{family_stage(PADDLEOCR_VL)} (its prompt form and image processor), not {stage}"
        )


def model_family_problems(session: Session, settings: Settings, base_model: str, stage: str) -> list[str]:
    """The refusal `create_run` gives when `stage` and `base_model`'s family disagree (the Train form shows
    it beside the stage before any data is picked); empty when they agree or the model is not known."""
    try:
        _check_model_family(base_model, stage, model_dir_for(session, settings, base_model))
    except InvalidInput as e:
        return [e.message] if e.message.startswith("stage:") else []
    return []


def _check_elastic(session: Session, settings: Settings, spec: RunSpec, cfg: TrainConfig) -> None:
    """An elastic run's lists against the base model (e.g. elastic_topk_choices above its moe_k), before
    anything is queued; a model that cannot be read yet (a download) is checked by the trainer."""
    if not cfg.elastic:
        return
    try:
        model = model_config(session, settings, spec.base_model)
    except InvalidInput:
        return
    problems = elastic_model_problems(cfg, model)
    if problems:
        raise InvalidInput("hyperparameters: " + "; ".join(problems), details={"problems": problems})


def _datasets_for(session: Session, spec: RunSpec, ids: list[int], field: str) -> list[Dataset]:
    """The datasets `ids` name, each holding the records `spec.stage` trains on."""
    datasets = [get_dataset(session, i) for i in ids]
    want_kind = stage_info(spec.stage).data_kind
    for ds in datasets:
        if ds.kind == BENCHMARK:
            raise InvalidInput(
                f"{field}: dataset {ds.id} ({ds.name}) is a {ds.format} benchmark file; benchmarks are for "
                "evaluation (POST /api/v1/evals, the Evaluate tab), not training: pick chat records to train on"
            )
        if ds.kind != want_kind:
            raise InvalidInput(
                f"{field}: dataset {ds.id} ({ds.name}) holds {ds.kind} records; stage {spec.stage} needs "
                f"{want_kind} data"
            )
    return datasets


def _dataset_keys(
    settings: Settings, split: str, datasets: list[Dataset], probs: list[float]
) -> dict[str, str]:
    """ERNIEKit's `<split>_dataset_type/path/prob` for datasets; their paths are confined under home."""
    return {
        f"{split}_dataset_type": ",".join(ds.format for ds in datasets),
        f"{split}_dataset_path": ",".join(str(dataset_path(settings, ds)) for ds in datasets),
        f"{split}_dataset_prob": ",".join(str(p) for p in probs),
    }


def _check_choices(spec: RunSpec) -> None:
    """Stage and fine-tuning against the engine's choices; hyperparameters are plain values the studio
    does not set itself, and never paths."""
    if spec.stage not in STAGES:
        raise InvalidInput(f"stage: {spec.stage!r} is not one of {', '.join(STAGES)}")
    if spec.fine_tuning not in FINE_TUNING:
        raise InvalidInput(f"fine_tuning: {spec.fine_tuning!r} is not one of {', '.join(FINE_TUNING)}")
    paths = sorted(set(spec.hyperparameters) & set(PATH_KEYS))
    if paths:
        raise InvalidInput(
            "; ".join(f"hyperparameters.{key}: paths are not accepted; {_instead(key)}" for key in paths)
        )
    bad = sorted(set(spec.hyperparameters) & set(STUDIO_KEYS))
    if bad:
        raise InvalidInput(
            f"hyperparameters: {', '.join(bad)} are set by the studio (from base_model, dataset_ids and "
            "eval_dataset_ids); leave them out"
        )
    for key, value in spec.hyperparameters.items():
        if not isinstance(value, str | int | float | bool) or value is None:
            raise InvalidInput(f"hyperparameters.{key}: must be a string, number or boolean, got {value!r}")


def _instead(key: str) -> str:
    return _INSTEAD.get(key, "upload files as datasets and pass their ids (dataset_ids, eval_dataset_ids)")


def preview_config(session: Session, settings: Settings, spec: RunSpec) -> dict[str, Any]:
    """The config `create_run` would store for `spec`, with a placeholder output dir (the Train tab's YAML)."""
    return build_config(session, settings, spec, PREVIEW_OUTPUT_DIR)


def effective_config(cfg: dict[str, Any]) -> TrainConfig:
    """The engine's reading of a run config: its keys checked (unknown ones come back with the closest
    valid key) and every key it leaves out at the engine's default."""
    try:
        return config_from_dict(TrainConfig, cfg, source="run config")
    except ConfigError as e:
        raise InvalidInput(f"hyperparameters: {e}", details={"problems": e.problems}) from None
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidInput(f"hyperparameters: {e}") from None


def config_problems(stage: str, fine_tuning: str, hyperparameters: dict[str, Any]) -> list[str]:
    """The engine's problems with `hyperparameters` alone, before a model and data are picked (placeholders
    stand in for the keys the studio fills in)."""
    cfg = {
        "model_name_or_path": "<model>",
        "train_dataset_path": "<data>",
        "stage": stage,
        "fine_tuning": fine_tuning,
        **hyperparameters,
    }
    try:
        effective_config(cfg)
    except InvalidInput as e:
        return (e.details or {}).get("problems") or [e.message]
    return []


def spec_problems(session: Session, settings: Settings, spec: RunSpec) -> list[str]:
    """Everything `create_run` would refuse `spec` for, each problem on its own (the engine's own messages,
    without the file or request prefix): the Train form shows them beside their fields as they change."""
    checks = (
        lambda: _check_devices(settings, spec),
        lambda: _check_known_devices(session, settings, spec),
        lambda: check_evaluate(session, settings, spec),
        # before the data's checks, which stop at the first wrong dataset
        lambda: _check_model_family(
            spec.base_model, spec.stage, model_dir_for(session, settings, spec.base_model)
        ),
        lambda: preview_config(session, settings, spec),
    )
    problems: list[str] = []
    for check in checks:
        try:
            check()
        except ServiceError as e:
            problems += (e.details or {}).get("problems") or [e.message]
    return list(dict.fromkeys(problems))


def run_dir(settings: Settings, run_id: int) -> Path:
    return settings.runs_dir / str(run_id)


def log_path(settings: Settings, run_id: int) -> Path:
    """The run's train.log: every attempt's trainer output, each after an `=== ... attempt N ===` line."""
    return run_dir(settings, run_id) / "train.log"


def _queue_for(settings: Settings, spec: RunSpec) -> str:
    """The queue a run of `spec` waits on (refused when no worker of the studio's node could take it)."""
    _check_devices(settings, spec)
    _check_gpu(settings, spec.gpu)
    if spec.gpu is not None:
        return queue.gpu_queue(settings.node_name, spec.gpu)
    return queue.devices_queue(spec.num_devices // spec.num_nodes)


def _recorded_estimate(session: Session, settings: Settings, spec: RunSpec, queue_name: str) -> dict | None:
    """The estimate kept on the run to compare with what it measures; a run is queued without one when
    the estimate cannot be made (it is a guide, never a gate)."""
    try:
        return _estimate(session, settings, spec, queue_name, compute_stats=False)
    except ServiceError:  # an invalid spec: create_run refuses it with the same message right after
        return None
    except Exception:
        log.exception("estimate of a new run failed; queued without one")
        return None


def create_run(
    session: Session,
    settings: Settings,
    spec: RunSpec,
    *,
    parent_run_id: int | None = None,
    sweep: tuple[int, int] | None = None,
) -> Run:
    """Record a queued run and put it on its queue; `sweep` = (sweep id, trial number) for a sweep's trial."""
    queue_name = _queue_for(settings, spec)
    _check_known_devices(session, settings, spec)
    check_evaluate(session, settings, spec)
    # before the run row exists: computing token statistics commits the dataset's cache
    estimate = _recorded_estimate(session, settings, spec, queue_name)
    run = Run(
        name=spec.name or "",
        stage=spec.stage,
        fine_tuning=spec.fine_tuning,
        base_model=spec.base_model,
        dataset_ids=list(spec.dataset_ids),
        config={},
        status=RunStatus.QUEUED,
        queue=queue_name,
        output_dir="",
        parent_run_id=parent_run_id,
        sweep_id=sweep[0] if sweep else None,
        sweep_trial=sweep[1] if sweep else None,
    )
    session.add(run)
    session.flush()
    out = run_dir(settings, run.id) / "output"
    run.config = build_config(session, settings, spec, out)
    run.output_dir = str(out)
    if spec.evaluate is not None:
        try:
            run.evaluate = _evaluate_plan(session, settings, spec, run)
        except ServiceError:
            shutil.rmtree(run_dir(settings, run.id), ignore_errors=True)  # a split written before the refusal
            raise
    run.name = spec.name or f"{spec.stage.lower()}-{spec.fine_tuning.lower()}-{run.id}"
    run.estimate = estimate
    per_node = spec.num_devices // spec.num_nodes
    run.num_nodes = spec.num_nodes
    waits_for = f" (waits for a worker owning {per_node} devices)" if per_node > 1 else ""
    if spec.num_nodes > 1:
        waits_for = f" (waits for {spec.num_nodes} nodes' workers owning {per_node} device(s) each)"
    add_event(session, "run.queued", f"run {run.name} queued on {queue_name}{waits_for}", run_id=run.id)
    session.commit()
    run_dir(settings, run.id).mkdir(parents=True, exist_ok=True)
    dispatch_run(session, settings, run)
    return run


def check_evaluate(session: Session, settings: Settings, spec: RunSpec) -> None:
    """What can be checked of "evaluate after training" before the run exists (`create_run` splits the data)."""
    ev = spec.evaluate
    if ev is None:
        return
    if spec.stage not in EVALUATED_STAGES:
        raise InvalidInput(
            f"evaluate: runs of stage {' or '.join(EVALUATED_STAGES)} are evaluated after training (records "
            f"with reference answers: chat records, or images with their text); this run is {spec.stage}"
        )
    if not ev.holdout and not ev.dataset_ids and ev.general is None:
        raise InvalidInput(
            "evaluate: give holdout (records kept out of training), dataset_ids (eval datasets) or general "
            "(the forgetting check)"
        )
    check_options(ev.options, "evaluate.options")
    ocr = is_ocr_model(spec.base_model, model_dir_for(session, settings, spec.base_model))
    if ev.holdout:  # the held-out records are scored as their datasets' kind
        training = [get_dataset(session, i) for i in spec.dataset_ids]
        check_model_reads(training, ocr, spec.base_model, "evaluate.holdout")
    if ev.dataset_ids:
        datasets = eval_datasets(session, settings, list(ev.dataset_ids), "evaluate.dataset_ids")
        check_model_reads(datasets, ocr, spec.base_model, "evaluate.dataset_ids")
    if ev.general is not None:
        if ocr:
            raise InvalidInput(
                f"evaluate.general: the general sets are text questions, and {spec.base_model} is a "
                "PaddleOCR-VL model, which reads images; leave general out"
            )
        _general_files(session, settings, ev.general)


def _general_files(session: Session, settings: Settings, check: GeneralCheck) -> list[dict[str, Any]]:
    field = "evaluate.general"
    datasets = eval_datasets(session, settings, list(check.dataset_ids), f"{field}.dataset_ids")
    return general_files(settings, check, datasets, field)


def _evaluate_plan(session: Session, settings: Settings, spec: RunSpec, run: Run) -> dict[str, Any]:
    """Hold out the split (the trainer is given the rest) and keep what the evals after training need."""
    ev = spec.evaluate
    plan: dict[str, Any] = ev.model_dump()
    plan["holdout_files"] = []
    if ev.holdout:
        datasets = [get_dataset(session, i) for i in spec.dataset_ids]
        seed = effective_config(run.config).seed
        train, held = hold_out(settings, session, run, datasets, ev.holdout, seed, "evaluate.holdout")
        run.config = {**run.config, "train_dataset_path": ",".join(train)}
        plan["holdout_files"], plan["seed"] = held, seed
    # The engine's checks of the eval options, on the files the evals will read.
    files = [(f["path"], f["type"]) for f in plan["holdout_files"]]
    evals = [get_dataset(session, i) for i in ev.dataset_ids or []]
    files += [(str(dataset_path(settings, ds)), ds.format) for ds in evals]
    if ev.general is not None:
        plan["general_files"] = _general_files(session, settings, ev.general)
        general = [f["path"] for f in plan["general_files"]]
        check_names([p for p, _ in files], general, "evaluate.general")
        files += [(f["path"], f["type"]) for f in plan["general_files"]]
    model_dir = run.config["model_name_or_path"]
    engine_config(
        model_dir, files, ev.options, "<eval dir>/output", "evaluate.options",
        ocr_model=is_ocr_model(spec.base_model, model_dir),
    )  # fmt: skip
    return plan


def _check_gpu(settings: Settings, gpu: int | None) -> None:
    """A pinned run goes to queue gpu.<node_name>.<i>, which only a worker of that GPU serves: refuse a GPU
    the studio was not told of (ERNIE_STUDIO_GPUS), or the run would wait forever."""
    if gpu is None or gpu in settings.gpu_indices:
        return
    if not settings.gpu_indices:
        raise InvalidInput(
            f"gpu: node {settings.node_name} has no GPUs the studio knows of (ERNIE_STUDIO_GPUS is empty); "
            "leave gpu out to run on any training worker, or list the node's GPUs in ERNIE_STUDIO_GPUS"
        )
    raise InvalidInput(
        f"gpu: node {settings.node_name} has no GPU {gpu}; its GPUs are "
        f"{', '.join(map(str, settings.gpu_indices))} (ERNIE_STUDIO_GPUS), or leave gpu out"
    )


def _check_devices(settings: Settings, spec: RunSpec) -> None:
    """A run on N devices waits on `train.devices.<N>` for a worker owning at least N devices of one node:
    refuse an N no worker of the node the studio knows (its ERNIE_STUDIO_GPUS and WORKER_DEVICES) can own,
    or the run would wait forever. Sharding asks for devices too: on one it is refused before anything is
    queued."""
    hyper = spec.hyperparameters
    trains = str(hyper.get("do_train", True)).lower() not in ("false", "0", "no")
    problems = sharding_device_problems(
        hyper.get("sharding", ""), hyper.get("sharding_parallel_degree", -1), spec.num_devices
    )
    if problems and trains:
        raise InvalidInput("hyperparameters: " + "; ".join(problems))
    if spec.num_devices % spec.num_nodes:
        raise InvalidInput(
            f"num_nodes: {spec.num_devices} devices do not split evenly over {spec.num_nodes} nodes; give "
            "num_devices as a multiple of num_nodes (each node runs num_devices / num_nodes ranks)"
        )
    if spec.num_nodes > 1 and spec.gpu is not None:
        raise InvalidInput("num_nodes: gpu pins a run to one GPU of this node; leave gpu out")
    per_node = spec.num_devices // spec.num_nodes
    if per_node == 1:
        return
    if spec.gpu is not None:
        raise InvalidInput(
            f"num_devices: gpu pins a run to one GPU; leave gpu out to train on {spec.num_devices} devices"
        )
    largest = max(len(group) for group in settings.device_groups)
    if per_node > largest:
        where = (
            f"its GPUs {settings.gpus} in groups of {settings.worker_devices}"
            if settings.gpu_indices
            else f"it has no GPUs and runs {settings.worker_devices} CPU process(es) per run"
        )
        raise InvalidInput(
            f"num_devices: {per_node} devices of one node are more than a training worker of node "
            f"{settings.node_name} owns ({largest}: {where}); ask for at most {largest} per node (spread "
            "the run over more num_nodes), or raise "
            "ERNIE_STUDIO_WORKER_DEVICES (and list the GPUs in ERNIE_STUDIO_GPUS) for the studio and its "
            "workers"
        )


def spec_of(run: Run) -> RunSpec:
    """The choices `run` was made from (its evaluation sets are by path in the config: see `clone_run`)."""
    hyper = {k: v for k, v in run.config.items() if k not in STUDIO_KEYS}
    return RunSpec(
        name=run.name,
        base_model=run.base_model,
        dataset_ids=list(run.dataset_ids),
        stage=run.stage,
        fine_tuning=run.fine_tuning,
        hyperparameters=hyper,
        num_devices=queue.devices_of(run.queue) * run.num_nodes,
        num_nodes=run.num_nodes,
        evaluate=EvaluateAfter(
            **{k: run.evaluate.get(k) for k in ("holdout", "dataset_ids", "options", "general")}
        )
        if run.evaluate
        else None,
    )


def list_runs(session: Session, *, status: str | None = None, limit: int = 200, offset: int = 0) -> list[Run]:
    if status is not None and status not in {s.value for s in RunStatus}:
        raise InvalidInput(f"status: {status!r} is not one of {', '.join(s.value for s in RunStatus)}")
    q = select(Run).order_by(Run.id.desc()).limit(limit).offset(offset)
    if status:
        q = q.where(Run.status == status)
    return list(session.scalars(q).all())


def get_run(session: Session, run_id: int) -> Run:
    return get_or_404(session, Run, run_id, "run")


def queue_position(session: Session, run: Run) -> int | None:
    """1 means next on its queue; None when the run is not queued.

    Workers take a queue's messages in the order the broker received them, so runs are ordered by dispatch
    time: a resumed, requeued or re-sent run goes behind the others, and runs still waiting for the
    reconciler to send them (a broker outage) come last, in id order, as it sends them."""
    if run.status != RunStatus.QUEUED:
        return None
    if run.dispatched_at is None:
        before = Run.dispatched_at.is_not(None) | (Run.id < run.id)
    else:
        before = (Run.dispatched_at < run.dispatched_at) | (
            (Run.dispatched_at == run.dispatched_at) & (Run.id < run.id)
        )
    ahead = session.scalar(
        select(func.count())
        .select_from(Run)
        .where(Run.status == RunStatus.QUEUED, Run.queue == run.queue, before)
    )
    return int(ahead or 0) + 1


def queue_positions(session: Session) -> dict[int, int]:
    """{run id: position} for every queued run, in one query (for lists), ordered as `queue_position`."""
    rows = session.execute(
        select(Run.id, Run.queue)
        .where(Run.status == RunStatus.QUEUED)
        .order_by(Run.dispatched_at.asc().nulls_last(), Run.id)
    ).all()
    seen: dict[str, int] = {}
    out: dict[int, int] = {}
    for run_id, queue_name in rows:
        seen[queue_name] = seen.get(queue_name, 0) + 1
        out[run_id] = seen[queue_name]
    return out


def get_metrics(
    session: Session,
    run_id: int,
    *,
    after_step: int | None = None,
    limit: int | None = None,
    max_points: int | None = None,
) -> list[RunMetric]:
    """The points `metric_rows` selects, as ORM rows."""
    if max_points is None and (after_step is not None or limit is not None):
        get_run(session, run_id)
        return list(session.scalars(_metric_page(select(RunMetric), run_id, after_step, limit)))
    rows = metric_rows(session, run_id, after_step=after_step, limit=limit, max_points=max_points)
    steps = [r["step"] for r in rows]
    q = (
        select(RunMetric)
        .where(RunMetric.run_id == run_id, RunMetric.step.in_(steps))
        .order_by(RunMetric.step)
    )
    return list(session.scalars(q)) if steps else []


def metric_rows(
    session: Session,
    run_id: int,
    *,
    after_step: int | None = None,
    limit: int | None = None,
    max_points: int | None = None,
) -> list[dict[str, Any]]:
    """Logged points in step order as plain dicts (the hot path of a polling UI).

    With neither `after_step` nor `limit`: the whole series, thinned to at most `max_points` (default
    METRICS_MAX_POINTS; see `studio.services.metric_series`). Otherwise the exact points after `after_step`,
    at most `limit` (default METRICS_PAGE), thinned only when `max_points` is given: paging reads every point.
    """
    run = _metrics_run(session, run_id, max_points)
    if after_step is None and limit is None:
        return metric_series.whole_series(session, run, max_points or METRICS_MAX_POINTS)
    if max_points is None:
        return metric_series.as_rows(
            session.execute(_metric_page(metric_series.ROW, run_id, after_step, limit))
        )
    points = session.execute(_metric_page(select(RunMetric.step, RunMetric.loss), run_id, after_step, limit))
    return metric_series.rows_at(session, run_id, metric_series.thin(points.all(), max_points))


def metrics_json(
    session: Session,
    run_id: int,
    *,
    after_step: int | None = None,
    limit: int | None = None,
    max_points: int | None = None,
) -> bytes:
    """`metric_rows` as a JSON array (non-finite numbers as null); a whole series is encoded once per change."""
    if after_step is None and limit is None:
        run = _metrics_run(session, run_id, max_points)
        return metric_series.whole_series_json(session, run, max_points or METRICS_MAX_POINTS)
    rows = metric_rows(session, run_id, after_step=after_step, limit=limit, max_points=max_points)
    return to_json(rows, inf_nan_mode="null")


def _metrics_run(session: Session, run_id: int, max_points: int | None) -> Run:
    if max_points is not None and max_points < 4:
        raise InvalidInput("max_points: give at least 4 (a bucket keeps its first, last, min and max)")
    return get_run(session, run_id)


def _metric_page(q: Select, run_id: int, after_step: int | None, limit: int | None) -> Select:
    """`q` narrowed to the run's points after `after_step`, at most `limit`, in step order."""
    q = q.where(RunMetric.run_id == run_id).order_by(RunMetric.step).limit(limit or METRICS_PAGE)
    return q if after_step is None else q.where(RunMetric.step > after_step)


def list_checkpoints(session: Session, run_id: int) -> list[Checkpoint]:
    get_run(session, run_id)
    return list(
        session.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)).all()
    )


def read_logs(
    session: Session, settings: Settings, run_id: int, *, offset: int = 0, limit: int = 65536
) -> dict[str, Any]:
    """A slice of the run's log file by byte offset, so a UI can follow it by passing `next_offset` back."""
    if offset < 0 or not 1 <= limit <= 1_048_576:
        raise InvalidInput("offset must be >= 0 and limit between 1 and 1048576 bytes")
    run = get_run(session, run_id)
    path = log_path(settings, run.id)
    if not path.exists():
        return {"run_id": run_id, "text": "", "offset": offset, "next_offset": offset, "size": 0}
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(min(offset, size))
        data = f.read(limit)
    return {
        "run_id": run_id,
        "text": data.decode("utf-8", errors="replace"),
        "offset": offset,
        "next_offset": min(offset, size) + len(data),
        "size": size,
    }


def cancel_run(session: Session, settings: Settings, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one is flagged and its worker stops the process group."""
    run = get_run(session, run_id)
    if run.status in TERMINAL_RUN_STATUSES:
        raise Conflict(f"run {run_id} already ended ({run.status}); nothing to cancel")
    now = utcnow()
    run.cancel_requested = True
    run.cancel_requested_at = now
    if run.status == RunStatus.QUEUED:
        # Conditional so a worker claiming it at the same instant wins or loses cleanly.
        n = session.execute(
            update(Run)
            .where(Run.id == run_id, Run.status == RunStatus.QUEUED)
            .values(status=RunStatus.CANCELLED, ended_at=now, cancel_requested=True, cancel_requested_at=now)
        ).rowcount
        if n:
            add_event(session, "run.cancelled", "cancelled while queued", run_id=run_id)
            session.commit()
            withdraw_run(settings, run)
            session.refresh(run)
            return run
    add_event(session, "run.cancel_requested", "cancel requested", run_id=run_id)
    session.commit()
    session.refresh(run)
    return run


def latest_checkpoint(settings: Settings, run: Run) -> Path | None:
    """The newest complete checkpoint-N directory of the run (as the trainer will resume from it)."""
    from engine.train.run_dir import latest_checkpoint as engine_latest

    return engine_latest(Path(run.output_dir)) if run.output_dir else None


def resume_run(session: Session, settings: Settings, run_id: int) -> Run:
    """Queue a failed or cancelled run again; it continues from its newest checkpoint."""
    run = get_run(session, run_id)
    if run.status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        raise Conflict(f"run {run_id} is {run.status}; only failed or cancelled runs can be resumed")
    # A config stored before paths were refused in hyperparameters must not reach the trainer again.
    confine_config_paths(settings, run.config, f"run {run_id}")
    ckpt = latest_checkpoint(settings, run)
    run.status = RunStatus.QUEUED
    run.cancel_requested = False
    run.cancel_requested_at = None
    run.error = None
    run.ended_at = None
    run.queued_at = utcnow()
    run.dispatched_at = None
    run.resume_from = str(ckpt) if ckpt else None
    add_event(
        session,
        "run.resumed",
        f"resumed from {ckpt.name}" if ckpt else "restarted from the beginning (no checkpoint yet)",
        run_id=run.id,
    )
    session.commit()
    dispatch_run(session, settings, run)
    return run


CLONE_SUFFIX = "-clone"


def clone_run(
    session: Session, settings: Settings, run_id: int, overrides: dict[str, Any] | None = None
) -> Run:
    """A new queued run with the same choices; `overrides` replace hyperparameters (or spec fields)."""
    src = get_run(session, run_id)
    overrides = overrides or {}
    data = spec_of(src).model_dump()
    data["name"] = f"{src.name[: MAX_NAME - len(CLONE_SUFFIX)]}{CLONE_SUFFIX}"
    if "eval_dataset_ids" not in overrides:
        data["eval_dataset_ids"] = _eval_dataset_ids(session, settings, src)
    for key, value in overrides.items():
        if key in RunSpec.model_fields:
            data[key] = value
        else:
            data["hyperparameters"][key] = value
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as e:
        problems = [f"overrides.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise InvalidInput("; ".join(problems), details=problems) from None
    return create_run(session, settings, spec, parent_run_id=src.id)


def _eval_dataset_ids(session: Session, settings: Settings, run: Run) -> list[int] | None:
    """The datasets a run evaluates on, found from the paths in its config (the run row keeps no ids)."""
    paths = [p.strip() for p in str(run.config.get("eval_dataset_path") or "").split(",") if p.strip()]
    if not paths:
        return None
    rels = {
        p: str(Path(p).relative_to(settings.home)) for p in paths if Path(p).is_relative_to(settings.home)
    }
    ids = dict(session.execute(select(Dataset.path, Dataset.id).where(Dataset.path.in_(rels.values()))).all())
    missing = [p for p in paths if ids.get(rels.get(p, "")) is None]
    if missing:
        raise InvalidInput(
            f"eval_dataset_ids: run {run.id} evaluates on {', '.join(missing)}, which is no dataset of the "
            "studio (deleted, or given as a path); pass eval_dataset_ids in overrides"
        )
    return [ids[rels[p]] for p in paths]


def delete_run(session: Session, settings: Settings, run_id: int) -> None:
    run = get_run(session, run_id)
    if run.status == RunStatus.RUNNING:
        raise Conflict(f"run {run_id} is running; cancel it first")
    if run.status == RunStatus.QUEUED:
        withdraw_run(settings, run)
    session.delete(run)
    session.commit()
    shutil.rmtree(run_dir(settings, run_id), ignore_errors=True)


def create_export(session: Session, settings: Settings, run_id: int, **choices: Any):
    """Queue `ernie-studio export` of a finished run (see studio.services.exports.create_export)."""
    return queue_export(session, settings, run_id, **choices)


def erniekit_yaml(session: Session, run_id: int) -> str:
    """The run's config as the YAML a person would pass to `ernie-studio train` (or ERNIEKit)."""
    run = get_run(session, run_id)
    return yaml.safe_dump(run.config, sort_keys=False)


def estimate_resources(session: Session, settings: Settings, spec: RunSpec) -> dict[str, Any]:
    """Memory, time and disk a run of `spec` would take (engine.estimate), with a range and what it assumed,
    checked against the nodes serving its queue (`warning` when it will not fit)."""
    queue_name = _queue_for(settings, spec)
    _check_known_devices(session, settings, spec)
    return _estimate(session, settings, spec, queue_name, compute_stats=True)


def _check_known_devices(session: Session, settings: Settings, spec: RunSpec) -> None:
    check_known_devices(session, settings, spec.num_devices)


def _estimate(
    session: Session, settings: Settings, spec: RunSpec, queue_name: str, *, compute_stats: bool
) -> dict[str, Any]:
    return estimate_spec(
        session,
        settings,
        model=model_config(session, settings, spec.base_model),
        train=effective_config(preview_config(session, settings, spec)),
        base_model=spec.base_model,
        dataset_ids=list(spec.dataset_ids),
        eval_dataset_ids=spec.eval_dataset_ids,
        queue_name=queue_name,
        compute_stats=compute_stats,
    )
