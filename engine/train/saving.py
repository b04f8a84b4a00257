"""What a run writes as it goes and at its end: step checkpoints (with the optimizer's state gathered from
its shards, and only the weights a rank holds), and the final model or adapter."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from engine.models.expert_parallel import (
    gather_named,
    is_expert_param,
)
from engine.train import lora as lora_mod
from engine.train import quant
from engine.train.config import TrainConfig
from engine.train.parallel import DataParallel
from engine.train.run_dir import (
    checkpoint_states,
    prune_checkpoints,
    save_checkpoint,
)
from engine.train.run_state import TrainRun


def save_step_checkpoint(
    cfg: TrainConfig, dp: DataParallel, out_dir: Path, run: TrainRun, step: int, elapsed: float, timing, emit
) -> None:
    """``checkpoint-<step>`` by rank 0, un-split: under sharding every rank first sends its part of the
    optimizer state, with expert parallelism its experts, so any number of ranks resumes the file."""
    t_save = time.time()
    state, states, ema = None, None, run.ema
    if run.sharded is not None:
        state = run.sharded.gathered_state(run.trainable)
    if run.model.expert_group is not None:
        states = gathered_states(run)
        if ema is not None:  # the weight average of every expert, as one process keeps it
            ema = SimpleNamespace(shadow=gather_named(ema.shadow, run.model.expert_group))
    if not dp.main:
        return
    path = save_checkpoint(
        out_dir,
        step,
        run.model,
        run.optimizer,
        run.trainable,
        run.data,
        ema,
        elapsed,
        run.elastic,
        states,
        optimizer_state=state,
    )
    timing.saved(time.time() - t_save)
    emit({"type": "checkpoint", "step": step, "path": str(path)})
    if cfg.save_total_limit:
        prune_checkpoints(out_dir, cfg.save_total_limit)


def held_weights(model) -> Callable[[str], bool] | None:
    """Expert parallelism: which weights of an un-split checkpoint this rank takes (its own experts and
    everything replicated); None takes them all."""
    if model.expert_group is None:
        return None
    names = set(model.state_dict())
    return lambda name: not is_expert_param(name) or name in names


def gathered_states(run: TrainRun) -> tuple[dict, dict] | None:
    """Expert parallelism: a checkpoint's weights and optimizer state with every rank's experts, on rank
    0, which writes it (None on the others, which only send theirs, one tensor at a time)."""
    group = run.model.expert_group
    weights, optim = checkpoint_states(run.model, run.optimizer, run.trainable)
    masters = optim.pop("master_weights", None)
    optim = gather_named(optim, group)
    if masters is not None:
        masters = gather_named(masters, group)
        if optim is not None:
            optim["master_weights"] = masters
    weights = gather_named(weights, group)
    return None if weights is None else (weights, optim)


def _save_final(cfg: TrainConfig, model, out_dir: Path, adapter: dict | None = None) -> Path:
    """Full runs: the model in Paddle layout at the root, in float32 (a bf16 run's weights upcast exactly,
    its fp32 router and norms kept; ``export dtype=bfloat16`` writes them in bf16). LoRA runs: the adapter +
    a base reference (``adapter``: its tensors when gathered from the ranks of an expert-parallel run)."""
    from engine.models.saving import save_model

    model.eval()
    if cfg.lora:
        base = Path(cfg.model_name_or_path).resolve()
        lora_mod.save_adapter(
            model,
            out_dir,
            {
                "base_model": str(base),
                "r": cfg.lora_rank,
                "lora_alpha": cfg.effective_lora_alpha,
                "rslora": cfg.rslora,
                "target_modules": cfg.lora_target_modules,
                "compute_type": cfg.compute_type,
                "weight_quant_group_size": cfg.weight_quant_group_size,
                "stage": cfg.stage,
            },
            state=adapter,
        )
        return out_dir
    quant.unwrap_fp8(model)
    save_model(model, out_dir, layout="hf" if cfg.save_to_hf else "paddle")
    return out_dir
