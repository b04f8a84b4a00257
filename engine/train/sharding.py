"""Optimizer state split over the data-parallel ranks (ERNIEKit's ``sharding``), with Paddle's own engine.

- Stage 1 is fleet's ``DygraphShardingOptimizer`` (``fleet.distributed_optimizer`` under a hybrid strategy
  with ``sharding_degree``): each rank keeps the AdamW state of about 1/N of the weights, the gradients are
  reduced to the rank that owns them, it updates those weights and broadcasts them. Gloo (CPU) and NCCL.
- Stage 2 is ``paddle.distributed.sharding.group_sharded_parallel(level="os_g")``: the gradients are split
  too, reduced by backward hooks. Paddle runs it on GPU / XPU only (``gpu_sharding_problem``).
- ``tensorwise_offload_optimizer`` keeps AdamW's moments in pinned host memory and brings each weight's
  to the device for its own update only (GPU).

Fleet averages the gradients over the ranks, where this engine's losses are normalised by the whole
step's token count (``engine.train.parallel``): ``loss_scale`` (the number of ranks) multiplies each loss
before backward, so the reduced gradients are the sums of one big batch. Checkpoints hold the optimizer
state un-split and keyed by parameter name (``gathered_state``): any number of ranks resumes them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import paddle

from engine.models.expert_parallel import gather_to_writer
from engine.train.config import TrainConfig
from engine.train.parallel import DataParallel
from engine.train.run_dir import optimizer_state_by_name

log = logging.getLogger(__name__)


def gpu_sharding_problem(what: str) -> str | None:
    """Why ``what`` (stage 2, tensorwise optimizer offload) cannot run on this node, or None.

    The one capability check of the GPU-only paths: ``group_sharded_parallel`` asserts that
    ``paddle.get_device()`` is a gpu / xpu / custom device, and offloading needs a device memory to leave."""
    device = paddle.get_device().split(":")[0]
    if device in ("gpu", "xpu") or device in paddle.device.get_all_custom_device_type():
        return None
    return f"{what} needs a GPU (Paddle runs it on gpu / xpu devices); this node trains on {device}"


# What stage 1 calls on the sharding group (DygraphShardingOptimizer.reduce_gradients and
# _sharding_sync_parameters, the global norm, gathered_state's send / recv to the writing rank); gloo has
# them all.
STAGE1_COLLECTIVES = ("reduce", "broadcast", "all_reduce", "all_gather_object", "send", "recv")


def sharding_support() -> dict[str, str | None]:
    """Each of ERNIEKit's sharding settings and why this node cannot run it (None: it can), for the doctor."""
    import paddle.distributed as dist

    missing = [name for name in STAGE1_COLLECTIVES if not callable(getattr(dist, name, None))]
    try:
        from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (  # noqa: F401
            DygraphShardingOptimizer,
        )
    except ImportError:
        missing.append("fleet's DygraphShardingOptimizer")
    stage1 = f"this Paddle lacks {', '.join(missing)}" if missing else None
    moves = all(hasattr(paddle.Tensor, m) for m in ("_copy_to", "_share_buffer_to"))
    return {
        "stage1": stage1,
        "stage2": stage1 or gpu_sharding_problem("stage2"),
        "tensorwise_offload_optimizer": gpu_sharding_problem("tensorwise_offload_optimizer")
        or (None if moves else "this Paddle's Tensor lacks _copy_to / _share_buffer_to"),
    }


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer state this process holds: AdamW's moments and beta powers (and the fp32
    master weights of AMP), counted on the Paddle optimizer inside any fleet wrapper."""
    inner = _paddle_optimizer(optimizer)
    tensors = [t for acc in inner._accumulators.values() for t in acc.values()]
    tensors += list(getattr(inner, "_master_weights", {}).values())
    return sum(int(t._numel()) * t.element_size() for t in tensors)


def per_rank(dp: DataParallel, value: int) -> list[int]:
    """Every rank's ``value``, in rank order (a float64 all-reduce of one slot per rank: exact below 2^53)."""
    slots = np.zeros(dp.world, dtype=np.float64)
    slots[dp.rank] = value
    return [int(v) for v in dp.sum(slots)]


