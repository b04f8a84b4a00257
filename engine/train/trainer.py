"""The training loop shared by every stage: one readable function, stages plug in their loss.

``run_training(config)`` loads the model, applies quantization and LoRA, builds the data, then repeats:
gather the micro-batches of one step, add their losses (normalised over the whole step), backward,
all-reduce gradients across data-parallel ranks, clip, step AdamW, update the MoE correction biases and
the weight EMA, log, evaluate, checkpoint. A run directory with checkpoints is resumed exactly.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from engine.models.elastic_family import ELASTIC_FAMILY_FILE
from engine.models.expert_parallel import (
    gather_named,
    unsplit_experts,
)
from engine.train import lora as lora_mod
from engine.train.build import (
    build_data,
    build_model,
    build_optimizer,
    check_model_family,
    processor_settings,
)
from engine.train.callbacks import Progress, WeightEMA
from engine.train.config import TrainConfig
from engine.train.elastic import ElasticTraining
from engine.train.notices import announce, runtime_notices
from engine.train.objectives import Objective, build_objective
from engine.train.options import ConfigError
from engine.train.parallel import DataParallel
from engine.train.precision import (
    MasterWeights,
    Precision,
    PrecisionMode,
    resolve_precision,
    set_up_amp,
)
from engine.train.run_checks import sharding_device_problems
from engine.train.run_dir import (
    MetricsLog,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    write_json,
)
from engine.train.run_state import RunSummary, TrainRun
from engine.train.saving import _save_final, held_weights, save_step_checkpoint
from engine.train.scalars import ScalarWriters, run_name
from engine.train.sharding import (
    ShardedOptimizer,
    TensorwiseOffload,
    gpu_sharding_problem,
    optimizer_state_bytes,
    per_rank,
)
from engine.train.stages import TEXT, stage_info
from engine.train.step import StepTiming, accumulate_gradients, optimizer_step, peak_rss_mib, step_metrics

log = logging.getLogger(__name__)


# ---- pieces of the loop --------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup, then cosine / linear decay to ``min_lr``, or constant."""
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    if warmup and step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    if cfg.lr_scheduler_type == "constant":
        return cfg.learning_rate
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if cfg.lr_scheduler_type == "cosine":
        factor = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        factor = 1 - progress
    return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * factor


def dropout_at(step: int, cfg: TrainConfig, layer: int, num_layers: int) -> float:
    """ERNIEKit's hidden dropout: rises linearly over ``dropout_warmup_steps``, and layer i of N drops
    ``p * i / N`` (the first layer none)."""
    ramp = min(1.0, step / cfg.dropout_warmup_steps) if cfg.dropout_warmup_steps else 1.0
    return cfg.hidden_dropout_prob * ramp * layer / num_layers


def set_dropout(model, cfg: TrainConfig, step: int) -> None:
    layers = model.ernie.layers
    for layer in layers:
        layer.hidden_dropout = dropout_at(step, cfg, layer.index, len(layers))


def due(strategy: str, every: int, step: int, epoch_steps: int) -> bool:
    """Whether ``step`` ends a period of ``evaluation_strategy`` / ``save_strategy`` (steps, epoch, no)."""
    if strategy == "steps":
        return bool(every) and step % every == 0
    if strategy == "epoch":
        return step % max(epoch_steps, 1) == 0
    return False


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


# ---- building the run ----------------------------------------------------------------------------------


# ---- the loop ------------------------------------------------------------------------------------------


