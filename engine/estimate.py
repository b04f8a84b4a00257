"""The pre-flight estimate of a training run: memory, time and disk from the facts of the run, and the ETA
of a running one. The one place the REST API, the Train form and ``ernie-studio estimate`` read.

Imports no Paddle (the studio's web process uses it): the facts are the model's config.json, the run's
``TrainConfig``, the token statistics of its datasets (``engine.data.stats``) and what the node reports
(``ernie-studio doctor``: devices, memory, the throughput probe). Every figure is a point value with a
low / high range, and the estimate lists what it assumed.

How a run spends memory (docs/training.md, Precision; ``engine/train/precision.py``):

- fp32 and fp8 QAT: fp32 weights; what trains has an fp32 gradient and two fp32 AdamW moments.
- bf16 on a CPU (emulated): decoder linears, embedding and untied head held in bf16, the rest fp32; what
  trains also has an fp32 master copy with an fp32 gradient (the bf16 gradient is moved onto it).
- bf16 / fp16 on a GPU (AMP O2): everything but the MoE routers held in 16 bits, fp32 masters and moments.
- wint8 / wint4/8: the frozen base's decoder linears as int8 values (int4 values sit in int8 memory) plus
  fp32 per-channel scales; embedding, norms and the vision tower stay fp32. Always LoRA.
- LoRA trains adapters only (fp32, rank r on each target linear, experts and VL groups included).
- The model loads in fp32 before it is cast or quantized, so every variant passes through an fp32 peak.
- Saving a checkpoint serialises a copy of what it writes (trainable weights and optimizer state);
  saving a Full run's final model copies the weights again (fp32).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES, ErnieConfig
from engine.models.counts import ParameterCounts, count_parameters
from engine.train.config import TrainConfig

GIB = 1024**3

# ---- calibration (measured on the reference node; bench/bench_estimate.py checks it) -------------------
# The reference node: 2-core AMD EPYC, Paddle 3.3.1 CPU build. Its doctor throughput probe (tiny model,
# batch 4 x 128, forward + backward + AdamW) runs at REFERENCE_PROBE_TOKENS_S while an ERNIE-4.5-0.3B
# step sustains REFERENCE_CPU_FLOPS in its matmuls. Another node (or the same one under another load) is
# assumed to run at (probe / reference) ** PROBE_EXPONENT of it: the tiny probe is dominated by per-op
# overhead, a big model by matmuls, and on the reference node the 0.3B step moved about half as much
# (in log terms) as the probe did across loads (bench/bench_estimate.py, docs/benchmarks.md).
REFERENCE_PROBE_TOKENS_S = 4300.0
REFERENCE_CPU_FLOPS = 46e9
PROBE_EXPONENT = 0.5
# Per trainable weight and step on the reference CPU: gradient zero-fill, all-reduce bookkeeping, the norm
# for clipping and AdamW's update (memory-bound, so it does not scale with matmul speed).
REFERENCE_CPU_OPTIMIZER_S_PER_PARAM = 7.8e-9
# Per weight and step, emulated bf16 and weight-only bases upcast (dequantize) every held weight in forward
# and again in backward: bench/bench_memory.py's s/step over fp32 at 128 tokens.
REFERENCE_CPU_UPCAST_S_PER_PARAM = {"bf16": 2.8e-9, "wint8": 12e-9, "wint4/8": 12e-9}
# Python and kernel-launch cost of one decoder layer's forward + backward.
REFERENCE_CPU_LAYER_OVERHEAD_S = 0.005
# Resident memory of a trainer process before the model loads (Python, Paddle, tokenizer, data).
CPU_PROCESS_BASELINE_BYTES = 424 * 1024**2
# Loading into the storage precision: the peak over the bytes held (measured 1.01-1.09x on the 0.3B shape),
# and on a GPU node the host's share (one block of rows of a tensor at a time, engine.models.streaming)
LOAD_OVERHEAD = 1.10
LOAD_BLOCK_BYTES = 64 * 1024**2
# A GPU process's CUDA context and kernels' workspace on the device.
GPU_CONTEXT_BYTES = 1 * GIB
# Writing a checkpoint or model: serialisation plus disk on the reference node.
REFERENCE_SAVE_BYTES_S = 300e6
# Saving: paddle.save's copy of a checkpoint's tensors beside the live ones (share of the checkpoint's
# bytes), and save_model's fp32 numpy state plus the shard being written (share of the model's bytes).
SAVE_COPY = 0.9
FINAL_SAVE_COPY = 1.5
# Eager fp32 activations kept for backward per token and decoder layer, in floats, beyond the shape-based
# count below (allocator slack, dtype casts, norm statistics); calibrated against measured peaks.
ACTIVATION_SLACK = 1.0
# Copies of the [tokens, vocab] logits alive at the start of backward (logits, log-softmax, its gradient).
LOGIT_COPIES = 3
# The range around point values: memory is well determined by shapes; time depends on the node's load.
MEMORY_RANGE = (0.85, 1.2)
TIME_RANGE = (0.7, 1.5)
# Peak dense bf16 FLOP/s by GPU name (a substring of the device name the doctor reports).
GPU_PEAK_FLOPS = {
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40": 362e12,
    "4090": 165e12,
    "A10": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}
GPU_DEFAULT_PEAK_FLOPS = 100e12
GPU_UTILISATION = 0.35  # share of peak a training step sustains (MFU)
# Recent steps the ETA looks at: the median of their per-step times (the first, slow step drops out).
ETA_WINDOW = 5


# ---- parameters: engine.models.counts ----------------------------------------------------------------


# ---- the facts an estimate reads ------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetTokens:
    """Token-length statistics of one dataset (``engine.data.stats.dataset_stats`` keys)."""

    num_samples: int
    mean_length: float
    p95_length: float
    max_length: int
    truncated_share: float = 0.0

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> DatasetTokens:
        return cls(
            num_samples=int(stats.get("num_valid") or stats.get("num_records") or 0),
            mean_length=float(stats.get("mean_length") or 0.0),
            p95_length=float(stats.get("p95_length") or stats.get("mean_length") or 0.0),
            max_length=int(stats.get("max_length") or 0),
            truncated_share=float(stats.get("truncated_share") or 0.0),
        )


@dataclass(frozen=True)
class NodeFacts:
    """What the run's node offers (from its doctor report): device kind, memory, speed."""

    device: str = "cpu"  # "cpu" | "gpu"
    name: str = ""  # the node's or worker's name, for messages
    memory_bytes: int | None = None  # RAM (CPU node) or memory of one device (GPU node)
    ram_bytes: int | None = None  # host RAM of a GPU node (where the fp32 load happens)
    gpu_name: str = ""
    probe_tokens_per_second: float | None = None  # the doctor's throughput probe

    @classmethod
    def from_doctor(cls, report: dict[str, Any] | None, name: str = "") -> NodeFacts:
        """The facts of an ``ernie-studio doctor --json`` report (as the node registry stores it)."""
        report = report or {}
        facts = report.get("facts") or {}
        ram = (facts.get("memory") or {}).get("total_bytes")
        gpus = [d for d in facts.get("devices") or [] if d.get("total_memory_bytes")]
        probe = None
        for check in report.get("checks") or []:
            if check.get("name") == "throughput":
                probe = (check.get("values") or {}).get("tokens_per_second")
        if gpus:
            smallest = min(gpus, key=lambda d: d["total_memory_bytes"])
            return cls(
                "gpu", name, int(smallest["total_memory_bytes"]), ram, str(smallest.get("name", "")), probe
            )
        return cls("cpu", name, ram, ram, "", probe)


