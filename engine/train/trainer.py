"""The training loop shared by every stage: one readable function, stages plug in their loss.

``run_training(config)`` loads the model, applies quantization and LoRA, builds the data, then repeats:
gather the micro-batches of one step, add their losses (normalised over the whole step), backward,
all-reduce gradients across data-parallel ranks, clip, step AdamW, update the MoE correction biases and
the weight EMA, log, evaluate, checkpoint. A run directory with checkpoints is resumed exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import paddle

from engine.models import gpas
from engine.models.expert_parallel import (
    ExpertGroup,
    RouterComm,
    gather_named,
    is_expert_param,
    new_expert_group,
    split_experts,
    sum_over_experts,
    sum_over_replicas,
    unsplit_experts,
)
from engine.models.lora import apply_lora
from engine.models.quantized import WeightOnlyLinear, hold_in_low_precision
from engine.models.streaming import Storage
from engine.train import lora as lora_mod
from engine.train import moe_balance, quant
from engine.train.callbacks import Progress, WeightEMA
from engine.train.config import (
    MOE_GROUPS_TENSOR,
    WEIGHT_ONLY_COMPUTE_TYPES,
    ConfigError,
    Notice,
    TrainConfig,
    expert_parallel_problem,
    sharding_device_problems,
    weights_draws,
)
from engine.train.dpo import DPOLoss, count_pairs, evaluate_dpo
from engine.train.elastic import ELASTIC_FAMILY_FILE, ElasticTraining
from engine.train.parallel import DataParallel
from engine.train.precision import (
    MasterWeights,
    Precision,
    PrecisionMode,
    resolve_precision,
    set_up_amp,
)
from engine.train.run_dir import (
    MetricsLog,
    checkpoint_states,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    write_json,
)
from engine.train.scalars import ScalarWriters, run_name
from engine.train.sft import evaluate_lm, labelled_tokens, language_model_loss
from engine.train.sharding import (
    ShardedOptimizer,
    TensorwiseOffload,
    gpu_sharding_problem,
    optimizer_state_bytes,
    per_rank,
)
from engine.train.stages import ERNIE_VL, PADDLEOCR_VL, PREFERENCE, TEXT, family_stage, stage_info
from engine.train.stages import LM as LM_OBJECTIVE

log = logging.getLogger(__name__)

EXIT_CANCELLED = 130


# Accepted config keys without effect here, written at the start of a run (see `announce`).
NOTICES_FILE = "notices.json"


@dataclass
class RunSummary:
    status: str
    stage: str
    output_dir: str
    model_dir: str | None = None
    final_metrics: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[str] = field(default_factory=list)
    error: str | None = None
    started_at: str = ""
    ended_at: str = ""
    steps: int = 0
    notices: list[dict[str, str]] = field(default_factory=list)
    precision: dict[str, Any] = field(default_factory=dict)  # what compute_type became on this node
    # bytes of optimizer state each rank held at the end (sharding splits it), and how it was split
    optimizer_state_bytes: list[int] = field(default_factory=list)
    sharding: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return {"succeeded": 0, "cancelled": EXIT_CANCELLED}.get(self.status, 1)


# ---- pieces of the loop --------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup, then cosine / linear decay to ``min_lr``, or constant."""
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    if warmup and step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    if cfg.lr_scheduler_type == "constant":
        return cfg.learning_rate
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if cfg.lr_scheduler_type == "cosine":
        factor = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        factor = 1 - progress
    return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * factor


def dropout_at(step: int, cfg: TrainConfig, layer: int, num_layers: int) -> float:
    """ERNIEKit's hidden dropout: rises linearly over ``dropout_warmup_steps``, and layer i of N drops
    ``p * i / N`` (the first layer none)."""
    ramp = min(1.0, step / cfg.dropout_warmup_steps) if cfg.dropout_warmup_steps else 1.0
    return cfg.hidden_dropout_prob * ramp * layer / num_layers


def set_dropout(model, cfg: TrainConfig, step: int) -> None:
    layers = model.ernie.layers
    for layer in layers:
        layer.hidden_dropout = dropout_at(step, cfg, layer.index, len(layers))


def due(strategy: str, every: int, step: int, epoch_steps: int) -> bool:
    """Whether ``step`` ends a period of ``evaluation_strategy`` / ``save_strategy`` (steps, epoch, no)."""
    if strategy == "steps":
        return bool(every) and step % every == 0
    if strategy == "epoch":
        return step % max(epoch_steps, 1) == 0
    return False


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


# ---- building the run ----------------------------------------------------------------------------------


def training_storage(cfg: TrainConfig, precision: Precision) -> Storage:
    """How the run holds its base weights, read straight into that form (``engine.models.streaming``):
    weight-only int8 / int4 linears, bf16 decoder weights computed in fp32 (emulated bf16), bf16 / fp16
    everywhere but the router (AMP on a GPU), or fp32 (fp32 runs and FP8 QAT, which trains fp32 weights)."""
    if cfg.compute_type in WEIGHT_ONLY_COMPUTE_TYPES:
        return Storage(weight_only=cfg.compute_type, group_size=cfg.weight_quant_group_size)
    if precision.mode is PrecisionMode.EMULATED:
        return Storage(precision.weights, "decoder")
    if precision.mode is PrecisionMode.AMP:
        return Storage(precision.weights, "all")
    return Storage()


def load_base(cfg: TrainConfig, storage: Storage, world: int = 1):
    """The run's base model read into ``storage``, with the run's MoE settings, this rank's experts under
    expert parallelism over ``world`` ranks, and GPAS gates."""
    from engine.models.loading import load_model  # a LoRA run dir as the base comes back merged

    def split(model) -> None:  # before the weights are read: other ranks' experts are never loaded here
        model.expert_group = split_for_expert_parallel(cfg, model, world)

    model = load_model(cfg.model_name_or_path, storage=storage, prepare=split)
    mc = model.config
    for key in ("moe_aux_loss_lambda", "moe_z_loss_lambda", "moe_orthogonal_loss_lambda", "moe_use_aux_free"):
        if getattr(cfg, key) is not None:
            setattr(mc, key, getattr(cfg, key))
    add_gpas_gates(cfg, model)
    return model