def run_training(cfg: TrainConfig, on_event: Callable[[dict], None] | None = None) -> RunSummary:
    """Train one stage as configured; writes the run directory and returns its summary."""
    started = datetime.now(UTC).isoformat()
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dp = DataParallel()
    emit = on_event or (lambda event: None)
    summary = RunSummary(status="running", stage=cfg.stage, output_dir=str(out_dir), started_at=started)
    stop = {"signal": None}

    def on_stop(signum, frame):
        stop["signal"] = signum
        # a second Ctrl-C interrupts at once instead of waiting for the checkpoint
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {}
    if _main_thread():  # signal handlers can only be installed from the main thread
        previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        announce(getattr(cfg, "notices", []), summary, emit, dp)
        _train(cfg, dp, out_dir, summary, emit, stop)
    except Exception as e:  # the summary records the failure for the studio; the caller still sees it
        summary.status = "failed"
        summary.error = f"{type(e).__name__}: {e}"
        _finish(summary, out_dir, dp)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _finish(summary, out_dir, dp)
    emit({"type": "status", "status": summary.status})
    return summary


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _finish(summary: RunSummary, out_dir: Path, dp: DataParallel) -> None:
    summary.ended_at = datetime.now(UTC).isoformat()
    summary.checkpoints = [str(p) for p in list_checkpoints(out_dir)]
    if dp.main:
        write_json(out_dir / "run_summary.json", asdict(summary))


@dataclass
class LoopEnd:
    step: int
    metrics: dict[str, Any]
    cancelled: bool


def _train(cfg: TrainConfig, dp: DataParallel, out_dir: Path, summary: RunSummary, emit, stop) -> None:
    run = setup_run(cfg, dp, out_dir, emit)
    summary.precision = run.precision.as_dict()
    announce(run.notices, summary, emit, dp)
    try:
        if not cfg.do_train:
            summary.status, summary.final_metrics = "succeeded", evaluate_only(cfg, run, emit)
            return
        end = train_loop(cfg, dp, out_dir, run, emit, stop)
        summary.optimizer_state_bytes = per_rank(dp, optimizer_state_bytes(run.optimizer))
        if run.sharded is not None:
            summary.sharding = {
                "stage": run.sharded.stage,
                "degree": run.sharded.degree,
                "data_parallel_degree": run.sharded.dp_degree,
            }
    finally:
        if run.scalars is not None:
            run.scalars.close(failed=sys.exc_info()[1] is not None)
    if end.cancelled:
        summary.status, summary.steps, summary.final_metrics = "cancelled", end.step, end.metrics
        return
    t_save = time.time()
    _finish_training(cfg, dp, out_dir, run, summary)
    if run.elastic is not None and dp.main:
        write_json(out_dir / ELASTIC_FAMILY_FILE, run.elastic.summary(run.model, end.metrics))
    end.metrics.update(final_save_s=round(time.time() - t_save, 3), peak_rss_mib=peak_rss_mib())
    summary.status, summary.steps, summary.final_metrics = "succeeded", end.step, end.metrics


def setup_run(cfg: TrainConfig, dp: DataParallel, out_dir: Path, emit) -> TrainRun:
    """Tokenizer, model (+ DPO reference), optimizer, EMA and data; restored from the last checkpoint."""
    from engine.tokenizer import load_tokenizer

    check_devices(cfg, dp.world)
    check_model_family(cfg)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    precision = resolve_precision(cfg.compute_type)
    model, trainable = build_model(cfg, precision, dp.world)
    if not stage_info(cfg.stage).trains(TEXT) and not model.config.is_vl:
        raise ValueError(
            f"stage {cfg.stage} needs a multimodal model; {cfg.model_name_or_path} has no vision encoder"
        )
    if dp.main:
        write_json(out_dir / "train_config.json", asdict(cfg))
    objective = build_objective(cfg, precision)
    # Emulated bf16: AdamW steps fp32 copies of the bf16 weights (LoRA adapters are fp32 already).
    masters = MasterWeights(trainable) if precision.mode is PrecisionMode.EMULATED else None
    if masters is not None and masters.low:
        trainable = masters.trainable(trainable)
    else:
        masters = None
    model, optimizer, scaler, sharded = build_run_optimizer(cfg, dp, model, trainable, precision)
    ema = WeightEMA(trainable, cfg.ema_decay) if cfg.ema_decay else None
    data, total, epoch_steps = None, 0, 1
    if cfg.do_train:  # an evaluation-only run needs no training data
        data = build_data(cfg, tokenizer, "train", cfg.batch_size * dp.world, model.config.vision_config)
        epoch_steps = _epoch_steps(cfg, data, epochs=1.0)
        total = cfg.max_steps if cfg.max_steps > 0 else _epoch_steps(cfg, data)
    if dp.main:
        _print_plan(cfg, dp, model, trainable, total, out_dir)
        print(precision.describe(), flush=True)
    log.info(precision.describe())
    run = TrainRun(tokenizer, model, trainable, optimizer, data, total, objective, ema, None)
    run.epoch_steps, run.notices = epoch_steps, runtime_notices(cfg, model, precision)
    run.precision, run.masters, run.scaler = precision, masters, scaler
    run.elastic = ElasticTraining(cfg, model) if cfg.elastic else None
    run.sharded = sharded
    ckpt = latest_checkpoint(out_dir) if data is not None else None
    if ckpt is not None:
        run.step, run.elapsed_before = load_checkpoint(
            ckpt, model, optimizer, trainable, data, ema, run.elastic, held_weights(model)
        )
        if masters is not None:
            masters.write_back()
        log.info("resuming from %s (step %d)", ckpt, run.step)
        emit({"type": "resume", "step": run.step, "checkpoint": str(ckpt)})
    if data is not None:  # every rank must continue from the same checkpoint, or the weights would differ
        dp.check_same(run.step, "the step resumed from")
    run.metrics_log = MetricsLog(out_dir / "metrics.jsonl") if dp.main else None
    run.scalars = ScalarWriters(cfg.logging_dir, cfg.report_to, run_name(out_dir)) if dp.main else None
    return run


