"""Time: the rows of a step, the steps of a run, FLOPs, seconds per step on a CPU or GPU node, saves and
evaluations."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.estimate.calibration import (
    GPU_DEFAULT_PEAK_FLOPS,
    GPU_PEAK_FLOPS,
    GPU_UTILISATION,
    REFERENCE_CPU_FLOPS,
    REFERENCE_CPU_LAYER_OVERHEAD_S,
    REFERENCE_CPU_OPTIMIZER_S_PER_PARAM,
    REFERENCE_CPU_UPCAST_S_PER_PARAM,
    REFERENCE_PROBE_TOKENS_S,
    REFERENCE_SAVE_BYTES_S,
    STEP_RATIO_BOUNDS,
    TIME_RANGE,
    cpu_speed,
)
from engine.estimate.facts import DatasetTokens, NodeFacts
from engine.estimate.messages import ESTIMATE
from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES, ErnieConfig
from engine.models.counts import ParameterCounts
from engine.train.config import TrainConfig
from engine.train.stages import stage_info


@dataclass(frozen=True)
class StepShape:
    """Rows of one micro-batch and how long they are: on average (time) and at the long end (memory)."""

    rows: int
    width: float  # mean padded row length
    memory_width: float  # a long batch's row length (p95 of the data), what peak memory sees
    attended: float  # attended (query, key) pairs of a mean micro-batch, summed over rows

    @property
    def tokens(self) -> float:
        return self.rows * self.width


def _step_shape(cfg: TrainConfig, datasets: list[DatasetTokens], notes: list[str]) -> StepShape:
    rows = cfg.batch_size * stage_info(cfg.stage).rows_per_sample  # DPO: chosen and rejected
    cap = cfg.max_seq_len
    data = [d for d in datasets if d.num_samples and d.mean_length]
    if not data:
        notes.append(ESTIMATE("no_token_stats", cap=cap))
        return StepShape(rows, float(cap), float(cap), float(rows * cap * cap))
    n = sum(d.num_samples for d in data)
    mean = min(sum(d.mean_length * d.num_samples for d in data) / n, cap)
    p95 = min(max(d.p95_length for d in data), cap)
    longest = min(max(d.max_length for d in data), cap)
    if cfg.packing:
        per_row = max(1.0, cap / mean)
        notes.append(ESTIMATE("packing", cap=cap, per_row=per_row, mean=mean))
        return StepShape(rows, float(cap), float(cap), rows * per_row * mean * mean * 1.2)
    # padded to the longest row of the batch: one row is a sample, many approach the long tail
    width = mean if cfg.batch_size == 1 else mean + (p95 - mean) * (1 - 1 / cfg.batch_size)
    memory_width = p95 if cfg.batch_size == 1 else p95 + (longest - p95) * (1 - 1 / cfg.batch_size)
    notes.append(
        ESTIMATE(
            "data", n=n, mean=mean, p95=p95, longest=longest, cap=cap, rows=cfg.batch_size, width=width,
            memory_width=memory_width,
        )
    )  # fmt: skip
    return StepShape(rows, width, memory_width, rows * width * width)


def _steps(
    cfg: TrainConfig, datasets: list[DatasetTokens], world: int, notes: list[str]
) -> tuple[int, int | None]:
    """Optimizer steps, and steps per epoch (as the trainer counts them: batches per epoch // accumulation)."""
    samples = sum(d.num_samples for d in datasets)
    per_epoch = None
    if samples:
        rows_per_step = cfg.batch_size * world
        items = samples
        if cfg.packing:
            mean = max(sum(d.mean_length * d.num_samples for d in datasets) / samples, 1.0)
            items = max(1, math.ceil(samples * min(mean, cfg.max_seq_len) / cfg.max_seq_len))
        if cfg.num_samples_each_epoch:
            items = max(1, round(items * cfg.num_samples_each_epoch / samples))
        per_epoch = max(1, math.ceil(items / rows_per_step) // cfg.gradient_accumulation_steps)
    if cfg.max_steps > 0:
        return cfg.max_steps, per_epoch
    if per_epoch is None:
        notes.append(ESTIMATE("epochs_without_stats"))
        per_epoch = 1
    return max(1, round(per_epoch * cfg.num_train_epochs)), per_epoch


def _flops_per_step(
    model: ErnieConfig, counts: ParameterCounts, cfg: TrainConfig, shape: StepShape, lora: bool
) -> float:
    """Matmul FLOPs of one optimizer step on one rank: forward 2 per weight and token, backward twice that
    for Full (input and weight gradients) and once for LoRA (input gradients; adapters are small), one
    more forward with recompute or a DPO reference."""
    forward = 2 * counts.matmul_per_token * shape.tokens
    forward += 2 * model.num_attention_heads * model.head_dim * shape.attended * model.num_hidden_layers
    passes = 2.0 if lora else 3.0
    if cfg.recompute:
        passes += 1.0
    if cfg.holds_reference:
        passes += 1.0
    return forward * passes * cfg.gradient_accumulation_steps


def _time(
    model: ErnieConfig,
    cfg: TrainConfig,
    counts: ParameterCounts,
    trainable: int,
    mode: str,
    flops: float,
    steps: int,
    ckpt_bytes: float,
    final_bytes: float,
    node: NodeFacts,
    world: int,
    notes: list[str],
) -> dict[str, Any]:
    layers = model.num_hidden_layers * cfg.gradient_accumulation_steps
    if node.device == "gpu":
        rate, opt_s, upcast_s, overhead, save_rate = _gpu_rates(node, mode, trainable, layers, notes)
    else:
        probe = node.probe_tokens_per_second
        speed = cpu_speed(probe)
        # ranks of one CPU node share its cores
        share = 1.0 / world
        rate = REFERENCE_CPU_FLOPS * speed * share
        # memory-bound: it does not follow the probe
        opt_s = trainable * REFERENCE_CPU_OPTIMIZER_S_PER_PARAM / share
        held = _upcast_weights(counts, mode)
        upcast_s = held * REFERENCE_CPU_UPCAST_S_PER_PARAM.get(_base_kind(mode), 0.0) / (speed * share)
        upcast_s *= cfg.gradient_accumulation_steps
        overhead = REFERENCE_CPU_LAYER_OVERHEAD_S * layers / speed
        save_rate = REFERENCE_SAVE_BYTES_S
        if probe:
            notes.append(
                ESTIMATE(
                    "cpu_rate_probed", gflops=rate / 1e9, reference_gflops=REFERENCE_CPU_FLOPS / 1e9,
                    probe=probe, reference_probe=REFERENCE_PROBE_TOKENS_S,
                )
            )  # fmt: skip
        else:
            notes.append(ESTIMATE("cpu_rate_assumed", gflops=rate / 1e9))
    step_s = model_step_s = flops / rate + opt_s + upcast_s + overhead
    ratio = node.step_time_ratio
    if ratio:
        # the node's own record beats any probe: its last runs took `ratio` times what this model said
        ratio = min(max(ratio, STEP_RATIO_BOUNDS[0]), STEP_RATIO_BOUNDS[1])
        step_s *= ratio
        notes.append(
            ESTIMATE(
                "step_record", ratio=ratio, runs=node.step_time_runs, model_step_s=model_step_s, step_s=step_s
            )
        )
    checkpoints = _checkpoint_count(cfg, steps)
    ckpt_s = ckpt_bytes / save_rate
    final_s = ckpt_s + final_bytes / save_rate  # the last step's checkpoint, then the final model
    notes.append(
        ESTIMATE(
            "saves_adapter" if cfg.lora else "saves_model", checkpoints=checkpoints,
            checkpoint_gb=ckpt_bytes / 1e9, final_gb=final_bytes / 1e9, mb_s=save_rate / 1e6,
        )
    )  # fmt: skip
    # the first step also allocates the optimizer state and warms the kernels up: about half a step more
    total = (steps + 0.5) * step_s + (checkpoints - 1) * ckpt_s + final_s
    return {
        "step_s": step_s,
        "step_s_model": model_step_s,
        "step_s_range": [step_s * TIME_RANGE[0], step_s * TIME_RANGE[1]],
        "compute_s": flops / rate,
        "optimizer_s": opt_s,
        "upcast_s": upcast_s,
        "checkpoints": checkpoints,
        "checkpoint_s": ckpt_s,
        "final_save_s": final_s,
        "total_s": total,
    }


def _gpu_rates(
    node: NodeFacts, mode: str, trainable: int, layers: int, notes: list[str]
) -> tuple[float, float, float, float, float]:
    """(FLOP/s sustained, optimizer s, upcast s, per-step overhead s, save bytes/s) of a GPU node: its
    model's peak (TF32 for fp32 and FP8 QAT) at ``GPU_UTILISATION``."""
    peak = next((v for k, v in GPU_PEAK_FLOPS.items() if k in node.gpu_name.upper()), GPU_DEFAULT_PEAK_FLOPS)
    if mode in ("fp32", "fp8-qat"):
        peak /= 2  # TF32
    rate = peak * GPU_UTILISATION
    opt_s = trainable * 16 / 1.5e12  # AdamW reads and writes ~16 bytes per weight at ~1.5 TB/s
    notes.append(
        ESTIMATE(
            "gpu_rate", gpu=node.gpu_name or "(unnamed)", tflops=rate / 1e12, util=GPU_UTILISATION,
            peak_tflops=peak / 1e12,
        )
    )  # fmt: skip
    return rate, opt_s, 0.0, 0.002 * layers, REFERENCE_SAVE_BYTES_S * 2


def _base_kind(mode: str) -> str:
    if mode in WEIGHT_ONLY_COMPUTE_TYPES:
        return mode
    return "bf16" if mode.endswith("-emulated") else ""


def _upcast_weights(counts: ParameterCounts, mode: str) -> int:
    if mode in WEIGHT_ONLY_COMPUTE_TYPES:
        return counts.decoder_linears
    if mode.endswith("-emulated"):
        return counts.decoder_linears + counts.embedding + counts.head
    return 0


def _checkpoint_count(cfg: TrainConfig, steps: int) -> int:
    """Checkpoints the run writes: every save period, and always at the last step."""
    if cfg.save_strategy == "steps" and cfg.save_steps:
        return steps // cfg.save_steps + (0 if steps % cfg.save_steps == 0 else 1)
    return 1


def _eval_time(
    cfg: TrainConfig,
    eval_datasets: list[DatasetTokens] | None,
    step_s: float,
    step_tokens: float,
    steps: int,
    per_epoch: int | None,
    notes: list[str],
) -> dict[str, float]:
    """Evaluations (due every eval_steps / epoch and at the last step) and seconds each: a forward pass over
    the eval set, about a third of a Full step's compute per token."""
    data = [d for d in eval_datasets or [] if d.num_samples]
    if not (cfg.do_eval and cfg.eval_dataset_path and data):
        return {"evals": 0, "eval_s": 0.0}
    if cfg.evaluation_strategy == "steps" and cfg.eval_steps:
        evals = steps // cfg.eval_steps + (0 if steps % cfg.eval_steps == 0 else 1)
    elif cfg.evaluation_strategy == "epoch" and per_epoch:
        evals = max(1, steps // per_epoch)
    else:
        evals = 1
    rows = cfg.per_device_eval_batch_size or cfg.batch_size
    samples = sum(d.num_samples for d in data)
    mean = sum(min(d.mean_length, cfg.max_seq_len) * d.num_samples for d in data) / samples
    batches = math.ceil(samples / rows)
    if cfg.max_evaluate_steps > 0:
        batches = min(batches, cfg.max_evaluate_steps)
    tokens = batches * rows * mean
    eval_s = step_s / 3 * tokens / max(step_tokens, 1.0)
    notes.append(ESTIMATE("evaluation", evals=evals, batches=batches, seconds=eval_s))
    return {"evals": evals, "eval_s": eval_s}