def _paddle_optimizer(optimizer):
    """The ``paddle.optimizer`` object under fleet's and group_sharded's wrappers."""
    while True:
        inner = getattr(optimizer, "_inner_opt", None) or getattr(optimizer, "_optim", None)
        if inner is None:
            return optimizer
        optimizer = inner


class ShardedOptimizer:
    """The run's AdamW split over the sharding group of ``cfg.sharding_degree(world)`` ranks; the other
    factor of the world (``world / degree``) replicates the split data-parallel."""

    def __init__(self, cfg: TrainConfig, dp: DataParallel, model, optimizer):
        from paddle.distributed import fleet

        self.stage = cfg.sharding_stage
        self.degree = cfg.sharding_degree(dp.world)
        self.dp_degree = dp.world // self.degree
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {
            "dp_degree": self.dp_degree,
            "mp_degree": 1,
            "pp_degree": 1,
            "sharding_degree": self.degree,
        }
        fleet.init(is_collective=True, strategy=strategy)
        self.hcg = fleet.get_hybrid_communicate_group()
        self.group = self.hcg.get_sharding_parallel_group()
        self.loss_scale = float(dp.world)  # fleet averages over all ranks; the losses here want sums
        self.layer = model  # the model itself (stage 2 trains through a wrapper of it)
        if self.stage == 1:
            wrapped = fleet.distributed_optimizer(optimizer)
            self.optimizer = getattr(wrapped, "_inner_opt", None)
            if type(self.optimizer).__name__ != "DygraphShardingOptimizer":
                raise RuntimeError(
                    f"sharding: stage1: fleet.distributed_optimizer gave {type(self.optimizer).__name__} "
                    "inside its HybridParallelOptimizer, not the DygraphShardingOptimizer this engine "
                    "drives (Paddle 3.3)"
                )
            self.model = model
        else:
            self.model, self.optimizer = self._stage2(cfg, model, optimizer)

    def _stage2(self, cfg: TrainConfig, model, optimizer):
        """``group_sharded_parallel(level="os_g")`` over the sharding group (GPU only). Its optimizer clips
        by the global norm across the group itself (GroupShardedClipGrad), so the norm goes to AdamW."""
        from paddle.distributed.sharding import group_sharded_parallel

        problem = gpu_sharding_problem(f"sharding: {cfg.sharding}")
        if problem:
            raise ValueError(problem + "; use sharding: stage1")
        if cfg.max_grad_norm > 0:
            _paddle_optimizer(optimizer)._grad_clip = paddle.nn.ClipGradByGlobalNorm(cfg.max_grad_norm)
        # one split over every rank (trainer.check_devices): no data-parallel group
        model, optimizer, _ = group_sharded_parallel(model, optimizer, "os_g", group=self.group)
        return model, optimizer

    def step(self, params: list[paddle.Tensor], max_norm: float) -> float:
        """Reduce, clip by the global norm over every shard, update this rank's weights and share them;
        returns the norm before clipping."""
        if self.stage == 2:
            norm = self._global_norm(self._owned(params))
            self.optimizer.step()  # GroupShardedStage2's step: dp all-reduce, clip, update, broadcast
            self.optimizer.clear_grad()
            return norm
        opt = self.optimizer
        opt.reduce_gradients(params, self.hcg)  # each weight's gradient, averaged, on the rank that owns it
        mine = opt.filter_parameters(params, self.hcg)
        if self.dp_degree > 1:
            from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

            fused_allreduce_gradients(mine, self.hcg)
        norm = self._global_norm(mine)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            with paddle.no_grad():
                for p in mine:
                    p.grad.scale_(coef)
        opt.step()  # AdamW on this rank's weights, then each owner broadcasts its weights
        opt.clear_grad(set_to_zero=False)
        return norm

    def _owned(self, params: list[paddle.Tensor]) -> list[paddle.Tensor]:
        owner = self.optimizer.param2rank  # GroupShardedOptimizerStage2: name -> rank in the group
        rank = self.hcg.get_sharding_parallel_rank()
        return [p for p in params if owner.get(p.name) == rank]

    def _global_norm(self, mine: list[paddle.Tensor]) -> float:
        """The L2 norm of all gradients: each rank's square sum of the weights it owns, summed over the
        sharding group (the data-parallel replicas hold the same)."""
        squares = [
            paddle._C_ops.squared_l2_norm(p.grad.astype("float32")).reshape([])
            for p in mine
            if p.grad is not None
        ]
        total = paddle.add_n(squares).reshape([1]) if squares else paddle.zeros([1], dtype="float32")
        paddle.distributed.all_reduce(total, group=self.group)
        return float(total.sqrt()[0])

    def gathered_state(self, trainable: dict[str, paddle.Tensor]) -> dict[str, Any] | None:
        """The whole optimizer state keyed by parameter name, as one process's ``save_checkpoint`` writes
        it (``optimizer.pdopt``), on the run's rank 0, which writes it: every rank of its sharding group
        sends its part one tensor at a time (``expert_parallel.gather_to_writer``), so the other ranks
        hold no more than their own state. None elsewhere; the groups of other data-parallel replicas,
        which hold the same state, exchange nothing."""
        if 0 not in self.group.ranks:
            return None
        local = optimizer_state_by_name(self.optimizer, trainable)
        flat = {k: v for k, v in local.items() if k != "master_weights"}
        flat.update({f"master_weights::{k}": v for k, v in local.get("master_weights", {}).items()})
        got = gather_to_writer(flat, writer=0, group=self.group)
        if got is None:
            return None
        out: dict[str, Any] = {}
        for key, value in got.items():
            if key.startswith("master_weights::"):
                out.setdefault("master_weights", {})[key.split("::", 1)[1]] = value
            else:
                out[key] = value
        return out


