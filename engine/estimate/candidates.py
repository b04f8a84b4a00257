"""The settings the planner weighs (``Candidate``), what each takes per device against the nodes
(``Verdict``), and which are best."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from engine.estimate.calibration import CPU_PROCESS_BASELINE_BYTES, GIB, SAVE_COPY
from engine.estimate.facts import NodeFacts
from engine.estimate.memory import Layout, _gathered_expert_bytes, _precision_mode, device_memory
from engine.models.config import ErnieConfig
from engine.models.counts import ParameterCounts
from engine.train.config import TrainConfig
from engine.train.stages import stage_info

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
# Pipeline-parallel degrees it tries with them when tensor parallelism alone does not fit (any that divides
# the devices over the tensor-parallel group, up to one layer a stage; ERNIEKit's 300B-A47B recipes use 5
# and 14).
PLAN_PIPELINE_PARALLEL = tuple(range(2, 65))
# What the planner lists: the best settings that fit, and the closest ones that do not.
PLAN_SHOWN = 5
# Share of a GPU's memory a run may plan on: the rest goes to the allocator's fragmentation and the
# collectives' buffers (Paddle's own default FLAGS_fraction_of_gpu_memory_to_use is 0.92).
GPU_USABLE_SHARE = 0.92
# How a Full DPO run may hold its frozen reference (dpo_reference_dtype), least lossy first.
DPO_REFERENCE_CHOICES = ("run", "wint8", "wint4")


class PlanError(ValueError):
    """A planner request that cannot be planned; the message names the key."""

    def __str__(self) -> str:
        # the message as raised: str() of a keyed message (engine.messages.Message) keeps its key
        return self.args[0] if len(self.args) == 1 and isinstance(self.args[0], str) else super().__str__()


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
        if lay.pipeline_parallel > 1:
            out["pipeline_parallel_degree"] = lay.pipeline_parallel
            # a 1F1B pipeline idles unless it runs at least as many micro-batches as stages (ERNIEKit's
            # recipes: 8 over 5 stages, 36 over 14)
            out["gradient_accumulation_steps"] = lay.pipeline_parallel
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
    pp: int = 1,
) -> list[Candidate]:
    nodes = len(_nodes_for(pool, devices))
    experts = min(model.expert_counts) if model.is_moe else 1
    per_stage = devices // pp  # the ranks holding one pipeline stage
    if ep_pin:
        eps = [ep_pin]
    else:
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if experts % e == 0 and per_stage % e == 0]
    stages = ([0, 1, 2] if kind == "gpu" else [0, 1]) if stage_pin is None else [stage_pin]
    offloads = (False, True) if kind == "gpu" and fine_tuning == "Full" else (False,)
    return [
        Candidate(ct, recompute, Layout(devices, ep, stage, offload, tp, pipeline_parallel=pp), nodes)
        for ct, recompute, ep, stage, offload in itertools.product(
            PLAN_PRECISIONS[(kind, fine_tuning)], (False, True), eps, stages, offloads
        )
        if not (stage and Layout(devices, ep, 1, False, tp, pipeline_parallel=pp).sharding_degree < 2)
        and not (stage and ep > 1)  # the trainer refuses sharding with expert parallelism (not combined yet)
    ]


def _weigh_stages(
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
    """``_weigh`` of a candidate, and under pipeline parallelism of its fullest stage: each stage holds its
    own layers (the first the embedding and the most micro-batches in flight, the last the head and the
    logits), and the run fits only if every stage does."""
    lay = cand.layout
    if lay.pipeline_parallel <= 1:
        return _weigh(model, counts, cfg, trainable, rows, seq_len, cand, pool, kind)
    stages = (replace(cand, layout=replace(lay, pipeline_stage=s)) for s in range(lay.pipeline_parallel))
    weighed = [_weigh(model, counts, cfg, trainable, rows, seq_len, c, pool, kind) for c in stages]
    return max(weighed, key=lambda v: v.memory["peak"])


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
