"""``ernie-studio export``'s config (``ExportConfig``: LoRA merge, layout, dtype, sharding, PTQ, GGUF) and the
keys a person chooses about an export (``EXPORT_CHOICES``); read like a training config (``config_load``).
"""

from __future__ import annotations

import logging
import re
import typing
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import ELASTIC_DEPTH_PATTERNS, parse_size
from engine.train.erniekit_keys import Notice
from engine.train.options import (
    EXPORT_DTYPES,
    EXPORT_FORMATS,
    GGUF_TYPES,
    GPAS_EXPORT,
    LAYOUTS,
    PTQ_METHODS,
    check_fields,
    config_default,
    option,
)
from engine.train.stages import DEFAULT_STAGE, STAGES

log = logging.getLogger(__name__)


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
