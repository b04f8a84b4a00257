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
- The weights stream from safetensors tensor by tensor into the run's storage precision (issue 26): the
  load holds the stored weights plus the tensor being read, never a whole fp32 copy.
- Across devices (``Layout``): sharding stage 1 splits masters and moments over the ranks holding the same
  weights, stage 2 the gradients too; expert parallelism gives each rank 1 / degree of the routed experts
  (their weights, gradients, state and adapters), and at a save every rank holds all ranks' expert
  state, gathered for rank 0's un-split checkpoint; offload moves masters and moments to host RAM (GPU).
- DPO: LoRA's reference is the base with its adapters off (no copy); Full keeps a frozen reference in the
  run's storage precision, every expert in each process.
- The planner's what-ifs, which this engine does not run (tensor parallelism, recompute replaying the MoE
  exchange), are weighed as ERNIEKit runs them: whole layers replayed under recompute, the MoE exchange
  included, and under tensor parallelism a Full DPO reference split like the model (``recompute_plan``).
- Saving a checkpoint serialises a copy of what it writes (trainable weights and optimizer state);
  saving a Full run's final model copies the weights again (fp32).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES, ErnieConfig
from engine.models.counts import ParameterCounts, count_parameters
from engine.train.config import TrainConfig
from engine.train.stages import stage_info

GIB = 1024**3

# ---- calibration (measured on the reference node; bench/bench_estimate.py checks it) -------------------
# The reference node: 2-core AMD EPYC, Paddle 3.3.1 CPU build. Its doctor throughput probe (tiny model,
# batch 4 x 128, forward + backward + AdamW) runs at REFERENCE_PROBE_TOKENS_S while an ERNIE-4.5-0.3B
# step sustains REFERENCE_CPU_FLOPS in its matmuls. Another node (or the same one under another load) is
# assumed to run at (probe / reference) ** PROBE_EXPONENT of it. Measured on 2026-11-26 with the CPU step
# of then (docs/benchmarks.md): the 0.3B LoRA step times the probe gave the same product (31.2k and 31.1k)
# at loads 7.5 and 14.7, where the probe moved 3.6x, and 33k-38k in the earlier runs at loads 2-4.5: the
# step follows the probe in proportion (a square root had it at half the measured time at load 14.7).
# On a quiet box the probe reads 2.5-2.8x the reference and the 0.3B step gains only about 2x: the tiny
# probe is bound by per-op overhead, which a quiet box speeds up more than the big matmuls, which approach
# what the cores and memory give. PROBE_SATURATION bends the proportion there (p / (1 + p / S), scaled to 1
# at the reference). Fitted on 2026-11-28 over the 9 runs docs/benchmarks.md records with their probes (AMD
# EPYC at loads 1-16, Intel Xeon quiet; LoRA fp32/bf16/wint8, Full, stage1 on 2 ranks): the estimate is
# within 0.84-1.18 of each, where the plain proportion gave 0.74-1.08 (the quiet bf16 / wint8 runs low).
REFERENCE_PROBE_TOKENS_S = 4300.0
REFERENCE_CPU_FLOPS = 54e9
PROBE_EXPONENT = 1.0
PROBE_SATURATION = 10.0


