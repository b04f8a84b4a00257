"""Training and export configs read from ERNIEKit-style YAML plus ``key=value`` overrides.

Field names are ERNIEKit's, so configs users already have keep working. An unknown key is an error that
names the file (and line) and suggests the closest valid key; values are checked with readable messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

STAGES = ("SFT", "DPO", "PT", "VL-SFT")
FINE_TUNING = ("Full", "LoRA")
COMPUTE_TYPES = ("fp32", "bf16", "fp16", "fp8", "wint8", "wint4/8")
SCHEDULERS = ("cosine", "linear", "constant")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
LAYOUTS = ("paddle", "hf")
PTQ_METHODS = ("", "wint8", "wint4", "fp8")
LORA_TARGETS = ("qkv_proj", "o_proj", "up_gate_proj", "down_proj")

# ERNIEKit keys for GPU parallelism, fused kernels and trainer plumbing that have no meaning for this engine
# on its own; accepted so existing configs load, and logged once.
IGNORED_ERNIEKIT_KEYS = {
    "do_train",
    "do_eval",
    "do_predict",
    "bf16",
    "fp16",
    "fp16_opt_level",
    "amp_master_grad",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "sharding_parallel_degree",
    "sharding",
    "sequence_parallel",
    "pipeline_parallel_config",
    "tensor_parallel_config",
    "sharding_parallel_config",
    "use_flash_attention",
    "use_sparse_head_and_loss_fn",
    "use_attn_mask_startend_row_indices",
    "use_sparse_flash_attn",
    "fuse_rope",
    "fuse_linear",
    "fuse_softmax_mask",
    "unified_checkpoint",
    "unified_checkpoint_config",
    "offload_optim",
    "distributed_dataloader",
    "dataloader_num_workers",
    "num_samples_each_epoch",
    "evaluation_strategy",
    "eval_strategy",
    "save_strategy",
    "save_total_limit",
    "max_evaluate_steps",
    "load_best_model_at_end",
    "greater_is_better",
    "metric_for_best_model",
    "overwrite_output_dir",
    "remove_unused_columns",
    "moe_group",
    "device",
    "from_scratch",
    "use_mem_eff_attn",
    "ignore_save_lr_and_optim",
    "release_grads",
    "gradient_checkpointing",
    "random_shuffle",
    "greedy_intokens",
    "buffer_size",
    "recompute_granularity",
    "no_recompute_layers",
    "disable_ckpt_quant",
    "save_to_aistudio",
    "layerwise_lr_decay_bound",
    "recompute_use_reentrant",
    "amp_custom_white_list",
    "amp_custom_black_list",
    "use_fused_head_and_loss_fn",
    "use_attn_mask_start_row_indices",
    "continue_training",
    "pp_seg_method",
    "ref_model_update_steps",
    "offset_alpha",
    "simpo_gamma",
    "dpop_lambda",
    "freeze_config",
    "modality_ratio",
    "min_pixels",
    "max_pixels",
    "dataset_name_or_path",
}


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says where and what to do."""


