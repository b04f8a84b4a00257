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
import time
from collections.abc import Iterator

import numpy as np
import paddle

from engine.models.config import ErnieConfig
from engine.models.elastic_family import (  # noqa: F401 (re-exported)
    DEPTH_PATTERNS,
    EXPORT_KEYS,
    ElasticError,
    SubModel,
    check_member,
    family,
    kept_layers,
    member_problems,
)
from engine.models.ernie import ErnieForCausalLM
from engine.models.moe import MoELayer


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