def cpu_speed(probe: float | None) -> float:
    """This node's matmul speed as a multiple of the reference node's, from its throughput probe."""
    if not probe:
        return 1.0
    p = (probe / REFERENCE_PROBE_TOKENS_S) ** PROBE_EXPONENT
    if not PROBE_SATURATION:
        return p
    return p / (1 + p / PROBE_SATURATION) * (1 + 1 / PROBE_SATURATION)


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
# How far a node's own record may move the modelled step time (a bad record must not swing it wildly).
STEP_RATIO_BOUNDS = (0.25, 4.0)
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
    devices: int = 1  # GPUs of a GPU node; processes a CPU node's training worker runs a run on
    # measured / modelled seconds per step of the node's recent runs (the studio keeps both), and how many
    step_time_ratio: float | None = None
    step_time_runs: int = 0

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
                "gpu",
                name,
                int(smallest["total_memory_bytes"]),
                ram,
                str(smallest.get("name", "")),
                probe,
                len(gpus),
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

    layout = layout_of(cfg, world)
    parts = device_memory(
        model, counts, cfg, mode, gpu, trainable, shape.rows, shape.memory_width, layout, notes
    )
    training = parts["training"]
    # the weights stream in tensor by tensor, cast or quantized as each is read: the load holds the run's
    # weights in their storage precision, plus the largest tensor (the embedding) while it is read; on a GPU
    # the host holds one tensor at a time
    largest = counts.embedding * (2 if mode.endswith("-emulated") or mode.endswith("-amp") else 4)
    load_peak = parts["baseline"] + parts["weights"] + parts["reference_model"] + largest
    if gpu:
        load_peak = CPU_PROCESS_BASELINE_BYTES + largest
    ckpt_bytes = _checkpoint_bytes(counts, trainable, mode, lora)
    final_bytes = counts.lora * 4 if lora else counts.total * 4
    # save: a serialised copy of the state beside what training holds (the allocator keeps its pool); with
    # sharding, rank 0, which writes, first receives the other ranks' optimizer state, with expert
    # parallelism their experts (expert_parallel.gather_to_writer); the other ranks hold nothing more
    gathered = (
        parts["optimizer"] * (layout.sharding_degree - 1)
        + (parts["master_weights"] * (layout.sharding_degree - 1))
        + _gathered_expert_bytes(counts, layout, trainable, mode, lora)
    )
    save_peak = training + SAVE_COPY * ckpt_bytes + gathered
    final_peak = training + (
        0 if lora else FINAL_SAVE_COPY * final_bytes + _unsplit_expert_bytes(counts, layout, mode)
    )
    memory = {k: v for k, v in parts.items() if k != "host_offload"}
    memory.update(load_peak=load_peak, save_peak=max(save_peak, final_peak))
    on_device = [training, memory["save_peak"]] + ([] if gpu else [load_peak])
    memory["peak"] = max(on_device)
    memory["total"] = memory["peak"]  # the name earlier clients read
    lo, hi = memory["peak"] * MEMORY_RANGE[0], memory["peak"] * MEMORY_RANGE[1]
    node_memory = memory["peak"] * (world if not gpu else 1)
    if gpu and parts["host_offload"]:
        notes.append(
            f"host RAM: the offloaded optimizer state, {parts['host_offload'] / GIB:.1f} GiB per rank "
            f"({world * parts['host_offload'] / GIB:.1f} GiB for {world})"
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
        plain = layout == Layout(world)
        notes.append(
            (f"{world} data-parallel ranks, each holding the whole model and optimizer" if plain else
             f"{world} ranks: {layout.describe()}")
            + ("" if gpu else f"; on one CPU node they share its RAM ({node_memory / GIB:.1f} GiB) and cores")
        )  # fmt: skip
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


# A weight-only linear's bytes per weight: int8 values (int4 ones sit in int8 memory on a CPU) and fp32
# per-output-channel scales (~1/in of the weights; 1% is ample).
WEIGHT_ONLY_BYTES = 1.01


def _reference_bytes(counts: ParameterCounts, cfg: TrainConfig, mode: str, gpu: bool) -> float:
    """Full DPO's frozen reference as ``dpo_reference_dtype`` holds it (engine.train.trainer.reference_storage)."""
    choice = cfg.dpo_reference_dtype
    if choice == "fp32":
        return 4 * counts.total
    if choice == "run":
        return _held_bytes(counts, cfg.compute_type, mode, gpu)
    rest = _held_bytes(counts, cfg.compute_type, mode, gpu) - _held_bytes_of_linears(counts, mode)
    return counts.decoder_linears * WEIGHT_ONLY_BYTES + rest


def _linear_bytes(mode: str) -> float:
    """Bytes per weight of a linear held in a plain mode: bf16 / fp16 storage (emulated or AMP), else fp32."""
    return 2 if mode.endswith(("-emulated", "-amp")) else 4


def _held_bytes_of_linears(counts: ParameterCounts, mode: str) -> float:
    return counts.decoder_linears * _linear_bytes(mode)


def _held_bytes(counts: ParameterCounts, compute_type: str, mode: str, gpu: bool) -> float:
    """The model's weights as the run holds them (``counts`` may be one device's share)."""
    if mode in WEIGHT_ONLY_COMPUTE_TYPES:
        # WEIGHT_ONLY_BYTES; int4 values are packed two a byte on a GPU (the weight-only GEMM's own layout)
        int4 = counts.expert_linears if compute_type == "wint4/8" and gpu else 0
        linears = (counts.decoder_linears - int4) * WEIGHT_ONLY_BYTES + int4 * 0.51
        return linears + 4 * (counts.total - counts.decoder_linears)
    if mode.endswith("-amp"):
        return 2 * (counts.total - counts.other) + 4 * counts.other
    if mode.endswith("-emulated"):
        low = counts.decoder_linears + counts.embedding + counts.head
        return 2 * low + 4 * (counts.total - low)
    return 4 * counts.total


def _training_state_bytes(trainable: float, mode: str, lora: bool) -> dict[str, float]:
    """Gradients, master weights and AdamW moments of what trains."""
    low = not lora and (mode.endswith("-emulated") or mode.endswith("-amp"))
    if low and mode.endswith("-emulated"):
        # bf16 gradient, then an fp32 one on the master (the bf16 one freed as it moves)
        return {"masters": 4 * trainable, "gradients": 6 * trainable, "moments": 8 * trainable}
    if low:
        return {"masters": 4 * trainable, "gradients": 2 * trainable, "moments": 8 * trainable}
    return {"masters": 0.0, "gradients": 4 * trainable, "moments": 8 * trainable}


# ---- how a run spreads over its devices ---------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a run's ranks split the work: ``devices`` = data-parallel x sharding x expert-parallel (x tensor
    parallel, which the planner only uses to say a run needs it). Sharding shards the optimizer state (stage
    1; stage 2 the gradients too) over the ranks holding the same weights; expert parallelism gives each rank
    1 / ``expert_parallel`` of every MoE layer's routed experts; offload keeps the optimizer state in host
    RAM (GPU). ``replay_exchange``, like ``tensor_parallel`` > 1, is only a what-if of the planner's:
    recompute replaying the split MoE blocks' exchange as ERNIEKit's does (``recompute_plan``)."""

    devices: int = 1
    expert_parallel: int = 1
    sharding_stage: int = 0
    offload: bool = False
    tensor_parallel: int = 1
    replay_exchange: bool = False

    @property
    def replays_exchange(self) -> bool:
        """Whether recompute rebuilds a split MoE block whole, its exchange included: never in this engine;
        in the planner's what-ifs, with ``replay_exchange`` or tensor parallelism (``recompute_plan``)."""
        return self.replay_exchange or self.tensor_parallel > 1

    @property
    def sharding_degree(self) -> int:
        if not self.sharding_stage:
            return 1
        if self.tensor_parallel > 1:  # experts split over the tensor-parallel group and beyond (moe_group mp)
            return max(self.devices // max(self.expert_parallel, self.tensor_parallel), 1)
        return max(self.devices // self.expert_parallel, 1)

    def describe(self) -> str:
        parts = []
        if self.tensor_parallel > 1:
            parts.append(f"tensor parallel {self.tensor_parallel}")
        if self.expert_parallel > 1:
            parts.append(f"experts split over {self.expert_parallel}")
        if self.sharding_stage:
            what = "optimizer state" + (" and gradients" if self.sharding_stage == 2 else "")
            parts.append(f"sharding stage {self.sharding_stage} ({what} split over {self.sharding_degree})")
        if self.offload:
            parts.append("optimizer state offloaded to host RAM")
        if self.replay_exchange:
            parts.append("MoE exchange replayed under recompute")
        return ", ".join(parts) or "data-parallel, each holding the whole model and optimizer"


def layout_of(cfg: TrainConfig, devices: int) -> Layout:
    """The layout a config asks for. The keys are read where the config has them (sharding, expert
    parallelism and offload are honoured by the trainer since issue 26; a config without them is plain
    data parallel)."""
    sharding = str(getattr(cfg, "sharding", "") or "")
    stage = 2 if "stage2" in sharding else (1 if "stage1" in sharding else 0)
    ep = int(getattr(cfg, "expert_parallel_degree", 1) or 1)
    offload = bool(getattr(cfg, "tensorwise_offload_optimizer", False))
    return Layout(max(devices, 1), max(ep, 1), stage if devices > 1 else 0, offload)


def local_counts(counts: ParameterCounts, layout: Layout) -> ParameterCounts:
    """One device's share of the weights: routed experts split over the expert-parallel group, the rest
    (embedding, head, dense linears) over the tensor-parallel group."""
    ep, tp = layout.expert_parallel, layout.tensor_parallel
    experts = counts.expert_linears
    dense = counts.decoder_linears - experts
    local_experts = experts // ep
    local_dense = dense // tp
    emb, head = counts.embedding // tp, counts.head // tp
    decoder = local_dense + local_experts
    total = decoder + emb + head + counts.other + counts.vision
    lora = counts.lora - counts.expert_lora + counts.expert_lora // ep
    return replace(
        counts,
        total=total,
        embedding=emb,
        head=head,
        decoder_linears=decoder,
        expert_linears=local_experts,
        lora=lora,
        expert_lora=counts.expert_lora // ep,
    )


def device_memory(
    model: ErnieConfig,
    counts: ParameterCounts,
    cfg: TrainConfig,
    mode: str,
    gpu: bool,
    trainable: int,
    rows: int,
    row_len: float,
    layout: Layout,
    notes: list[str] | None = None,
) -> dict[str, float]:
    """Bytes one device (one process on a CPU node) holds while training, by part, under ``layout``;
    ``host_offload``: what offload moves to host RAM per rank."""
    lora = cfg.lora
    local = local_counts(counts, layout)
    local_trainable = local.lora if lora else max(trainable - (counts.total - local.total), 0)
    held = _held_bytes(local, cfg.compute_type, mode, gpu)
    state = _training_state_bytes(local_trainable, mode, lora)
    s = layout.sharding_degree
    masters, moments = state["masters"] / s, state["moments"] / s
    gradients = state["gradients"] / (s if layout.sharding_stage >= 2 else 1)
    offloaded = 0.0
    if layout.offload and gpu:
        offloaded, masters, moments = masters + moments, 0.0, 0.0
    adapters = 4 * local.lora if lora else 0  # fp32 adapter weights beside the frozen base
    recompute, moe_recompute = recompute_plan(cfg, layout.expert_parallel, layout.replays_exchange)
    act = _activation_bytes(model, recompute, rows, row_len, gpu, mode, layout.tensor_parallel, moe_recompute)
    # DPO's reference: LoRA switches its adapters off (the base is the reference); Full keeps a frozen copy
    # of the base in the run's storage precision
    reference = 0.0
    if cfg.holds_reference and not lora:
        # held as dpo_reference_dtype says, with every expert in each process (the trainer never splits it,
        # engine/train/trainer.py build_reference). Under tensor parallelism, which only the planner's
        # what-if has, it is split like the model, as ERNIEKit builds it (erniekit/train/dpo/workflow.py:
        # ref_model = model_class.from_config(ref_config) with the run's tensor_parallel_degree and moe_group)
        reference = _reference_bytes(local if layout.tensor_parallel > 1 else counts, cfg, mode, gpu)
    baseline = GPU_CONTEXT_BYTES if gpu else CPU_PROCESS_BASELINE_BYTES
    steady = baseline + held + adapters + masters + moments + reference
    # gradients fill up while backward frees activations, but Paddle's allocator keeps what it freed for
    # reuse: at the end of the first backward the process holds both
    training = steady + gradients + act["total"]
    return {
        "baseline": baseline,
        "weights": held,
        "adapters": adapters,
        "master_weights": masters,
        "gradients": gradients,
        "optimizer": moments,
        "reference_model": reference,
        "activations": act["total"],
        "logits": act["logits"],
        "moe_activations": act["moe_kept"],
        "training": training,
        "host_offload": offloaded,
    }


def _gathered_expert_bytes(
    counts: ParameterCounts, layout: Layout, trainable: int, mode: str, lora: bool
) -> float:
    """Expert parallelism's checkpoint on rank 0, which writes it un-split: the other ranks of its expert
    group send their experts' checkpoint state (trainable weights and moments) one tensor at a time
    (``expert_parallel.gather_to_writer``), and rank 0 holds it beside its own through the write. The other
    ranks hold nothing more than one tensor in flight."""
    ep = layout.expert_parallel
    if ep <= 1 or not trainable:
        return 0.0
    local = local_counts(counts, layout)
    experts = local.expert_lora if lora else local.expert_linears
    return (ep - 1) * _checkpoint_bytes(counts, experts, mode, lora)


def _unsplit_expert_bytes(counts: ParameterCounts, layout: Layout, mode: str) -> float:
    """A Full run's final save under expert parallelism: rank 0 puts the other ranks' experts back into its
    model, as held (``expert_parallel.unsplit_experts``), before it writes the un-split model. (LoRA runs
    gather only the experts' adapters.)"""
    ep = layout.expert_parallel
    if ep <= 1:
        return 0.0
    held = WEIGHT_ONLY_BYTES if mode in WEIGHT_ONLY_COMPUTE_TYPES else _linear_bytes(mode)
    return (ep - 1) * local_counts(counts, layout).expert_linears * held


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
    rows = cfg.batch_size * stage_info(cfg.stage).rows_per_sample  # DPO: chosen and rejected
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
) -> dict[str, float]:
    """Activations kept for backward, with and without recompute, and the logits. Eager fp32 on a CPU (its
    attention keeps the score matrices); 16-bit with flash attention (no scores) on a GPU in bf16 / fp16 or
    under a weight-only base. ``recompute`` is the granularity (engine/models/ernie.py
    ``DecoderLayer.forward``): ``full`` recomputes the attention and dense FFN blocks and keeps each one's
    input, ``full_attn`` the attention blocks only, ``core_attn`` only the scores inside attention.
    MoE blocks (``moe_recompute``): ``block`` keeps their input only, ``experts`` (expert parallelism)
    keeps all but the routed and shared experts' FFN activations, None keeps everything.
    Tensor parallelism (sequence parallel) splits them over its group."""
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
    for is_moe, ffn in _ffn_per_layer(model):
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
    kept += largest  # one block's activations live at a time while it is recomputed
    logits = 4 * LOGIT_COPIES * tokens * model.vocab_size
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
                f"CPU: {rate / 1e9:.0f} GFLOP/s in matmuls, the reference node's {REFERENCE_CPU_FLOPS / 1e9:.0f} "
                f"scaled by this node's doctor throughput probe against the reference "
                f"({probe:,.0f} vs {REFERENCE_PROBE_TOKENS_S:,.0f} tokens/s)"
            )
        else:
            notes.append(
                f"CPU: no throughput probe from this node; the reference node's {rate / 1e9:.0f} GFLOP/s assumed"
            )
    step_s = model_step_s = flops / rate + opt_s + upcast_s + overhead
    ratio = node.step_time_ratio
    if ratio:
        # the node's own record beats any probe: its last runs took `ratio` times what this model said
        ratio = min(max(ratio, STEP_RATIO_BOUNDS[0]), STEP_RATIO_BOUNDS[1])
        step_s *= ratio
        notes.append(
            f"this node's recent runs took {ratio:.2f}x the modelled step time "
            f"({node.step_time_runs} run(s)): {model_step_s:.2f} s a step becomes {step_s:.2f} s"
        )
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


