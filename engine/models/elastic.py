"""Elastic MoE sub-models: run a smaller member of the model's family, or cut it out as a model of its own.

A member is named by three numbers (ERNIE 5.0's elastic dimensions): its depth (decoder layers kept; the
first and the last always stay), its routed experts per MoE layer and its top-k. The kept experts are the
first ``experts`` of each MoE layer and the kept layers follow a fixed pattern, so the members are nested
(every smaller member's weights are part of every larger one) and a member named by its numbers is the same
sub-network in training, evaluation and extraction.

``use_submodel(model, member)`` makes the full model compute the member (the masked full model);
``extract_submodel(model, member)`` returns a real smaller ``ErnieForCausalLM`` with only the member's
weights, whose logits equal the masked full model's (``tests/engine/test_elastic.py``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import paddle

from engine.models.config import ELASTIC_DEPTH_PATTERNS, ErnieConfig
from engine.models.ernie import ErnieForCausalLM
from engine.models.moe import MoELayer

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


def set_submodel(model: ErnieForCausalLM, member: SubModel | None) -> None:
    """Make ``model`` compute ``member`` from now on (None: the full model again)."""
    config = model.config
    full = member is None or member.is_full(config)
    layers = None if full else frozenset(kept_layers(config.num_hidden_layers, member.depth, member.pattern))
    model.ernie.active_layers = layers
    for m in model.sublayers():
        if isinstance(m, MoELayer):
            m.active_experts = None if full else member.experts
            m.active_k = None if full else member.k


@contextlib.contextmanager
def use_submodel(model: ErnieForCausalLM, member: SubModel | None) -> Iterator[ErnieForCausalLM]:
    """``with use_submodel(model, member): model(...)`` runs the member; the full model afterwards."""
    if member is not None:
        check_member(model.config, member)
    set_submodel(model, member)
    try:
        yield model
    finally:
        set_submodel(model, None)


def submodel_config(config: ErnieConfig, member: SubModel) -> ErnieConfig:
    """The config.json of the extracted member: fewer layers (MoE rule kept), experts, moe_k."""
    layers = kept_layers(config.num_hidden_layers, member.depth, member.pattern)
    types = ["sparse" if config.is_moe_layer(i) else "dense" for i in layers]
    small = config.replace(
        num_hidden_layers=len(layers),
        moe_num_experts=member.experts,
        moe_k=member.k,
        mlp_layer_types=types,
    )
    rule = small.moe_layer_rule()
    if rule is not None:  # the start / end / interval keys Baidu's loaders read, instead of the list
        small = small.replace(mlp_layer_types=None, **rule)
    return small


def extract_submodel(model: ErnieForCausalLM, member: SubModel) -> ErnieForCausalLM:
    """A new model holding only ``member``'s weights (layers renumbered, experts and router columns cut)."""
    check_member(model.config, member)
    config = model.config
    layers = kept_layers(config.num_hidden_layers, member.depth, member.pattern)
    small = ErnieForCausalLM(submodel_config(config, member))
    source = model.state_dict()
    for name, p in small.state_dict().items():
        p.set_value(_source_tensor(source, name, layers, member.experts).astype(p.dtype))
    small.eval()
    return small


def _source_tensor(source: dict, name: str, layers: list[int], experts: int) -> paddle.Tensor:
    """The full model's tensor behind the member's ``name`` (layer index mapped, expert dims cut)."""
    parts = name.split(".")
    if name.startswith("ernie.layers."):
        parts[2] = str(layers[int(parts[2])])
    full = ".".join(parts)
    t = source[full]
    if full.endswith("mlp.gate.weight"):
        return t[:, :experts]
    if full.endswith("moe_statics.e_score_correction_bias"):
        return t[:, :experts]
    return t


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


@paddle.no_grad()
def decode_tokens_per_second(
    model: ErnieForCausalLM, member: SubModel | None, prompt: int = 16, tokens: int = 32
) -> float:
    """Greedy decoding speed of ``member`` (the masked full model, KV cache, batch 1), tokens per second."""
    was_training = model.training
    model.eval()
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(3, model.config.vocab_size, (1, prompt)), dtype="int64")
    try:
        with use_submodel(model, member):
            out = model(ids, use_cache=True, logits_to_keep=1)
            warmup, start = 2, 0.0  # the first steps pay for one-off setup, not for the member's size
            for i in range(warmup + tokens):
                if i == warmup:
                    float(out.logits[0, -1, 0])  # wait for the device
                    start = time.perf_counter()
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(nxt, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            float(out.logits[0, -1, 0])
            return tokens / (time.perf_counter() - start)
    finally:
        model.train(was_training)


def active_parameters(config: ErnieConfig, member: SubModel) -> tuple[int, int]:
    """(total, active per token) weights of ``member``, from its config alone."""
    from engine.models.counts import count_parameters

    counts = count_parameters(submodel_config(config, member))
    return counts.total, counts.active + counts.vision
