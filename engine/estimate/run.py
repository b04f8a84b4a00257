"""The estimate of one run (memory, time, disk, with ranges and what it assumed) and the check against a
node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.estimate.calibration import (
    CPU_PROCESS_BASELINE_BYTES,
    FINAL_SAVE_COPY,
    GIB,
    MEMORY_RANGE,
    SAVE_COPY,
    TIME_RANGE,
)
from engine.estimate.facts import DatasetTokens, NodeFacts
from engine.estimate.memory import (
    Layout,
    _checkpoint_bytes,
    _full_trainable,
    _gathered_expert_bytes,
    _precision_mode,
    _unsplit_expert_bytes,
    device_memory,
    layout_of,
)
from engine.estimate.messages import ESTIMATE
from engine.estimate.timing import _eval_time, _flops_per_step, _step_shape, _steps, _time
from engine.models.config import ErnieConfig
from engine.models.counts import ParameterCounts, count_parameters
from engine.train.config import TrainConfig

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
    ckpt_bytes = _checkpoint_bytes(counts, trainable, mode, lora)
    final_bytes = counts.lora * 4 if lora else counts.total * 4
    memory = _memory_peaks(parts, counts, layout, trainable, mode, lora, gpu, ckpt_bytes, final_bytes)
    lo, hi = memory["peak"] * MEMORY_RANGE[0], memory["peak"] * MEMORY_RANGE[1]
    node_memory = memory["peak"] * (world if not gpu else 1)
    if gpu and parts["host_offload"]:
        offload = parts["host_offload"] / GIB
        notes.append(ESTIMATE("host_offload", rank_gib=offload, total_gib=world * offload, n=world))
    flops = _flops_per_step(model, counts, cfg, shape, lora)
    time = _time(
        model, cfg, counts, trainable, mode, flops, steps, ckpt_bytes, final_bytes, node, world, notes
    )
    time.update(_eval_time(cfg, eval_datasets, time["step_s"], shape.tokens, steps, per_epoch, notes))
    time["total_s"] += time["eval_s"] * time["evals"]
    time["total_s_range"] = [time["total_s"] * TIME_RANGE[0], time["total_s"] * TIME_RANGE[1]]
    checkpoints = time["checkpoints"]
    kept = min(checkpoints, cfg.save_total_limit) if cfg.save_total_limit else checkpoints
    disk = {"checkpoint_bytes": ckpt_bytes, "checkpoints": checkpoints, "final_bytes": final_bytes,
            "total_bytes": ckpt_bytes * kept + final_bytes}  # fmt: skip
    kind = f"LoRA r{cfg.lora_rank}" if lora else "Full"
    notes.insert(
        0, ESTIMATE("weights_train", trainable=trainable, total=counts.total, kind=kind, active=counts.active)
    )
    if world > 1:
        notes.append(_ranks_note(layout, world, gpu, node_memory))
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


def _ranks_note(layout: Layout, world: int, gpu: bool, node_memory: float) -> str:
    """How ``world`` ranks split the run, and on a CPU node that they share its RAM and cores."""
    if layout == Layout(world):
        if gpu:
            return ESTIMATE("data_parallel", n=world)
        return ESTIMATE("data_parallel_cpu", n=world, gib=node_memory / GIB)
    shared = "" if gpu else f"; on one CPU node they share its RAM ({node_memory / GIB:.1f} GiB) and cores"
    return f"{world} ranks: {layout.describe()}{shared}"


def _memory_peaks(
    parts: dict[str, int],
    counts: ParameterCounts,
    layout: Layout,
    trainable: int,
    mode: str,
    lora: bool,
    gpu: bool,
    ckpt_bytes: int,
    final_bytes: int,
) -> dict[str, int]:
    """The memory parts of a run (``device_memory``) with its three peaks: loading the weights, training,
    and saving a checkpoint or the final model; ``peak`` is the largest the device (on a CPU node, RAM) holds."""
    training = parts["training"]
    # the weights stream in tensor by tensor, cast or quantized as each is read: the load holds the run's
    # weights in their storage precision, plus the largest tensor (the embedding) while it is read; on a GPU
    # the host holds one tensor at a time
    largest = counts.embedding * (2 if mode.endswith("-emulated") or mode.endswith("-amp") else 4)
    load_peak = parts["baseline"] + parts["weights"] + parts["reference_model"] + largest
    if gpu:
        load_peak = CPU_PROCESS_BASELINE_BYTES + largest
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
    return memory


# ---- the check against a node ----------------------------------------------------------------------------


def fit_warning(est: Estimate, node: NodeFacts | None) -> str | None:
    """A sentence saying the run will not fit ``node``, or None when it fits (or the node is unknown)."""
    if node is None or not node.memory_bytes:
        return None
    need_lo = est.memory_range[0] * (est.num_devices if node.device == "cpu" else 1)
    need = est.node_memory
    have = node.memory_bytes
    where = (
        ESTIMATE("node_ram", node=node.name, have_gib=have / GIB)
        if node.device == "cpu"
        else ESTIMATE("node_device", node=node.name, gpu=node.gpu_name, have_gib=have / GIB)
    )
    if need_lo > have:
        return ESTIMATE("will_not_fit", need_gib=need / GIB, low_gib=need_lo / GIB, where=where)
    if need > have:
        return ESTIMATE("may_not_fit", need_gib=need / GIB, where=where, have_gib=have / GIB)
    loading = est.memory["load_peak"] * est.num_devices
    if node.device == "gpu" and node.ram_bytes and loading > node.ram_bytes:
        return ESTIMATE("may_not_load", need_gib=loading / GIB, node=node.name, have_gib=node.ram_bytes / GIB)
    return None