# ---- the planner: settings that fit the studio's nodes ----------------------------------------------------

# Precisions the planner tries, most faithful first (a run takes the first that fits). On a GPU, Full trains
# in bf16 (AMP O2); on a CPU bf16 is emulated and slower than fp32, so fp32 comes first there.
PLAN_PRECISIONS = {
    ("gpu", "Full"): ("bf16",),
    ("gpu", "LoRA"): ("bf16", "wint8", "wint4/8"),
    ("cpu", "Full"): ("fp32", "bf16"),
    ("cpu", "LoRA"): ("fp32", "bf16", "wint8", "wint4/8"),
}
# Tensor-parallel degrees the planner tries when nothing else fits, to say how much a run would need.
PLAN_TENSOR_PARALLEL = (2, 4, 8)
# What the planner lists: the best settings that fit, and the closest ones that do not.
PLAN_SHOWN = 5
# Share of a GPU's memory a run may plan on: the rest goes to the allocator's fragmentation and the
# collectives' buffers (Paddle's own default FLAGS_fraction_of_gpu_memory_to_use is 0.92).
GPU_USABLE_SHARE = 0.92
# How a Full DPO run may hold its frozen reference (dpo_reference_dtype), least lossy first.
DPO_REFERENCE_CHOICES = ("run", "wint8", "wint4")


