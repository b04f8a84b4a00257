"""What a person chooses for a training run (`RunSpec`, "evaluate after training") and the checks and
config built from it before anything is stored: the ERNIEKit config (`build_config`, `preview_config`), the
engine's reading of it (`effective_config`), and every problem `create_run` would refuse it for
(`spec_problems`), including whether a worker of this node could ever take it. `studio.services.runs`
stores and follows the runs made from it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field
from sqlalchemy.orm import Session

from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.options import FINE_TUNING, MAX_DEVICES, ConfigError
from engine.train.run_checks import check_expert_parallel, elastic_model_problems, sharding_device_problems
from engine.train.stages import PADDLEOCR_VL, STAGES, family_stage, find_stage, stage_info, stage_names
from studio.config import Settings
from studio.models import Dataset
from studio.schemas import RequestModel
from studio.services.datasets import BENCHMARK, dataset_path, get_dataset
from studio.services.errors import InvalidInput, ServiceError
from studio.services.estimates import check_known_devices
from studio.services.evals import check_model_reads, check_options, eval_datasets
from studio.services.forgetting import GeneralCheck, general_files
from studio.services.messages import SERVICES
from studio.services.models import is_ocr_model, model_config, model_dir_for
from studio.services.paths import PATH_KEYS
from studio.services.store import RowId

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
        raise InvalidInput(SERVICES("ocr_stage_needs_ocr_model", stage=stage, model=base_model))
    if ocr and not trains_ocr:
        raise InvalidInput(
            SERVICES(
                "ocr_model_needs_ocr_stage",
                model=base_model,
                ocr_stage=family_stage(PADDLEOCR_VL),
                stage=stage,
            )
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
                SERVICES(
                    "dataset_kind",
                    field=field,
                    id=ds.id,
                    name=ds.name,
                    kind=ds.kind,
                    stage=spec.stage,
                    want=want_kind,
                )
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
        lambda: check_devices(settings, spec),
        lambda: check_node_devices(session, settings, spec),
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
        general_check_files(session, settings, ev.general)


def general_check_files(session: Session, settings: Settings, check: GeneralCheck) -> list[dict[str, Any]]:
    """The forgetting check's general files (built-in sets and the person's own), checked."""
    field = "evaluate.general"
    datasets = eval_datasets(session, settings, list(check.dataset_ids), f"{field}.dataset_ids")
    return general_files(settings, check, datasets, field)


def check_gpu(settings: Settings, gpu: int | None) -> None:
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


def check_devices(settings: Settings, spec: RunSpec) -> None:
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


def check_node_devices(session: Session, settings: Settings, spec: RunSpec) -> None:
    check_known_devices(session, settings, spec.num_devices)