def build_run_optimizer(cfg: TrainConfig, dp: DataParallel, model, trainable: dict, precision: Precision):
    """AdamW, decorated for AMP on a GPU (with its fp16 loss scaler), its state offloaded to host memory
    (tensorwise_offload_optimizer, GPU) and split over the ranks (sharding): (model, optimizer, scaler,
    sharded); stage 2 wraps the model too."""
    optimizer = build_optimizer(cfg, model, trainable)
    scaler = None
    if precision.mode is PrecisionMode.AMP:
        model, optimizer, scaler = set_up_amp(model, optimizer, precision)
    if cfg.tensorwise_offload_optimizer and gpu_sharding_problem("") is None:
        TensorwiseOffload(optimizer)
    split = cfg.do_train and cfg.sharding_degree(dp.world) > 1
    sharded = ShardedOptimizer(cfg, dp, model, optimizer) if split else None
    if sharded is not None:
        model, optimizer = sharded.model, sharded.optimizer
    return model, optimizer, scaler, sharded


def check_devices(cfg: TrainConfig, world: int) -> None:
    """What the config asks of the ``world`` ranks this run got: sharding needs 2+ ranks that its degree
    divides, and stage 2 a GPU (``engine.train.sharding.gpu_sharding_problem``)."""
    if not cfg.do_train:  # an evaluation has no optimizer state to split (runtime_notices says so)
        return
    problems = sharding_device_problems(cfg.sharding, cfg.sharding_parallel_degree, world)
    if cfg.sharding_stage == 2 and 1 < cfg.sharding_degree(world) < world:
        # the gradient norm it reports would miss the data-parallel all-reduce inside Paddle's step
        problems.append(
            f"sharding_parallel_degree: stage2 spans all of the run's {world} devices here; "
            "set -1, or use stage1 to replicate a smaller split"
        )
    if cfg.sharding_stage == 2 and cfg.sharding_degree(world) > 1:
        problems += [
            p + "; use sharding: stage1" for p in [gpu_sharding_problem(f"sharding: {cfg.sharding}")] if p
        ]
    if problems:
        raise ConfigError("; ".join(problems))