class PlanError(ValueError):
    """A planner request that cannot be planned; the message names the key."""


@dataclass(frozen=True)
class Candidate:
    """One setting the planner weighs: precision, recompute and how the ranks split the work."""

    compute_type: str
    recompute: bool
    layout: Layout
    nodes: int
    reference: str = "run"  # Full DPO: dpo_reference_dtype

    def settings(self) -> dict[str, Any]:
        """The training keys of this setting (ERNIEKit's names) and the studio's num_devices / nodes."""
        lay = self.layout
        out: dict[str, Any] = {
            "compute_type": self.compute_type,
            "recompute": self.recompute,
            "num_devices": lay.devices,
            "nodes": self.nodes,
        }
        if self.reference != "run":
            out["dpo_reference_dtype"] = self.reference
        if lay.sharding_stage:
            out["sharding"] = f"stage{lay.sharding_stage}"
            out["sharding_parallel_degree"] = lay.sharding_degree
        if lay.expert_parallel > 1:
            out["expert_parallel_degree"] = lay.expert_parallel
        if lay.offload:
            out["tensorwise_offload_optimizer"] = True
        if lay.tensor_parallel > 1:
            out["tensor_parallel_degree"] = lay.tensor_parallel
        return out

    def describe(self) -> str:
        where = f"{self.layout.devices} device(s)" + (f" on {self.nodes} nodes" if self.nodes > 1 else "")
        how = [self.compute_type] + (["recompute"] if self.recompute else [])
        return f"{where}, {' + '.join(how)}, {self.layout.describe()}"