# ---- the estimate --------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """Memory (bytes), time (seconds) and disk of one run, with ranges and the assumptions behind them."""

    parameters: ParameterCounts
    trainable: int
    precision: str
    num_devices: int
    device: str
    memory: dict[str, float]  # bytes per device (per process on a CPU node)
    memory_range: tuple[float, float]
    node_memory: float  # what the node must hold (a CPU node runs every rank in its RAM)
    tokens_per_step: float
    row_length: float
    steps: int
    steps_per_epoch: int | None
    time: dict[str, float]
    disk: dict[str, float]
    flops_per_step: float
    assumptions: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> float:
        return self.memory["peak"]

    def to_dict(self) -> dict[str, Any]:
        """JSON for REST, the run's recorded prediction and the UI (memory in GiB, disk in bytes)."""
        mem = {k: v / GIB for k, v in self.memory.items()}
        lo, hi = self.memory_range
        return {
            "num_parameters": self.parameters.total,
            "active_parameters": self.parameters.active,
            "trainable_parameters": self.trainable,
            "parameters": self.parameters.as_dict(),
            "precision": self.precision,
            "device": self.device,
            "num_devices": self.num_devices,
            "memory_gib": {**mem, "range": [lo / GIB, hi / GIB], "node_total": self.node_memory / GIB},
            "tokens": round(self.tokens_per_step * self.steps),
            "tokens_per_step": self.tokens_per_step,
            "row_length": self.row_length,
            "steps": self.steps,
            "steps_per_epoch": self.steps_per_epoch,
            "flops": self.flops_per_step * self.steps,
            "time": dict(self.time),
            "seconds": {self.device: self.time["total_s"]},
            "disk": dict(self.disk),
            "assumptions": list(self.assumptions),
        }