def _print_plan(
    cfg: TrainConfig, dp: DataParallel, model, trainable: dict, total: int, out_dir: Path
) -> None:
    n_train = sum(int(np.prod(p.shape)) for p in trainable.values())
    n_all = sum(int(np.prod(p.shape)) for p in model.parameters())
    if not cfg.do_train:
        print(f"{cfg.stage} evaluation of {cfg.model_name_or_path} ({cfg.eval_dataset_path})", flush=True)
        return
    print(
        f"{cfg.stage} ({cfg.fine_tuning}, {cfg.compute_type}) on {cfg.model_name_or_path}: {total} steps x "
        f"{cfg.batch_size * cfg.gradient_accumulation_steps * dp.world} samples, "
        f"{n_train:,} of {n_all:,} weights train; run dir {out_dir}",
        flush=True,
    )


def train_loop(cfg: TrainConfig, dp: DataParallel, out_dir: Path, run: TrainRun, emit, stop) -> LoopEnd:
    """Optimiser steps from ``run.step`` to ``run.total``, or until a stop signal (checkpointed)."""
    step, total = run.step, run.total
    progress = Progress(total, step, dp.main, not cfg.disable_tqdm)
    t_start = time.time() - run.elapsed_before
    it = iter(run.data)
    last_metrics: dict[str, Any] = dict(run.metrics_log.last) if run.metrics_log is not None else {}
    timing = StepTiming()
    while step < total:
        t0 = time.time()
        micro = [dp.slice(next(it), run.model.config) for _ in range(cfg.gradient_accumulation_steps)]
        lr = lr_at(step, cfg, total)
        run.optimizer.set_lr(lr)
        if cfg.hidden_dropout_prob:
            set_dropout(run.model, cfg, step)
        if run.elastic is not None:
            run.elastic.begin_step(run.model)
        try:
            sums, tokens, counts = accumulate_gradients(
                run.model,
                run.objective,
                micro,
                dp,
                run.moe_groups,
                run.scaler,
                run.sharded.loss_scale if run.sharded is not None else 1.0,
            )
        finally:
            if run.elastic is not None:
                run.elastic.end_step(run.model)
        grad_norm = optimizer_step(cfg, run, dp)
        step += 1
        metrics, all_tokens = step_metrics(cfg, run, dp, sums, tokens, counts)
        now = time.time()
        metrics.update(
            step=step,
            learning_rate=lr,
            grad_norm=grad_norm,
            tokens_per_second=all_tokens / max(now - t0, 1e-9),
            elapsed_s=now - t_start,
            epoch=float(run.data.epoch),
        )
        timing.stepped(now - t0)
        metrics.update(timing.row(total))
        last_metrics = metrics
        logged = log_step(cfg, run, step, metrics, emit)
        if logged:
            timing.logged()
        progress.update(step, metrics, logged)

        # every rank must stop at the same step, or the others would wait in all_reduce forever
        cancelled = bool(dp.sum(np.array([stop["signal"] is not None], dtype=np.float64))[0])
        # the last step is always checkpointed: a rerun then finds the run finished, and a larger
        # max_steps continues it instead of starting over
        saving = due(cfg.save_strategy, cfg.save_steps, step, run.epoch_steps)
        if saving or step == total or cancelled:
            save_step_checkpoint(cfg, dp, out_dir, run, step, now - t_start, timing, emit)
        if cancelled:
            # the other ranks wait for rank 0's checkpoint: a rank leaving first makes the launcher stop them
            dp.sum(np.zeros(1))
            progress.close()
            log.warning("received signal %s: saved checkpoint-%d, stopping", stop["signal"], step)
            return LoopEnd(step, last_metrics, cancelled=True)
    progress.close()
    if timing.last_save_s is not None:
        last_metrics["checkpoint_s"] = round(timing.last_save_s, 3)
    return LoopEnd(step, last_metrics, cancelled=False)


def log_step(cfg: TrainConfig, run: TrainRun, step: int, metrics: dict, emit) -> bool:
    """Evaluate when due and write the metrics row when due; True when the step was logged."""
    logged = step % cfg.logging_steps == 0 or step == run.total
    evaluating = due(cfg.evaluation_strategy, cfg.eval_steps, step, run.epoch_steps) or step == run.total
    if cfg.do_eval and cfg.eval_dataset_path and evaluating:
        t0 = time.time()
        metrics.update(_evaluate(cfg, run.model, run.tokenizer, run.objective, run.elastic))
        metrics["eval_s"] = round(time.time() - t0, 3)
        logged = True
    if logged and run.metrics_log is not None:
        record(run, {k: metrics[k] for k in _metric_order(metrics)})
        emit({"type": "metrics", **metrics})
    return logged