@dataclass
class Verdict:
    """A candidate's per-device memory against the device it would run on, and why it does not fit."""

    candidate: Candidate
    memory: dict[str, float]  # bytes per device by part, "peak" included
    host_bytes: float  # host RAM one node needs (offloaded state, or every process of a CPU node)
    fits: bool
    reason: str = ""
    capacity: float = 0.0  # what one device (one process's share of a CPU node) offers
    host_capacity: float | None = None  # a node's host RAM, where known

    def to_dict(self) -> dict[str, Any]:
        parts = {k: v / GIB for k, v in self.memory.items() if v}
        return {
            "settings": self.candidate.settings(),
            "description": self.candidate.describe(),
            "memory_gib": parts,
            "capacity_gib": self.capacity / GIB,
            "host_gib_per_node": self.host_bytes / GIB,
            "host_capacity_gib": None if self.host_capacity is None else self.host_capacity / GIB,
            "fits": self.fits,
            "reason": self.reason,
        }


@dataclass
class Plan:
    """The planner's answer: the settings that fit (best first) at the fewest devices, the closest ones
    that do not and why, and when nothing fits, the reason (a tensor-parallel degree that would)."""

    model: str
    stage: str
    fine_tuning: str
    seq_len: int
    device: str
    devices_known: int
    device_memory: float
    fits: list[Verdict]
    rejected: list[Verdict]
    reason: str = ""
    needs_tensor_parallel: int | None = None
    tensor_parallel_option: Verdict | None = None  # the setting that would fit with that much

    @property
    def verdict(self) -> str:
        return "fits" if self.fits else "does not fit"

    @property
    def best(self) -> Verdict | None:
        return self.fits[0] if self.fits else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "model": self.model,
            "stage": self.stage,
            "fine_tuning": self.fine_tuning,
            "seq_len": self.seq_len,
            "device": self.device,
            "devices_known": self.devices_known,
            "device_memory_gib": self.device_memory / GIB,
            "proposal": self.best.to_dict() if self.best else None,
            "fits": [v.to_dict() for v in self.fits],
            "rejected": [v.to_dict() for v in self.rejected],
            "needs_tensor_parallel": self.needs_tensor_parallel,
            "tensor_parallel_option": self.tensor_parallel_option.to_dict()
            if self.tensor_parallel_option
            else None,
        }


def plan_config(
    model: ErnieConfig, cfg: TrainConfig, nodes: list[NodeFacts], *, model_name: str = ""
) -> Plan:
    """``plan_run`` for a training config (``TrainConfig``): its stage, fine-tuning, max_seq_len, LoRA rank and
    targets, batch size and reference-free choice."""
    return plan_run(
        model,
        cfg.stage,
        cfg.fine_tuning,
        cfg.max_seq_len,
        nodes,
        model_name=model_name or cfg.model_name_or_path,
        lora_rank=cfg.lora_rank,
        lora_targets=list(cfg.lora_target_modules) if cfg.lora else None,
        batch_size=cfg.batch_size,
        reference_free=cfg.reference_free,
    )