def estimate_run(
    model: ErnieConfig,
    cfg: TrainConfig,
    datasets: list[DatasetTokens],
    eval_datasets: list[DatasetTokens] | None = None,
    node: NodeFacts | None = None,
    num_devices: int = 1,
) -> Estimate:
    """Estimate one run of ``cfg`` on ``model`` over ``datasets`` on ``node`` (default: a CPU node like the
    reference one)."""
    node = node or NodeFacts()
    notes: list[str] = []
    gpu = node.device == "gpu"
    lora = cfg.lora
    targets = list(cfg.lora_target_modules) if lora else []
    counts = count_parameters(model, cfg.lora_rank, targets)
    trainable = counts.lora if lora else _full_trainable(model, counts, cfg)
    mode = _precision_mode(cfg.compute_type, gpu, notes)

    shape = _step_shape(cfg, datasets, notes)
    world = max(num_devices, 1)
    steps, per_epoch = _steps(cfg, datasets, world, notes)

    held = _held_bytes(counts, cfg.compute_type, mode, gpu)
    state = _training_state_bytes(trainable, mode, lora)
    adapters = 4 * counts.lora if lora else 0  # fp32 adapter weights beside the frozen base
    act = _activation_bytes(model, cfg, shape.rows, shape.memory_width)
    reference = (
        _reference_bytes(counts, cfg, mode, gpu)
        if cfg.stage == "DPO" and not lora and not cfg.reference_free
        else 0
    )
    baseline = GPU_CONTEXT_BYTES if gpu else CPU_PROCESS_BASELINE_BYTES
    steady = baseline + held + adapters + state["masters"] + state["moments"] + reference
    # gradients fill up while backward frees activations, but Paddle's allocator keeps what it freed for
    # reuse: at the end of the first backward the process holds both
    training = steady + state["gradients"] + act["total"]
    # The checkpoint is read tensor by tensor straight into what the run holds (engine.models.streaming):
    # the load's peak is those bytes and a few percent (1.01-1.09x measured on the 0.3B shape,
    # bench/bench_load_memory.py); on a GPU they go to the device and the host holds one block at a time.
    load_peak = CPU_PROCESS_BASELINE_BYTES + (LOAD_BLOCK_BYTES if gpu else LOAD_OVERHEAD * (held + reference))
    ckpt_bytes = _checkpoint_bytes(counts, trainable, mode, lora)
    final_bytes = counts.lora * 4 if lora else counts.total * 4
    # save: a serialised copy of the state beside what training holds (the allocator keeps its pool)
    save_peak = training + SAVE_COPY * ckpt_bytes
    final_peak = training + (0 if lora else FINAL_SAVE_COPY * final_bytes)
    memory = {
        "baseline": baseline,
        "weights": held,
        "adapters": adapters,
        "master_weights": state["masters"],
        "gradients": state["gradients"],
        "optimizer": state["moments"],
        "reference_model": reference,
        "activations": act["total"],
        "logits": act["logits"],
        "training": training,
        "load_peak": load_peak,
        "save_peak": max(save_peak, final_peak),
    }
    on_device = [training, memory["save_peak"]] + ([] if gpu else [load_peak])
    memory["peak"] = max(on_device)
    memory["total"] = memory["peak"]  # the name earlier clients read
    lo, hi = memory["peak"] * MEMORY_RANGE[0], memory["peak"] * MEMORY_RANGE[1]
    node_memory = memory["peak"] * (world if not gpu else 1)
    if gpu:
        notes.append(
            f"host RAM: the model is read tensor by tensor onto the device, about {load_peak / GIB:.1f} GiB per "
            f"rank ({world * load_peak / GIB:.1f} GiB for {world})"
        )
    flops = _flops_per_step(model, counts, cfg, shape, lora)
    time = _time(
        model, cfg, counts, trainable, mode, flops, steps, ckpt_bytes, final_bytes, node, world, notes
    )
    time.update(_eval_time(cfg, eval_datasets, time["step_s"], shape.tokens, steps, per_epoch, notes))
    time["total_s"] += time["eval_s"] * time["evals"]
    time["total_s_range"] = [time["total_s"] * TIME_RANGE[0], time["total_s"] * TIME_RANGE[1]]
    checkpoints = time["checkpoints"]
    kept = min(checkpoints, cfg.save_total_limit) if cfg.save_total_limit else checkpoints
    disk = {
        "checkpoint_bytes": ckpt_bytes,
        "checkpoints": checkpoints,
        "final_bytes": final_bytes,
        "total_bytes": ckpt_bytes * kept + final_bytes,
    }
    kind = f"LoRA r{cfg.lora_rank}" if lora else "Full"
    notes.insert(
        0, f"{trainable:,} of {counts.total:,} weights train ({kind}); {counts.active:,} active per token"
    )
    if world > 1:
        notes.append(
            f"{world} data-parallel ranks, each holding the whole model and optimizer"
            + ("" if gpu else f"; on one CPU node they share its RAM ({node_memory / GIB:.1f} GiB) and cores")
        )
    return Estimate(
        parameters=counts,
        trainable=trainable,
        precision=mode,
        num_devices=world,
        device=node.device,
        memory=memory,
        memory_range=(lo, hi),
        node_memory=node_memory,
        tokens_per_step=shape.tokens * world * cfg.gradient_accumulation_steps,
        row_length=shape.width,
        steps=steps,
        steps_per_epoch=per_epoch,
        time=time,
        disk=disk,
        flops_per_step=flops,
        assumptions=notes,
    )