def record(run: TrainRun, row: dict[str, Any]) -> None:
    """A metrics row into metrics.jsonl and, when it is new there (not a resumed run's repeat), report_to's logs."""
    if run.metrics_log.write(row) and run.scalars is not None:
        run.scalars.write(row)


def evaluate_only(cfg: TrainConfig, run: TrainRun, emit) -> dict[str, Any]:
    """``do_train: false``: evaluate the model once and record it as step 0; no model is written."""
    metrics = {
        "step": 0,
        **_evaluate(cfg, run.model, run.tokenizer, run.objective, run.elastic),
    }
    if run.metrics_log is not None:
        record(run, metrics)
    emit({"type": "metrics", **metrics})
    print("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "step"), flush=True)
    return metrics


def _finish_training(cfg: TrainConfig, dp: DataParallel, out_dir: Path, run: TrainRun, summary) -> None:
    """Average weights in (EMA), then write the final model and the tokenizer at the run dir root."""
    from engine.tokenizer import copy_tokenizer_files

    if run.ema is not None:
        run.ema.copy_to(run.trainable)
        if run.masters is not None:
            run.masters.write_back()
    adapter = None
    if run.model.expert_group is not None:  # the final model in the official un-split layout, on rank 0
        if cfg.lora:  # only the adapter is written: the experts' adapters, not their frozen base weights
            adapter = gather_named(lora_mod.adapter_state(run.model), run.model.expert_group)
        else:
            unsplit_experts(run.model, run.model.expert_group)
    if dp.main:
        # stage 2 wraps the model (GroupShardedStage2): the final files name the model's own weights
        model = run.sharded.layer if run.sharded is not None else run.model
        summary.model_dir = str(_save_final(cfg, model, out_dir, adapter))
        copy_tokenizer_files(cfg.model_name_or_path, out_dir)
        settings = (
            processor_settings(cfg, model.config.vision_config)
            if stage_info(cfg.stage).trains_paddleocr_vl
            else None
        )
        if settings is not None:  # the image processor it trained with (min_pixels / max_pixels included)
            write_json(out_dir / "preprocessor_config.json", settings.to_preprocessor_config())


def _metric_order(metrics: dict) -> list[str]:
    head = ["step", "loss", "learning_rate", "tokens_per_second", "elapsed_s"]
    return [k for k in head if k in metrics] + sorted(k for k in metrics if k not in head)


def _epoch_steps(cfg: TrainConfig, data, epochs: float | None = None) -> int:
    """Optimiser steps of ``epochs`` (default num_train_epochs) epochs: passes over the data, or with
    num_samples_each_epoch, ERNIEKit's epoch of that many samples drawn from the mixture."""
    batches = data.steps_per_epoch
    if cfg.num_samples_each_epoch:
        batches = max(1, round(batches * cfg.num_samples_each_epoch / max(data.num_items, 1)))
    per_epoch = max(1, batches // cfg.gradient_accumulation_steps)
    return max(1, round(per_epoch * (cfg.num_train_epochs if epochs is None else epochs)))


def _evaluate(cfg: TrainConfig, model, tokenizer, objective: Objective, elastic=None) -> dict:
    rows = cfg.per_device_eval_batch_size or cfg.batch_size
    data = build_data(cfg, tokenizer, "eval", rows, model.config.vision_config)
    model.eval()
    try:
        limit = cfg.max_evaluate_steps if cfg.max_evaluate_steps > 0 else None
        batches = list(itertools.islice(data.one_pass(), limit))
        out = objective.evaluate(model, batches)
        # elastic runs train LM stages (ELASTIC_STAGES): each member's loss beside the whole model's
        return out if elastic is None else {**out, **elastic.evaluate(model, batches)}
    finally:
        model.train()
