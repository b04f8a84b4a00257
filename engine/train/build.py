"""Building a training run's parts from its config: the storage and the base model, recompute, expert
parallelism, GPAS gates, the optimizer and its per-group learning rates, the data, and DPO's loss and frozen
reference. `engine.train.trainer` puts them together and runs the loop."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import paddle

from engine.models import gpas
from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES
from engine.models.expert_parallel import (
    ExpertGroup,
    RouterComm,
    new_expert_group,
    split_experts,
)
from engine.models.lora import apply_lora
from engine.models.quantized import WeightOnlyLinear, hold_in_low_precision
from engine.models.streaming import Storage
from engine.train import lora as lora_mod
from engine.train import quant
from engine.train.config import TrainConfig
from engine.train.dpo import DPOLoss
from engine.train.options import ConfigError
from engine.train.precision import (
    Precision,
    PrecisionMode,
    resolve_precision,
)
from engine.train.run_checks import expert_parallel_problem
from engine.train.stages import ERNIE_VL, PADDLEOCR_VL, family_stage, stage_info

log = logging.getLogger(__name__)


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
        counts = hold_in_low_precision(model, precision.weights, precision.activations)
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
        hold_in_low_precision(reference, storage.dtype, precision.activations)
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