def _full_trainable(model: ErnieConfig, counts: ParameterCounts, cfg: TrainConfig) -> int:
    frozen = cfg.frozen
    n = counts.total
    if "freeze_vision" in frozen:
        n -= counts.vision
    if "freeze_lm" in frozen:
        n = counts.vision if "freeze_vision" not in frozen else 0
    return n


def _precision_mode(compute_type: str, gpu: bool, notes: list[str]) -> str:
    if compute_type in WEIGHT_ONLY_COMPUTE_TYPES:
        return compute_type
    if compute_type in ("bf16", "fp16"):
        if gpu:
            return f"{compute_type}-amp"
        if compute_type == "fp16":
            notes.append("fp16 needs a GPU (loss scaling); this node would refuse the run")
        notes.append(
            "bf16 on a CPU is emulated: bf16 weight storage, fp32 compute, fp32 master weights and moments"
        )
        return f"{compute_type}-emulated"
    return "fp32" if compute_type != "fp8" else "fp8-qat"


def _reference_bytes(counts: ParameterCounts, cfg: TrainConfig, mode: str, gpu: bool) -> float:
    """Full DPO's frozen reference as ``dpo_reference_dtype`` holds it (engine.train.trainer.reference_storage)."""
    choice = cfg.dpo_reference_dtype
    if choice == "fp32":
        return 4 * counts.total
    if choice == "run":
        return _held_bytes(counts, cfg.compute_type, mode, gpu)
    rest = _held_bytes(counts, cfg.compute_type, mode, gpu) - _held_bytes_of_linears(counts, mode)
    return counts.decoder_linears * 1.01 + rest  # int8 values (int4 in int8 memory) and fp32 scales