def build_model(cfg: TrainConfig, precision: Precision | None = None, world: int = 1):
    """Load the base model straight into the run's storage precision (quantized or low precision as it is
    read), keep this rank's experts (expert parallelism over ``world`` ranks), apply FP8 QAT and LoRA;
    return (model, trainable). On a GPU, ``decorate_for_amp`` then finds the weights in bf16 / fp16 already."""
    precision = precision or resolve_precision(cfg.compute_type)
    storage = training_storage(cfg, precision)
    model = load_base(cfg, storage, world)
    if cfg.compute_type == "fp8":
        n = quant.apply_fp8_qat(
            model, cfg.fp8_hadamard_block_size if cfg.fp8_hadamard else 0, cfg.fp8_scale_ema_rate
        )
        log.info("fp8 QAT on %d linears (hadamard=%s)", n, cfg.fp8_hadamard)
    elif storage.weight_only:
        counts = weight_only_counts(model)
        log.info("weight-only base: %d int8 and %d int4 linears", counts[8], counts[4])
    elif precision.mode is PrecisionMode.EMULATED:
        # the weights are bf16 already: this swaps in the layers that upcast them per call
        counts = hold_in_low_precision(model, precision.weights, precision.matmuls)
        log.info("held in %s: %s", precision.weights, counts)
    if cfg.lora:
        wrapped = apply_lora(
            model, cfg.lora_rank, cfg.effective_lora_alpha, cfg.rslora, cfg.lora_target_modules, seed=cfg.seed
        )
        log.info("LoRA rank %d on %d linears", cfg.lora_rank, len(wrapped))
    else:
        frozen = sum((FROZEN_PREFIXES[part] for part in cfg.frozen), ())
        for name, p in model.named_parameters():
            resampler = name.startswith(RESAMPLER_PREFIX)
            p.stop_gradient = "moe_statics" in name or (name.startswith(frozen) and not resampler)
    set_recompute(cfg, model)
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if not p.stop_gradient}
    return model, trainable


def set_recompute(cfg: TrainConfig, model) -> None:
    """recompute, recompute_granularity and use_recompute_moe onto the model (ErnieModel, DecoderLayer)."""
    if not cfg.recompute:
        return
    model.ernie.gradient_checkpointing = True
    model.ernie.recompute_granularity = cfg.recompute_granularity
    for layer in model.ernie.layers:
        layer.recompute_moe = cfg.use_recompute_moe


def split_for_expert_parallel(cfg: TrainConfig, model, world: int) -> ExpertGroup | None:
    """Check expert_parallel_degree / moe_group against the model and the ranks, then keep only this
    rank's routed experts (before any wrapping, so adapters and optimizer state exist for those alone)."""
    problem = expert_parallel_problem(model.config, cfg.expert_parallel_degree)
    degree = cfg.expert_degree(world) if problem is None else 1
    problem = problem or expert_parallel_problem(model.config, degree)
    if problem:
        raise ConfigError(problem)
    if world > 1 and model.config.is_moe:
        model.router_comm = RouterComm(world)  # router losses over the global batch
    if degree == 1:
        return None
    group = new_expert_group(degree)
    kept = split_experts(model, group)
    log.info("expert parallel: %d ranks per expert group, %d routed experts per layer here", degree, kept)
    return group


def weight_only_counts(model) -> dict[int, int]:
    """How many weight-only linears of each bit width the model holds."""
    counts = {4: 0, 8: 0}
    for layer in model.sublayers():
        if isinstance(layer, WeightOnlyLinear):
            counts[layer.bits] += 1
    return counts


def add_gpas_gates(cfg: TrainConfig, model) -> None:
    """``gpas: true`` on a model without gates: fresh ones (the model computes the same until they train)."""
    if not cfg.gpas or model.config.gpas:
        return
    if cfg.lora:
        raise ValueError(
            "gpas: a LoRA run trains adapters only and its adapter file cannot hold new GPAS gates; "
            "use fine_tuning: Full (a model already trained with GPAS keeps its gates under LoRA)"
        )
    log.info("GPAS: %d gates added", gpas.add_gates(model))


# The vision encoder's parameter names: ERNIE 4.5 VL's ViT, PaddleOCR-VL's NaViT encoder.
VISION_PREFIXES = ("vision_model.", "visual.")
# freeze_config's parts: the parameter-name prefixes they keep frozen. The resampler (ERNIE 4.5 VL) and the
# projector (PaddleOCR-VL, ``projector.``) always train; the resampler sits inside ``ernie.`` in the
# checkpoint layout, but belongs to neither part.
FROZEN_PREFIXES = {"freeze_vision": VISION_PREFIXES, "freeze_lm": ("ernie.", "lm_head.")}
RESAMPLER_PREFIX = "ernie.resampler_model."


def lr_ratio(cfg: TrainConfig, name: str) -> float:
    """A Full run's learning-rate multiplier of one weight: the vision encoder and the MoE routers have theirs."""
    if name.startswith(VISION_PREFIXES):
        return cfg.vit_lr_ratio
    if ".mlp.gate." in name:
        return cfg.moe_gate_lr_ratio
    return 1.0


def build_optimizer(cfg: TrainConfig, model, trainable: dict[str, paddle.Tensor]):
    """AdamW (``optim`` adamw or ERNIEKit's adamw_custom) with LoRA+ or per-module learning-rate groups.

    Under sharding the groups become each weight's ``optimize_attr["learning_rate"]`` (what Paddle's
    param groups set) on one flat list: fleet's DygraphShardingOptimizer takes no param groups."""
    if cfg.lora:
        params = lora_mod.lora_parameter_groups(model, cfg.lora_plus_scale)
    else:
        groups: dict[float, list] = {}
        for name, p in trainable.items():
            groups.setdefault(lr_ratio(cfg, name), []).append(p)
        params = (
            list(trainable.values())
            if set(groups) <= {1.0}
            else [{"params": ps, "learning_rate": ratio} for ratio, ps in groups.items()]
        )
    no_decay = {p.name for n, p in trainable.items() if p.ndim < 2 or "norm" in n}
    if cfg.sharding_stage and isinstance(params[0], dict):
        flat = []
        for group in params:
            for p in group["params"]:
                p.optimize_attr["learning_rate"] = group.get("learning_rate", 1.0)
                flat.append(p)
        params = flat
    return paddle.optimizer.AdamW(
        learning_rate=cfg.learning_rate,
        parameters=params,
        beta1=cfg.adam_beta1,
        beta2=cfg.adam_beta2,
        epsilon=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        apply_decay_param_fun=lambda name: name not in no_decay,
    )


def processor_settings(cfg: TrainConfig, vision_config):
    """The image processor of a VL run: the model directory's preprocessor_config.json (as Baidu ships it),
    the vision config's patch / merge sizes, and the run's min_pixels / max_pixels when set; PaddleOCR-VL's
    own image processor for stage OCR-VL-SFT (a LoRA run as the base: the one it trained with)."""
    if vision_config is None:
        return None
    bounds = {k: v for k, v in (("min_pixels", cfg.min_pixels), ("max_pixels", cfg.max_pixels)) if v}
    if stage_info(cfg.stage).trains_paddleocr_vl:
        from engine.data.paddleocr_vl_processor import OCRProcessorSettings

        settings = OCRProcessorSettings.from_model_dir(processor_dir(cfg.model_name_or_path))
        return dataclasses.replace(
            settings,
            patch_size=vision_config.patch_size,
            merge_size=vision_config.spatial_merge_size,
            **bounds,
        )
    from engine.data.vl_processor import ProcessorSettings

    settings = ProcessorSettings.for_model(cfg.model_name_or_path, vision_config)
    return dataclasses.replace(settings, **bounds)


