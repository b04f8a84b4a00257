"""Training and export configs read from ERNIEKit-style YAML plus ``key=value`` overrides.

Field names are ERNIEKit's, so configs users already have keep working. An unknown key is an error that
names the file (and line) and suggests the closest valid key; values are checked with readable messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.models.config import (
    ELASTIC_DEPTH_PATTERNS,
    WEIGHT_ONLY_COMPUTE_TYPES,
    ErnieConfig,
    parse_size,
)
from engine.train.scalars import REPORT_TO, report_to_problems
from engine.train.stages import (
    DEFAULT_STAGE,
    ELASTIC_STAGES,
    STAGE_ALIASES,
    STAGE_DEFAULTS,
    STAGES,
    find_stage,
    stage_names,
)

log = logging.getLogger(__name__)

# The stages, their aliases and their per-stage defaults (STAGES, STAGE_ALIASES, STAGE_DEFAULTS) are
# engine.train.stages' registry, imported above for the schema and its readers.
FINE_TUNING = ("LoRA", "Full")
COMPUTE_TYPES = ("fp32", "bf16", "fp16", "fp8", *WEIGHT_ONLY_COMPUTE_TYPES)
SCHEDULERS = ("cosine", "linear", "constant")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
# how Full DPO holds its frozen reference model (dpo_reference_dtype)
DPO_REFERENCE_DTYPES = ("run", "fp32", "wint8", "wint4")
MIX_STRATEGIES = ("random", "concat", "interleave_under", "interleave_over")
LAYOUTS = ("paddle", "hf")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
PTQ_METHODS = ("", "wint8", "wint4", "fp8")
# `export_format: gguf` writes llama.cpp / Ollama files; its types are llama.cpp's names (f16 and q8_0 are
# written by the gguf package, q4_K_M by llama.cpp's llama-quantize from the f16 file).
EXPORT_FORMATS = ("safetensors", "gguf")
GGUF_TYPES = ("f32", "f16", "q8_0", "q4_K_M")
LORA_TARGETS = ("qkv_proj", "o_proj", "up_gate_proj", "down_proj")
# VL models: adapters on the vision tower's / resampler's (ERNIE 4.5 VL) or projector's (PaddleOCR-VL)
# linears too (engine.models.lora.TARGET_GROUPS)
LORA_VL_TARGETS = ("vision", "resampler", "projector")
OPTIMIZERS = ("adamw", "adamw_custom")
GPAS_EXPORT = ("keep", "fold")
# ERNIEKit's dataset type names for formats this engine calls otherwise (its Thinking configs say messages).
DATASET_TYPE_NAMES = {"messages": "chatml"}
STRATEGIES = ("steps", "epoch", "no")
FREEZE_OPTIONS = ("freeze_vision", "freeze_lm")

# Upper bounds: values past these are typing mistakes, and some would hold a worker for hours before the
# first step (ERNIE 4.5 reads up to 131,072 tokens; 1,048,576 leaves room for longer-context variants).
MAX_SEQ_LEN = 1_048_576
MAX_BATCH_SIZE = 4096
MAX_STEPS = 100_000_000
MAX_EPOCHS = 10_000
MAX_LORA_RANK = 4096

# What each training key is for: the studio's Train form groups its fields by these, in this order.
OPTION_GROUPS = (
    "data",
    "schedule",
    "optimizer",
    "lora",
    "dpo",
    "moe",
    "precision",
    "elastic",
    "gpas",
    "evaluation",
    "logging",
    "run",
)
# Model kinds a key may need (Applies.model): an MoE model, a multimodal one, a text-only MoE model.
MODEL_KINDS = ("moe", "vl", "text-moe")


@dataclass(frozen=True)
class Applies:
    """When a training key has an effect: on these stages, on LoRA (adapters) or Full runs, with these compute
    types, on this kind of model. Empty means any; a key without ``applies`` always has an effect."""

    stages: tuple[str, ...] = ()
    adapters: bool | None = None
    compute_types: tuple[str, ...] = ()
    model: str = ""

    def unmet(
        self, stage: str, fine_tuning: str, compute_type: str, model: ErnieConfig | None = None
    ) -> list[tuple[str, str]]:
        """The conditions a run of these choices does not meet, as ``(what, needed)`` pairs: ``("stage",
        "DPO")``, ``("adapters", "LoRA")``, ``("compute_type", "fp8")``, ``("model", "moe")``. An unknown
        model (None) meets every model condition."""
        unmet: list[tuple[str, str]] = []
        if self.stages and stage not in self.stages:
            unmet.append(("stage", ", ".join(self.stages)))
        adapters = fine_tuning == "LoRA" or compute_type in WEIGHT_ONLY_COMPUTE_TYPES
        if self.adapters is not None and adapters != self.adapters:
            unmet.append(("adapters", "LoRA" if self.adapters else "Full"))
        if self.compute_types and compute_type not in self.compute_types:
            unmet.append(("compute_type", ", ".join(self.compute_types)))
        if self.model and model is not None and not _model_is(model, self.model):
            unmet.append(("model", self.model))
        return unmet


def _model_is(model: ErnieConfig, kind: str) -> bool:
    if kind == "moe":
        return model.is_moe
    if kind == "vl":
        return model.is_vl
    return model.is_moe and not model.is_vl


UNMET_REASONS = {
    "stage": "applies to stage {needed} only",
    "adapters": "applies to {needed} runs only",
    "compute_type": "applies with compute_type {needed} only",
    "model": "applies to {needed} models only",
}
LORA_RUNS = Applies(adapters=True)
FULL_RUNS = Applies(adapters=False)
DPO_RUNS = Applies(stages=stage_names(lambda s: s.option_group == "dpo"))
VL_SFT_RUNS = Applies(stages=stage_names(lambda s: s.mixes_text_data))
IMAGE_RUNS = Applies(stages=stage_names(lambda s: s.reads_images))  # the runs that read images
REFERENCE_RUNS = Applies(stages=stage_names(lambda s: s.needs_reference), adapters=False)
MOE_MODELS = Applies(model="moe")
ELASTIC_RUNS = Applies(stages=ELASTIC_STAGES, model="text-moe")
FP8_RUNS = Applies(compute_types=("fp8",))
# GPAS gates go into ERNIE 4.5 decoders of Full runs; PaddleOCR-VL's decoder takes none (_ocr_problems)
GPAS_RUNS = Applies(stages=stage_names(lambda s: s.gpas), adapters=False)


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    factory: Any = dataclasses.MISSING,
    group: str | None = None,
    common: bool = False,
    applies: Applies | None = None,
) -> Any:
    """A config field with the facts every front end reads: help text, allowed values and bounds; for the
    studio's form also its group (one of OPTION_GROUPS), whether it is a common one (shown unfolded) and
    when it has an effect."""
    metadata = {
        "help": help,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "group": group,
        "common": common,
        "applies": applies,
    }
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ERNIEKit's names for keys this engine calls otherwise: the value is the field's on the right.
ERNIEKIT_ALIASES: dict[str, str] = {
    "apply_hadamard": "fp8_hadamard",
    "hadamard_block_size": "fp8_hadamard_block_size",
    "actscale_moving_rate": "fp8_scale_ema_rate",
    "moe_use_aux_free_update_coef": "moe_correction_bias_rate",
    "eval_strategy": "evaluation_strategy",
    "eval_iters": "max_evaluate_steps",
    "gradient_checkpointing": "recompute",
}

_PARALLEL = (
    "GPU model parallelism (tensor / pipeline / sharding / sequence); this engine trains data-parallel only "
    "(`paddle.distributed.launch --nproc_per_node N`)"
)
# Model-parallel degrees this engine cannot honour: above 1 the run would not be the one asked for, so
# such a config is refused instead of announced.
REFUSED_DEGREES = {"tensor_parallel_degree": "tensor", "pipeline_parallel_degree": "pipeline"}
# ERNIEKit's moe_group values this engine honours (its get_moe_group also has sharding and mpdp).
MOE_GROUPS = ("dummy", "none", "dp", "data", "world", "mp", "model", "tp")
MOE_GROUPS_ALL_RANKS = ("dp", "data", "world")
MOE_GROUPS_TENSOR = ("mp", "model", "tp")
# recompute_granularity values (ERNIEKit's names), see TrainConfig.recompute_granularity.
RECOMPUTE_GRANULARITIES = ("full", "full_attn", "core_attn")
# Devices (GPUs, or gloo processes on a CPU node) one data-parallel run may use on one node.
MAX_DEVICES = 16
# `sharding`: ERNIEKit's (PaddleNLP's) stage names. Stage 3 (sharded weights) and `offload` (stage 2's,
# fp16 only in Paddle) are refused by name.
SHARDING_STAGES = ("stage1", "stage2")
SHARDING_WORDS = (*SHARDING_STAGES, "offload")
_SHARDING_TUNING = (
    "tunes fleet's sharding (split_param, tensor fusion, communication buffers); `sharding` here runs "
    "fleet's DygraphShardingOptimizer with its defaults: the same updates"
)
_KERNEL = "chooses a fused GPU kernel; this engine's plain Paddle ops compute the same result"
_MEMORY = "a GPU memory saving; this engine keeps weights, gradients and optimizer state in one place"
_AMP = "compute_type chooses the precision here (bf16 / fp16: low-precision weights, fp32 master weights)"
_AMP_OPS = (
    "an AMP op list / master-gradient switch; this engine runs no auto_cast: the model itself computes norm "
    "statistics, rotary, attention softmax, the MoE router and the loss in fp32"
)
_CHECKPOINT = (
    "ERNIEKit's checkpoint format; this engine writes checkpoint-N/ (resumable) and the final model in "
    "Paddle layout (save_to_hf: true, the Hugging Face one)"
)
_MODEL_JSON = "the model's config.json decides this (multimodal, MoE, layers), not the training config"
_VL_DATA = (
    "ERNIEKit's VL data pipeline option; this engine's VL-SFT reads erniekit_vl records with its own "
    "image handling and chat template"
)
_OCR_DATA = (
    "ERNIEKit's OCR data pipeline option; stage OCR-VL-SFT here reads OCR pairs and erniekit_vl records and "
    "prepares their images with PaddleOCR-VL's own image processor (rescaled, normalised, float32)"
)
_LOADER = "data loading runs in the training process here; there are no loader workers to configure"
_DPO_VARIANT = "a DPO loss variant this engine does not implement (loss_type: sigmoid, ipo, hinge)"

# ERNIEKit keys that have no effect on this engine, each with the reason a run announces (one line, once,
# as a `notice` event, in train.log and in run_summary.json). Keys ERNIEKit's example configs use are all
# here or fields; a key neither ERNIEKit nor this engine knows is an error.
ERNIEKIT_NOTICES: dict[str, str] = {
    # parallelism and distributed plumbing
    "tensor_parallel_degree": _PARALLEL,
    "pipeline_parallel_degree": _PARALLEL,
    "sequence_parallel": _PARALLEL,
    "pipeline_parallel_config": _PARALLEL,
    "tensor_parallel_config": _PARALLEL,
    "sharding_parallel_config": _SHARDING_TUNING,
    "sharding_comm_buffer_size_MB": _SHARDING_TUNING,
    "virtual_pp_degree": _PARALLEL,
    "pp_need_data": _PARALLEL,
    "pp_need_data_degree": _PARALLEL,
    "pp_seg_method": _PARALLEL,
    "disable_pipeline_warmup": _PARALLEL,
    "moe_multimodal_dispatch_use_allgather": (
        "the expert-parallel dispatch here follows the backend: all-to-all on GPUs (NCCL), all_gather on "
        "gloo (CPU), both modality groups in one exchange"
    ),
    "use_sp_callback": "a sequence-parallel gradient hook; there is no sequence parallelism here",
    "tensor_parallel_output": "keeps the LM head's logits split across tensor-parallel ranks; "
    "there is no tensor parallelism here",
    "distributed_dataloader": _LOADER,
    "save_sharding_stage1_model_include_freeze_params": _CHECKPOINT,
    "load_sharded_model": _CHECKPOINT,
    "save_sharded_model": _CHECKPOINT,
    "unified_checkpoint": _CHECKPOINT,
    "unified_checkpoint_config": _CHECKPOINT,
    "disable_ckpt_quant": "checkpoints here hold optimizer state unquantized",
    "ignore_save_lr_and_optim": "checkpoints here always hold the optimizer state, so runs resume exactly",
    "ignore_load_lr_and_optim": "checkpoints here always hold the optimizer state, so runs resume exactly",
    "save_to_aistudio": "uploading is not part of training here; the run directory is local",
    "device": "the device comes from the Paddle build (GPU when compiled with CUDA, else CPU)",
    "FLAGS_use_stride_kernel": "a Paddle runtime flag (ERNIEKit's XPU configs set it); the config does not set "
    "Paddle flags here: export FLAGS_use_stride_kernel in the environment instead",
    "convert_from_hf": "a model directory's layout (Paddle or Hugging Face; PaddleOCR-VL's published or "
    "transformers' form) is recognised from its files and read either way",
    # fused kernels
    "fuse_rope": _KERNEL,
    "fuse_linear": _KERNEL,
    "fuse_rms_norm": _KERNEL,
    "fuse_softmax_mask": _KERNEL,
    "use_flash_attention": _KERNEL,
    "use_mem_eff_attn": _KERNEL,
    "use_sparse_flash_attn": _KERNEL,
    "use_sparse_head_and_loss_fn": _KERNEL,
    "use_fused_head_and_loss_fn": _KERNEL,
    "use_attn_mask_startend_row_indices": _KERNEL,
    "use_attn_mask_start_row_indices": _KERNEL,
    # memory
    "offload_optim": _MEMORY,
    "optim_shard_num": "shards ERNIEKit's optimizer state files across GPUs; optimizer state here is one file",
    "use_lowprecision_moment": "AdamW moments stay fp32 here (bf16 moments are a GPU memory saving)",
    "release_grads": _MEMORY,
    "pre_alloc_memory": _MEMORY,
    "gc_interval": _MEMORY,
    "recompute_use_reentrant": (
        "recompute here is always non-reentrant (Paddle's saved-tensor hooks); the same activations are "
        "rebuilt and the same gradients computed either way"
    ),
    "no_recompute_layers": "recompute here applies to every layer",
    "use_recompute_loss_fn": "the loss here is not recomputed",
    "loss_subbatch_seqlen": "computes the loss in chunks of this many tokens to save GPU memory; the loss here "
    "is computed over the whole sequence at once (the same value)",
    "refined_recompute": "chooses ops ERNIEKit keeps instead of recomputing (a memory / speed trade); "
    "recompute and recompute_granularity decide what is rebuilt here, with the same gradients",
    # mixed precision
    "bf16": _AMP,
    "fp16": _AMP,
    "fp16_opt_level": "compute_type bf16 / fp16 always train O2-style here (low-precision weights, fp32 "
    "master weights and AdamW moments)",
    "amp_master_grad": _AMP_OPS,
    "amp_custom_white_list": _AMP_OPS,
    "amp_custom_black_list": _AMP_OPS,
    "scale_loss": (
        "the initial fp16 loss scale; fp16 (GPU only) starts paddle.amp.GradScaler at 32768, ERNIEKit's "
        "default, and adapts it every step"
    ),
    # model structure decided by config.json
    "multimodal": _MODEL_JSON,
    "use_moe": _MODEL_JSON,
    "moe_use_hard_gate": _MODEL_JSON,
    "num_nextn_predict_layers": "multi-token prediction (MTP) layers are not trained here; ERNIEKit sets it 0",
    # data and loader
    "dataloader_num_workers": _LOADER,
    "prefetch_factor": _LOADER,
    "random_shuffle": "the training stream is always shuffled by seed",
    "greedy_intokens": "packing here is always first-fit-decreasing over a pool of samples",
    "buffer_size": "packing here draws from a pool of 8 batches' worth of samples",
    "padding": "a batch here is never padded to max_seq_len: its rows are padded to the longest one "
    "(ERNIEKit's padding: false)",
    "split_multi_turn": "a multi-turn sample trains every assistant turn in one sequence here",
    "dataset_name": "the reader follows from each file's records here (erniekit, erniekit_vl, chatml, ...)",
    "dataset_name_or_path": "datasets are named by train_dataset_path here",
    "dataset_type": "pre-tokenized pretraining shards are not read here; give PT data as train_dataset_path",
    "input_dir": "pre-tokenized pretraining shards are not read here; give PT data as train_dataset_path",
    "split": "pre-tokenized pretraining shards are not read here; give eval data as eval_dataset_path",
    "use_pic_id": _VL_DATA,
    "variable_resolution": _VL_DATA,
    "pad_to_max_seqlen": _VL_DATA,
    "render_timestamp": _VL_DATA,
    "serialize_output": _VL_DATA,
    "one_sample_in_one_seq": _VL_DATA,
    "add_sys_token": _VL_DATA,
    "same_data": _VL_DATA,
    "trigger_data_prob": _VL_DATA,
    "drop_history_with_k": _VL_DATA,
    "modality_ratio": _VL_DATA,
    "sft_replace_ids": _OCR_DATA,
    "sft_image_normalize": _OCR_DATA,
    "sft_image_rescale": _OCR_DATA,
    "image_dtype": _OCR_DATA,
    "chat_template": "the chat template comes from the model directory's tokenizer files",
    # optimisation details not implemented
    "attention_probs_dropout_prob": (
        "this engine's attention has no dropout on its probabilities; hidden_dropout_prob is applied"
    ),
    "layerwise_lr_decay_bound": "every layer here trains with the same learning rate",
    "visual_ld": "the vision encoder's layers share vit_lr_ratio here (no per-layer decay)",
    # trainer plumbing
    "do_predict": "prediction is `ernie-studio chat` / `serve` here, not part of training",
    "from_scratch": "training always starts from model_name_or_path (init-model makes a fresh model)",
    "continue_training": "a run resumes from its output_dir's newest checkpoint by itself",
    "overwrite_output_dir": "a run resumes from its output_dir's newest checkpoint by itself",
    "load_best_model_at_end": "the final model is the last step's (or the weight EMA with ema_decay)",
    "greater_is_better": "the final model is the last step's (or the weight EMA with ema_decay)",
    "metric_for_best_model": "the final model is the last step's (or the weight EMA with ema_decay)",
    "remove_unused_columns": "batches here carry only the model's inputs",
    # DPO variants
    "offset_alpha": _DPO_VARIANT,
    "simpo_gamma": _DPO_VARIANT,
    "dpop_lambda": _DPO_VARIANT,
    "ref_model_update_steps": "the DPO reference model stays frozen for the whole run",
}

# Export configs of ERNIEKit carry these besides training keys.
EXPORT_NOTICES: dict[str, str] = {
    "hf_hub_id": "uploading to the Hugging Face Hub is not done here; the export is written to export_dir",
}


@dataclass(frozen=True)
class Notice:
    """An accepted key that has no effect on this run, and why (one line in the run's events)."""

    key: str
    message: str

    def line(self) -> str:
        return f"notice: {self.key}: {self.message}"


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says where and what to do. ``problems``
    holds each problem on its own (without the file name), for front ends that show them by key."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


@dataclass
class TrainConfig:
    """Everything one training run needs. Keys and defaults follow ERNIEKit's YAML configs."""

    model_name_or_path: str = option("", "A model directory (config.json, weights, tokenizer).", group="run")
    stage: str = option(DEFAULT_STAGE, "Training stage.", choices=STAGES, group="run")
    fine_tuning: str = option(
        "LoRA", "Train all weights (Full) or low-rank adapters (LoRA).", choices=FINE_TUNING, group="run"
    )
    output_dir: str = option(
        "./output", "Run directory: metrics, checkpoints and the final model.", group="run"
    )
    save_to_hf: bool = option(
        False,
        "Full runs: write the final model in the Hugging Face layout (PyTorch names; PaddleOCR-VL: "
        "transformers' config.json form) instead of the Paddle one (PaddleOCR-VL: its published form).",
        group="run",
        applies=Applies(adapters=False),
    )
    logging_dir: str = option(
        "",
        "Where report_to's TensorBoard / VisualDL / MLflow logs go (a folder per tool); empty means output_dir.",
        group="logging",
    )
    report_to: list[str] | None = option(  # noqa: RUF009 (a field with a default_factory)
        help="Scalar logs besides metrics.jsonl: visualdl (ERNIEKit's default), tensorboard, all (both), "
        "mlflow (with the tracking extra), or none; comma-separated.",
        choices=REPORT_TO,
        factory=lambda: ["visualdl"],
        group="logging",
    )
    # data
    train_dataset_type: str = option("", "Format of each training file (comma-separated).", group="data")
    train_dataset_path: str = option("", "Training files, comma-separated for mixing.", group="data")
    train_dataset_prob: str = option("1.0", "Sampling probability of each training file.", group="data")
    eval_dataset_type: str = option("", "Format of each evaluation file.", group="data")
    eval_dataset_path: str = option("", "Evaluation files, comma-separated.", group="data")
    eval_dataset_prob: str = option("1.0", "Sampling probability of each evaluation file.", group="data")
    text_dataset_path: str = option(
        "",
        "VL-SFT: text-only training files mixed in with the image data.",
        group="data",
        applies=VL_SFT_RUNS,
    )
    text_dataset_prob: str = option(
        "", "Sampling probability of each text_dataset_path file.", group="data", applies=VL_SFT_RUNS
    )
    min_pixels: int = option(
        0,
        "VL-SFT / OCR-VL-SFT: smallest image area after resizing, in pixels; 0 = the model's processor "
        "setting.",
        minimum=0,
        group="data",
        applies=IMAGE_RUNS,
    )
    max_pixels: int = option(
        0,
        "VL-SFT / OCR-VL-SFT: largest image area after resizing, in pixels; 0 = the model's processor "
        "setting.",
        minimum=0,
        group="data",
        applies=IMAGE_RUNS,
    )
    num_samples_each_epoch: int = option(
        0,
        "Samples in one epoch (ERNIEKit's epoch) when training by epochs; 0 is one pass.",
        minimum=0,
        group="data",
    )
    max_seq_len: int = option(
        2048,
        "Longer samples drop their oldest turns first.",
        minimum=1,
        maximum=MAX_SEQ_LEN,
        group="data",
        common=True,
    )
    max_prompt_len: int = option(
        1024,
        "DPO: longest prompt kept before the responses.",
        minimum=1,
        maximum=MAX_SEQ_LEN,
        group="dpo",
        applies=DPO_RUNS,
    )
    packing: bool | None = option(
        None,
        "Pack short samples into one sequence (no cross-attention); default per stage.",
        group="data",
        common=True,
    )
    mix_strategy: str = option(
        "random", "How several training files are mixed.", choices=MIX_STRATEGIES, group="data"
    )
    packing_size: int = option(
        0,
        "With packing: at most this many samples in one max_seq_len row (ERNIEKit's OCR configs); 0 packs "
        "as many as fit.",
        minimum=0,
        maximum=MAX_BATCH_SIZE,
        group="data",
    )
    # batch and optimiser
    batch_size: int = option(
        1,
        "Samples (or packed sequences) per step per device.",
        minimum=1,
        maximum=MAX_BATCH_SIZE,
        group="schedule",
    )
    per_device_train_batch_size: int = option(
        0,
        "ERNIEKit's name for batch_size (wins when set).",
        minimum=0,
        maximum=MAX_BATCH_SIZE,
        group="schedule",
        common=True,
    )
    per_device_eval_batch_size: int = option(
        0, "Evaluation batch size; 0 means batch_size.", minimum=0, maximum=MAX_BATCH_SIZE, group="evaluation"
    )
    gradient_accumulation_steps: int = option(
        1,
        "Micro-batches summed per optimizer step.",
        minimum=1,
        maximum=MAX_STEPS,
        group="schedule",
        common=True,
    )
    learning_rate: float | None = option(
        None,
        "Peak learning rate after warm-up; default per stage and fine-tuning.",
        minimum=0,
        maximum=1,
        group="schedule",
        common=True,
    )
    lr_scheduler_type: str = option(
        "cosine", "Learning-rate schedule after warm-up.", choices=SCHEDULERS, group="schedule", common=True
    )
    min_lr: float = option(
        0.0, "Learning rate at the end of the schedule.", minimum=0, maximum=1, group="schedule"
    )
    warmup_steps: int = option(
        0,
        "Linear warm-up from 0 to learning_rate.",
        minimum=0,
        maximum=MAX_STEPS,
        group="schedule",
        common=True,
    )
    warmup_ratio: float = option(
        0.0,
        "Warm-up as a share of all steps (when warmup_steps is 0).",
        minimum=0,
        maximum=1,
        group="schedule",
    )
    max_steps: int = option(
        -1,
        "Optimizer steps; -1 (or 0) trains num_train_epochs.",
        minimum=-1,
        maximum=MAX_STEPS,
        group="schedule",
        common=True,
    )
    num_train_epochs: float = option(
        1.0,
        "Passes over the data; used when max_steps is -1.",
        minimum=0,
        maximum=MAX_EPOCHS,
        group="schedule",
        common=True,
    )
    optim: str = option(
        "adamw",
        "Optimizer; adamw_custom (ERNIEKit's AdamW) is the same update.",
        choices=OPTIMIZERS,
        group="optimizer",
    )
    weight_decay: float = option(0.0, "AdamW weight decay.", minimum=0, group="optimizer", common=True)
    adam_beta1: float = option(0.9, "AdamW beta1.", minimum=0, maximum=1, group="optimizer")
    adam_beta2: float = option(0.999, "AdamW beta2.", minimum=0, maximum=1, group="optimizer")
    adam_epsilon: float = option(1e-8, "AdamW epsilon.", minimum=0, group="optimizer")
    max_grad_norm: float = option(
        1.0, "Gradient clipping by global norm; 0 turns it off.", minimum=0, group="optimizer"
    )
    moe_gate_lr_ratio: float = option(
        1.0,
        "Learning-rate multiplier of the MoE routers (Full runs).",
        minimum=0,
        group="optimizer",
        applies=Applies(adapters=False, model="moe"),
    )
    vit_lr_ratio: float = option(
        1.0,
        "Learning-rate multiplier of the vision encoder (VL, Full runs).",
        minimum=0,
        group="optimizer",
        applies=Applies(adapters=False, model="vl"),
    )
    freeze_config: str = option(
        "",
        "Weights that stay frozen in Full runs: freeze_vision and/or freeze_lm (space or comma separated).",
        group="optimizer",
        applies=Applies(adapters=False, model="vl"),
    )
    hidden_dropout_prob: float = option(
        0.0,
        "Dropout on each decoder layer's attention and FFN outputs; layer i of N drops p*i/N.",
        minimum=0,
        group="optimizer",
    )
    dropout_warmup_steps: int = option(
        0,
        "Dropout rises linearly from 0 to hidden_dropout_prob over these steps.",
        minimum=0,
        group="optimizer",
    )
    ema_decay: float = option(
        0.0, "Exponential moving average of the weights; 0 turns it off.", minimum=0, group="optimizer"
    )
    seed: int = option(
        42,
        "Seed for initialisation, shuffling and dropout.",
        minimum=0,
        maximum=2**32 - 1,
        group="schedule",
        common=True,
    )
    recompute: bool = option(
        False, "Recompute activations in backward (less memory, more time).", group="precision"
    )
    recompute_granularity: str = option(
        "full",
        "What recompute rebuilds in backward: full (every block of each decoder layer: attention, dense FFN "
        "and MoE), full_attn (the attention blocks), core_attn (the softmax attention inside them).",
        choices=RECOMPUTE_GRANULARITIES,
        group="precision",
    )
    use_recompute_moe: bool = option(
        True,
        "Under recompute, rebuild the MoE blocks too (router, routed and shared experts), whatever the "
        "granularity; false keeps their activations. With expert parallelism only the routed and shared "
        "experts are rebuilt (the exchange is never replayed); those runs say so.",
        group="precision",
        applies=MOE_MODELS,
    )
    compute_type: str = option(
        "fp32",
        "bf16/fp16 hold the weights in that precision with fp32 master weights (bf16 is emulated where "
        "there are no bf16 kernels, fp16 needs a GPU); wint8/wint4 quantize the frozen base (LoRA); fp8 is "
        "FP8 QAT.",
        choices=COMPUTE_TYPES,
        group="precision",
        common=True,
    )
    # what runs, logging, checkpoints
    do_train: bool = option(
        True, "Train; false only evaluates the model (needs do_eval and an eval set).", group="evaluation"
    )
    do_eval: bool = option(True, "Evaluate on the eval set when one is given.", group="evaluation")
    evaluation_strategy: str = option(
        "steps",
        "When to evaluate while training: every eval_steps, every epoch, or no.",
        choices=STRATEGIES,
        group="evaluation",
    )
    max_evaluate_steps: int = option(
        -1,
        "Batches per evaluation; -1 (or 0) evaluates the whole eval set.",
        minimum=-1,
        maximum=MAX_STEPS,
        group="evaluation",
    )
    save_strategy: str = option(
        "steps",
        "When to checkpoint: every save_steps, every epoch, or no (last step only).",
        choices=STRATEGIES,
        group="evaluation",
    )
    save_total_limit: int = option(
        0,
        "Keep the newest N checkpoints, deleting older ones; 0 keeps all.",
        minimum=0,
        maximum=MAX_STEPS,
        group="evaluation",
    )
    logging_steps: int = option(
        1, "Write a metrics point every N steps.", minimum=1, maximum=MAX_STEPS, group="logging", common=True
    )
    save_steps: int = option(
        500,
        "Resumable checkpoint every N steps.",
        minimum=1,
        maximum=MAX_STEPS,
        group="evaluation",
        common=True,
    )
    eval_steps: int = option(
        0,
        "Evaluate every N steps (evaluation_strategy steps); 0 evaluates at the end only.",
        minimum=0,
        maximum=MAX_STEPS,
        group="evaluation",
    )
    disable_tqdm: bool = option(False, "No progress bar on stdout.", group="logging")
    # LoRA
    lora_rank: int = option(
        8,
        "Rank of the low-rank update.",
        minimum=1,
        maximum=MAX_LORA_RANK,
        group="lora",
        common=True,
        applies=LORA_RUNS,
    )
    lora_alpha: float = option(
        -1.0, "LoRA scale numerator; -1 means 2 x rank.", group="lora", common=True, applies=LORA_RUNS
    )
    lora_plus_scale: float = option(
        1.0, "LoRA+: learning-rate multiplier of the B matrices.", minimum=0, group="lora", applies=LORA_RUNS
    )
    rslora: bool = option(
        False, "Rank-stabilised LoRA scaling (alpha / sqrt(rank)).", group="lora", applies=LORA_RUNS
    )
    lora_target_modules: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="Linear layers that get adapters; VL models also take vision, and resampler (ERNIE 4.5 VL) or "
        "projector (PaddleOCR-VL).",
        choices=LORA_TARGETS + LORA_VL_TARGETS,
        factory=lambda: list(LORA_TARGETS),
        group="lora",
        applies=LORA_RUNS,
    )
    # DPO
    beta: float = option(
        0.1,
        "Strength of the KL anchor to the reference model.",
        minimum=0,
        group="dpo",
        common=True,
        applies=DPO_RUNS,
    )
    loss_type: str = option(
        "sigmoid", "DPO loss.", choices=DPO_LOSSES, group="dpo", common=True, applies=DPO_RUNS
    )
    pref_loss_ratio: float = option(
        1.0, "Weight of the preference loss.", minimum=0, group="dpo", applies=DPO_RUNS
    )
    sft_loss_ratio: float = option(
        0.0, "Weight of the SFT loss on the chosen response.", minimum=0, group="dpo", applies=DPO_RUNS
    )
    label_smoothing: float = option(
        0.0, "Conservative DPO: assumed share of flipped labels.", minimum=0, group="dpo", applies=DPO_RUNS
    )
    reference_free: bool = option(False, "DPO without a reference model.", group="dpo", applies=DPO_RUNS)
    dpo_reference_dtype: str = option(
        "run",
        "Full DPO: how the frozen reference model is held: run (as the run holds its weights: fp32, or bf16 "
        "with compute_type bf16), fp32, or its linears weight-only wint8 / wint4 (less memory, an "
        "approximate reference). LoRA DPO has no second model: its reference is the base with the adapters "
        "switched off.",
        choices=DPO_REFERENCE_DTYPES,
        group="dpo",
        applies=REFERENCE_RUNS,
    )
    # MoE (None keeps the value in the model's config.json)
    moe_aux_loss_lambda: float | None = option(
        None,
        "Weight of the load-balancing loss; empty keeps the model's config.json value.",
        minimum=0,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_z_loss_lambda: float | None = option(
        None,
        "Weight of the router z-loss; empty keeps the model's config.json value.",
        minimum=0,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_orthogonal_loss_lambda: float | None = option(
        None,
        "Weight of the router orthogonal loss; empty keeps the model's config.json value.",
        minimum=0,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_use_aux_free: bool | None = option(
        None,
        "Balance experts with correction biases (aux-free); empty keeps the model's config.json value.",
        group="moe",
        applies=MOE_MODELS,
    )
    moe_correction_bias_rate: float = option(
        1e-3, "Step size of the aux-free bias update.", minimum=0, group="moe", applies=MOE_MODELS
    )
    expert_parallel_degree: int = option(
        1,
        "Expert parallelism: split each MoE layer's routed experts over this many ranks (a divisor of the "
        "expert count and of the run's ranks); tokens travel to their expert's rank and back.",
        minimum=1,
        maximum=MAX_DEVICES,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_group: str = option(
        "dummy",
        "ERNIEKit's expert-parallel group: dp (or data, world) splits the experts over all ranks; mp (model, "
        "tp) over the tensor-parallel group, one rank here; dummy (none) does not split.",
        choices=MOE_GROUPS,
        group="moe",
        applies=MOE_MODELS,
    )
    # GPAS (engine.models.gpas)
    gpas: bool = option(
        False,
        "GPAS: a learnable gate after every residual add scales activations down while gradients pass "
        "unchanged; starts as the plain model (Full runs; a model trained with GPAS keeps its gates).",
        group="gpas",
        applies=GPAS_RUNS,
    )
    gpas_gate_grad_clip: float = option(
        0.0,
        "GPAS: clip the gates' gradients by this global norm after max_grad_norm (the reference's "
        "clip_gate_grad, 0.01 for its 1B and 7B runs); 0 turns it off.",
        minimum=0,
        group="gpas",
        applies=GPAS_RUNS,
    )
    # elastic MoE training (engine.train.elastic)
    elastic: bool = option(
        False,
        "Elastic MoE training: each step trains a sub-model sampled over depth, experts and top-k, so one "
        "run yields a family of smaller models (PT / SFT on a text MoE model).",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_depth_choices: str = option(
        "",
        "Elastic: depths (decoder layers kept; the first and the last always stay) a sub-model may have, "
        "comma-separated, e.g. 20,24; empty keeps every layer.",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_depth_pattern: str = option(
        "contiguous",
        "Elastic: which layers a shallower sub-model drops: one contiguous block before the last layer, "
        "or evenly strided ones.",
        choices=ELASTIC_DEPTH_PATTERNS,
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_experts_choices: str = option(
        "",
        "Elastic: routed experts per MoE layer a sub-model may keep (the first N; the router renormalises "
        "over them), comma-separated, e.g. 32,48; empty keeps every expert.",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_topk_choices: str = option(
        "",
        "Elastic: experts per token (k' <= moe_k) a sub-model may route to, comma-separated, e.g. 2,4; "
        "empty keeps moe_k.",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_full_share: float = option(
        0.5,
        "Elastic: share of steps that train the full model; the others train a sub-model sampled uniformly "
        "from the elastic_* lists.",
        minimum=0,
        maximum=1,
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    # quantization-aware training and weight-only bases
    fp8_hadamard: bool = option(
        True,
        "FP8 QAT: rotate blocks with a Hadamard transform before quantizing.",
        group="precision",
        applies=FP8_RUNS,
    )
    fp8_hadamard_block_size: int = option(
        32, "FP8 QAT: Hadamard block size (a power of two).", minimum=1, group="precision", applies=FP8_RUNS
    )
    fp8_scale_ema_rate: float = option(
        0.01, "FP8 QAT: EMA rate of activation scales.", minimum=0, group="precision", applies=FP8_RUNS
    )
    # sharded optimizer state over the data-parallel ranks (engine.train.sharding)
    sharding: str = option(
        "",
        "Split the optimizer state over the data-parallel devices: stage1 (AdamW state; CPU and GPU) or "
        "stage2 (gradients too; GPU only). Needs 2 or more devices; empty trains plain data-parallel.",
        group="precision",
    )
    sharding_parallel_degree: int = option(
        -1,
        "Devices one optimizer-state split spans: -1 is all of the run's devices, 1 turns sharding off; "
        "it must divide the run's devices (the rest replicate the split data-parallel).",
        minimum=-1,
        maximum=MAX_DEVICES,
        group="precision",
    )
    tensorwise_offload_optimizer: bool = option(
        False,
        "GPU: keep AdamW's moments in host memory and bring each weight's to the device only for its "
        "update (on CPU they live in host memory already).",
        group="precision",
    )
    weight_quant_group_size: int = option(
        -1,
        "Weight-only bases: group size; -1 is per channel.",
        group="precision",
        applies=Applies(compute_types=WEIGHT_ONLY_COMPUTE_TYPES),
    )

    # Accepted ERNIEKit keys without effect here (set by the loader; not a key of the config itself).
    notices: typing.ClassVar[list[Notice]]

    def __post_init__(self) -> None:
        self.notices = []
        if self.per_device_train_batch_size:
            self.batch_size = self.per_device_train_batch_size
        if not self.logging_dir:
            self.logging_dir = self.output_dir
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = _split(self.lora_target_modules)
        if isinstance(self.report_to, str) or self.report_to is None:  # `report_to=none` arrives as None
            self.report_to = _split(self.report_to or "none")
        for key, value in STAGE_DEFAULTS.get((self.stage, self.fine_tuning), {}).items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    @property
    def holds_reference(self) -> bool:
        """The stage compares against a reference model and the run keeps one (not reference_free)."""
        stage = find_stage(self.stage)
        return stage is not None and stage.needs_reference and not self.reference_free

    @property
    def lora(self) -> bool:
        return self.fine_tuning == "LoRA" or self.compute_type in WEIGHT_ONLY_COMPUTE_TYPES

    @property
    def frozen(self) -> list[str]:
        """The parts freeze_config names (``freeze_vision``, ``freeze_lm``)."""
        return [p for p in re.split(r"[\s,]+", self.freeze_config) if p]

    @property
    def effective_lora_alpha(self) -> float:
        return 2.0 * self.lora_rank if self.lora_alpha == -1 else self.lora_alpha

    def dataset_spec(self, split: str = "train") -> dict[str, str]:
        """ERNIEKit's three dataset keys of a split for ``engine.data.build_train_data`` (always named
        ``train_*`` there); the train split also mixes in ``text_dataset_path`` (ERNIEKit's VL text data)."""
        paths = _split(getattr(self, f"{split}_dataset_path"))
        types = [
            DATASET_TYPE_NAMES.get(t, t)
            for t in _split(getattr(self, f"{split}_dataset_type") or self.train_dataset_type)
        ]
        probs = _split(getattr(self, f"{split}_dataset_prob"))
        if split == "train" and self.text_dataset_path:
            types = (types * len(paths) if len(types) == 1 else types) or ["auto"] * len(paths)
            probs = probs or ["1.0"] * len(paths)
            text = _split(self.text_dataset_path)
            probs = probs if paths else []
            paths, types = paths + text, types + ["auto"] * len(text)
            probs = probs + (_split(self.text_dataset_prob) or ["1.0"] * len(text))
        return {
            "train_dataset_type": ",".join(types),
            "train_dataset_path": ",".join(paths),
            "train_dataset_prob": ",".join(probs),
        }

    def _data_problems(self) -> list[str]:
        if self.do_train and not self.train_dataset_path and not self.text_dataset_path:
            return ["train_dataset_path is required (comma-separated files for mixing)"]
        if not self.do_train and not (self.do_eval and self.eval_dataset_path):
            return ["do_train: false only evaluates: set do_eval: true and eval_dataset_path"]
        return []

    def validate(self) -> list[str]:
        problems = check_fields(self) + self._ocr_problems()
        if not self.model_name_or_path:
            problems.append(
                "model_name_or_path is required: a model directory (e.g. from `ernie-studio init-model`)"
            )
        problems += self._data_problems()
        problems += report_to_problems(self.report_to)
        for item in self.frozen:
            _choice(problems, "freeze_config", item, FREEZE_OPTIONS)
        if self.hidden_dropout_prob >= 1:
            problems.append(f"hidden_dropout_prob must be below 1, got {self.hidden_dropout_prob}")
        if self.max_steps < 1 and self.num_train_epochs <= 0:
            problems.append("set max_steps >= 1 or num_train_epochs > 0")
        if not 0 <= self.ema_decay < 1:
            problems.append(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.dpo_reference_dtype != "run" and not (self.holds_reference and not self.lora):
            problems.append(
                f"dpo_reference_dtype {self.dpo_reference_dtype}: only a Full DPO run with a reference holds a "
                "reference model (a LoRA run's reference is its base with the adapters off); remove the key"
            )
        if self.compute_type in WEIGHT_ONLY_COMPUTE_TYPES and self.fine_tuning != "LoRA":
            problems.append(
                f"compute_type {self.compute_type} freezes a quantized base, so it needs fine_tuning: LoRA"
            )
        if self.fp8_hadamard_block_size < 1 or self.fp8_hadamard_block_size & (
            self.fp8_hadamard_block_size - 1
        ):
            problems.append(
                f"fp8_hadamard_block_size must be a power of two, got {self.fp8_hadamard_block_size}"
            )
        problems += self._expert_parallel_problems()
        return problems + self._elastic_problems() + self._sharding_problems()

    def _ocr_problems(self) -> list[str]:
        """What PaddleOCR-VL (stage OCR-VL-SFT) does not train with here, by key."""
        stage = find_stage(self.stage)
        if stage is None or not stage.trains_paddleocr_vl:
            return []
        problems = []
        if self.compute_type not in ("fp32", "bf16", "fp16"):
            problems.append(
                f"compute_type {self.compute_type}: PaddleOCR-VL trains in fp32, bf16 or fp16 here (FP8 QAT and "
                "weight-only bases are ERNIE 4.5 decoders' only)"
            )
        if self.gpas:
            problems.append("gpas: PaddleOCR-VL's decoder takes no GPAS gates here; leave gpas false")
        if self.text_dataset_path:
            problems.append(
                f"text_dataset_path: an {self.stage} record needs an image; mix no text-only data in"
            )
        return problems

    def _expert_parallel_problems(self) -> list[str]:
        problems = []
        splits = self.expert_parallel_degree > 1 or self.moe_group in MOE_GROUPS_ALL_RANKS
        if self.elastic and splits:
            problems.append(
                "expert_parallel_degree / moe_group: elastic training samples sub-models over the experts; "
                "it runs with every expert in each process (leave expert_parallel_degree at 1)"
            )
        if self.sharding_stage and splits:
            problems.append(
                "sharding with expert_parallel_degree / moe_group: the split optimizer state and the split "
                "experts are not combined here yet; use one of them"
            )
        return problems

    @property
    def sharding_stage(self) -> int:
        """0 (no sharding), 1 or 2, as ``sharding`` names it (validate() has refused anything else)."""
        words = _split_words(self.sharding)
        return next((int(w[-1]) for w in words if w in SHARDING_STAGES), 0)

    def sharding_degree(self, devices: int) -> int:
        """Ranks one optimizer-state split spans on ``devices`` devices (1: no sharding)."""
        if not self.sharding_stage:
            return 1
        return devices if self.sharding_parallel_degree == -1 else self.sharding_parallel_degree

    def _sharding_problems(self) -> list[str]:
        words = _split_words(self.sharding)
        problems = []
        for w in words:
            if w == "stage3":
                problems.append(
                    "sharding: stage3 (weights split over the devices) is not supported here; use stage1 "
                    "(optimizer state) or stage2 (optimizer state and gradients)"
                )
            elif w not in SHARDING_WORDS:
                problems.append(f"sharding: {w!r} is not one of {', '.join(SHARDING_WORDS)}")
        return problems or self._sharding_combination_problems(words)

    def _sharding_combination_problems(self, words: list[str]) -> list[str]:
        problems = []
        stages = [w for w in words if w in SHARDING_STAGES]
        if len(stages) > 1:
            problems.append(f"sharding: name one stage, got {' and '.join(stages)}")
        if "offload" in words:
            # GroupShardedOptimizerStage2.__init__ asserts fp16 weights when offloading (Paddle 3.3)
            problems.append(
                "sharding: offload: Paddle's stage-2 offload runs with fp16 weights only, and fp16 does not "
                "run with sharding here; keep the optimizer state in host memory with "
                "tensorwise_offload_optimizer: true (GPU) instead"
            )
        if self.sharding_parallel_degree == 0:
            problems.append("sharding_parallel_degree must be -1 (all devices) or a number of devices >= 1")
        if self.sharding_parallel_degree > 1 and not stages:
            problems.append(
                f"sharding_parallel_degree: {self.sharding_parallel_degree} needs sharding: stage1 or stage2"
            )
        if stages and self.compute_type == "fp16":
            problems.append(
                "sharding: compute_type fp16's loss scaling does not run over split optimizer state here; "
                "use compute_type bf16"
            )
        if stages and self.gpas_gate_grad_clip > 0:
            problems.append(
                "sharding: gpas_gate_grad_clip clips the gates' gradients, which the split optimizer holds "
                "on one device each; set gpas_gate_grad_clip: 0 or leave sharding out"
            )
        return problems

    def expert_degree(self, world: int) -> int:
        """The expert-parallel degree on ``world`` ranks, from expert_parallel_degree and moe_group."""
        degree = self.expert_parallel_degree
        if self.moe_group in MOE_GROUPS_ALL_RANKS:
            if degree > 1 and degree != world:
                raise ConfigError(
                    f"expert_parallel_degree: {degree} and moe_group: {self.moe_group} (all {world} ranks) "
                    "disagree; give one of them"
                )
            degree = world
        if world % degree:
            raise ConfigError(
                f"expert_parallel_degree: {degree} does not divide the {world} rank(s) of this run; "
                "train on a multiple of it (the studio's num_devices, or --nproc_per_node)"
            )
        return degree

    def elastic_choices(self, key: str) -> list[int]:
        """The numbers one ``elastic_*_choices`` key lists (ValueError when they are not numbers)."""
        return [int(v) for v in _split(str(getattr(self, key)))]

    def _elastic_problems(self) -> list[str]:
        """What can be checked without the model (engine.train.elastic checks the rest against it)."""
        keys = ("elastic_depth_choices", "elastic_experts_choices", "elastic_topk_choices")
        problems = []
        for key in keys:
            try:
                values = self.elastic_choices(key)
            except ValueError:
                problems.append(
                    f"{key} must be whole numbers separated by commas, got {getattr(self, key)!r}"
                )
                continue
            low = [v for v in values if v < (2 if key == "elastic_depth_choices" else 1)]
            if low:
                what = (
                    "a sub-model keeps the first and the last layer"
                    if key == "elastic_depth_choices"
                    else (
                        "zero experts would leave the MoE layers empty"
                        if key == "elastic_experts_choices"
                        else "k' >= 1"
                    )
                )
                problems.append(f"{key}: {low[0]} is too small ({what})")
        if not self.elastic:
            given = [k for k in (*keys, "elastic_full_share") if getattr(self, k) not in ("", 0.5)]
            if given:
                problems.append(
                    f"{given[0]} is set but elastic is false; set elastic: true to train sub-models"
                )
            return problems
        if self.stage not in ELASTIC_STAGES:
            problems.append(
                f"elastic: stage {self.stage} is not supported; elastic training runs {' and '.join(ELASTIC_STAGES)}"
            )
        if self.elastic_full_share < 1 and not any(getattr(self, k) for k in keys):
            problems.append(
                "elastic: true needs at least one of elastic_depth_choices, elastic_experts_choices, elastic_topk_choices"
            )
        return problems


def sharding_device_problems(sharding: Any, degree: Any, devices: int) -> list[str]:
    """What ``sharding`` / ``sharding_parallel_degree`` ask of a run on ``devices`` devices (a value that is
    not a stage name or a number is left to the config's own checks)."""
    words = _split_words(str(sharding or ""))
    if not any(w in SHARDING_STAGES for w in words):
        return []
    try:
        degree = int(degree)
    except (TypeError, ValueError):
        return []
    if degree == 1 or degree == 0:
        return []
    if devices == 1:
        return [
            f"sharding: {sharding} splits the optimizer state over data-parallel devices, but this run has "
            "one device; train on 2 or more (the studio's num_devices, or paddle.distributed.launch "
            "--nproc_per_node N), set sharding_parallel_degree: 1, or leave sharding out"
        ]
    if degree > 1 and devices % degree:
        return [
            f"sharding_parallel_degree: {degree} must divide the run's {devices} devices "
            "(or be -1 for all of them)"
        ]
    return []


def expert_parallel_problem(model: ErnieConfig, degree: int) -> str | None:
    """Why ``model`` cannot split its experts over ``degree`` ranks, naming the key; None when it can."""
    if degree <= 1:
        return None
    if not model.is_moe:
        return (
            f"expert_parallel_degree: {degree} needs an MoE model, but {model.model_type} is dense (no routed "
            "experts to split); leave expert_parallel_degree at 1 and moe_group at dummy"
        )
    for n in model.expert_counts:
        if n % degree:
            return (
                f"expert_parallel_degree: {degree} does not divide the model's {n} experts per MoE layer "
                f"(moe_num_experts {model.expert_counts}); use a divisor of {n}"
            )
    return None


def check_expert_parallel(cfg: TrainConfig, world: int) -> None:
    """Expert parallelism against the model's config.json and ``world`` ranks, before a run is queued or a
    weight is read (the studio calls it when a run is created); raises ConfigError naming the key."""
    from engine.models.paths import architecture_dir

    if cfg.expert_parallel_degree == 1 and cfg.moe_group not in MOE_GROUPS_ALL_RANKS:
        return
    try:
        model = ErnieConfig.from_file(architecture_dir(cfg.model_name_or_path) / "config.json")
    except FileNotFoundError:  # not there yet (a download): the trainer checks again once it is
        return
    problem = expert_parallel_problem(model, cfg.expert_parallel_degree)
    problem = problem or expert_parallel_problem(model, cfg.expert_degree(world))
    if problem:
        raise ConfigError(problem)


def elastic_model_problems(cfg: TrainConfig, model: ErnieConfig) -> list[str]:
    """Why an elastic run of ``cfg`` cannot train ``model`` (its elastic lists against the model's layers,
    experts and moe_k, e.g. ``elastic_topk_choices`` above ``moe_k``); each message names its key."""
    from engine.models.elastic_family import SubModel, member_problems

    if not cfg.elastic:
        return []
    full = SubModel.full(model, cfg.elastic_depth_pattern) if model.is_moe else None
    if full is None or model.is_vl:
        return member_problems(model, SubModel(0, 0, 0))[:1]
    problems: list[str] = []
    for key, what in (
        ("elastic_depth_choices", "depth"),
        ("elastic_experts_choices", "experts"),
        ("elastic_topk_choices", "k"),
    ):
        try:
            values = cfg.elastic_choices(key)
        except ValueError:
            continue  # validate() names it
        for v in values:
            one = {"depth": full.depth, "experts": full.experts, "k": full.k, what: v}
            if what == "experts":
                one["k"] = min(full.k, v)  # k' <= experts is a property of a member, checked per member
            member = SubModel(one["depth"], one["experts"], one["k"], full.pattern)
            problems += [
                p for p in member_problems(model, member, ELASTIC_TRAIN_KEYS) if p.startswith(f"{key} {v}")
            ]
    return list(dict.fromkeys(problems))


# The elastic keys of a training config, as member_problems names them.
ELASTIC_TRAIN_KEYS = {
    "depth": "elastic_depth_choices",
    "experts": "elastic_experts_choices",
    "topk": "elastic_topk_choices",
    "pattern": "elastic_depth_pattern",
}


def problem_key(message: str, cls: type = TrainConfig) -> str | None:
    """The key a config problem is about: the first key (or ERNIEKit alias) the message names, None when it
    names none (the studio shows such a problem beside Launch instead of beside a field)."""
    fields = _fields(cls)
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message):
        target = ERNIEKIT_ALIASES.get(word, word)
        if target in fields:
            return target
    return None


def not_applicable(
    cls: type, name: str, stage: str, fine_tuning: str, compute_type: str, model: ErnieConfig | None = None
) -> list[tuple[str, str]]:
    """Why key ``name`` has no effect on a run of these choices (``Applies.unmet``); empty when it has one."""
    applies = field_info(cls, name).get("applies")
    return applies.unmet(stage, fine_tuning, compute_type, model) if applies else []


def defaults_for(stage: str = DEFAULT_STAGE, fine_tuning: str = "LoRA") -> dict[str, Any]:
    """Every training key's starting value for this stage and fine-tuning: what a config that leaves the key
    out gets (the studio's form shows these)."""
    return dataclasses.asdict(TrainConfig(stage=stage, fine_tuning=fine_tuning))


def field_info(cls: type, name: str) -> dict[str, Any]:
    """Help text, choices and bounds of one config key (``{"help", "choices", "minimum", "maximum"}``)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return dict(f.metadata)
    raise KeyError(f"{cls.__name__} has no key {name!r}")


def check_fields(config: Any) -> list[str]:
    """Choices and bounds of every field, read from the schema; one readable line per problem."""
    problems: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        meta = f.metadata
        if value is None:
            continue
        if meta.get("choices") is not None:
            for item in value if isinstance(value, list) else [value]:
                _choice(problems, f.name, item, meta["choices"])
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{f.name} must be a finite number, got {value}")
            continue
        lo, hi = meta.get("minimum"), meta.get("maximum")
        if lo is not None and value < lo:
            problems.append(f"{f.name} must be >= {_number(lo)}, got {value}")
        if hi is not None and value > hi:
            problems.append(f"{f.name} must be <= {_number(hi)}, got {value}")
    return problems


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass
class ExportConfig:
    """``ernie-studio export``: LoRA merge, output layout, sharding, tokenizer copy and PTQ."""

    model_name_or_path: str = option(
        "", "The model directory to export when output_dir holds no trained model."
    )
    # A training run's output_dir: when it holds a trained model, that model is exported (for lora=True
    # it must hold the LoRA run); otherwise model_name_or_path is.
    output_dir: str = option("", "A training run's directory.")
    export_dir: str = option("", "Where the export goes; empty means output_dir/export.")
    lora: bool = option(False, "Merge the run's LoRA adapters into its base model.")
    layout: str = option(
        "paddle", "Checkpoint layout: Paddle (fused, [in, out]) or Hugging Face (hf).", choices=LAYOUTS
    )
    max_shard_size: str = option(
        "5GB", "Largest safetensors shard: 5GB, 500MB, or a number of GB as in ERNIEKit."
    )
    copy_tokenizer: bool = option(True, "Copy the tokenizer files next to the weights.")
    dtype: str = option("float32", "Dtype of the exported weights.", choices=EXPORT_DTYPES)
    quantization: str = option("", "Post-training quantization of the export.", choices=PTQ_METHODS)
    weight_quant_group_size: int = option(64, "PTQ group size; -1 is per channel.")
    export_format: str = option(
        "safetensors",
        "safetensors: a checkpoint directory (layout, dtype, PTQ); gguf: llama.cpp / Ollama files.",
        choices=EXPORT_FORMATS,
    )
    gguf_types: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="GGUF files to write with export_format gguf, one per type (q4_K_M needs llama.cpp's llama-quantize).",
        choices=GGUF_TYPES,
        factory=lambda: ["f16", "q8_0"],
    )
    # the perplexity report of PTQ uses these
    eval_dataset_type: str = option("erniekit", "Format of the PTQ perplexity set.")
    eval_dataset_path: str = option("", "Data for the PTQ perplexity report (optional).")
    eval_dataset_prob: str = option("1.0", "Sampling probability of each perplexity file.")
    stage: str = option(DEFAULT_STAGE, "Stage whose data format the perplexity set has.", choices=STAGES)
    max_seq_len: int = option(512, "Sequence length of the perplexity report.", minimum=1)
    batch_size: int = option(4, "Batch size of the perplexity report.", minimum=1)
    seed: int = option(42, "Seed of the perplexity report's sampling.")
    # an elastic run's member (engine.models.elastic): a real smaller model directory
    elastic_depth: int = option(
        0, "Elastic member to write: decoder layers kept (first and last stay); 0 keeps all.", minimum=0
    )
    elastic_experts: int = option(
        0, "Elastic member to write: routed experts kept per MoE layer (the first N); 0 keeps all.", minimum=0
    )
    elastic_topk: int = option(
        0, "Elastic member to write: experts per token (moe_k of the export); 0 keeps moe_k.", minimum=0
    )
    elastic_depth_pattern: str = option(
        "",
        "Elastic member to write: which layers a shallower member drops; empty takes the run's "
        "(train_config.json), else contiguous.",
        choices=("", *ELASTIC_DEPTH_PATTERNS),
    )
    # GPAS models (engine.models.gpas)
    gpas_gates: str = option(
        "keep",
        "A GPAS model's gates: keep them (this engine's Paddle layout reads them) or fold them into the "
        "weights (a plain ERNIE 4.5 model for transformers, FastDeploy and PTQ; exact up to RMSNorm's eps).",
        choices=GPAS_EXPORT,
    )
    gpas_fold_tolerance: float = option(
        1e-3,
        "Folding refuses when the folded model's logits move by more than this share of the largest logit "
        "on a probe batch.",
        minimum=0,
    )

    notices: typing.ClassVar[list[Notice]]

    def __post_init__(self) -> None:
        self.notices = []
        if self.lora and not self.output_dir:
            self.output_dir = "./output"
        if not self.export_dir:
            self.export_dir = str(Path(self.output_dir or "./output") / "export")
        self.layout = self.layout.lower()
        if re.fullmatch(r"\s*\d+(\.\d+)?\s*", self.max_shard_size):
            # ERNIEKit documents max_shard_size as a number of GB (its default is 5).
            self.max_shard_size = f"{self.max_shard_size.strip()}GB"
        if self.quantization.lower() in ("none", "false"):
            self.quantization = ""

    def validate(self) -> list[str]:
        problems = check_fields(self)
        try:
            too_small = parse_size(self.max_shard_size) < 1
        except ValueError:
            too_small = None
        if too_small is not False:
            problems.append(
                f"max_shard_size must be a size like 5GB or 500MB, or a number of GB, not {self.max_shard_size!r}"
            )
        if not self.lora and not self.model_name_or_path and not self.output_dir:
            problems.append(
                "set output_dir (a training run) or model_name_or_path (a model directory) to export"
            )
        if self.quantization and not self.eval_dataset_path:
            log.info("no eval_dataset_path: PTQ perplexity will not be reported")
        if self.quantization and self.export_format != "gguf":
            problems += _quantized_export_problems(self)
        if self.export_format == "gguf":
            if not self.gguf_types:
                problems.append(f"gguf_types is empty; name one or more of {', '.join(GGUF_TYPES)}")
            if self.quantization:
                problems.append(
                    "quantization (PTQ) applies to safetensors exports; a GGUF export quantizes through "
                    "gguf_types (q8_0, q4_K_M)"
                )
        return problems


def _quantized_export_problems(cfg: ExportConfig) -> list[str]:
    """A PTQ export writes its own weights: the Paddle layout, quantized values with fp32 scales."""
    problems = []
    if cfg.layout != "paddle":
        problems.append(
            "quantization: quantized exports are written in the Paddle layout; choose layout paddle"
        )
    default_dtype = config_default(ExportConfig, "dtype")
    if cfg.dtype != default_dtype:
        problems.append(
            f"dtype: a {cfg.quantization} export stores quantized weights with fp32 scales; leave dtype at "
            f"{default_dtype} or export without quantization"
        )
    return problems


# What a person chooses about an export: the studio's REST body, its Runs tab and its database row are made
# from these fields of ExportConfig (their defaults, help and choices). The studio sets the other keys from
# the run (its paths, the perplexity set, an elastic member's sizes); the CLI reads every key.
EXPORT_CHOICES = (
    "layout",
    "quantization",
    "dtype",
    "max_shard_size",
    "export_format",
    "gguf_types",
    "gpas_gates",
)


def config_default(cls: type, name: str) -> Any:
    """The default of one config key (a list key's factory value)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default_factory() if f.default is dataclasses.MISSING else f.default
    raise KeyError(f"{cls.__name__} has no key {name!r}")


# ---- loading -------------------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read an ERNIEKit training YAML and apply ``key=value`` overrides (later wins).

    ERNIEKit keys without effect here are accepted; ``config.notices`` says which and why.
    """
    return _load(TrainConfig, path, overrides or [], tolerated={})


def load_export_config(path: str | Path | None, overrides: list[str] | None = None) -> ExportConfig:
    """Read an export YAML; keys of a training config are accepted (and announced) so one file serves both."""
    tolerated = {f.name: "a training key; export does not use it" for f in dataclasses.fields(TrainConfig)}
    return _load(ExportConfig, path, overrides or [], tolerated={**tolerated, **EXPORT_NOTICES})


def config_from_dict(cls: type, values: dict[str, Any], source: str = "<dict>") -> Any:
    """Build a config from a plain dict (the studio's run form), with the same checks as a file."""
    return _build(cls, dict(values), source, {}, {})


def read_yaml_text(text: str, source: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A config's YAML text as ``load_config`` reads it: its ``key: value`` pairs and each key's line
    (for text that is not a file: the studio's YAML import)."""
    return _parse_yaml(text, source)


@dataclass
class ConfigKeys:
    """What the engine makes of a config's keys before it builds the config: each field's value converted
    to its type (ERNIEKit aliases resolved), the keys it announces, and the problems by kind, each message
    naming where (``source:line``) and the key."""

    values: dict[str, Any]
    notices: list[Notice]
    unknown: list[str]
    refused: list[str]
    wrong: dict[str, str]


def read_keys(
    cls: type, values: dict[str, Any], source: str = "<dict>", lines: dict[str, int] | None = None
) -> ConfigKeys:
    """Sort a config's keys as ``load_config`` does: fields (converted), announced ERNIEKit keys, refused
    model-parallel degrees, keys of the wrong type and unknown keys (with the closest valid key)."""
    return _read_keys(cls, values, source, lines or {}, {})


def _load(cls: type, path: str | Path | None, overrides: list[str], tolerated: dict[str, str]) -> Any:
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    source = "<overrides>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.exists():
            raise FileNotFoundError(f"{p}: config file does not exist")
        values, lines = _read_yaml(p)
    fields = _fields(cls)
    unknown: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. max_steps=100)")
        key, raw = item.split("=", 1)
        key = key.strip()
        target = _alias(cls, key)
        if target not in fields and key not in tolerated and key not in ERNIEKIT_NOTICES:
            unknown.append(f"override {item!r}: unknown key {key!r}{_suggest(key, fields)}")
            continue
        values.pop(key, None)  # an override goes after the file's keys, so it wins over an alias there too
        values[key] = _parse_override(raw.strip(), fields.get(target))
        lines[key] = -1
    return _build(cls, values, source, lines, tolerated, unknown)


def _alias(cls: type, key: str) -> str:
    """The field an ERNIEKit name stands for (``apply_hadamard`` -> ``fp8_hadamard``), else the key."""
    target = ERNIEKIT_ALIASES.get(key, key)
    return target if target in _fields(cls) else key


def _build(
    cls: type,
    values: dict[str, Any],
    source: str,
    lines: dict[str, int],
    tolerated: dict[str, str],
    unknown: list[str] | None = None,
) -> Any:
    """Check every key and value, and report all unknown keys at once (each with its line and the closest
    valid key), so a config from another tool is fixed in one pass. Keys without effect become notices."""
    keys = _read_keys(cls, values, source, lines, tolerated)
    unknown = keys.unknown + list(unknown or [])  # the file's keys in file order, then the overrides
    if unknown:
        head = f"{len(unknown)} unknown keys:\n" if len(unknown) > 1 else ""
        raise ConfigError(head + "\n".join(unknown), unknown)
    wrong = list(keys.wrong.values())
    if keys.refused or wrong:
        raise ConfigError("\n".join(keys.refused + wrong), keys.refused + wrong)
    config = cls(**keys.values)
    problems = config.validate()
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems), problems)
    # Not a field: it is what the file said beyond the schema, so asdict() (train_config.json, the studio's
    # comparisons) stays the effective config itself.
    config.notices = keys.notices
    return config


def _read_keys(
    cls: type, values: dict[str, Any], source: str, lines: dict[str, int], tolerated: dict[str, str]
) -> ConfigKeys:
    fields = _fields(cls)
    kwargs = {}
    notices: list[Notice] = []
    found: list[str] = []
    refused: list[str] = []
    wrong: dict[str, str] = {}
    for key, value in values.items():
        where = f"{source}:{lines[key]}" if lines.get(key, -1) > 0 else source
        target = _alias(cls, key)
        if target == "stage" and value in STAGE_ALIASES:
            notices.append(
                Notice(key, f"{value} is ERNIEKit's earlier name of {STAGE_ALIASES[value]}; trained as that")
            )
            value = STAGE_ALIASES[value]
        if target in fields:
            try:
                kwargs[target] = _coerce(value, fields[target], key, where)
            except ConfigError as e:
                wrong[key] = str(e)
        elif cls is TrainConfig and key in REFUSED_DEGREES and _degree(value) > 1:
            refused.append(
                f"{where}: {key}: {value} asks for {REFUSED_DEGREES[key]} parallelism, which this engine "
                "does not do; set it to 1 (or leave it out) and train data-parallel on N devices (the "
                "studio's num_devices, or paddle.distributed.launch --nproc_per_node N)"
            )
        elif key in tolerated or key in ERNIEKIT_NOTICES:
            notices.append(Notice(key, tolerated.get(key) or ERNIEKIT_NOTICES[key]))
        else:
            found.append(f"{where}: unknown key {key!r}{_suggest(key, fields)}")
    return ConfigKeys(kwargs, notices, found, refused, wrong)


def _degree(value: Any) -> int:
    """A parallel degree as ERNIEKit writes it (an int, "2", or -1 for "all")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    return _parse_yaml(path.read_text(encoding="utf-8"), str(path))


def _parse_yaml(text: str, path: str) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {getattr(e, 'problem', e)}") from e
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of key: value lines, not {type(data).__name__}")
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            lines[str(k.value)] = k.start_mark.line + 1
    return {str(k): v for k, v in data.items()}, lines


@functools.cache
def _fields(cls: type) -> Mapping[str, Any]:
    # Cached: resolving the string annotations is ~3 ms, and a config checks every key it is given against
    # them (a run config of 60 keys took 0.2 s to build; the Train form builds one per change).
    hints = typing.get_type_hints(cls)
    return types.MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(cls)})


def _suggest(key: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _split_words(s: str) -> list[str]:
    """ERNIEKit's space-separated option words (``sharding: "stage2 offload"``), lower-cased."""
    return [w.lower() for w in re.split(r"[\s,]+", s.strip()) if w]


def comma_list(s: str) -> list[str]:
    """ERNIEKit's comma-separated list (``train_dataset_path: a.jsonl,b.jsonl``), items stripped."""
    return [p.strip() for p in s.split(",") if p.strip()]


_split = comma_list


def weights_draws(probabilities: str) -> bool:
    """Whether a ``*_dataset_prob`` value (ERNIEKit's comma- or space-separated list) gives any probability
    other than 1; a value that is not numbers gives none (the data loaders name it)."""
    try:
        return any(float(p) != 1.0 for p in _split_words(probabilities))
    except ValueError:
        return False


def _base_types(tp: Any) -> tuple[type, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(t for t in typing.get_args(tp) if t is not type(None))
    return (tp,)


def _parse_override(raw: str, tp: Any) -> Any:
    """Command-line strings become the field's type; YAML syntax handles lists, numbers and nulls."""
    if raw.lower() in ("none", "null"):
        return None
    if tp is None:
        return raw
    base = _base_types(tp)
    if str in base:
        return raw
    if any(typing.get_origin(t) is list for t in base):
        return _split(raw)
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    base = _base_types(tp)
    if value is None:
        if type(None) in typing.get_args(tp):
            return None
        raise ConfigError(f"{where}: {key} may not be empty")
    for t in base:
        converter = _list_value if typing.get_origin(t) is list else _CONVERTERS.get(t)
        converted = converter(value) if converter else _NO_VALUE
        if converted is not _NO_VALUE:
            return converted
    names = " or ".join(getattr(t, "__name__", str(t)) for t in base)
    raise ConfigError(f"{where}: {key} must be {names}, got {value!r}")


_NO_VALUE = object()  # a converter's answer for "not of my type"


def _list_value(value: Any) -> Any:
    if isinstance(value, str):
        return _split(value)
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return _NO_VALUE


def _bool_value(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return _NO_VALUE


def _int_value(value: Any) -> Any:
    if isinstance(value, bool):
        return _NO_VALUE
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return _parsed(value, int)


def _float_value(value: Any) -> Any:
    if isinstance(value, bool):
        return _NO_VALUE
    if isinstance(value, int | float):
        return float(value)
    return _parsed(value, float)


def _parsed(value: Any, parse: type) -> Any:
    """A number written as text ("3e-4", "100"), or _NO_VALUE."""
    if isinstance(value, str):
        try:
            return parse(value)
        except ValueError:
            pass
    return _NO_VALUE


def _str_value(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    return _NO_VALUE


_CONVERTERS = {bool: _bool_value, int: _int_value, float: _float_value, str: _str_value}


def _choice(problems: list[str], name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(
            f"{name} must be one of {', '.join(a or repr(a) for a in allowed)}, not {value!r}{hint}"
        )


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def keys_table(cls: type) -> str:
    """The config's keys as a Markdown table (key, default, allowed values, meaning) for the docs.

    docs/training.md carries this table for TrainConfig and ExportConfig; a test keeps it equal to the
    schema (`tools/make_config_docs.py` rewrites them).
    """
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        meta = f.metadata
        allowed = ", ".join(c or "''" for c in meta["choices"]) if meta.get("choices") else _range(meta)
        rows.append(f"| `{f.name}` | {_declared_default(f)} | {allowed} | {meta.get('help', '')} |")
    return "\n".join(rows)


def _declared_default(f: dataclasses.Field) -> str:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if default is None and any(f.name in values for values in STAGE_DEFAULTS.values()):
        return "per stage (below)"
    if default is None:
        return "from the model's config.json"
    if isinstance(default, list):
        default = ",".join(default)
    return f"`{default}`" if default != "" else "(empty)"


def erniekit_keys_table() -> str:
    """ERNIEKit's other names for fields and the keys a run announces instead of using, for the docs."""
    rows = ["| ERNIEKit key | here |", "|---|---|"]
    rows += [f"| `{k}` | the same as `{v}` |" for k, v in ERNIEKIT_ALIASES.items()]
    notices = {**ERNIEKIT_NOTICES, **EXPORT_NOTICES}
    rows += [f"| `{k}` | announced: {notices[k]} |" for k in sorted(notices, key=str.lower)]
    return "\n".join(rows)


def stage_defaults_table() -> str:
    """STAGE_DEFAULTS as a Markdown table for the docs."""
    keys = sorted({k for values in STAGE_DEFAULTS.values() for k in values})
    rows = ["| stage | fine_tuning | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for (stage, ft), values in STAGE_DEFAULTS.items():
        rows.append(f"| {stage} | {ft} | " + " | ".join(f"`{values[k]}`" for k in keys) + " |")
    return "\n".join(rows)


def _range(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f">= {_number(lo)}"
    return f"{_number(lo)} .. {_number(hi)}" if lo is not None else f"<= {_number(hi)}"