def _held_bytes_of_linears(counts: ParameterCounts, mode: str) -> float:
    return counts.decoder_linears * (2 if mode.endswith(("-emulated", "-amp")) else 4)


def _held_bytes(counts: ParameterCounts, compute_type: str, mode: str, gpu: bool) -> float:
    """The model's weights as the run holds them."""
    if mode in WEIGHT_ONLY_COMPUTE_TYPES:
        # int8 values (int4 too) + fp32 per-output-channel scales (~1/in of the weights; 1% is ample)
        linears = counts.decoder_linears * 1.01
        if gpu:  # the weight-only GEMM keeps a second copy in its own layout (int4 packed on GPU)
            int4 = counts.expert_linears if compute_type == "wint4/8" else 0
            linears += (counts.decoder_linears - int4) + int4 * 0.5
        return linears + 4 * (counts.total - counts.decoder_linears)
    if mode.endswith("-amp"):
        return 2 * (counts.total - counts.other) + 4 * counts.other
    if mode.endswith("-emulated"):
        low = counts.decoder_linears + counts.embedding + counts.head
        return 2 * low + 4 * (counts.total - low)
    return 4 * counts.total


def _training_state_bytes(trainable: int, mode: str, lora: bool) -> dict[str, float]:
    """Gradients, master weights and AdamW moments of what trains."""
    low = not lora and (mode.endswith("-emulated") or mode.endswith("-amp"))
    if low and mode.endswith("-emulated"):
        # bf16 gradient, then an fp32 one on the master (the bf16 one freed as it moves)
        return {"masters": 4 * trainable, "gradients": 6 * trainable, "moments": 8 * trainable}
    if low:
        return {"masters": 4 * trainable, "gradients": 2 * trainable, "moments": 8 * trainable}
    return {"masters": 0.0, "gradients": 4 * trainable, "moments": 8 * trainable}


def _checkpoint_bytes(counts: ParameterCounts, trainable: int, mode: str, lora: bool) -> float:
    """checkpoint-N: trainable weights (fp32 masters where held), AdamW moments, AMP's master weights."""
    masters = 4 * trainable if mode.endswith("-amp") and not lora else 0
    return 4 * trainable + 8 * trainable + masters


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
    rows = cfg.batch_size * (2 if cfg.stage == "DPO" else 1)  # DPO: chosen and rejected
    cap = cfg.max_seq_len
    data = [d for d in datasets if d.num_samples and d.mean_length]
    if not data:
        notes.append(f"no token statistics of the data yet: every sample assumed {cap} tokens long")
        return StepShape(rows, float(cap), float(cap), float(rows * cap * cap))
    n = sum(d.num_samples for d in data)
    mean = min(sum(d.mean_length * d.num_samples for d in data) / n, cap)
    p95 = min(max(d.p95_length for d in data), cap)
    longest = min(max(d.max_length for d in data), cap)
    if cfg.packing:
        per_row = max(1.0, cap / mean)
        notes.append(
            f"packing: rows of {cap} tokens holding ~{per_row:.1f} samples of {mean:.0f} tokens on average"
        )
        return StepShape(rows, float(cap), float(cap), rows * per_row * mean * mean * 1.2)
    # padded to the longest row of the batch: one row is a sample, many approach the long tail
    width = mean if cfg.batch_size == 1 else mean + (p95 - mean) * (1 - 1 / cfg.batch_size)
    memory_width = p95 if cfg.batch_size == 1 else p95 + (longest - p95) * (1 - 1 / cfg.batch_size)
    notes.append(
        f"data: {n:,} samples, mean {mean:.0f} / p95 {p95:.0f} / max {longest} tokens (cut at max_seq_len "
        f"{cap}); a step of {cfg.batch_size} row(s) pads to ~{width:.0f} tokens, long ones to "
        f"~{memory_width:.0f}"
    )
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
        notes.append("training by epochs over datasets without statistics: 1 step per epoch assumed")
        per_epoch = 1
    return max(1, round(per_epoch * cfg.num_train_epochs)), per_epoch