def processor_dir(model_dir: str) -> Path:
    """Where a model's preprocessor_config.json is: its own directory, or a LoRA run's base's when the run
    wrote none."""
    from engine.models.loading import lora_chain

    d = Path(model_dir)
    return d if (d / "preprocessor_config.json").is_file() else lora_chain(d)[0]


def check_model_family(cfg: TrainConfig) -> None:
    """Stage OCR-VL-SFT trains PaddleOCR-VL and nothing else trains it (its config.json decides, before any
    weight is read)."""
    from engine.models.loading import lora_chain
    from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir

    path = Path(cfg.model_name_or_path)
    if not path.is_dir():  # the loader says what is missing
        return
    ocr = is_paddleocr_vl_dir(lora_chain(path)[0])
    stage = stage_info(cfg.stage)
    if stage.trains_paddleocr_vl and not ocr:
        raise ConfigError(
            f"stage {cfg.stage} fine-tunes PaddleOCR-VL, and {path} is not one (its config.json has no "
            f"model_type paddleocr_vl); ERNIE 4.5 VL models train with stage {family_stage(ERNIE_VL)}"
        )
    if ocr and not stage.trains_paddleocr_vl:
        raise ConfigError(
            f"{path} is PaddleOCR-VL, which trains with stage {family_stage(PADDLEOCR_VL)} (its prompt form "
            f"and image processor), not {cfg.stage}"
        )


def build_data(cfg: TrainConfig, tokenizer, split: str, rows: int, vision_config=None):
    """``engine.data.build_train_data`` for the train or eval split, ``rows`` samples per batch."""
    from engine.data import build_train_data

    return build_train_data(
        cfg.dataset_spec(split),
        tokenizer,
        stage=cfg.stage,
        max_seq_len=cfg.max_seq_len,
        packing=cfg.packing,
        seed=cfg.seed,
        batch_size=rows,
        max_prompt_len=cfg.max_prompt_len,
        vision_config=vision_config,
        vision=processor_settings(cfg, vision_config),
        shuffle=split == "train",
        mix_strategy=cfg.mix_strategy if split == "train" else "random",
        packing_size=cfg.packing_size,
    )


# ---- the loop ------------------------------------------------------------------------------------------


def run_training(cfg: TrainConfig, on_event: Callable[[dict], None] | None = None) -> RunSummary:
    """Train one stage as configured; writes the run directory and returns its summary."""
    started = datetime.now(UTC).isoformat()
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dp = DataParallel()
    emit = on_event or (lambda event: None)
    summary = RunSummary(status="running", stage=cfg.stage, output_dir=str(out_dir), started_at=started)
    stop = {"signal": None}

    def on_stop(signum, frame):
        stop["signal"] = signum
        # a second Ctrl-C interrupts at once instead of waiting for the checkpoint
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {}
    if _main_thread():  # signal handlers can only be installed from the main thread
        previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        announce(getattr(cfg, "notices", []), summary, emit, dp)
        _train(cfg, dp, out_dir, summary, emit, stop)
    except Exception as e:  # the summary records the failure for the studio; the caller still sees it
        summary.status = "failed"
        summary.error = f"{type(e).__name__}: {e}"
        _finish(summary, out_dir, dp)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _finish(summary, out_dir, dp)
    emit({"type": "status", "status": summary.status})
    return summary


def announce(notices: list[Notice], summary: RunSummary, emit, dp: DataParallel) -> None:
    """Each accepted key without effect, once: a ``notice`` event, a line in train.log, and
    ``notices.json`` in the run directory as soon as it is known (run_summary.json repeats them at the end;
    the studio's worker turns the file into run events while the run trains)."""
    for n in notices:
        summary.notices.append({"key": n.key, "message": n.message})
        emit({"type": "notice", "key": n.key, "message": n.message})
        if dp.main:
            print(n.line(), flush=True)
    if notices and dp.main:
        write_json(Path(summary.output_dir) / NOTICES_FILE, {"notices": summary.notices})


EP_RECOMPUTE_NOTE = (
    "with expert parallelism the MoE blocks are recomputed in part: the routed experts each rank runs and "
    "the shared experts are, the router and the expert exchange are not (their collectives are never "
    "replayed in backward), so the dispatched and combined rows keep their activations"
)


def runtime_notices(cfg: TrainConfig, model, precision: Precision | None = None) -> list[Notice]:
    """What this node and this model make of the config (known only once the model is loaded)."""
    out = []
    if precision is not None and precision.mode is PrecisionMode.EMULATED:
        out.append(
            Notice(
                "compute_type",
                f"{cfg.compute_type} is emulated: {precision.reason}; AdamW keeps float32 master weights",
            )
        )
    if cfg.frozen and cfg.lora:
        out.append(Notice("freeze_config", "a LoRA run trains adapters only; the base stays frozen anyway"))
    elif "freeze_vision" in cfg.frozen and not model.config.is_vl:
        out.append(Notice("freeze_config", "freeze_vision: this model has no vision encoder"))
    if cfg.vit_lr_ratio != 1.0 and (cfg.lora or not model.config.is_vl):
        out.append(Notice("vit_lr_ratio", "the vision encoder does not train in this run"))
    if cfg.moe_group in MOE_GROUPS_TENSOR and cfg.expert_parallel_degree == 1 and model.config.is_moe:
        out.append(
            Notice(
                "moe_group",
                f"{cfg.moe_group}: the experts split over the tensor-parallel group, which is one rank here "
                "(tensor_parallel_degree 1), so every rank holds them all; expert_parallel_degree N (or "
                "moe_group: dp) splits them over N ranks",
            )
        )
    if cfg.recompute and cfg.use_recompute_moe and getattr(model, "expert_group", None) is not None:
        out.append(Notice("recompute", EP_RECOMPUTE_NOTE))
    if cfg.moe_gate_lr_ratio != 1.0 and (cfg.lora or not model.config.is_moe):
        out.append(Notice("moe_gate_lr_ratio", "no MoE router trains in this run"))
    if cfg.sharding_stage and not cfg.do_train:
        out.append(
            Notice("sharding", "an evaluation-only run (do_train: false) has no optimizer state to split")
        )
    if cfg.tensorwise_offload_optimizer and gpu_sharding_problem("") is not None:
        out.append(
            Notice("tensorwise_offload_optimizer", "on CPU the optimizer state lives in host memory already")
        )
    return out + eval_notices(cfg) + vision_notices(cfg, model) + save_notices(cfg)


def save_notices(cfg: TrainConfig) -> list[Notice]:
    """save_to_hf on a LoRA run, whose final files are the adapter."""
    if cfg.save_to_hf and cfg.lora:
        why = "a LoRA run writes its adapter; `ernie-studio export` with layout: hf merges it"
        return [Notice("save_to_hf", why)]
    return []


