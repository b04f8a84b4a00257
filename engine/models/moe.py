"""ERNIE 4.5 mixture of experts: fp32 top-k router with correction bias, shared experts, router losses.

The multimodal (heterogeneous) variant keeps one expert group and one gate per modality; tokens route
only inside the group of their ``token_type_ids`` (0 text, 1 image) while shared experts see every token.
Everything here is plain Paddle ops so it trains on CPU and GPU alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from engine.models import kernels
from engine.models.config import ErnieConfig
from engine.models.layers import MLP, Linear


@dataclass
class RouterStats:
    """What one MoE layer did with one batch: per-group logits, probabilities and expert choices."""

    logits: list[paddle.Tensor]  # per group [N_g, E_g] fp32
    probs: list[paddle.Tensor]  # per group [N_g, E_g] fp32
    selected: list[paddle.Tensor]  # per group [N_g, k] int64, index inside the group
    token_index: list[paddle.Tensor | None]  # per group: which flat tokens were routed there (None: all)
    gate_weights: list[paddle.Tensor]  # per group [H, E_g]
    groups: list[int] = field(default_factory=list)  # per entry: which modality group it is
    layer: nn.Layer | None = None  # the MoELayer (its gates, for groups with no tokens on this rank)

    def expert_counts(self) -> list[np.ndarray]:
        """Number of token assignments each expert of each group received."""
        out = []
        for sel, probs in zip(self.selected, self.probs, strict=True):
            counts = np.bincount(sel.numpy().reshape(-1), minlength=probs.shape[-1])
            out.append(counts)
        return out


# ---- router losses (each a hand-checkable formula, see tests/engine/test_moe.py) ----------------------


def aux_loss(probs: paddle.Tensor, selected: paddle.Tensor) -> paddle.Tensor:
    """Load-balancing loss ``E * sum_e me_e * ce_e`` (1.0 when perfectly balanced).

    me_e is the mean routing probability of expert e, ce_e the (detached) share of assignments it got.
    """
    n, e = probs.shape
    if n == 0:
        return paddle.zeros([], dtype="float32")
    me = probs.mean(axis=0)
    onehot = F.one_hot(selected.reshape([-1]), e).astype("float32")
    ce = (onehot.sum(axis=0) / onehot.shape[0]).detach()
    return e * (me * ce).sum()


def z_loss(logits: paddle.Tensor) -> paddle.Tensor:
    """``mean_t (logsumexp_e logits_te)^2``: keeps router logits small."""
    if logits.shape[0] == 0:
        return paddle.zeros([], dtype="float32")
    return paddle.logsumexp(logits, axis=-1).pow(2).mean()


def orthogonal_loss(gate_weight: paddle.Tensor) -> paddle.Tensor:
    """``||W_hat W_hat^T - I||_F^2 / numel`` over the unit-normalised expert rows of the gate."""
    w = gate_weight.astype("float32").T  # [E, H], one row per expert
    w = w / paddle.clip(w.norm(axis=-1, keepdim=True), min=1e-12)
    gram = paddle.matmul(w, w, transpose_y=True)
    eye = paddle.eye(gram.shape[0], dtype="float32")
    return (gram - eye).pow(2).sum() / gram.numel().astype("float32")


def global_router_losses(stats: list[RouterStats], comm) -> dict[str, paddle.Tensor]:
    """The aux, z and orthogonal losses of the whole global batch (every rank's tokens), as one process
    holding all of it would compute them.

    Token counts and expert loads are summed over ranks in the forward (``comm.sum``, no gradient); each
    rank returns ``comm.world`` times its own tokens' share of the aux and z sums, so the mean over ranks,
    which the trainer takes, is the global loss and its gradient reaches every rank's router exactly. A
    modality group with tokens on any rank counts its gate's orthogonal loss on every rank.
    """
    entries, vec, at = [], [], 0
    for s in stats:
        row = dict(zip(s.groups, range(len(s.groups)), strict=True))
        for g, n in enumerate(s.layer.group_sizes):
            v = np.zeros(1 + n)
            i = row.get(g)
            if i is not None:
                sel = s.selected[i].numpy()
                e = s.probs[i].shape[-1]
                v[0] = sel.shape[0]
                v[1 : 1 + e] = np.bincount(sel.reshape(-1), minlength=e)[:e]
            entries.append((s, g, i, at))
            vec.append(v)
            at += len(v)
    totals = comm.sum(np.concatenate(vec)) if vec else np.zeros(0)
    aux = zl = orth = paddle.zeros([], dtype="float32")
    for s, g, i, at in entries:
        n_global = totals[at]
        if n_global == 0:
            continue
        if i is None:
            e = s.layer.active_experts or s.layer.group_sizes[g]
            orth = orth + orthogonal_loss(s.layer.gate_weight(g)[:, :e])
            continue
        probs, sel = s.probs[i], s.selected[i]
        e, k = probs.shape[-1], sel.shape[-1]
        ce = paddle.to_tensor((totals[at + 1 : at + 1 + e] / (n_global * k)).astype(np.float32))
        aux = aux + comm.world * e * (probs.sum(axis=0) / n_global * ce).sum()
        zl = zl + comm.world * paddle.logsumexp(s.logits[i], axis=-1).pow(2).sum() / n_global
        orth = orth + orthogonal_loss(s.gate_weights[i])
    n = max(len(stats), 1)
    return {"aux_loss": aux / n, "z_loss": zl / n, "orthogonal_loss": orth / n}


def update_correction_bias(bias: np.ndarray, counts: np.ndarray, rate: float = 1e-3) -> np.ndarray:
    """Aux-free balancing: nudge the bias up for under-loaded experts and down for over-loaded ones."""
    counts = np.asarray(counts, dtype=np.float32)
    return (bias + rate * np.sign(counts.mean() - counts)).astype(np.float32)


def route(
    logits: paddle.Tensor, bias: paddle.Tensor, k: int, norm_min: float
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Top-k by probability + correction bias; combine weights are the unbiased probabilities, renormalised.

    Returns (probs [N, E], selected [N, k], weights [N, k]).
    """
    probs = F.softmax(logits, axis=-1)
    _, selected = paddle.topk(probs + bias.detach(), k, axis=-1)
    weights = paddle.take_along_axis(probs, selected, axis=-1)
    weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=norm_min)
    return probs, selected, weights