def _activation_bytes(model: ErnieConfig, cfg: TrainConfig, rows: int, row_len: float) -> dict[str, float]:
    """Eager fp32 activations kept for backward, with and without recompute, and the logits."""
    h, hd = model.hidden_size, model.head_dim
    nh, kv = model.num_attention_heads, model.num_key_value_heads
    layers = model.num_hidden_layers
    ffn = _ffn_width_per_token(model)
    # norms (in and out, twice), qkv, rotary (q and k, rotated and their halves), scaled q, attention out
    # and its transpose, o_proj, residuals, up_gate, swiglu, down
    per_token_layer = 8 * h + (nh + 2 * kv) * hd + (4 * nh + 2 * kv) * hd + 3 * ffn
    tokens = rows * row_len
    scores = 2 * nh * rows * row_len * row_len / 2  # scores and probabilities of the causal half
    layer_bytes = 4 * ACTIVATION_SLACK * (per_token_layer * tokens + scores)
    if cfg.recompute:  # each layer keeps its input; one layer's activations live at a time in backward
        kept = 4 * h * tokens * layers + layer_bytes
    else:
        kept = layer_bytes * layers
    logits = 4 * LOGIT_COPIES * tokens * model.vocab_size
    return {"layers": kept, "logits": logits, "total": kept + logits}


def _ffn_width_per_token(model: ErnieConfig) -> float:
    """Mean FFN width a token runs through over the layers (MoE: k experts + shared experts)."""
    widths = []
    for i in range(model.num_hidden_layers):
        if not model.is_moe_layer(i):
            widths.append(model.intermediate_size)
        else:
            inter = model.expert_intermediate_sizes[0]
            widths.append(inter * (model.moe_k + model.moe_num_shared_experts))
    return sum(widths) / max(len(widths), 1)


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
    if cfg.stage == "DPO" and not cfg.reference_free:
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
        peak = next(
            (v for k, v in GPU_PEAK_FLOPS.items() if k in node.gpu_name.upper()), GPU_DEFAULT_PEAK_FLOPS
        )
        if mode in ("fp32", "fp8-qat"):
            peak /= 2  # TF32
        rate = peak * GPU_UTILISATION
        opt_s = trainable * 16 / 1.5e12  # AdamW reads and writes ~16 bytes per weight at ~1.5 TB/s
        upcast_s = 0.0
        overhead = 0.002 * layers
        save_rate = REFERENCE_SAVE_BYTES_S * 2
        notes.append(
            f"GPU {node.gpu_name or '(unnamed)'}: {rate / 1e12:.0f} TFLOP/s sustained "
            f"({GPU_UTILISATION:.0%} of {peak / 1e12:.0f})"
        )
    else:
        probe = node.probe_tokens_per_second
        speed = (probe / REFERENCE_PROBE_TOKENS_S) ** PROBE_EXPONENT if probe else 1.0
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
                f"CPU: {rate / 1e9:.0f} GFLOP/s in matmuls, the reference node's {REFERENCE_CPU_FLOPS / 1e9:.0f} "
                f"scaled by the square root of this node's doctor throughput probe against the reference "
                f"({probe:,.0f} vs {REFERENCE_PROBE_TOKENS_S:,.0f} tokens/s)"
            )
        else:
            notes.append(
                f"CPU: no throughput probe from this node; the reference node's {rate / 1e9:.0f} GFLOP/s assumed"
            )
    step_s = flops / rate + opt_s + upcast_s + overhead
    checkpoints = _checkpoint_count(cfg, steps)
    ckpt_s = ckpt_bytes / save_rate
    final_s = ckpt_s + final_bytes / save_rate  # the last step's checkpoint, then the final model
    notes.append(
        f"saves: {checkpoints} checkpoint(s) of {ckpt_bytes / 1e9:.2f} GB and a final "
        f"{'adapter' if cfg.lora else 'model'} of {final_bytes / 1e9:.2f} GB at ~{save_rate / 1e6:.0f} MB/s"
    )
    # the first step also allocates the optimizer state and warms the kernels up: about half a step more
    total = (steps + 0.5) * step_s + (checkpoints - 1) * ckpt_s + final_s
    return {
        "step_s": step_s,
        "step_s_range": [step_s * TIME_RANGE[0], step_s * TIME_RANGE[1]],
        "compute_s": flops / rate,
        "optimizer_s": opt_s,
        "upcast_s": upcast_s,
        "checkpoints": checkpoints,
        "checkpoint_s": ckpt_s,
        "final_save_s": final_s,
        "total_s": total,
    }


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
    notes.append(f"evaluation: {evals} pass(es) over {batches} batch(es), ~{eval_s:.0f} s each")
    return {"evals": evals, "eval_s": eval_s}


