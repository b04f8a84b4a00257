"""How a config key is declared and read back: the choices and bounds keys take, the Train form's groups,
when a key has an effect (``Applies``), ``option()`` that declares a field with these facts, and the readers
every config class shares (``field_info``, ``config_default``, ``check_fields``, ``field_types``).

Also ERNIEKit's list syntax (``comma_list``, ``split_words``) and ``ConfigError``, which the config checks and
loaders raise.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES, ErnieConfig
from engine.train.stages import ELASTIC_STAGES, stage_names

# The stages, their aliases and their per-stage defaults (STAGES, STAGE_ALIASES, STAGE_DEFAULTS) are
# engine.train.stages' registry; the schema and its readers import them from there.
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


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says where and what to do. ``problems``
    holds each problem on its own (without the file name), for front ends that show them by key."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def field_info(cls: type, name: str) -> dict[str, Any]:
    """Help text, choices and bounds of one config key (``{"help", "choices", "minimum", "maximum"}``)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return dict(f.metadata)
    raise KeyError(f"{cls.__name__} has no key {name!r}")


def config_default(cls: type, name: str) -> Any:
    """The default of one config key (a list key's factory value)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default_factory() if f.default is dataclasses.MISSING else f.default
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
                choice(problems, f.name, item, meta["choices"])
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{f.name} must be a finite number, got {value}")
            continue
        lo, hi = meta.get("minimum"), meta.get("maximum")
        if lo is not None and value < lo:
            problems.append(f"{f.name} must be >= {number(lo)}, got {value}")
        if hi is not None and value > hi:
            problems.append(f"{f.name} must be <= {number(hi)}, got {value}")
    return problems


def number(x: float) -> str:
    """A bound as messages and the docs write it (``5``, not ``5.0``; ``3e-05``)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def choice(problems: list[str], name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Append a problem to ``problems`` when ``value`` of key ``name`` is not one of ``allowed``."""
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(
            f"{name} must be one of {', '.join(a or repr(a) for a in allowed)}, not {value!r}{hint}"
        )


@functools.cache
def field_types(cls: type) -> Mapping[str, Any]:
    # Cached: resolving the string annotations is ~3 ms, and a config checks every key it is given against
    # them (a run config of 60 keys took 0.2 s to build; the Train form builds one per change).
    hints = typing.get_type_hints(cls)
    return types.MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(cls)})


def split_words(s: str) -> list[str]:
    """ERNIEKit's space-separated option words (``sharding: "stage2 offload"``), lower-cased."""
    return [w.lower() for w in re.split(r"[\s,]+", s.strip()) if w]


def comma_list(s: str) -> list[str]:
    """ERNIEKit's comma-separated list (``train_dataset_path: a.jsonl,b.jsonl``), items stripped."""
    return [p.strip() for p in s.split(",") if p.strip()]


def weights_draws(probabilities: str) -> bool:
    """Whether a ``*_dataset_prob`` value (ERNIEKit's comma- or space-separated list) gives any probability
    other than 1; a value that is not numbers gives none (the data loaders name it)."""
    try:
        return any(float(p) != 1.0 for p in split_words(probabilities))
    except ValueError:
        return False
