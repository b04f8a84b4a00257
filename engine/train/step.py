"""One training step's arithmetic, as every stage shares it: the objective a stage trains, the gradients
accumulated over micro-batches (the stage's objective: engine.train.objectives), summed over ranks or expert groups, clipped by their
global norm, and the optimizer's update (replicated, or through the sharded optimizer)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from engine.models import gpas, kernels
from engine.models.expert_parallel import (
    ExpertGroup,
    is_expert_param,
    sum_over_experts,
    sum_over_replicas,
)
from engine.train import moe_balance, quant
from engine.train.config import TrainConfig
from engine.train.objectives import Objective
from engine.train.parallel import DataParallel
from engine.train.run_state import TrainRun


def optimizer_step(cfg: TrainConfig, run: TrainRun, dp: DataParallel) -> float:
    """All-reduce, clip and apply the accumulated gradients; returns the gradient norm before clipping."""
    if run.masters is not None:  # emulated bf16: the bf16 gradients left, upcast, onto the fp32 masters
        run.masters.gather_grads()
    # Every trainable weight gets a gradient (zero when unused, e.g. an idle expert) so that ranks
    # all-reduce the same tensors and AdamW treats them the same with 1 or N ranks.
    for p in run.params:
        if p.grad is None:
            p._copy_gradient_from(paddle.zeros_like(p))
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    if run.sharded is not None:  # reduce to the owners, clip by the norm over every shard, update, share
        grad_norm = run.sharded.step(run.params, max_norm)
    else:
        grad_norm = _replicated_step(cfg, run, dp, max_norm)
    if run.masters is not None:
        run.masters.write_back()
    if cfg.compute_type == "fp8":
        quant.next_step(run.model)
    return grad_norm


def _replicated_step(cfg: TrainConfig, run: TrainRun, dp: DataParallel, max_norm: float) -> float:
    """Every rank sums the replicated gradients, clips them and steps the whole AdamW. A held expert's
    gradient is already complete (it saw the whole expert group's tokens): it is summed over the ranks
    holding the same experts only, never over the expert group."""
    group = run.model.expert_group
    split = [p for n, p in run.trainable.items() if is_expert_param(n)] if group is not None else []
    if split:
        split_ids = {id(p) for p in split}
        dp.sum_grads([p for p in run.params if id(p) not in split_ids])
        sum_expert_grads(split, group)
    else:
        dp.sum_grads(run.params)
    if run.scaler is not None:  # fp16: clip the true gradients, not the scaled ones
        run.scaler.unscale_(run.optimizer)
    grad_norm = clip_grad_norm(run.params, max_norm, split, group)
    if cfg.gpas_gate_grad_clip > 0:
        gpas.clip_gate_grads(run.model, cfg.gpas_gate_grad_clip)
    if run.scaler is not None:  # skips the step when a gradient overflowed, and adapts the scale
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.optimizer.clear_grad(set_to_zero=False)
    return grad_norm


def sum_expert_grads(params: list[paddle.Tensor], group: ExpertGroup) -> None:
    """Sum the held experts' gradients over their data-parallel replicas (none when one copy exists)."""
    if group.replicas == 1:
        return
    grads = [p.grad for p in params]
    flat = sum_over_replicas(paddle.concat([g.reshape([-1]) for g in grads]), group)
    offset = 0
    for g in grads:
        n = int(np.prod(g.shape))
        g.set_value(flat[offset : offset + n].reshape(g.shape))
        offset += n


def clip_grad_norm(
    params: list[paddle.Tensor],
    max_norm: float,
    split: list[paddle.Tensor] | None = None,
    group: ExpertGroup | None = None,
) -> float:
    """Global L2 norm of the gradients; scales them in place to ``max_norm`` when above it, as
    ``paddle.nn.utils.clip_grad_norm_`` does.

    Each tensor's square sum is ``kernels.square_sum``: threaded C with float64 partial sums on a CPU
    (``cpu_grad_clip``), else Paddle's ``squared_l2_norm`` (the op of its own ``ClipGradByGlobalNorm``): a
    tree reduction, 2e-8 from a float64 sum on the 0.3B model's gradients in 56 ms, where a BLAS dot product
    (sequential float32 sums: 4% off on the 106M-value embedding) took 317 ms and the ``p_norm`` kernel of
    ``clip_grad_norm_`` 1.7 s (bench/bench_cpu_step.py, docs/benchmarks.md)."""
    split_ids = {id(p) for p in split or []}
    squares, split_squares = [], []
    for p in params:
        if p.grad is not None:
            g = p.grad if p.grad.dtype == paddle.float32 else p.grad.astype("float32")
            square = kernels.square_sum(g)  # float64
            (split_squares if id(p) in split_ids else squares).append(square)
    # Summed in float64: with the experts split, the per-tensor terms are added in another order than in
    # one process, and the clipping coefficient should not depend on that order.
    if split_squares:  # expert parallelism: the split experts' share is summed over the expert group
        squares.append(sum_over_experts(paddle.stack(split_squares).sum(), group))
    if not squares:
        return 0.0
    total = float(paddle.stack(squares).sum().sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:  # multiplying by 1 would change nothing and cost a pass over every gradient
        with paddle.no_grad():
            for p in params:
                if p.grad is not None:
                    kernels.scale_grad_(p.grad, coef)
    return total


def accumulate_gradients(
    model,
    objective: Objective,
    micro: list[dict],
    dp: DataParallel,
    moe_groups: list[int],
    scaler=None,
    loss_scale: float = 1.0,
):
    """Forward and backward every micro-batch of one optimiser step.

    Losses are normalised by the labelled tokens (preference objectives: pairs) of the whole step on all
    ranks (``objective.norms``), so the summed gradients equal those of one big batch. Returns metric sums,
    tokens seen and expert counts. ``scaler`` (fp16 on a GPU) scales each loss before backward;
    ``loss_scale`` (the ranks, under sharding, whose reduction averages) multiplies it.
    """
    share = 1.0 / (len(micro) * dp.world)
    norms = objective.norms(micro, dp)
    sums: dict[str, float] = {}
    counts = None
    tokens = 0
    for batch in micro:
        loss, m, routed = objective.loss(model, batch, norms, share)
        for stats, prefix in routed:
            keep = moe_balance.real_token_mask(batch, prefix)
            tokens += (
                int(keep.sum()) if keep is not None else int(np.asarray(batch[prefix + "input_ids"]).size)
            )
            if moe_groups:
                present = moe_balance.present_groups(batch, model.config, prefix)
                layer_counts = moe_balance.expert_counts(stats, moe_groups, present, keep)
                counts = moe_balance.add_counts(counts, layer_counts)
        if loss_scale != 1.0:
            loss = loss * loss_scale
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    return sums, tokens, counts


def _unflatten(counts: list[list[np.ndarray]], flat: np.ndarray) -> list[list[np.ndarray]]:
    out, i = [], 0
    for layer in counts:
        row = []
        for c in layer:
            row.append(flat[i : i + len(c)].astype(np.int64))
            i += len(c)
        out.append(row)
    return out


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (what a CPU node's RAM must hold), in MiB.

    VmHWM, not ``ru_maxrss``: Linux carries ``ru_maxrss`` over ``exec``, so a trainer started by a big
    parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class StepTiming:
    """What the studio's ETA and the estimate's check need in each metrics row: the seconds per optimizer
    step since the last logged row (training alone: evaluation and saves are timed apart), the run's total
    steps (also for epoch runs), the last checkpoint's save time, and the process's peak memory."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
        self.last_save_s: float | None = None

    def stepped(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def saved(self, seconds: float) -> None:
        self.last_save_s = seconds

    def row(self, total: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "total_steps": total,
            "step_s": round(self.seconds / max(self.steps, 1), 4),
            "peak_rss_mib": peak_rss_mib(),
        }
        if self.last_save_s is not None:
            out["checkpoint_s"] = round(self.last_save_s, 3)
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
            # a GPU run's estimate is of device memory: what the allocator held at most
            out["peak_device_mib"] = round(paddle.device.cuda.max_memory_reserved() / 2**20, 1)
        return out

    def logged(self) -> None:
        self.seconds, self.steps = 0.0, 0


def step_metrics(
    cfg: TrainConfig, run: TrainRun, dp: DataParallel, sums: dict, tokens: int, counts
) -> tuple[dict[str, Any], float]:
    """(loss and MoE load metrics, tokens) summed over ranks; also moves the correction biases and the EMA."""
    mc = run.model.config
    names = sorted(sums)
    totals = dp.sum(np.array([sums[k] for k in names] + [tokens], dtype=np.float64))
    metrics: dict[str, Any] = {k: float(v) for k, v in zip(names, totals[:-1], strict=True)}
    if counts is not None:
        flat = dp.sum(np.concatenate([c for layer in counts for c in layer]).astype(np.float64))
        counts = _unflatten(counts, flat)
        layers, experts = run.elastic.routed(run.model) if run.elastic is not None else (None, None)
        # a LoRA run leaves the base untouched, correction biases included (the adapter file would lose them)
        if mc.is_moe and mc.moe_use_aux_free and not cfg.lora:
            moe_balance.update_correction_biases(
                run.model, counts, cfg.moe_correction_bias_rate, layers=layers, experts=experts
            )
        metrics.update(moe_balance.load_metrics(counts, experts))
    if run.elastic is not None:
        metrics.update(run.elastic.step_metrics(metrics))
    if mc.gpas:
        metrics.update(gpas.gate_values(run.model))
    if run.ema is not None:
        run.ema.update(run.trainable)
    return metrics, float(totals[-1])
