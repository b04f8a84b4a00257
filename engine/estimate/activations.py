"""Activations kept for backward under recompute (as the trainer sets it, or as ERNIEKit runs it), and the
logits."""

from __future__ import annotations

from engine.estimate.calibration import ACTIVATION_SLACK, LOGIT_COPIES
from engine.models.config import ErnieConfig
from engine.train.config import TrainConfig


def recompute_plan(
    cfg: TrainConfig, expert_parallel: int, replay_exchange: bool = False
) -> tuple[str | None, str | None]:
    """(granularity or None, what of the MoE blocks is recomputed) as the trainer sets them
    (engine/train/trainer.py ``set_recompute``, engine/models/ernie.py ``DecoderLayer.forward``): with
    ``use_recompute_moe`` the whole ``block``, or only its ``experts`` when expert parallelism splits them
    (the exchange is never replayed); None keeps every MoE activation.

    ``replay_exchange`` (``Layout.replays_exchange``: the planner's what-ifs, tensor parallelism among them)
    rebuilds the MoE blocks whole as ERNIEKit does, which this engine does not: ERNIEKit recomputes each
    decoder layer whole, its MoE block and the block's exchange included (PaddlePaddle/ERNIE
    ernie/modeling_moe.py: ``Ernie4_5_Model.recompute_training`` wraps the layer in fleet's ``recompute``),
    and under tensor parallelism the mp layers' sequence-parallel gathers are replayed in every rebuild
    anyway."""
    if not cfg.recompute:
        return None, None
    granularity = getattr(cfg, "recompute_granularity", "full")
    if not getattr(cfg, "use_recompute_moe", True):
        return granularity, None
    return granularity, "block" if expert_parallel <= 1 or replay_exchange else "experts"


def _activation_bytes(
    model: ErnieConfig,
    recompute: str | None,
    rows: int,
    row_len: float,
    gpu: bool,
    mode: str,
    tp: int = 1,
    moe_recompute: str | None = None,
    layers: range | None = None,
    in_flight: int = 1,
) -> dict[str, float]:
    """Activations kept for backward, with and without recompute, and the logits. Eager fp32 on a CPU (its
    attention keeps the score matrices); 16-bit with flash attention (no scores) on a GPU in bf16 / fp16 or
    under a weight-only base. ``recompute`` is the granularity (engine/models/ernie.py
    ``DecoderLayer.forward``): ``full`` recomputes the attention and dense FFN blocks and keeps each one's
    input, ``full_attn`` the attention blocks only, ``core_attn`` only the scores inside attention.
    MoE blocks (``moe_recompute``): ``block`` keeps their input only, ``experts`` (expert parallelism)
    keeps all but the routed and shared experts' FFN activations, None keeps everything.
    Tensor parallelism (sequence parallel) splits them over its group. A pipeline stage (``layers``) keeps
    what its layers keep for each of its ``in_flight`` micro-batches, rebuilds one layer at a time, and holds
    the logits only when it is the last stage (which runs each micro-batch's backward right after its
    forward)."""
    h, hd = model.hidden_size, model.head_dim
    nh, kv = model.num_attention_heads, model.num_key_value_heads
    elem = 2 if gpu and mode not in ("fp32", "fp8-qat") else 4
    tokens = rows * row_len
    # norms (in and out), qkv, rotary (q and k, rotated and their halves), scaled q, attention out and its
    # transpose, o_proj, residual
    attention = 4 * h + (nh + 2 * kv) * hd + (4 * nh + 2 * kv) * hd
    scores = 0.0 if gpu else 2 * nh * rows * row_len * row_len / 2  # scores and probabilities, causal half
    slack = elem * ACTIVATION_SLACK
    kept = 0.0
    largest = 0.0  # what is rebuilt at once in backward (a whole layer: the estimate stays on the safe side)
    moe = 0.0  # what the MoE blocks keep when they are not recomputed
    ffn_layers = _ffn_per_layer(model)
    last = layers is None or layers.stop == len(ffn_layers)
    for is_moe, ffn in ffn_layers if layers is None else ffn_layers[layers.start : layers.stop]:
        attn_all, ffn_all = slack * (attention * tokens + scores), slack * ffn * tokens
        if recompute is None:
            kept += attn_all + ffn_all
            continue
        if recompute == "core_attn":
            kept += attn_all - slack * scores
            largest = max(largest, slack * scores)
        else:
            kept += elem * h * tokens
            largest = max(largest, attn_all + ffn_all)
        if is_moe and moe_recompute == "experts":
            experts = 3 * model.expert_intermediate_sizes[0] * (model.moe_k + model.moe_num_shared_experts)
            kept += slack * (ffn - experts) * tokens
            moe += slack * (ffn - experts) * tokens
        elif is_moe and moe_recompute is None:
            kept += ffn_all
            moe += ffn_all
        elif is_moe or recompute == "full":
            kept += elem * h * tokens
        else:
            kept += ffn_all
    kept, moe = kept * in_flight, moe * in_flight
    kept += largest  # one block's activations live at a time while it is recomputed
    logits = 4 * LOGIT_COPIES * tokens * model.vocab_size if last else 0.0
    return {"layers": kept / tp, "logits": logits / tp, "total": (kept + logits) / tp, "moe_kept": moe / tp}


_FFN_LAYERS: dict[int, tuple[ErnieConfig, list[tuple[bool, int]]]] = {}


def _ffn_per_layer(model: ErnieConfig) -> list[tuple[bool, int]]:
    """(MoE or not, floats kept per token) of each layer's FFN block; remembered per config object (the
    planner weighs hundreds of settings of one model)."""
    hit = _FFN_LAYERS.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    h, out = model.hidden_size, []
    for i in range(model.num_hidden_layers):
        if model.is_moe_layer(i):
            inter, k = model.expert_intermediate_sizes[0], model.moe_k
            # each token's k expert inputs and outputs (dispatch and combine) beside the FFN activations
            out.append((True, 4 * h + 3 * inter * (k + model.moe_num_shared_experts) + 2 * k * h))
        else:
            out.append((False, 4 * h + 3 * model.intermediate_size))
    if len(_FFN_LAYERS) > 16:
        _FFN_LAYERS.clear()
    _FFN_LAYERS[id(model)] = (model, out)
    return out