def plan_run(
    model: ErnieConfig,
    stage: str,
    fine_tuning: str,
    seq_len: int,
    nodes: list[NodeFacts],
    *,
    model_name: str = "",
    lora_rank: int = 8,
    lora_targets: tuple[str, ...] | list[str] | None = None,
    batch_size: int = 1,
    reference_free: bool = False,
    num_devices: int | None = None,
    expert_parallel_degree: int | None = None,
    sharding: str | None = None,
) -> Plan:
    """Settings that fit ``model`` for ``stage`` / ``fine_tuning`` at ``seq_len`` tokens a row on ``nodes``
    (the studio's nodes: their devices and memory), best first, and why the others do not. ``num_devices``,
    ``expert_parallel_degree`` and ``sharding`` pin those choices (checked; a bad one raises PlanError)."""
    from engine.train.config import LORA_TARGETS, TrainConfig, config_from_dict

    if not nodes:
        raise PlanError("nodes: no node has reported its devices yet; start a worker (ernie-studio worker)")
    gpu_nodes = [n for n in nodes if n.device == "gpu"]
    pool = gpu_nodes or list(nodes)
    kind = "gpu" if gpu_nodes else "cpu"
    known = sum(max(n.devices, 1) for n in pool)
    check_settings(model, pool, num_devices, expert_parallel_degree, sharding)
    lora = fine_tuning == "LoRA"
    targets = list(lora_targets or LORA_TARGETS) if lora else []
    base = config_from_dict(
        TrainConfig,
        {
            "model_name_or_path": model_name or "model",
            "train_dataset_path": "data.jsonl",
            "output_dir": "out",
            "stage": stage,
            "fine_tuning": fine_tuning,
            "max_seq_len": seq_len,
            "batch_size": batch_size,
            "reference_free": reference_free,
            "lora_rank": lora_rank,
            **({"lora_target_modules": targets} if lora else {}),
        },
        source="plan",
    )
    counts = count_parameters(model, lora_rank, targets)
    trainable = counts.lora if lora else _full_trainable(model, counts, base)
    rows = batch_size * stage_info(stage).rows_per_sample
    counts_to_try = _device_counts(pool, num_devices)
    stage_pin = None if sharding is None else _sharding_stage(sharding)

    def weigh(cand: Candidate) -> Verdict:
        cfg = replace(
            base, compute_type=cand.compute_type, recompute=cand.recompute, dpo_reference_dtype=cand.reference
        )
        return _weigh(model, counts, cfg, trainable, rows, seq_len, cand, pool, kind)

    verdicts: dict[int, list[Verdict]] = {}
    for d in counts_to_try:
        cands = _candidates(model, kind, fine_tuning, d, pool, expert_parallel_degree, stage_pin, tp=1)
        cands = _with_references(cands, stage, fine_tuning, reference_free)
        verdicts[d] = sorted((weigh(c) for c in cands), key=_preference)
    device_memory = min(n.memory_bytes or 0 for n in pool)
    fitting_counts = [d for d in counts_to_try if any(v.fits for v in verdicts[d])]
    plan = Plan(
        model=model_name,
        stage=stage,
        fine_tuning=fine_tuning,
        seq_len=seq_len,
        device=kind,
        devices_known=known,
        device_memory=device_memory,
        fits=[],
        rejected=[],
    )
    if fitting_counts:
        chosen = fitting_counts[0]
        plan.fits = [v for v in verdicts[chosen] if v.fits][:PLAN_SHOWN]
        plan.rejected = _alternatives(plan.fits[0], verdicts[chosen])
        smaller = [d for d in counts_to_try if d < chosen][-3:]
        plan.rejected += [_leanest(verdicts[d]) for d in smaller]
        return plan
    plan.rejected = [_leanest(verdicts[d]) for d in counts_to_try[-3:]]
    leanest = plan.rejected[-1]
    plan.reason = f"does not fit on {_pool_text(pool, counts_to_try[-1])}: {leanest.reason}"
    split = [v for v in verdicts[counts_to_try[-1]] if v.candidate.layout.expert_parallel > 1]
    if split and leanest.candidate.layout.expert_parallel == 1:  # and what splitting the experts leaves
        closest = _leanest(split)
        plan.reason += (
            f"; with the experts split over {closest.candidate.layout.expert_parallel}: {closest.reason}"
        )
    plan.reason += _replay_what_if(split, weigh)
    _tensor_parallel_what_if(plan, model, base, kind, counts_to_try[-1], pool, stage_pin, weigh)
    return plan


def _replay_what_if(split: list[Verdict], weigh) -> str:
    """Would recompute replaying the split MoE blocks' exchange (ERNIEKit's recompute does, this engine's
    does not) make one of the expert-parallel settings ``split`` fit, without tensor parallelism? The
    clause that says so, or nothing."""
    replayed = [
        weigh(replace(v.candidate, layout=replace(v.candidate.layout, replay_exchange=True)))
        for v in split
        if v.candidate.recompute
    ]
    fit = sorted((v for v in replayed if v.fits), key=_preference)
    if not fit:
        return ""
    return (
        "; recompute replaying the MoE exchange, as ERNIEKit's does and this engine's does not, would "
        f"bring it to {fit[0].memory['peak'] / GIB:.1f} GiB per device ({fit[0].candidate.describe()})"
    )


def _tensor_parallel_what_if(
    plan: Plan,
    model: ErnieConfig,
    base: TrainConfig,
    kind: str,
    devices: int,
    pool: list[NodeFacts],
    stage_pin: int | None,
    weigh,
) -> None:
    """Would tensor parallelism make it fit on ``devices``? Weighed as ERNIEKit's recipes run it (fleet's
    mp layers with sequence parallel, experts split, whole layers replayed under recompute, a Full DPO
    reference split like the model: ``recompute_plan``, ``device_memory``). Sets ``needs_tensor_parallel``
    to the smallest degree that would, or says what the largest one would still leave per device."""
    per_node = max(n.devices for n in pool)
    closest: Verdict | None = None
    for tp in PLAN_TENSOR_PARALLEL:
        if tp > per_node or devices % tp:
            continue
        cands = _candidates(model, kind, base.fine_tuning, devices, pool, None, stage_pin, tp=tp)
        weighed = [
            weigh(c) for c in _with_references(cands, base.stage, base.fine_tuning, base.reference_free)
        ]
        fit = sorted((v for v in weighed if v.fits), key=_preference)
        if fit:
            plan.needs_tensor_parallel = tp
            plan.tensor_parallel_option = fit[0]
            plan.reason += (
                f"; it needs tensor parallelism: with tensor_parallel_degree {tp} "
                f"({_tensor_parallel_terms(base, fit[0].candidate)}) it would take "
                f"{fit[0].memory['peak'] / GIB:.1f} GiB per device ({fit[0].candidate.describe()}), "
                "and this engine has no tensor parallelism (fleet's mp layers are not implemented)"
            )
            return
        closest = _leanest(weighed) if weighed else closest
    if closest is None:
        return
    held = (
        "weights, gradients and reference" if closest.memory["reference_model"] else "weights and gradients"
    )
    plan.reason += (
        f"; even with tensor_parallel_degree {closest.candidate.layout.tensor_parallel} "
        f"({_tensor_parallel_terms(base, closest.candidate)}): {closest.reason}; what would split the "
        f"{held} further, pipeline parallelism (ERNIEKit's pipeline_parallel_degree) or sharding combined "
        "with expert parallelism, is not in this engine either"
    )