def eval_notices(cfg: TrainConfig) -> list[Notice]:
    """Evaluation reads each eval file whole (one pass), so probabilities other than 1 change nothing."""
    if cfg.eval_dataset_path and weights_draws(cfg.eval_dataset_prob):
        message = (
            "evaluation reads every record of each eval_dataset_path file once; probabilities weight the "
            "training draws only"
        )
        return [Notice("eval_dataset_prob", message)]
    return []


def vision_notices(cfg: TrainConfig, model) -> list[Notice]:
    """VL-only keys given for a model without a vision encoder, and the vision parts one VL family lacks."""
    if model.config.is_vl:
        ocr = stage_info(cfg.stage).trains_paddleocr_vl
        lacks = {"resampler": "PaddleOCR-VL has no resampler (its projector is 'projector')"} if ocr else {}
        if not ocr:
            lacks["projector"] = "ERNIE 4.5 VL has no projector (its resampler is 'resampler')"
        out = [
            Notice("lora_target_modules", why)
            for g, why in lacks.items()
            if cfg.lora and g in cfg.lora_target_modules
        ]
        if ocr and cfg.recompute:
            out.append(
                Notice(
                    "recompute", "recomputes the decoder's layers; the vision encoder keeps its activations"
                )
            )
        return out
    out = []
    groups = [g for g in ("vision", "resampler") if g in cfg.lora_target_modules]
    if cfg.lora and groups:
        out.append(Notice("lora_target_modules", f"{', '.join(groups)}: this model has no vision encoder"))
    for key in ("min_pixels", "max_pixels"):
        if getattr(cfg, key):
            out.append(Notice(key, "this model reads no images"))
    return out


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _finish(summary: RunSummary, out_dir: Path, dp: DataParallel) -> None:
    summary.ended_at = datetime.now(UTC).isoformat()
    summary.checkpoints = [str(p) for p in list_checkpoints(out_dir)]
    if dp.main:
        write_json(out_dir / "run_summary.json", asdict(summary))


class Objective(StrEnum):
    """What a stage optimises: the language-model loss (SFT, PT, VL-SFT) or the DPO preference loss."""

    LM = LM_OBJECTIVE
    DPO = PREFERENCE


def objective_for(stage: str) -> Objective:
    return Objective(stage_info(stage).objective)


@dataclass
class TrainRun:
    """The pieces the loop works with, built once by ``setup_run`` (a resumed run starts at ``step``)."""

    tokenizer: Any
    model: Any
    trainable: dict[str, paddle.Tensor]
    optimizer: Any
    data: Any
    total: int
    objective: Objective
    dpo_loss: DPOLoss | None  # set for Objective.DPO only
    ema: WeightEMA | None
    metrics_log: MetricsLog | None
    step: int = 0
    elapsed_before: float = 0.0
    epoch_steps: int = 1  # optimizer steps per epoch (evaluation_strategy / save_strategy "epoch")
    notices: list[Notice] = field(default_factory=list)
    precision: Precision = field(default_factory=lambda: resolve_precision("fp32"))
    masters: MasterWeights | None = None  # emulated bf16: the fp32 weights ``trainable`` holds
    scaler: Any = None  # fp16 on a GPU: paddle.amp.GradScaler
    scalars: ScalarWriters | None = None  # report_to: TensorBoard / VisualDL copies of metrics.jsonl rows
    elastic: ElasticTraining | None = None  # elastic: the family and the per-step sampler
    sharded: ShardedOptimizer | None = None  # sharding: the optimizer state split over the ranks

    def __post_init__(self) -> None:
        mc = self.model.config
        self.params = list(self.trainable.values())
        self.moe_groups = mc.expert_counts if mc.is_moe else []


@dataclass
class LoopEnd:
    step: int
    metrics: dict[str, Any]
    cancelled: bool


def _train(cfg: TrainConfig, dp: DataParallel, out_dir: Path, summary: RunSummary, emit, stop) -> None:
    run = setup_run(cfg, dp, out_dir, emit)
    summary.precision = run.precision.as_dict()
    announce(run.notices, summary, emit, dp)
    try:
        if not cfg.do_train:
            summary.status, summary.final_metrics = "succeeded", evaluate_only(cfg, run, emit)
            return
        end = train_loop(cfg, dp, out_dir, run, emit, stop)
        summary.optimizer_state_bytes = per_rank(dp, optimizer_state_bytes(run.optimizer))
        if run.sharded is not None:
            summary.sharding = {
                "stage": run.sharded.stage,
                "degree": run.sharded.degree,
                "data_parallel_degree": run.sharded.dp_degree,
            }
    finally:
        if run.scalars is not None:
            run.scalars.close(failed=sys.exc_info()[1] is not None)
    if end.cancelled:
        summary.status, summary.steps, summary.final_metrics = "cancelled", end.step, end.metrics
        return
    t_save = time.time()
    _finish_training(cfg, dp, out_dir, run, summary)
    if run.elastic is not None and dp.main:
        write_json(out_dir / ELASTIC_FAMILY_FILE, run.elastic.summary(run.model, end.metrics))
    end.metrics.update(final_save_s=round(time.time() - t_save, 3), peak_rss_mib=peak_rss_mib())
    summary.status, summary.steps, summary.final_metrics = "succeeded", end.step, end.metrics


