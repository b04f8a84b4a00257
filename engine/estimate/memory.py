"""Memory by part: the weights as held, what trains and its optimizer state, and how the ranks split them
(``Layout``); one device's bytes (``device_memory``), shared by the estimate and the planner."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.estimate.activations import _activation_bytes, recompute_plan
from engine.estimate.calibration import CPU_PROCESS_BASELINE_BYTES, GPU_CONTEXT_BYTES
from engine.estimate.messages import ESTIMATE
from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES, ErnieConfig
from engine.models.counts import ParameterCounts, count_parameters
from engine.train.config import TrainConfig


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
            notes.append(ESTIMATE("fp16_needs_gpu"))
        notes.append(ESTIMATE("bf16_emulated"))
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


def _training_state_bytes(
    trainable: float, mode: str, lora: bool, embedding: float = 0.0
) -> dict[str, float]:
    """Gradients, master weights and AdamW moments of what trains (``embedding``: the trained embedding
    table's share of it)."""
    low = not lora and (mode.endswith("-emulated") or mode.endswith("-amp"))
    if low and mode.endswith("-emulated"):
        # the GEMMs' gradients in fp32 on the masters (engine.models.master_grads); the embedding lookup's
        # in bf16 on the table until the step adds it to its master
        gradients = 4 * trainable + 2 * embedding
        return {"masters": 4 * trainable, "gradients": gradients, "moments": 8 * trainable}
    if low:
        return {"masters": 4 * trainable, "gradients": 2 * trainable, "moments": 8 * trainable}
    return {"masters": 0.0, "gradients": 4 * trainable, "moments": 8 * trainable}


# ---- how a run spreads over its devices ---------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a run's ranks split the work: ``devices`` = data-parallel x sharding x expert-parallel (x tensor
    parallel x pipeline parallel, which the planner only uses to say a run needs them). Sharding shards the
    optimizer state (stage 1; stage 2 the gradients too) over the ranks holding the same weights; expert
    parallelism gives each rank 1 / ``expert_parallel`` of every MoE layer's routed experts; offload keeps
    the optimizer state in host RAM (GPU). ``replay_exchange``, like ``tensor_parallel`` or
    ``pipeline_parallel`` > 1, is only a what-if of the planner's: recompute replaying the split MoE blocks'
    exchange as ERNIEKit's does (``recompute_plan``). Under pipeline parallelism a device holds one stage's
    layers (``pipeline_stage``, ``stage_layers``)."""

    devices: int = 1
    expert_parallel: int = 1
    sharding_stage: int = 0
    offload: bool = False
    tensor_parallel: int = 1
    replay_exchange: bool = False
    pipeline_parallel: int = 1
    pipeline_stage: int = 0

    @property
    def replays_exchange(self) -> bool:
        """Whether recompute rebuilds a split MoE block whole, its exchange included: never in this engine;
        in the planner's what-ifs, with ``replay_exchange``, tensor or pipeline parallelism
        (``recompute_plan``)."""
        return self.replay_exchange or self.tensor_parallel > 1 or self.pipeline_parallel > 1

    @property
    def sharding_degree(self) -> int:
        if not self.sharding_stage:
            return 1
        ranks = self.devices // self.pipeline_parallel  # each stage's ranks shard that stage's state
        if self.tensor_parallel > 1:  # experts split over the tensor-parallel group and beyond (moe_group mp)
            return max(ranks // max(self.expert_parallel, self.tensor_parallel), 1)
        return max(ranks // self.expert_parallel, 1)

    def describe(self) -> str:
        parts = []
        if self.tensor_parallel > 1:
            parts.append(f"tensor parallel {self.tensor_parallel}")
        if self.pipeline_parallel > 1:
            parts.append(
                f"pipeline parallel {self.pipeline_parallel} (stage {self.pipeline_stage} the fullest)"
            )
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


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of pipeline ``stage`` of ``stages``: an even split with the remainder on the last
    stages, as fleet's ``SegmentLayers.uniform`` cuts (Paddle 3.3
    paddle/distributed/fleet/meta_parallel/parallel_layers/pp_layers.py); the embedding goes with the
    first stage and the head with the last (``count_parameters``)."""
    size, extra = divmod(num_layers, stages)
    start = stage * size + max(0, stage - (stages - extra))
    return range(start, start + size + (1 if stage >= stages - extra else 0))


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
    pp, in_flight, layers = layout.pipeline_parallel, 1, None
    if pp > 1:  # one stage's layers; 1F1B keeps stages - stage micro-batches in flight on it
        layers = stage_layers(model.num_hidden_layers, pp, layout.pipeline_stage)
        in_flight = pp - layout.pipeline_stage
        targets = list(cfg.lora_target_modules) if lora else []
        counts = count_parameters(model, cfg.lora_rank, targets, layers)
        trainable = counts.lora if lora else _full_trainable(model, counts, cfg)
    local = local_counts(counts, layout)
    local_trainable = local.lora if lora else max(trainable - (counts.total - local.total), 0)
    held = _held_bytes(local, cfg.compute_type, mode, gpu)
    state = _training_state_bytes(local_trainable, mode, lora, local.embedding)
    s = layout.sharding_degree
    masters, moments = state["masters"] / s, state["moments"] / s
    gradients = state["gradients"] / (s if layout.sharding_stage >= 2 else 1)
    offloaded = 0.0
    if layout.offload and gpu:
        offloaded, masters, moments = masters + moments, 0.0, 0.0
    adapters = 4 * local.lora if lora else 0  # fp32 adapter weights beside the frozen base
    recompute, moe_recompute = recompute_plan(cfg, layout.expert_parallel, layout.replays_exchange)
    act = _activation_bytes(
        model, recompute, rows, row_len, gpu, mode, layout.tensor_parallel, moe_recompute, layers, in_flight
    )
    # DPO's reference: LoRA switches its adapters off (the base is the reference); Full keeps a frozen copy
    # of the base in the run's storage precision
    reference = 0.0
    if cfg.holds_reference and not lora:
        # held as dpo_reference_dtype says, with every expert in each process (the trainer never splits it,
        # engine/train/trainer.py build_reference). Under tensor parallelism, which only the planner's
        # what-if has, it is split like the model, as ERNIEKit builds it (erniekit/train/dpo/workflow.py:
        # ref_model = model_class.from_config(ref_config) with the run's tensor_parallel_degree and moe_group)
        # (and over pipeline stages, which the same config builds)
        split = layout.tensor_parallel > 1 or pp > 1
        reference = _reference_bytes(local if split else counts, cfg, mode, gpu)
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
