"""MoE load-balancing bookkeeping that every stage on an MoE model runs: expert loads and aux-free balancing.

After every optimiser step the correction bias of each MoE layer is nudged towards balance from the
expert counts of that step (summed over micro-batches and data-parallel ranks), as in ERNIE 4.5.
"""

from __future__ import annotations

import numpy as np
import paddle

from engine.models.moe import MoELayer, RouterStats, update_correction_bias
from engine.models.positions import moe_token_types


def moe_layers(model) -> list[MoELayer]:
    return [m for m in model.sublayers() if isinstance(m, MoELayer)]


def expert_counts(
    stats: list[RouterStats], groups: list[int], present: list[int], keep: np.ndarray | None = None
) -> list[list[np.ndarray]]:
    """Per MoE layer, per modality group: assignments each expert received in this micro-batch.

    ``present`` lists the modality groups that had tokens (the layer skips empty groups in its stats);
    ``keep`` (flat [B*T] bool) leaves padding out, so it does not sway aux-free balancing.
    """
    out = []
    for s in stats:
        counts = [np.zeros(n, np.int64) for n in groups]
        for group, sel, idx in zip(present, s.selected, s.token_index, strict=True):
            sel = sel.numpy()
            if keep is not None:
                rows = keep if idx is None else keep[idx.numpy()]
                sel = sel[rows]
            counts[group] += np.bincount(sel.reshape(-1), minlength=groups[group])[: groups[group]]
        out.append(counts)
    return out


def real_token_mask(batch: dict, prefix: str = "") -> np.ndarray | None:
    """Flat [B*T] mask of the positions that hold real tokens (None when the batch has no padding info)."""
    if batch.get(prefix + "attention_mask") is not None:
        return np.asarray(batch[prefix + "attention_mask"]).reshape(-1) > 0
    if batch.get(prefix + "segment_ids") is not None:
        return np.asarray(batch[prefix + "segment_ids"]).reshape(-1) >= 0
    return None


def present_groups(batch: dict, config, prefix: str = "") -> list[int]:
    """Modality groups with tokens in this batch, mirroring how the model routes (0 text, 1 image)."""
    if len(config.expert_counts) == 1:
        return [0]
    types = batch.get(prefix + "token_type_ids")
    if types is None:
        if config.vision_config is None:
            return [0]
        types = moe_token_types(np.asarray(batch[prefix + "input_ids"]), config)
    return sorted({int(t) for t in np.unique(np.asarray(types))} & set(range(len(config.expert_counts))))


def add_counts(total: list | None, new: list) -> list:
    if total is None:
        return [[c.copy() for c in layer] for layer in new]
    for t_layer, n_layer in zip(total, new, strict=True):
        for t, n in zip(t_layer, n_layer, strict=True):
            t += n
    return total


def update_correction_biases(
    model,
    counts: list[list[np.ndarray]],
    rate: float,
    layers: list[int] | None = None,
    experts: int | None = None,
) -> None:
    """Aux-free balancing step for every MoE layer (bias is not trained by gradients).

    An elastic sub-model's step (engine.train.elastic) moves only what it routed through: ``layers`` are the
    positions, among the model's MoE layers, that ``counts`` belong to, and only the first ``experts``
    biases of each move (a dropped expert got no tokens because it was absent, not because it is idle)."""
    targets = moe_layers(model)
    if layers is not None:
        targets = [targets[i] for i in layers]
    for layer, layer_counts in zip(targets, counts, strict=True):
        bias = layer.moe_statics.e_score_correction_bias
        value = bias.numpy().copy()
        for g, c in enumerate(layer_counts):
            c = c[:experts] if experts else c
            if c.sum() == 0:
                continue
            value[g, : len(c)] = update_correction_bias(value[g, : len(c)], c, rate)
        bias.set_value(paddle.to_tensor(value))


def load_metrics(counts: list[list[np.ndarray]], experts: int | None = None) -> dict[str, float]:
    """How balanced the step was: experts without tokens, and the max/min load relative to the mean
    (over the first ``experts`` of each layer when an elastic sub-model kept only those)."""
    dead, worst_max, worst_min = 0, 0.0, float("inf")
    for layer in counts:
        for c in layer:
            c = c[:experts] if experts else c
            if c.sum() == 0:
                continue
            dead += int((c == 0).sum())
            rel = c / c.mean()
            worst_max = max(worst_max, float(rel.max()))
            worst_min = min(worst_min, float(rel.min()))
    return {
        "experts_without_tokens": dead,
        "expert_load_max": worst_max,
        "expert_load_min": 0.0 if worst_min == float("inf") else worst_min,
    }
