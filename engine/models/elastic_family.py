"""Elastic MoE members as numbers: which sub-models a model's family holds and why one is impossible.

Free of Paddle, so the studio checks a form's elastic lists against a model's config.json before a run is
queued; ``engine.models.elastic`` runs and cuts out the members.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.models.config import ELASTIC_DEPTH_PATTERNS, ErnieConfig

DEPTH_PATTERNS = ELASTIC_DEPTH_PATTERNS


class ElasticError(ValueError):
    """An impossible member for this model; the message names the key to change."""


@dataclass(frozen=True)
class SubModel:
    """One member: ``depth`` layers, ``experts`` routed experts per MoE layer, ``k`` experts per token."""

    depth: int
    experts: int
    k: int
    pattern: str = "contiguous"

    @property
    def name(self) -> str:
        return f"d{self.depth}-e{self.experts}-k{self.k}"

    @classmethod
    def parse(cls, name: str, pattern: str = "contiguous") -> SubModel:
        """``d2-e4-k1`` -> SubModel(2, 4, 1); ValueError naming the expected form otherwise."""
        m = re.fullmatch(r"d(\d+)-e(\d+)-k(\d+)", name.strip())
        if m is None:
            raise ValueError(f"{name!r} is not a member name like d2-e4-k1 (depth, experts, top-k)")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), pattern)

    @classmethod
    def full(cls, config: ErnieConfig, pattern: str = "contiguous") -> SubModel:
        return cls(config.num_hidden_layers, min(config.expert_counts), config.moe_k, pattern)

    def is_full(self, config: ErnieConfig) -> bool:
        return (self.depth, self.experts, self.k) == (
            config.num_hidden_layers,
            min(config.expert_counts),
            config.moe_k,
        )


def kept_layers(num_layers: int, depth: int, pattern: str = "contiguous") -> list[int]:
    """The decoder layers a member of ``depth`` layers keeps; the first and the last always stay.

    ``contiguous`` drops one block of layers just before the last (the deepest middle layers);
    ``strided`` keeps layers spread evenly over the stack (dropping every other one, or so). Only
    ``contiguous`` is nested in depth: a shallower member's layers are a subset of every deeper one's.
    """
    if pattern not in DEPTH_PATTERNS:
        raise ElasticError(
            f"elastic_depth_pattern must be one of {', '.join(DEPTH_PATTERNS)}, not {pattern!r}"
        )
    if depth >= num_layers:
        return list(range(num_layers))
    if pattern == "contiguous":
        return [*range(depth - 1), num_layers - 1]
    picks = np.linspace(0, num_layers - 1, depth)
    return sorted({int(v) for v in np.rint(picks)})


# The keys that name a member's numbers: export's (one member); training names its lists *_choices.
EXPORT_KEYS = {
    "depth": "elastic_depth",
    "experts": "elastic_experts",
    "topk": "elastic_topk",
    "pattern": "elastic_depth_pattern",
}


def member_problems(config: ErnieConfig, member: SubModel, keys: dict[str, str] | None = None) -> list[str]:
    """Why ``member`` is not a sub-model of a model with ``config`` (empty: it is). Messages name the keys."""
    keys = keys or EXPORT_KEYS
    if not config.is_moe:
        return [
            "elastic_*: elastic sub-models need an MoE model; this model is dense (no moe_num_experts / moe_k)"
        ]
    if config.is_vl:
        return [
            "elastic_*: elastic sub-models of multimodal (VL) models are not supported; use a text MoE model"
        ]
    problems = []
    n, e, k = config.num_hidden_layers, min(config.expert_counts), config.moe_k
    if not 2 <= member.depth <= n:
        problems.append(
            f"{keys['depth']} {member.depth}: a member keeps the first and the last layer, so its depth is "
            f"between 2 and the model's {n} layers"
        )
    if not 1 <= member.experts <= e:
        problems.append(
            f"{keys['experts']} {member.experts}: a member keeps between 1 and the model's {e} routed experts "
            "per MoE layer (zero experts would leave the MoE layers without experts)"
        )
    if not 1 <= member.k <= k:
        problems.append(f"{keys['topk']} {member.k}: k' must be between 1 and the model's moe_k ({k})")
    elif member.k > member.experts >= 1:
        problems.append(
            f"{keys['topk']} {member.k} exceeds {keys['experts']} {member.experts}: a token cannot use more "
            "experts than the member keeps"
        )
    if member.pattern not in DEPTH_PATTERNS:
        problems.append(
            f"{keys['pattern']} must be one of {', '.join(DEPTH_PATTERNS)}, not {member.pattern!r}"
        )
    elif 2 <= member.depth <= n:
        layers = kept_layers(n, member.depth, member.pattern)
        if not any(config.is_moe_layer(i) for i in layers):
            problems.append(f"{keys['depth']} {member.depth}: the kept layers {layers} hold no MoE layer")
    return problems


def check_member(config: ErnieConfig, member: SubModel, keys: dict[str, str] | None = None) -> None:
    problems = member_problems(config, member, keys)
    if problems:
        raise ElasticError("; ".join(problems))


def family(
    config: ErnieConfig, depths: list[int], experts: list[int], topks: list[int], pattern: str
) -> list[SubModel]:
    """Every member the elastic lists allow (k' <= experts), the full model first, then largest to smallest."""
    full = SubModel.full(config, pattern)
    members = {full}
    for d in depths or [full.depth]:
        for e in experts or [full.experts]:
            for k in topks or [min(full.k, e)]:
                if k <= e:
                    members.add(SubModel(d, e, k, pattern))
    rest = sorted(members - {full}, key=lambda m: (-m.depth, -m.experts, -m.k))
    return [full, *rest]


# An elastic run's family at the end of the run (``ElasticTraining.summary``), in its output_dir.
ELASTIC_FAMILY_FILE = "elastic_family.json"


def read_family(output_dir: str | Path) -> dict[str, Any] | None:
    """The family an elastic run wrote (None for a run without one, or one still training)."""
    path = Path(output_dir) / ELASTIC_FAMILY_FILE
    return json.loads(path.read_text()) if path.exists() else None


def member_export_keys(name: str) -> dict[str, int]:
    """``ernie-studio export``'s keys for the member ``d<depth>-e<experts>-k<topk>``."""
    m = SubModel.parse(name)
    return {"elastic_depth": m.depth, "elastic_experts": m.experts, "elastic_topk": m.k}
