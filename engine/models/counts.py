"""Weights of an ERNIE 4.5 model counted from its config alone (no Paddle, nothing built): by where they
sit, what a token uses, and the LoRA adapters of given targets. The one count the estimate, the studio's
model list and an elastic family's members read; tests hold it equal to the built model's weights."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.models.config import ErnieConfig, vision_parameter_count


@dataclass(frozen=True)
class ParameterCounts:
    """Weights of a model by where they sit (what precision, quantization and LoRA treat differently)."""

    total: int
    active: int  # per text token: k of E routed experts per group used + shared experts
    embedding: int
    head: int  # an untied head's weights (0 when tied to the embedding)
    decoder_linears: int  # qkv, o, FFN, shared and routed experts: what bf16 / int8 bases hold
    expert_linears: int  # routed experts alone (int4 under wint4/8)
    vision: int  # ViT + resampler
    other: int  # norms and router gates (always fp32)
    lora: int  # adapter weights for the given rank and targets
    matmul_per_token: int  # weights a text token multiplies with (head included, embedding lookup not)
    expert_lora: int = 0  # the adapters on routed experts (split with them under expert parallelism)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _linear_shapes(config: ErnieConfig, layers: range) -> list[tuple[str, int, int, int]]:
    """(LoRA target, in, out, copies) of every linear of decoder ``layers``; expert linears say
    'expert:<target>'."""
    h, hd = config.hidden_size, config.head_dim
    nh, kv = config.num_attention_heads, config.num_key_value_heads
    out: list[tuple[str, int, int, int]] = []
    for i in layers:
        out += [("qkv_proj", h, (nh + 2 * kv) * hd, 1), ("o_proj", nh * hd, h, 1)]
        if not config.is_moe_layer(i):
            inter = config.intermediate_size
            out += [("up_gate_proj", h, 2 * inter, 1), ("down_proj", inter, h, 1)]
            continue
        sizes = config.expert_intermediate_sizes
        if config.moe_num_shared_experts:
            shared = sizes[0] * config.moe_num_shared_experts
            out += [("up_gate_proj", h, 2 * shared, 1), ("down_proj", shared, h, 1)]
        for n, inter in zip(config.expert_counts, sizes, strict=True):
            out += [("expert:up_gate_proj", h, 2 * inter, n), ("expert:down_proj", inter, h, n)]
    return out


def _vision_linears(config: ErnieConfig) -> dict[str, list[tuple[int, int, int]]]:
    """(in, out, copies) of the linears the VL LoRA groups 'vision' and 'resampler' adapt."""
    v = config.vision_config
    if v is None:
        return {"vision": [], "resampler": []}
    d, inner = v.hidden_size, v.intermediate_size
    s = d * v.spatial_merge_size**2
    vision = [(d, 3 * d, v.depth), (d, d, v.depth), (d, inner, v.depth), (inner, d, v.depth)]
    resampler = [
        (s, s, 1),
        (s, s, 1),
        (v.temporal_merge_size * s, s, 1),
        (s, s, 1),
        (s, config.hidden_size, 1),
    ]
    return {"vision": vision, "resampler": resampler}


def count_parameters(
    config: ErnieConfig,
    lora_rank: int = 8,
    lora_targets: list[str] | tuple[str, ...] = (),
    layers: range | None = None,
) -> ParameterCounts:
    """Total and active weights of ``config`` by part, and the LoRA adapters of ``lora_targets``.

    ``layers`` counts one pipeline stage: those decoder layers, with the embedding (and the vision tower)
    when it starts at layer 0 and the final norm and head when it ends at the last layer. A tied head is
    the embedding, which a last stage that is not also the first holds a copy of (fleet's shared layer)."""
    h = config.hidden_size
    n_layers = config.num_hidden_layers
    layers = range(n_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == n_layers
    embedding = config.vocab_size * h if first else 0
    tied_copy = config.tie_word_embeddings and not first
    head = config.vocab_size * h if last and (not config.tie_word_embeddings or tied_copy) else 0
    linears = _linear_shapes(config, layers)
    decoder = sum(i * o * n for _, i, o, n in linears)
    experts = sum(i * o * n for t, i, o, n in linears if t.startswith("expert:"))
    moe_layers = sum(config.is_moe_layer(i) for i in layers)
    routers = moe_layers * h * sum(config.expert_counts) if config.is_moe else 0
    norms = h * (2 * len(layers) + (1 if last else 0))
    vision_count = vision_parameter_count(config.vision_config, h) if config.vision_config is not None else 0
    vision = vision_count if first else 0
    total = embedding + head + decoder + routers + norms + vision
    # a text token runs k experts of the text group (the first); the vision group serves image tokens
    unused = 0
    if config.is_moe:
        n_text, inter_text = config.expert_counts[0], config.expert_intermediate_sizes[0]
        per_expert = 3 * h * inter_text
        unused = moe_layers * per_expert * (n_text - min(config.moe_k, n_text))
        for n, inter in zip(config.expert_counts[1:], config.expert_intermediate_sizes[1:], strict=True):
            unused += moe_layers * 3 * h * inter * n
    active = total - unused - vision
    matmul = decoder - unused + routers + (config.vocab_size * h if last else 0)
    targets = set(lora_targets)
    adapters = sum(lora_rank * (i + o) * n for t, i, o, n in linears if t.removeprefix("expert:") in targets)
    expert_adapters = sum(
        lora_rank * (i + o) * n
        for t, i, o, n in linears
        if t.startswith("expert:") and t.removeprefix("expert:") in targets
    )
    for group, shapes in _vision_linears(config).items():
        if group in targets and first:
            adapters += sum(lora_rank * (i + o) * n for i, o, n in shapes)
    return ParameterCounts(
        total=total,
        active=active,
        embedding=embedding,
        head=head,
        decoder_linears=decoder,
        expert_linears=experts,
        vision=vision,
        other=routers + norms,
        lora=adapters,
        matmul_per_token=matmul,
        expert_lora=expert_adapters,
    )