@dataclass
class TrainConfig:
    """Everything one training run needs. Keys and defaults follow ERNIEKit's YAML configs."""

    model_name_or_path: str = ""
    stage: str = "SFT"
    fine_tuning: str = "Full"
    output_dir: str = "./output"
    logging_dir: str = ""
    # data
    train_dataset_type: str = ""
    train_dataset_path: str = ""
    train_dataset_prob: str = "1.0"
    eval_dataset_type: str = ""
    eval_dataset_path: str = ""
    eval_dataset_prob: str = "1.0"
    max_seq_len: int = 2048
    max_prompt_len: int = 1024
    packing: bool = False
    mix_strategy: str = "random"
    # batch and optimiser
    batch_size: int = 1
    per_device_train_batch_size: int = 0
    per_device_eval_batch_size: int = 0
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-5
    lr_scheduler_type: str = "cosine"
    min_lr: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_steps: int = -1
    num_train_epochs: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    ema_decay: float = 0.0
    seed: int = 42
    recompute: bool = False
    compute_type: str = "fp32"
    # logging / checkpoints
    logging_steps: int = 1
    save_steps: int = 500
    eval_steps: int = 0
    disable_tqdm: bool = False
    # LoRA
    lora_rank: int = 8
    lora_alpha: float = -1.0
    lora_plus_scale: float = 1.0
    rslora: bool = False
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # DPO
    beta: float = 0.1
    loss_type: str = "sigmoid"
    pref_loss_ratio: float = 1.0
    sft_loss_ratio: float = 0.0
    label_smoothing: float = 0.0
    reference_free: bool = False
    # MoE (None keeps the value in the model's config.json)
    moe_aux_loss_lambda: float | None = None
    moe_z_loss_lambda: float | None = None
    moe_orthogonal_loss_lambda: float | None = None
    moe_use_aux_free: bool | None = None
    moe_correction_bias_rate: float = 1e-3
    # quantization-aware training and weight-only bases
    fp8_hadamard: bool = True
    fp8_hadamard_block_size: int = 32
    fp8_scale_ema_rate: float = 0.01
    weight_quant_group_size: int = -1

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size:
            self.batch_size = self.per_device_train_batch_size
        if not self.logging_dir:
            self.logging_dir = self.output_dir
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = _split(self.lora_target_modules)

    @property
    def lora(self) -> bool:
        return self.fine_tuning == "LoRA" or self.compute_type in ("wint8", "wint4/8")

    @property
    def effective_lora_alpha(self) -> float:
        return 2.0 * self.lora_rank if self.lora_alpha == -1 else self.lora_alpha

    def dataset_spec(self, split: str = "train") -> dict[str, str]:
        """ERNIEKit's three dataset keys for ``engine.data.build_train_data``."""
        return {
            f"{split}_dataset_type": getattr(self, f"{split}_dataset_type"),
            f"{split}_dataset_path": getattr(self, f"{split}_dataset_path"),
            f"{split}_dataset_prob": getattr(self, f"{split}_dataset_prob"),
        }

    def validate(self) -> list[str]:
        problems = []
        _choice(problems, "stage", self.stage, STAGES)
        _choice(problems, "fine_tuning", self.fine_tuning, FINE_TUNING)
        _choice(problems, "compute_type", self.compute_type, COMPUTE_TYPES)
        _choice(problems, "lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        _choice(problems, "loss_type", self.loss_type, DPO_LOSSES)
        for t in self.lora_target_modules:
            _choice(problems, "lora_target_modules", t, LORA_TARGETS)
        if not self.model_name_or_path:
            problems.append(
                "model_name_or_path is required: a model directory (e.g. from `ernie-studio init-model`)"
            )
        if not self.train_dataset_path:
            problems.append("train_dataset_path is required (comma-separated files for mixing)")
        for name in (
            "batch_size",
            "gradient_accumulation_steps",
            "max_seq_len",
            "logging_steps",
            "save_steps",
            "lora_rank",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "min_lr", "weight_decay", "max_grad_norm", "beta", "label_smoothing"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps < 1 and self.num_train_epochs <= 0:
            problems.append("set max_steps >= 1 or num_train_epochs > 0")
        if not 0 <= self.ema_decay < 1:
            problems.append(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.compute_type in ("wint8", "wint4/8") and self.fine_tuning != "LoRA":
            problems.append(
                f"compute_type {self.compute_type} freezes a quantized base, so it needs fine_tuning: LoRA"
            )
        if self.fp8_hadamard_block_size < 1 or self.fp8_hadamard_block_size & (
            self.fp8_hadamard_block_size - 1
        ):
            problems.append(
                f"fp8_hadamard_block_size must be a power of two, got {self.fp8_hadamard_block_size}"
            )
        return problems


@dataclass
class ExportConfig:
    """``ernie-studio export``: LoRA merge, output layout, sharding, tokenizer copy and PTQ."""

    model_name_or_path: str = ""
    # A training run's output_dir: when it holds a trained model, that model is exported (for lora=True
    # it must hold the LoRA run); otherwise model_name_or_path is.
    output_dir: str = ""
    export_dir: str = ""
    lora: bool = False
    layout: str = "paddle"
    max_shard_size: str = "5GB"
    copy_tokenizer: bool = True
    dtype: str = "float32"
    quantization: str = ""
    weight_quant_group_size: int = 64
    # the perplexity report of PTQ uses these
    eval_dataset_type: str = "erniekit"
    eval_dataset_path: str = ""
    eval_dataset_prob: str = "1.0"
    stage: str = "SFT"
    max_seq_len: int = 512
    batch_size: int = 4
    seed: int = 42

    def __post_init__(self) -> None:
        if self.lora and not self.output_dir:
            self.output_dir = "./output"
        if not self.export_dir:
            self.export_dir = str(Path(self.output_dir or "./output") / "export")
        self.layout = self.layout.lower()
        if self.quantization.lower() in ("none", "false"):
            self.quantization = ""

    def validate(self) -> list[str]:
        problems = []
        _choice(problems, "layout", self.layout, LAYOUTS)
        _choice(problems, "quantization", self.quantization, PTQ_METHODS)
        _choice(problems, "dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if not self.lora and not self.model_name_or_path and not self.output_dir:
            problems.append(
                "set output_dir (a training run) or model_name_or_path (a model directory) to export"
            )
        if self.quantization and not self.eval_dataset_path:
            log.info("no eval_dataset_path: PTQ perplexity will not be reported")
        return problems


# ---- loading -------------------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read an ERNIEKit training YAML and apply ``key=value`` overrides (later wins)."""
    return _load(TrainConfig, path, overrides or [], tolerated=set())


def load_export_config(path: str | Path | None, overrides: list[str] | None = None) -> ExportConfig:
    """Read an export YAML; keys of a training config are accepted (and unused) so one file can serve both."""
    tolerated = {f.name for f in dataclasses.fields(TrainConfig)}
    return _load(ExportConfig, path, overrides or [], tolerated=tolerated)


def config_from_dict(cls: type, values: dict[str, Any], source: str = "<dict>") -> Any:
    """Build a config from a plain dict (the studio's run form), with the same checks as a file."""
    return _build(cls, dict(values), source, {}, set())


def _load(cls: type, path: str | Path | None, overrides: list[str], tolerated: set[str]) -> Any:
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
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. max_steps=100)")
        key, raw = item.split("=", 1)
        key = key.strip()
        where = f"override {item!r}"
        if key not in fields and key not in tolerated and key not in IGNORED_ERNIEKIT_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}{_suggest(key, fields)}")
        values[key] = _parse_override(raw.strip(), fields.get(key))
        lines[key] = -1
    return _build(cls, values, source, lines, tolerated)


def _build(cls: type, values: dict[str, Any], source: str, lines: dict[str, int], tolerated: set[str]) -> Any:
    fields = _fields(cls)
    kwargs = {}
    ignored = []
    for key, value in values.items():
        where = f"{source}:{lines[key]}" if lines.get(key, -1) > 0 else source
        if key in fields:
            kwargs[key] = _coerce(value, fields[key], key, where)
        elif key in IGNORED_ERNIEKIT_KEYS or key in tolerated:
            ignored.append(key)
        else:
            raise ConfigError(f"{where}: unknown key {key!r}{_suggest(key, fields)}")
    if ignored:
        log.info("%s: keys not used by this engine: %s", source, ", ".join(sorted(ignored)))
    config = cls(**kwargs)
    problems = config.validate()
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return config


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    text = path.read_text(encoding="utf-8")
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


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _suggest(key: str, fields: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _split(s: str) -> list[str]:
    return [p.strip() for p in s.split(",") if p.strip()]


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
        if typing.get_origin(t) is list:
            if isinstance(value, str):
                return _split(value)
            if isinstance(value, list | tuple):
                return [str(v) for v in value]
        elif t is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                try:
                    return int(value)
                except ValueError:
                    pass
        elif t is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        elif t is str:
            if isinstance(value, list | tuple):
                return ",".join(str(v) for v in value)
            if isinstance(value, str | int | float) and not isinstance(value, bool):
                return str(value)
    names = " or ".join(getattr(t, "__name__", str(t)) for t in base)
    raise ConfigError(f"{where}: {key} must be {names}, got {value!r}")


def _choice(problems: list[str], name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(
            f"{name} must be one of {', '.join(a or repr(a) for a in allowed)}, not {value!r}{hint}"
        )


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