def check_settings(
    model: ErnieConfig,
    nodes: list[NodeFacts],
    num_devices: int | None,
    ep: int | None = None,
    sharding: str | None = None,
) -> None:
    """Refuse, naming the key, what cannot run on ``nodes``: more devices than they hold, an expert-parallel
    degree that does not divide the experts (or the devices) or on a dense model, sharding on one device,
    sharding stage 2 without GPUs."""
    gpu_nodes = [n for n in nodes if n.device == "gpu"]
    pool = gpu_nodes or list(nodes)
    known = sum(max(n.devices, 1) for n in pool)
    if num_devices is not None:
        if num_devices < 1:
            raise PlanError(f"num_devices: {num_devices} is not a number of devices (1 or more)")
        if num_devices > known:
            held = ", ".join(f"{n.name or 'a node'}: {max(n.devices, 1)}" for n in pool)
            raise PlanError(
                f"num_devices: {num_devices} devices are more than the studio's nodes hold ({known}: {held}); "
                f"ask for at most {known}, or start workers on more nodes"
            )
    if ep is not None and ep > 1:
        _check_expert_parallel(model, ep, num_devices)
    if sharding is not None:
        stage = _sharding_stage(sharding)
        if stage and num_devices is not None and num_devices < 2:
            raise PlanError(
                f"sharding: {sharding} splits the optimizer state over data-parallel ranks and the run has "
                "one device; leave sharding out or ask for num_devices of 2 or more"
            )
        if stage == 2 and all(n.device != "gpu" for n in pool):
            raise PlanError(
                "sharding: stage2 needs GPUs (Paddle's group_sharded_parallel refuses CPU); use stage1 here"
            )


def _check_expert_parallel(model: ErnieConfig, ep: int, num_devices: int | None) -> None:
    if not model.is_moe:
        raise PlanError(
            f"expert_parallel_degree: {ep} splits routed experts, and this model is dense (no "
            "moe_num_experts); leave it at 1"
        )
    bad = [n for n in model.expert_counts if n % ep]
    if bad:
        raise PlanError(
            f"expert_parallel_degree: {ep} does not divide the model's {bad[0]} routed experts per layer; "
            f"use a divisor of {bad[0]}"
        )
    if num_devices is not None and num_devices % ep:
        raise PlanError(
            f"expert_parallel_degree: {ep} does not divide num_devices {num_devices}; each expert group "
            "needs that many ranks"
        )


def _sharding_stage(sharding: str) -> int:
    value = (sharding or "").strip()
    if value in ("", "none", "0"):
        return 0
    if value in ("stage1", "1"):
        return 1
    if value in ("stage2", "2"):
        return 2
    raise PlanError(f"sharding: {sharding!r} is not one of stage1, stage2 (or empty for none)")