def run_experts(
    x: paddle.Tensor, experts: nn.LayerList, selected: paddle.Tensor, weights: paddle.Tensor
) -> paddle.Tensor:
    """Dispatch each token to its k experts, weight and combine. x [N, H] -> [N, H].

    The grouped path (``grouped_experts``) when the experts are plain linears and the ``grouped_moe`` fast
    path is on; otherwise the per-expert loop (``loop_experts``), the plain reference both are tested
    against.
    """
    if kernels.enabled("grouped_moe") and can_group(experts):
        return grouped_experts(x, experts, selected, weights)
    return loop_experts(x, experts, selected, weights)


def loop_experts(
    x: paddle.Tensor, experts: nn.LayerList, selected: paddle.Tensor, weights: paddle.Tensor
) -> paddle.Tensor:
    """The reference dispatch: every expert runs once, as its own layer, on a contiguous slice.

    Assignments are sorted by expert; the host sync for the counts is what lets the same code run on CPU
    without capacity padding.
    """
    n, h = x.shape
    k = selected.shape[-1]
    flat = selected.reshape([-1])
    order = paddle.argsort(flat, stable=True)
    token_of = order // k  # which token each sorted assignment belongs to
    counts = np.bincount(flat.numpy(), minlength=len(experts))
    xs = paddle.gather(x, token_of)
    outs = []
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            outs.append(experts[e](xs[start : start + c]))
        start += c
    ys = paddle.concat(outs, axis=0)
    # Undo the sort, weight each assignment and sum the k contributions of every token.
    inverse = paddle.argsort(order)
    ys = paddle.gather(ys, inverse).reshape([n, k, h])
    return (ys * weights.astype(ys.dtype).unsqueeze(-1)).sum(axis=1)