def setup_run(cfg: TrainConfig, dp: DataParallel, out_dir: Path, emit) -> TrainRun:
    """Tokenizer, model (+ DPO reference), optimizer, EMA and data; restored from the last checkpoint."""
    from engine.tokenizer import load_tokenizer

    check_devices(cfg, dp.world)
    check_model_family(cfg)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    precision = resolve_precision(cfg.compute_type)
    model, trainable = build_model(cfg, precision, dp.world)
    if not stage_info(cfg.stage).trains(TEXT) and not model.config.is_vl:
        raise ValueError(
            f"stage {cfg.stage} needs a multimodal model; {cfg.model_name_or_path} has no vision encoder"
        )
    if dp.main:
        write_json(out_dir / "train_config.json", asdict(cfg))
    objective = objective_for(cfg.stage)
    dpo_loss = build_dpo_loss(cfg, precision) if objective is Objective.DPO else None
    # Emulated bf16: AdamW steps fp32 copies of the bf16 weights (LoRA adapters are fp32 already).
    masters = MasterWeights(trainable) if precision.mode is PrecisionMode.EMULATED else None
    if masters is not None and masters.low:
        trainable = masters.trainable(trainable)
    else:
        masters = None
    model, optimizer, scaler, sharded = build_run_optimizer(cfg, dp, model, trainable, precision)
    ema = WeightEMA(trainable, cfg.ema_decay) if cfg.ema_decay else None
    data, total, epoch_steps = None, 0, 1
    if cfg.do_train:  # an evaluation-only run needs no training data
        data = build_data(cfg, tokenizer, "train", cfg.batch_size * dp.world, model.config.vision_config)
        epoch_steps = _epoch_steps(cfg, data, epochs=1.0)
        total = cfg.max_steps if cfg.max_steps > 0 else _epoch_steps(cfg, data)
    if dp.main:
        _print_plan(cfg, dp, model, trainable, total, out_dir)
        print(precision.describe(), flush=True)
    log.info(precision.describe())
    run = TrainRun(tokenizer, model, trainable, optimizer, data, total, objective, dpo_loss, ema, None)
    run.epoch_steps, run.notices = epoch_steps, runtime_notices(cfg, model, precision)
    run.precision, run.masters, run.scaler = precision, masters, scaler
    run.elastic = ElasticTraining(cfg, model) if cfg.elastic else None
    run.sharded = sharded
    ckpt = latest_checkpoint(out_dir) if data is not None else None
    if ckpt is not None:
        run.step, run.elapsed_before = load_checkpoint(
            ckpt, model, optimizer, trainable, data, ema, run.elastic, held_weights(model)
        )
        if masters is not None:
            masters.write_back()
        log.info("resuming from %s (step %d)", ckpt, run.step)
        emit({"type": "resume", "step": run.step, "checkpoint": str(ckpt)})
    if data is not None:  # every rank must continue from the same checkpoint, or the weights would differ
        dp.check_same(run.step, "the step resumed from")
    run.metrics_log = MetricsLog(out_dir / "metrics.jsonl") if dp.main else None
    run.scalars = ScalarWriters(cfg.logging_dir, cfg.report_to, run_name(out_dir)) if dp.main else None
    return run


def build_run_optimizer(cfg: TrainConfig, dp: DataParallel, model, trainable: dict, precision: Precision):
    """AdamW, decorated for AMP on a GPU (with its fp16 loss scaler), its state offloaded to host memory
    (tensorwise_offload_optimizer, GPU) and split over the ranks (sharding): (model, optimizer, scaler,
    sharded); stage 2 wraps the model too."""
    optimizer = build_optimizer(cfg, model, trainable)
    scaler = None
    if precision.mode is PrecisionMode.AMP:
        model, optimizer, scaler = set_up_amp(model, optimizer, precision)
    if cfg.tensorwise_offload_optimizer and gpu_sharding_problem("") is None:
        TensorwiseOffload(optimizer)
    split = cfg.do_train and cfg.sharding_degree(dp.world) > 1
    sharded = ShardedOptimizer(cfg, dp, model, optimizer) if split else None
    if sharded is not None:
        model, optimizer = sharded.model, sharded.optimizer
    return model, optimizer, scaler, sharded


def check_devices(cfg: TrainConfig, world: int) -> None:
    """What the config asks of the ``world`` ranks this run got: sharding needs 2+ ranks that its degree
    divides, and stage 2 a GPU (``engine.train.sharding.gpu_sharding_problem``)."""
    if not cfg.do_train:  # an evaluation has no optimizer state to split (runtime_notices says so)
        return
    problems = sharding_device_problems(cfg.sharding, cfg.sharding_parallel_degree, world)
    if cfg.sharding_stage == 2 and 1 < cfg.sharding_degree(world) < world:
        # the gradient norm it reports would miss the data-parallel all-reduce inside Paddle's step
        problems.append(
            f"sharding_parallel_degree: stage2 spans all of the run's {world} devices here; "
            "set -1, or use stage1 to replicate a smaller split"
        )
    if cfg.sharding_stage == 2 and cfg.sharding_degree(world) > 1:
        problems += [
            p + "; use sharding: stage1" for p in [gpu_sharding_problem(f"sharding: {cfg.sharding}")] if p
        ]
    if problems:
        raise ConfigError("; ".join(problems))


def build_dpo_loss(cfg: TrainConfig, precision: Precision | None = None) -> DPOLoss:
    """DPO's loss with its reference: for LoRA the same model with its adapters switched off, for Full a
    frozen copy of the base held as ``dpo_reference_dtype`` says."""
    reference = None
    if not cfg.lora and not cfg.reference_free:
        reference = build_reference(cfg, precision or resolve_precision(cfg.compute_type))
    return DPOLoss(cfg, reference, lora=cfg.lora)


def reference_storage(cfg: TrainConfig, precision: Precision) -> Storage:
    """How Full DPO holds its frozen reference: the run's own storage (``run``), fp32, or its decoder
    linears weight-only quantized with the rest as the run holds it (``wint8`` / ``wint4``)."""
    choice = cfg.dpo_reference_dtype
    if choice == "fp32":
        return Storage()
    run = training_storage(cfg, precision)
    if choice == "run":
        return run
    return Storage(run.dtype, run.scope, weight_only=choice, group_size=cfg.weight_quant_group_size)


def build_reference(cfg: TrainConfig, precision: Precision):
    """Full DPO's frozen reference model, read straight into ``reference_storage``; computes as the run's
    model did before its first step (bf16 weights upcast per call where bf16 is emulated)."""
    storage = reference_storage(cfg, precision)
    # the frozen reference runs every expert in each process
    plain = dataclasses.replace(
        cfg, fine_tuning="Full", recompute=False, expert_parallel_degree=1, moe_group="dummy"
    )
    reference = load_base(plain, storage)
    if storage.scope == "decoder" and storage.dtype != "float32":
        hold_in_low_precision(reference, storage.dtype, precision.matmuls)
    if storage.scope == "all" and storage.dtype != "float32":
        reference = paddle.amp.decorate(
            models=reference,
            level="O2",
            dtype=storage.dtype,
            excluded_layers=_router_layers(reference) or None,
        )
    for p in reference.parameters():
        p.stop_gradient = True
    reference.eval()
    log.info("DPO reference held as %s (dpo_reference_dtype %s)", storage, cfg.dpo_reference_dtype)
    return reference


def _router_layers(model) -> list:
    return [layer for name, layer in model.named_sublayers() if name.endswith(("mlp.gate", "moe_statics"))]


def _print_plan(
    cfg: TrainConfig, dp: DataParallel, model, trainable: dict, total: int, out_dir: Path
) -> None:
    n_train = sum(int(np.prod(p.shape)) for p in trainable.values())
    n_all = sum(int(np.prod(p.shape)) for p in model.parameters())
    if not cfg.do_train:
        print(f"{cfg.stage} evaluation of {cfg.model_name_or_path} ({cfg.eval_dataset_path})", flush=True)
        return
    print(
        f"{cfg.stage} ({cfg.fine_tuning}, {cfg.compute_type}) on {cfg.model_name_or_path}: {total} steps x "
        f"{cfg.batch_size * cfg.gradient_accumulation_steps * dp.world} samples, "
        f"{n_train:,} of {n_all:,} weights train; run dir {out_dir}",
        flush=True,
    )