def _device_counts(pool: list[NodeFacts], pinned: int | None) -> list[int]:
    """Device counts worth trying, ascending: powers of two within a node, whole nodes past it."""
    if pinned is not None:
        return [pinned]
    total = sum(max(n.devices, 1) for n in pool)
    per_node = max(max(n.devices, 1) for n in pool)
    counts = {d for d in (1, 2, 4, 8, 16, 32, 64) if d <= min(per_node, total)}
    counts |= {k * per_node for k in range(1, total // per_node + 1)}
    counts.add(total)
    return sorted(counts)


def _nodes_for(pool: list[NodeFacts], devices: int) -> list[NodeFacts]:
    """The nodes a run of ``devices`` takes: the largest first, whole nodes."""
    taken, have = [], 0
    for n in sorted(pool, key=lambda n: -max(n.devices, 1)):
        if have >= devices:
            break
        taken.append(n)
        have += max(n.devices, 1)
    return taken


def _pool_text(pool: list[NodeFacts], devices: int) -> str:
    nodes = _nodes_for(pool, devices)
    mem = min(n.memory_bytes or 0 for n in nodes)
    what = "GiB device(s)" if nodes[0].device == "gpu" else "GiB of RAM per node"
    return f"{devices} device(s) on {len(nodes)} node(s) ({mem / GIB:.0f} {what})"


def _with_references(cands: list[Candidate], stage: str, fine_tuning: str, reference_free: bool) -> list:
    """Full DPO: each setting with each way of holding the frozen reference, which keeps every expert in
    each process (the trainer never splits it), so quantizing it is the knob that frees room."""
    if not stage_info(stage).needs_reference or fine_tuning != "Full" or reference_free:
        return cands
    return [replace(c, reference=r) for c in cands for r in DPO_REFERENCE_CHOICES]


def _candidates(
    model: ErnieConfig,
    kind: str,
    fine_tuning: str,
    devices: int,
    pool: list[NodeFacts],
    ep_pin: int | None,
    stage_pin: int | None,
    tp: int,
) -> list[Candidate]:
    nodes = len(_nodes_for(pool, devices))
    experts = min(model.expert_counts) if model.is_moe else 1
    if ep_pin:
        eps = [ep_pin]
    else:
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if experts % e == 0 and devices % e == 0]
    stages = ([0, 1, 2] if kind == "gpu" else [0, 1]) if stage_pin is None else [stage_pin]
    offloads = (False, True) if kind == "gpu" and fine_tuning == "Full" else (False,)
    return [
        Candidate(ct, recompute, Layout(devices, ep, stage, offload, tp), nodes)
        for ct, recompute, ep, stage, offload in itertools.product(
            PLAN_PRECISIONS[(kind, fine_tuning)], (False, True), eps, stages, offloads
        )
        if not (stage and Layout(devices, ep, 1, False, tp).sharding_degree < 2)  # nothing to shard over
        and not (stage and ep > 1)  # the trainer refuses sharding with expert parallelism (not combined yet)
    ]


def _weigh(
    model: ErnieConfig,
    counts: ParameterCounts,
    cfg: TrainConfig,
    trainable: int,
    rows: int,
    seq_len: int,
    cand: Candidate,
    pool: list[NodeFacts],
    kind: str,
) -> Verdict:
    gpu = kind == "gpu"
    mode = _precision_mode(cand.compute_type, gpu, [])
    parts = device_memory(model, counts, cfg, mode, gpu, trainable, rows, seq_len, cand.layout)
    peak = parts["training"]
    if not gpu:  # a CPU rank also serialises a checkpoint beside what it holds
        ckpt = parts["master_weights"] + parts["optimizer"] + (parts["adapters"] or parts["weights"])
        peak += SAVE_COPY * ckpt + _gathered_expert_bytes(counts, cand.layout, trainable, mode, cfg.lora)
    memory = {k: v for k, v in parts.items() if k not in ("training", "host_offload")}
    memory["peak"] = peak
    nodes = _nodes_for(pool, cand.layout.devices)
    per_node = min(max(n.devices, 1) for n in nodes) if len(nodes) > 1 else cand.layout.devices
    per_node = min(per_node, cand.layout.devices)
    if gpu:
        host = per_node * (parts["host_offload"] + CPU_PROCESS_BASELINE_BYTES)
        device_cap = GPU_USABLE_SHARE * min(n.memory_bytes or 0 for n in nodes)
        ram = min((n.ram_bytes for n in nodes if n.ram_bytes), default=None)
    else:  # the ranks of one CPU node share its RAM
        host = per_node * peak
        device_cap = min(n.memory_bytes or 0 for n in nodes) / per_node
        ram = None
    lines = []
    if peak > device_cap:
        big = sorted(
            (
                (k, v)
                for k, v in memory.items()
                if k not in ("peak", "baseline", "logits", "moe_activations") and v
            ),
            key=lambda kv: -kv[1],
        )[:4]
        what = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in big)
        where = "per device" if gpu else f"per process ({per_node} per node)"
        lines.append(f"{peak / GIB:.1f} GiB {where} against {device_cap / GIB:.1f} GiB ({what} GiB)")
        if memory["moe_activations"] > 0.25 * peak:
            lines.append(
                f"{memory['moe_activations'] / GIB:.1f} GiB of the activations are the MoE blocks', which "
                "recompute covers only in part with expert parallelism (the router, dispatch and combine are "
                "not replayed in backward: the exchange's collectives are never run twice)"
            )
    if ram is not None and host > ram:
        lines.append(f"host RAM: {host / GIB:.0f} GiB per node against {ram / GIB:.0f} GiB")
    return Verdict(cand, memory, host, not lines, "; ".join(lines), device_cap, ram)


def _preference(v: Verdict) -> tuple:
    """Best first: what fits, then the more faithful precision, no recompute, no offload, less sharding,
    fewer expert groups (less communication)."""
    c = v.candidate
    order = {ct: i for i, ct in enumerate(("fp32", "bf16", "wint8", "wint4/8"))}
    return (not v.fits, order.get(c.compute_type, 9), DPO_REFERENCE_CHOICES.index(c.reference), c.recompute,
            c.layout.offload, c.layout.sharding_stage, c.layout.expert_parallel)  # fmt: skip


def _leanest(verdicts: list[Verdict]) -> Verdict:
    """The setting that needs the least memory per device (what comes closest to fitting)."""
    return min(verdicts, key=lambda v: v.memory["peak"])


def _tensor_parallel_terms(cfg: TrainConfig, cand: Candidate) -> str:
    """What the planner's tensor-parallel what-if assumes beyond the degree, as ERNIEKit's recipes run it
    (``recompute_plan``, ``device_memory``)."""
    terms = ["sequence parallel"]
    if cand.layout.expert_parallel > 1:
        terms.append(f"experts split over {cand.layout.expert_parallel}")
        if cand.recompute:
            terms.append("recompute replaying whole layers, the MoE exchange included, as ERNIEKit's does")
    if cfg.holds_reference and not cfg.lora:
        terms.append("the frozen reference split like the model, as ERNIEKit builds it")
    return ", ".join(terms)


def _alternatives(best: Verdict, verdicts: list[Verdict]) -> list[Verdict]:
    """At the chosen device count, each cheaper choice the best setting could not make, and why: the
    more faithful precision, no recompute, no offload, less sharding, fewer expert groups."""
    c = best.candidate
    lay = c.layout
    order = ("fp32", "bf16", "wint8", "wint4/8")
    wanted = []
    for v in verdicts:
        o, lo = v.candidate, v.candidate.layout
        if v.fits:
            continue
        same = (o.compute_type, o.recompute, lo.offload, lo.sharding_stage, lo.expert_parallel)
        mine = (c.compute_type, c.recompute, lay.offload, lay.sharding_stage, lay.expert_parallel)
        differs = [a != b for a, b in zip(same, mine, strict=True)]
        if sum(differs) != 1:
            continue
        cheaper = (
            (differs[0] and order.index(o.compute_type) < order.index(c.compute_type))
            or (differs[1] and not o.recompute)
            or (differs[2] and not lo.offload)
            or (differs[3] and lo.sharding_stage < lay.sharding_stage)
            or (differs[4] and lo.expert_parallel < lay.expert_parallel)
        )
        if cheaper:
            wanted.append(v)
    return wanted[:PLAN_SHOWN]


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