def can_group(experts: nn.LayerList) -> bool:
    """Whether the grouped path computes exactly what the loop would and is worth its weight copy.

    Every expert must be the plain SwiGLU MLP with plain linears: LoRA, QAT and weight-only wrappers change
    what a linear computes, so those experts take the loop. The grouped path stacks the experts' weights
    on every call; ``kernels.grouped_moe_fits`` says whether a copy of that size pays off here.
    """
    plain = all(
        type(e) is MLP and type(e.up_gate_proj) is Linear and type(e.down_proj) is Linear for e in experts
    )
    if not plain or not len(experts):
        return False
    w = experts[0].up_gate_proj.weight
    stacked = len(experts) * (w.numel() + experts[0].down_proj.weight.numel()) * w.element_size()
    return kernels.grouped_moe_fits(int(stacked), w.place.is_gpu_place())


def grouped_experts(
    x: paddle.Tensor, experts: nn.LayerList, selected: paddle.Tensor, weights: paddle.Tensor
) -> paddle.Tensor:
    """The loop's result with one gather in, two batched matmuls and one gather out.

    The experts that received tokens are stacked ([E', H, 2I] and [E', I, H]) and their tokens laid out
    [E', C, H], C = the largest count; the padding rows compute values nobody reads, so they get no
    gradient. Experts without tokens are left out of the stack: their weights get no gradient at all
    (``None``), exactly as in the loop, so an optimizer skips them alike. The counts are read on the host
    once (the loop's sync) and the index arithmetic is done there.
    """
    n, h = x.shape
    k = selected.shape[-1]
    flat = selected.reshape([-1]).numpy()
    counts = np.bincount(flat, minlength=len(experts))
    active = np.flatnonzero(counts)
    cap = int(counts.max())
    slot = np.full(len(experts), -1, dtype=np.int64)
    slot[active] = np.arange(len(active))
    order = np.argsort(flat, kind="stable")
    sorted_e = flat[order]
    starts = np.cumsum(counts) - counts
    row = np.empty_like(flat)  # row of each assignment in the [E' * C] padded layout
    row[order] = slot[sorted_e] * cap + np.arange(flat.size) - starts[sorted_e]
    source = np.zeros(len(active) * cap, dtype=np.int64)  # token each padded row reads (pads: token 0)
    source[row] = np.arange(flat.size) // k
    xs = paddle.gather(x, paddle.to_tensor(source)).reshape([len(active), cap, h])
    mlps = [experts[int(e)] for e in active]
    up = paddle.bmm(xs, paddle.stack([m.up_gate_proj.weight for m in mlps]))
    if mlps[0].up_gate_proj.bias is not None:
        up = up + paddle.stack([m.up_gate_proj.bias for m in mlps]).unsqueeze(1)
    ys = paddle.bmm(kernels.swiglu(up), paddle.stack([m.down_proj.weight for m in mlps]))
    if mlps[0].down_proj.bias is not None:
        ys = ys + paddle.stack([m.down_proj.bias for m in mlps]).unsqueeze(1)
    ys = paddle.gather(ys.reshape([-1, h]), paddle.to_tensor(row)).reshape([n, k, h])
    return (ys * weights.astype(ys.dtype).unsqueeze(-1)).sum(axis=1)


def _place(out: paddle.Tensor, y: paddle.Tensor, idx: paddle.Tensor | None) -> paddle.Tensor:
    """A modality group's routed output into the layer's output rows (all rows when ``idx`` is None)."""
    return out + y if idx is None else paddle.scatter(out, idx, y, overwrite=True)