def train_loop(cfg: TrainConfig, dp: DataParallel, out_dir: Path, run: TrainRun, emit, stop) -> LoopEnd:
    """Optimiser steps from ``run.step`` to ``run.total``, or until a stop signal (checkpointed)."""
    step, total = run.step, run.total
    progress = Progress(total, step, dp.main, not cfg.disable_tqdm)
    t_start = time.time() - run.elapsed_before
    it = iter(run.data)
    last_metrics: dict[str, Any] = dict(run.metrics_log.last) if run.metrics_log is not None else {}
    timing = StepTiming()
    while step < total:
        t0 = time.time()
        micro = [dp.slice(next(it), run.model.config) for _ in range(cfg.gradient_accumulation_steps)]
        lr = lr_at(step, cfg, total)
        run.optimizer.set_lr(lr)
        if cfg.hidden_dropout_prob:
            set_dropout(run.model, cfg, step)
        if run.elastic is not None:
            run.elastic.begin_step(run.model)
        try:
            sums, tokens, counts = accumulate_gradients(
                run.model,
                run.objective,
                micro,
                dp,
                run.moe_groups,
                run.dpo_loss,
                run.scaler,
                run.sharded.loss_scale if run.sharded is not None else 1.0,
            )
        finally:
            if run.elastic is not None:
                run.elastic.end_step(run.model)
        grad_norm = optimizer_step(cfg, run, dp)
        step += 1
        metrics, all_tokens = step_metrics(cfg, run, dp, sums, tokens, counts)
        now = time.time()
        metrics.update(
            step=step,
            learning_rate=lr,
            grad_norm=grad_norm,
            tokens_per_second=all_tokens / max(now - t0, 1e-9),
            elapsed_s=now - t_start,
            epoch=float(run.data.epoch),
        )
        timing.stepped(now - t0)
        metrics.update(timing.row(total))
        last_metrics = metrics
        logged = log_step(cfg, run, step, metrics, emit)
        if logged:
            timing.logged()
        progress.update(step, metrics, logged)

        # every rank must stop at the same step, or the others would wait in all_reduce forever
        cancelled = bool(dp.sum(np.array([stop["signal"] is not None], dtype=np.float64))[0])
        # the last step is always checkpointed: a rerun then finds the run finished, and a larger
        # max_steps continues it instead of starting over
        saving = due(cfg.save_strategy, cfg.save_steps, step, run.epoch_steps)
        if saving or step == total or cancelled:
            save_step_checkpoint(cfg, dp, out_dir, run, step, now - t_start, timing, emit)
        if cancelled:
            # the other ranks wait for rank 0's checkpoint: a rank leaving first makes the launcher stop them
            dp.sum(np.zeros(1))
            progress.close()
            log.warning("received signal %s: saved checkpoint-%d, stopping", stop["signal"], step)
            return LoopEnd(step, last_metrics, cancelled=True)
    progress.close()
    if timing.last_save_s is not None:
        last_metrics["checkpoint_s"] = round(timing.last_save_s, 3)
    return LoopEnd(step, last_metrics, cancelled=False)


def save_step_checkpoint(
    cfg: TrainConfig, dp: DataParallel, out_dir: Path, run: TrainRun, step: int, elapsed: float, timing, emit
) -> None:
    """``checkpoint-<step>`` by rank 0, un-split: under sharding every rank first sends its part of the
    optimizer state, with expert parallelism its experts, so any number of ranks resumes the file."""
    t_save = time.time()
    state, states, ema = None, None, run.ema
    if run.sharded is not None:
        state = run.sharded.gathered_state(run.trainable)
    if run.model.expert_group is not None:
        states = gathered_states(run)
        if ema is not None:  # the weight average of every expert, as one process keeps it
            ema = SimpleNamespace(shadow=gather_named(ema.shadow, run.model.expert_group))
    if not dp.main:
        return
    path = save_checkpoint(
        out_dir,
        step,
        run.model,
        run.optimizer,
        run.trainable,
        run.data,
        ema,
        elapsed,
        run.elastic,
        states,
        optimizer_state=state,
    )
    timing.saved(time.time() - t_save)
    emit({"type": "checkpoint", "step": step, "path": str(path)})
    if cfg.save_total_limit:
        prune_checkpoints(out_dir, cfg.save_total_limit)


def held_weights(model) -> Callable[[str], bool] | None:
    """Expert parallelism: which weights of an un-split checkpoint this rank takes (its own experts and
    everything replicated); None takes them all."""
    if model.expert_group is None:
        return None
    names = set(model.state_dict())
    return lambda name: not is_expert_param(name) or name in names