class TensorwiseOffload:
    """``tensorwise_offload_optimizer``: AdamW's accumulators live in pinned host memory; each weight's are
    copied to the device just before its update and back just after (PaddleNLP's
    ``trainer/utils/offload_optimizer.py`` does the same by patching Paddle's classes; this wraps one
    optimizer object). Built on ``Optimizer._add_accumulator`` and ``_append_optimize_op`` of Paddle 3.3
    (python/paddle/optimizer/optimizer.py, adamw.py)."""

    def __init__(self, optimizer, host=None, device=None):
        self.opt = _paddle_optimizer(optimizer)
        self.host = host or paddle.CUDAPinnedPlace()
        self.device = device or paddle.framework._current_expected_place()
        self.moved: set[int] = set()
        add, append = self.opt._add_accumulator, self.opt._append_optimize_op

        def add_accumulator(*args, **kwargs):
            var = add(*args, **kwargs)
            if id(var) not in self.moved and not var.place.is_cpu_place():
                self.moved.add(id(var))
                _move(var, self.host)
            return var

        def append_optimize_op(block, param_and_grad):
            name = param_and_grad[0].name
            mine = [acc[name] for acc in self.opt._accumulators.values() if id(acc.get(name)) in self.moved]
            for t in mine:
                _move(t, self.device)
            try:
                return append(block, param_and_grad)
            finally:
                for t in mine:
                    _move(t, self.host)

        self.opt._add_accumulator = add_accumulator
        self.opt._append_optimize_op = append_optimize_op


def _move(t: paddle.Tensor, place) -> None:
    """``t``'s storage onto ``place``, the tensor object kept (the optimizer's dicts hold it)."""
    t._copy_to(place, True)._share_buffer_to(t)
