"""Checks of a training config that need more than its values: the run's devices (sharding), its ranks and
the model's experts (expert parallelism), the model's shape (the elastic lists). And what front ends ask of
the schema per key: the key a problem names, why a key has no effect on a run, a stage's starting values.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from engine.models.config import ErnieConfig
from engine.train.config import TrainConfig
from engine.train.erniekit_keys import ERNIEKIT_ALIASES
from engine.train.options import (
    MOE_GROUPS_ALL_RANKS,
    SHARDING_STAGES,
    ConfigError,
    field_info,
    field_types,
    split_words,
)
from engine.train.stages import DEFAULT_STAGE


def sharding_device_problems(sharding: Any, degree: Any, devices: int) -> list[str]:
    """What ``sharding`` / ``sharding_parallel_degree`` ask of a run on ``devices`` devices (a value that is
    not a stage name or a number is left to the config's own checks)."""
    words = split_words(str(sharding or ""))
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
    fields = field_types(cls)
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