def gathered_states(run: TrainRun) -> tuple[dict, dict] | None:
    """Expert parallelism: a checkpoint's weights and optimizer state with every rank's experts, on rank
    0, which writes it (None on the others, which only send theirs, one tensor at a time)."""
    group = run.model.expert_group
    weights, optim = checkpoint_states(run.model, run.optimizer, run.trainable)
    masters = optim.pop("master_weights", None)
    optim = gather_named(optim, group)
    if masters is not None:
        masters = gather_named(masters, group)
        if optim is not None:
            optim["master_weights"] = masters
    weights = gather_named(weights, group)
    return None if weights is None else (weights, optim)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (what a CPU node's RAM must hold), in MiB.

    VmHWM, not ``ru_maxrss``: Linux carries ``ru_maxrss`` over ``exec``, so a trainer started by a big
    parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class StepTiming:
    """What the studio's ETA and the estimate's check need in each metrics row: the seconds per optimizer
    step since the last logged row (training alone: evaluation and saves are timed apart), the run's total
    steps (also for epoch runs), the last checkpoint's save time, and the process's peak memory."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
        self.last_save_s: float | None = None

    def stepped(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def saved(self, seconds: float) -> None:
        self.last_save_s = seconds

    def row(self, total: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "total_steps": total,
            "step_s": round(self.seconds / max(self.steps, 1), 4),
            "peak_rss_mib": peak_rss_mib(),
        }
        if self.last_save_s is not None:
            out["checkpoint_s"] = round(self.last_save_s, 3)
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
            # a GPU run's estimate is of device memory: what the allocator held at most
            out["peak_device_mib"] = round(paddle.device.cuda.max_memory_reserved() / 2**20, 1)
        return out

    def logged(self) -> None:
        self.seconds, self.steps = 0.0, 0


def optimizer_step(cfg: TrainConfig, run: TrainRun, dp: DataParallel) -> float:
    """All-reduce, clip and apply the accumulated gradients; returns the gradient norm before clipping."""
    if run.masters is not None:  # emulated bf16: the bf16 gradients, upcast, onto the fp32 masters
        run.masters.gather_grads()
    # Every trainable weight gets a gradient (zero when unused, e.g. an idle expert) so that ranks
    # all-reduce the same tensors and AdamW treats them the same with 1 or N ranks.
    for p in run.params:
        if p.grad is None:
            p._copy_gradient_from(paddle.zeros_like(p))
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    if run.sharded is not None:  # reduce to the owners, clip by the norm over every shard, update, share
        grad_norm = run.sharded.step(run.params, max_norm)
    else:
        grad_norm = _replicated_step(cfg, run, dp, max_norm)
    if run.masters is not None:
        run.masters.write_back()
    if cfg.compute_type == "fp8":
        quant.next_step(run.model)
    return grad_norm


def _replicated_step(cfg: TrainConfig, run: TrainRun, dp: DataParallel, max_norm: float) -> float:
    """Every rank sums the replicated gradients, clips them and steps the whole AdamW. A held expert's
    gradient is already complete (it saw the whole expert group's tokens): it is summed over the ranks
    holding the same experts only, never over the expert group."""
    group = run.model.expert_group
    split = [p for n, p in run.trainable.items() if is_expert_param(n)] if group is not None else []
    if split:
        split_ids = {id(p) for p in split}
        dp.sum_grads([p for p in run.params if id(p) not in split_ids])
        sum_expert_grads(split, group)
    else:
        dp.sum_grads(run.params)
    if run.scaler is not None:  # fp16: clip the true gradients, not the scaled ones
        run.scaler.unscale_(run.optimizer)
    grad_norm = clip_grad_norm(run.params, max_norm, split, group)
    if cfg.gpas_gate_grad_clip > 0:
        gpas.clip_gate_grads(run.model, cfg.gpas_gate_grad_clip)
    if run.scaler is not None:  # skips the step when a gradient overflowed, and adapts the scale
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.optimizer.clear_grad(set_to_zero=False)
    return grad_norm


def sum_expert_grads(params: list[paddle.Tensor], group: ExpertGroup) -> None:
    """Sum the held experts' gradients over their data-parallel replicas (none when one copy exists)."""
    if group.replicas == 1:
        return
    grads = [p.grad for p in params]
    flat = sum_over_replicas(paddle.concat([g.reshape([-1]) for g in grads]), group)
    offset = 0
    for g in grads:
        n = int(np.prod(g.shape))
        g.set_value(flat[offset : offset + n].reshape(g.shape))
        offset += n


def clip_grad_norm(
    params: list[paddle.Tensor],
    max_norm: float,
    split: list[paddle.Tensor] | None = None,
    group: ExpertGroup | None = None,
) -> float:
    """Global L2 norm of the gradients; scales them in place to ``max_norm`` when above it, as
    ``paddle.nn.utils.clip_grad_norm_`` does.

    Each tensor's square sum is Paddle's ``squared_l2_norm`` (the op of its own ``ClipGradByGlobalNorm``): a
    tree reduction, 2e-8 from a float64 sum on the 0.3B model's gradients in 56 ms, where a BLAS dot product
    (sequential float32 sums: 4% off on the 106M-value embedding) took 317 ms and the ``p_norm`` kernel of
    ``clip_grad_norm_`` 1.7 s (bench/bench_cpu_step.py, docs/benchmarks.md)."""
    split_ids = {id(p) for p in split or []}
    squares, split_squares = [], []
    for p in params:
        if p.grad is not None:
            g = p.grad if p.grad.dtype == paddle.float32 else p.grad.astype("float32")
            square = paddle._C_ops.squared_l2_norm(g).reshape([])
            (split_squares if id(p) in split_ids else squares).append(square)
    # Summed in float64: with the experts split, the per-tensor terms are added in another order than in
    # one process, and the clipping coefficient should not depend on that order.
    if split_squares:  # expert parallelism: the split experts' share is summed over the expert group
        squares.append(sum_over_experts(paddle.stack(split_squares).astype("float64").sum(), group))
    if not squares:
        return 0.0
    total = float(paddle.stack([s.astype("float64") for s in squares]).sum().sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:  # multiplying by 1 would change nothing and cost a pass over every gradient
        with paddle.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.scale_(coef)
    return total


def step_metrics(
    cfg: TrainConfig, run: TrainRun, dp: DataParallel, sums: dict, tokens: int, counts
) -> tuple[dict[str, Any], float]:
    """(loss and MoE load metrics, tokens) summed over ranks; also moves the correction biases and the EMA."""
    mc = run.model.config
    names = sorted(sums)
    totals = dp.sum(np.array([sums[k] for k in names] + [tokens], dtype=np.float64))
    metrics: dict[str, Any] = {k: float(v) for k, v in zip(names, totals[:-1], strict=True)}
    if counts is not None:
        flat = dp.sum(np.concatenate([c for layer in counts for c in layer]).astype(np.float64))
        counts = _unflatten(counts, flat)
        layers, experts = run.elastic.routed(run.model) if run.elastic is not None else (None, None)
        # a LoRA run leaves the base untouched, correction biases included (the adapter file would lose them)
        if mc.is_moe and mc.moe_use_aux_free and not cfg.lora:
            moe_balance.update_correction_biases(
                run.model, counts, cfg.moe_correction_bias_rate, layers=layers, experts=experts
            )
        metrics.update(moe_balance.load_metrics(counts, experts))
    if run.elastic is not None:
        metrics.update(run.elastic.step_metrics(metrics))
    if mc.gpas:
        metrics.update(gpas.gate_values(run.model))
    if run.ema is not None:
        run.ema.update(run.trainable)
    return metrics, float(totals[-1])


def log_step(cfg: TrainConfig, run: TrainRun, step: int, metrics: dict, emit) -> bool:
    """Evaluate when due and write the metrics row when due; True when the step was logged."""
    logged = step % cfg.logging_steps == 0 or step == run.total
    evaluating = due(cfg.evaluation_strategy, cfg.eval_steps, step, run.epoch_steps) or step == run.total
    if cfg.do_eval and cfg.eval_dataset_path and evaluating:
        t0 = time.time()
        metrics.update(_evaluate(cfg, run.model, run.tokenizer, run.objective, run.dpo_loss, run.elastic))
        metrics["eval_s"] = round(time.time() - t0, 3)
        logged = True
    if logged and run.metrics_log is not None:
        record(run, {k: metrics[k] for k in _metric_order(metrics)})
        emit({"type": "metrics", **metrics})
    return logged


def record(run: TrainRun, row: dict[str, Any]) -> None:
    """A metrics row into metrics.jsonl and, when it is new there (not a resumed run's repeat), report_to's logs."""
    if run.metrics_log.write(row) and run.scalars is not None:
        run.scalars.write(row)


def evaluate_only(cfg: TrainConfig, run: TrainRun, emit) -> dict[str, Any]:
    """``do_train: false``: evaluate the model once and record it as step 0; no model is written."""
    metrics = {
        "step": 0,
        **_evaluate(cfg, run.model, run.tokenizer, run.objective, run.dpo_loss, run.elastic),
    }
    if run.metrics_log is not None:
        record(run, metrics)
    emit({"type": "metrics", **metrics})
    print("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "step"), flush=True)
    return metrics


def _finish_training(cfg: TrainConfig, dp: DataParallel, out_dir: Path, run: TrainRun, summary) -> None:
    """Average weights in (EMA), then write the final model and the tokenizer at the run dir root."""
    from engine.tokenizer import copy_tokenizer_files

    if run.ema is not None:
        run.ema.copy_to(run.trainable)
        if run.masters is not None:
            run.masters.write_back()
    adapter = None
    if run.model.expert_group is not None:  # the final model in the official un-split layout, on rank 0
        if cfg.lora:  # only the adapter is written: the experts' adapters, not their frozen base weights
            adapter = gather_named(lora_mod.adapter_state(run.model), run.model.expert_group)
        else:
            unsplit_experts(run.model, run.model.expert_group)
    if dp.main:
        # stage 2 wraps the model (GroupShardedStage2): the final files name the model's own weights
        model = run.sharded.layer if run.sharded is not None else run.model
        summary.model_dir = str(_save_final(cfg, model, out_dir, adapter))
        copy_tokenizer_files(cfg.model_name_or_path, out_dir)
        settings = (
            processor_settings(cfg, model.config.vision_config)
            if stage_info(cfg.stage).trains_paddleocr_vl
            else None
        )
        if settings is not None:  # the image processor it trained with (min_pixels / max_pixels included)
            write_json(out_dir / "preprocessor_config.json", settings.to_preprocessor_config())


def accumulate_gradients(
    model,
    objective: Objective,
    micro: list[dict],
    dp: DataParallel,
    moe_groups: list[int],
    dpo_loss: DPOLoss | None = None,
    scaler=None,
    loss_scale: float = 1.0,
):
    """Forward and backward every micro-batch of one optimiser step.

    Losses are normalised by the labelled tokens (DPO: pairs) of the whole step on all ranks, so the
    summed gradients equal those of one big batch. Returns metric sums, tokens seen and expert counts.
    ``scaler`` (fp16 on a GPU) scales each loss before backward; ``loss_scale`` (the ranks, under sharding,
    whose reduction averages) multiplies it.
    """
    share = 1.0 / (len(micro) * dp.world)
    token_norm, pair_norm = _step_norms(objective, micro, dp)
    sums: dict[str, float] = {}
    counts = None
    tokens = 0
    for batch in micro:
        if objective is Objective.LM:
            loss, m, routed = language_model_loss(model, batch, token_norm, share)
        else:
            loss, m, routed = dpo_loss(model, batch, pair_norm, token_norm, share)
        for stats, prefix in routed:
            keep = moe_balance.real_token_mask(batch, prefix)
            tokens += (
                int(keep.sum()) if keep is not None else int(np.asarray(batch[prefix + "input_ids"]).size)
            )
            if moe_groups:
                present = moe_balance.present_groups(batch, model.config, prefix)
                layer_counts = moe_balance.expert_counts(stats, moe_groups, present, keep)
                counts = moe_balance.add_counts(counts, layer_counts)
        if loss_scale != 1.0:
            loss = loss * loss_scale
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    return sums, tokens, counts


def _step_norms(objective: Objective, micro: list[dict], dp: DataParallel) -> tuple[float, float]:
    """(labelled tokens, preference pairs) of the whole step on all ranks; pairs only count for DPO."""
    if objective is Objective.LM:
        return max(float(dp.sum(np.array([sum(labelled_tokens(b) for b in micro)]))[0]), 1.0), 0.0
    token_norm = float(dp.sum(np.array([sum(labelled_tokens(b, "chosen_") for b in micro)]))[0])
    pair_norm = float(dp.sum(np.array([sum(count_pairs(b) for b in micro)]))[0])
    return max(token_norm, 1.0), pair_norm


def _metric_order(metrics: dict) -> list[str]:
    head = ["step", "loss", "learning_rate", "tokens_per_second", "elapsed_s"]
    return [k for k in head if k in metrics] + sorted(k for k in metrics if k not in head)


def _unflatten(counts: list[list[np.ndarray]], flat: np.ndarray) -> list[list[np.ndarray]]:
    out, i = [], 0
    for layer in counts:
        row = []
        for c in layer:
            row.append(flat[i : i + len(c)].astype(np.int64))
            i += len(c)
        out.append(row)
    return out


def _epoch_steps(cfg: TrainConfig, data, epochs: float | None = None) -> int:
    """Optimiser steps of ``epochs`` (default num_train_epochs) epochs: passes over the data, or with
    num_samples_each_epoch, ERNIEKit's epoch of that many samples drawn from the mixture."""
    batches = data.steps_per_epoch
    if cfg.num_samples_each_epoch:
        batches = max(1, round(batches * cfg.num_samples_each_epoch / max(data.num_items, 1)))
    per_epoch = max(1, batches // cfg.gradient_accumulation_steps)
    return max(1, round(per_epoch * (cfg.num_train_epochs if epochs is None else epochs)))


def _evaluate(
    cfg: TrainConfig, model, tokenizer, objective: Objective, dpo_loss: DPOLoss | None, elastic=None
) -> dict:
    rows = cfg.per_device_eval_batch_size or cfg.batch_size
    data = build_data(cfg, tokenizer, "eval", rows, model.config.vision_config)
    model.eval()
    try:
        limit = cfg.max_evaluate_steps if cfg.max_evaluate_steps > 0 else None
        batches = list(itertools.islice(data.one_pass(), limit))
        if objective is Objective.LM:
            out = evaluate_lm(model, batches)
            return out if elastic is None else {**out, **elastic.evaluate(model, batches)}
        return evaluate_dpo(model, batches, dpo_loss)
    finally:
        model.train()


def _save_final(cfg: TrainConfig, model, out_dir: Path, adapter: dict | None = None) -> Path:
    """Full runs: the model in Paddle layout at the root, in float32 (a bf16 run's weights upcast exactly,
    its fp32 router and norms kept; ``export dtype=bfloat16`` writes them in bf16). LoRA runs: the adapter +
    a base reference (``adapter``: its tensors when gathered from the ranks of an expert-parallel run)."""
    from engine.models.saving import save_model

    model.eval()
    if cfg.lora:
        base = Path(cfg.model_name_or_path).resolve()
        lora_mod.save_adapter(
            model,
            out_dir,
            {
                "base_model": str(base),
                "r": cfg.lora_rank,
                "lora_alpha": cfg.effective_lora_alpha,
                "rslora": cfg.rslora,
                "target_modules": cfg.lora_target_modules,
                "compute_type": cfg.compute_type,
                "weight_quant_group_size": cfg.weight_quant_group_size,
                "stage": cfg.stage,
            },
            state=adapter,
        )
        return out_dir
    quant.unwrap_fp8(model)
    save_model(model, out_dir, layout="hf" if cfg.save_to_hf else "paddle")
    return out_dir