class MoEStatics(nn.Layer):
    """Holds ``e_score_correction_bias`` [groups, E]; updated by aux-free balancing, never by gradients."""

    def __init__(self, groups: int, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = self.create_parameter(
            [groups, num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0)
        )
        self.e_score_correction_bias.stop_gradient = True


class MoELayer(nn.Layer):
    """Routed experts (one or two modality groups) plus shared experts.

    Parameter names follow the Paddle checkpoint layout: ``gate.weight`` [H, E] (``gate.weight_1`` for the
    vision group), ``experts.{e}`` (text experts first, then vision), ``shared_experts``, ``moe_statics``.
    """

    def __init__(self, config: ErnieConfig):
        super().__init__()
        self.k = config.moe_k
        self.norm_min = config.moe_norm_min
        self.group_sizes = config.expert_counts
        inter = config.expert_intermediate_sizes
        h = config.hidden_size
        self.gate = nn.Layer()
        for g, e in enumerate(self.group_sizes):
            name = "weight" if g == 0 else f"weight_{g}"
            param = self.gate.create_parameter([h, e], dtype="float32")
            self.gate.add_parameter(name, param)
        self.experts = nn.LayerList(
            [MLP(h, inter[g], config.use_bias) for g, e in enumerate(self.group_sizes) for _ in range(e)]
        )
        self.shared_experts = (
            MLP(h, inter[0] * config.moe_num_shared_experts, config.use_bias)
            if config.moe_num_shared_experts
            else None
        )
        self.moe_statics = MoEStatics(len(self.group_sizes), max(self.group_sizes))
        # Elastic training (engine.models.elastic): a sub-model routes among the first ``active_experts``
        # experts of each group (the router's softmax over those alone) with ``active_k`` experts per token.
        self.active_experts: int | None = None
        self.active_k: int | None = None
        # Expert parallelism (engine.models.expert_parallel): the group the routed experts are split over;
        # None runs every expert here. Its ``run_experts`` exchanges the tokens with the other ranks.
        self.expert_group = None

    def gate_weight(self, group: int) -> paddle.Tensor:
        return getattr(self.gate, "weight" if group == 0 else f"weight_{group}")

    def forward(
        self, x: paddle.Tensor, token_type_ids: paddle.Tensor | None = None, recompute_experts: bool = False
    ) -> tuple[paddle.Tensor, RouterStats]:
        """``recompute_experts`` (recompute under expert parallelism, where the whole layer is not replayed):
        the routed experts this rank runs and the shared experts keep only their inputs for backward and
        are recomputed there; the router and the exchange are not (no collective is ever replayed)."""
        b, t, h = x.shape
        flat = x.reshape([-1, h])
        stats = RouterStats([], [], [], [], [], layer=self)
        if len(self.group_sizes) == 1 or token_type_ids is None:
            routed_groups = [(0, None)]
        else:
            types = token_type_ids.reshape([-1])
            routed_groups = [
                (g, paddle.nonzero(types == g).reshape([-1])) for g in range(len(self.group_sizes))
            ]
        out = paddle.zeros_like(flat)
        k = self.active_k or self.k
        offset = 0
        split: list = []  # expert parallelism: (group, tokens, selected, weights, idx), run after routing
        for g, idx in routed_groups:
            n_experts = self.group_sizes[g]
            experts = self.experts[offset : offset + n_experts]
            offset += n_experts
            tokens = flat if idx is None else paddle.gather(flat, idx)
            if tokens.shape[0] == 0:
                continue
            w = self.gate_weight(g)
            if self.active_experts and self.active_experts < n_experts:
                # a prefix, so the kept experts' indices are their indices in the whole group
                n_experts = self.active_experts
                experts, w = experts[:n_experts], w[:, :n_experts]
            logits = paddle.matmul(tokens.astype("float32"), w)
            bias = self.moe_statics.e_score_correction_bias[g, :n_experts]
            probs, selected, weights = route(logits, bias, k, self.norm_min)
            if self.expert_group is not None:
                split.append((g, tokens, selected, weights, idx))
            else:
                out = _place(out, run_experts(tokens, experts, selected, weights), idx)
            stats.logits.append(logits)
            stats.probs.append(probs)
            stats.selected.append(selected)
            stats.token_index.append(idx)
            stats.gate_weights.append(w)
            stats.groups.append(g)
        if self.expert_group is not None:  # every rank exchanges once per layer, tokens or not
            ys = self.expert_group.run_experts(self, [p[:4] for p in split], flat, recompute_experts)
            for (*_, idx), y in zip(split, ys, strict=True):
                out = _place(out, y, idx)
        if self.shared_experts is not None:
            if recompute_experts:
                from paddle.distributed.fleet.utils import recompute as checkpoint

                out = out + checkpoint(self.shared_experts, flat, use_reentrant=False)
            else:
                out = out + self.shared_experts(flat)
        return out.reshape([b, t, h]), stats