# ---- the check against a node ----------------------------------------------------------------------------


def fit_warning(est: Estimate, node: NodeFacts | None) -> str | None:
    """A sentence saying the run will not fit ``node``, or None when it fits (or the node is unknown)."""
    if node is None or not node.memory_bytes:
        return None
    need_lo = est.memory_range[0] * (est.num_devices if node.device == "cpu" else 1)
    need = est.node_memory
    have = node.memory_bytes
    where = (
        f"{node.name}'s RAM ({have / GIB:.1f} GiB)"
        if node.device == "cpu"
        else f"one device of {node.name} ({node.gpu_name}, {have / GIB:.1f} GiB)"
    )
    if need_lo > have:
        return (
            f"will not fit: the run needs about {need / GIB:.1f} GiB at its peak "
            f"(at least {need_lo / GIB:.1f}) and {where} holds less; try LoRA, compute_type bf16 or wint8, "
            "recompute, a shorter max_seq_len or a smaller batch_size"
        )
    if need > have:
        return (
            f"may not fit: the run needs about {need / GIB:.1f} GiB at its peak and {where} holds "
            f"{have / GIB:.1f}; the estimate's low end fits"
        )
    if node.device == "gpu" and node.ram_bytes and est.memory["load_peak"] * est.num_devices > node.ram_bytes:
        return (
            f"may not fit: loading takes about {est.memory['load_peak'] * est.num_devices / GIB:.1f} GiB of "
            f"{node.name}'s host RAM ({node.ram_bytes / GIB:.1f} GiB)"
        )
    return None


# ---- the ETA of a running run ----------------------------------------------------------------------------


def recent_step_seconds(step_times: list[float]) -> float | None:
    """Seconds per step from the last ``ETA_WINDOW`` per-step times: their median (one slow first step or a
    hiccup does not swing it, and a run that slows down moves it within a few steps)."""
    times = [t for t in step_times if t and t > 0]
    if not times:
        return None
    if len(times) > 1:
        times = times[1:] if len(times) <= ETA_WINDOW else times[-ETA_WINDOW:]
    return float(statistics.median(times))


def remaining_seconds(
    *,
    step: int,
    total: int,
    step_s: float | None,
    eval_s: float = 0.0,
    evals_left: int = 0,
    checkpoint_s: float = 0.0,
    checkpoints_left: int = 0,
    final_save_s: float = 0.0,
    since_last_step_s: float = 0.0,
) -> float | None:
    """Seconds until a run ends: its remaining steps, evaluations and saves, and the final save (the last
    step's checkpoint and the final model). Past the last step: what is left of the final save, never 0
    while it runs."""
    if step >= total:
        return max(final_save_s - since_last_step_s, 1.0)
    if step_s is None:
        return None
    left = (total - step) * step_s - min(since_last_step_s, step_s)
    return max(left, 0.0) + evals_left * eval_s + checkpoints_left * checkpoint_s + final_save_s
