"""The planner: the settings that fit a model, stage and sequence length on the studio's nodes, why the
others do not, and the what-ifs this engine does not run (ERNIEKit's recompute, tensor and pipeline
parallelism)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.estimate.calibration import GIB
from engine.estimate.candidates import (
    PLAN_PIPELINE_PARALLEL,
    PLAN_SHOWN,
    PLAN_TENSOR_PARALLEL,
    Candidate,
    PlanError,
    Verdict,
    _alternatives,
    _candidates,
    _device_counts,
    _leanest,
    _pool_text,
    _preference,
    _weigh_stages,
    _with_references,
)
from engine.estimate.checks import _sharding_stage, check_settings
from engine.estimate.facts import NodeFacts
from engine.estimate.memory import _full_trainable
from engine.models.config import ErnieConfig
from engine.models.counts import count_parameters
from engine.train.config import TrainConfig
from engine.train.stages import stage_info


@dataclass
class Plan:
    """The planner's answer: the settings that fit (best first) at the fewest devices, the closest ones
    that do not and why, and when nothing fits, the reason (a tensor-parallel degree that would, with a
    pipeline-parallel degree where tensor parallelism alone does not)."""

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
    needs_pipeline_parallel: int | None = None  # set with needs_tensor_parallel when TP alone is not enough

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
            "needs_pipeline_parallel": self.needs_pipeline_parallel,
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
    from engine.train.config_load import config_from_dict
    from engine.train.options import LORA_TARGETS

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
            "model_name_or_path": model_name or "model", "train_dataset_path": "data.jsonl", "output_dir": "out",
            "stage": stage, "fine_tuning": fine_tuning, "max_seq_len": seq_len, "batch_size": batch_size,
            "reference_free": reference_free, "lora_rank": lora_rank,
            **({"lora_target_modules": targets} if lora else {}),
        },
        source="plan",
    )  # fmt: skip
    counts = count_parameters(model, lora_rank, targets)
    trainable = counts.lora if lora else _full_trainable(model, counts, base)
    rows = batch_size * stage_info(stage).rows_per_sample
    counts_to_try = _device_counts(pool, num_devices)
    stage_pin = None if sharding is None else _sharding_stage(sharding)

    def weigh(cand: Candidate) -> Verdict:
        cfg = replace(
            base, compute_type=cand.compute_type, recompute=cand.recompute, dpo_reference_dtype=cand.reference
        )
        return _weigh_stages(model, counts, cfg, trainable, rows, seq_len, cand, pool, kind)

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
    what_if = (model, base, kind, counts_to_try[-1], pool, stage_pin, weigh)
    return _nothing_fits(plan, verdicts, counts_to_try, pool, weigh, what_if)


def _nothing_fits(
    plan: Plan,
    verdicts: dict[int, list[Verdict]],
    counts_to_try: list[int],
    pool: list[NodeFacts],
    weigh: Callable[[Candidate], Verdict],
    what_if: tuple,
) -> Plan:
    """``plan`` when no device count fits: the leanest setting of the largest counts and why it does not fit,
    what splitting the experts or replaying their exchange would leave, and the tensor / pipeline
    parallelism (and fewer devices) that would fit. ``what_if``: the what-if helpers' shared arguments."""
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
    closest = _tensor_parallel_what_if(plan, *what_if)
    if closest is not None:
        _pipeline_parallel_what_if(plan, closest, *what_if)
        plan.reason += _fewer_devices_what_if(counts_to_try[:-1], *what_if)
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
) -> Verdict | None:
    """Would tensor parallelism make it fit on ``devices``? Weighed as ERNIEKit's recipes run it (fleet's
    mp layers with sequence parallel, experts split, whole layers replayed under recompute, a Full DPO
    reference split like the model: ``recompute_plan``, ``device_memory``). Sets ``needs_tensor_parallel``
    to the smallest degree that would; otherwise returns the closest setting of the largest degree."""
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
            return None
        closest = _leanest(weighed) if weighed else closest
    if closest is not None:
        plan.reason += (
            f"; even with tensor_parallel_degree {closest.candidate.layout.tensor_parallel} "
            f"({_tensor_parallel_terms(base, closest.candidate)}): {closest.reason}"
        )
    return closest


def _pipeline_parallel_what_if(
    plan: Plan,
    tp_closest: Verdict,
    model: ErnieConfig,
    base: TrainConfig,
    kind: str,
    devices: int,
    pool: list[NodeFacts],
    stage_pin: int | None,
    weigh,
) -> None:
    """Where tensor parallelism alone leaves too much per device: would pipeline parallelism with it make
    the run fit on ``devices``, as ERNIEKit's 300B-A47B recipes combine them (PaddlePaddle/ERNIE
    examples/configs/ERNIE-4.5-300B-A47B: sft/run_sft_8k.yaml and run_sft_32k.yaml tensor_parallel_degree 8
    x pipeline_parallel_degree 5, dpo/run_dpo_8k.yaml and run_dpo_32k.yaml 8 x 14)? Each stage holds its
    share of the layers (``stage_layers``) with their weights, gradients, state and reference, and the
    activations of the micro-batches 1F1B keeps in flight on it; a setting fits if its fullest stage does
    (``_weigh_stages``). Tries the fewest stages first, then the smallest tensor-parallel degree; sets
    ``needs_pipeline_parallel`` and ``needs_tensor_parallel``, or says what the closest leaves."""
    per_node = max(n.devices for n in pool)
    closest: Verdict | None = None
    for pp in (p for p in PLAN_PIPELINE_PARALLEL if p <= model.num_hidden_layers):
        for tp in PLAN_TENSOR_PARALLEL:
            if tp > per_node or devices % (tp * pp):
                continue
            cands = _candidates(model, kind, base.fine_tuning, devices, pool, None, stage_pin, tp=tp, pp=pp)
            cands = _with_references(cands, base.stage, base.fine_tuning, base.reference_free)
            weighed = [weigh(c) for c in cands]
            fit = sorted((v for v in weighed if v.fits), key=_preference)
            if fit:
                plan.needs_tensor_parallel, plan.needs_pipeline_parallel = tp, pp
                plan.tensor_parallel_option = fit[0]
                plan.reason += (
                    f"; it needs tensor and pipeline parallelism: with tensor_parallel_degree {tp} and "
                    f"pipeline_parallel_degree {pp} ({_pipeline_terms(base, fit[0].candidate)}) it would take "
                    f"{fit[0].memory['peak'] / GIB:.1f} GiB per device on its fullest stage "
                    f"({fit[0].candidate.describe()}), and this engine has neither (fleet's mp layers and "
                    "pipeline parallelism are not implemented)"
                )
                return
            closest = min([*weighed, closest] if closest else weighed, key=lambda v: v.memory["peak"])
    if closest is None:
        held = "weights, gradients and reference" if tp_closest.memory["reference_model"] else "weights"
        plan.reason += (
            f"; pipeline parallelism, which would split the {held} over stages, does not divide "
            f"{devices} devices over a tensor-parallel group here, and this engine has neither"
        )
        return
    lay = closest.candidate.layout
    plan.reason += (
        f"; even with pipeline parallelism (at best tensor_parallel_degree {lay.tensor_parallel} x "
        f"pipeline_parallel_degree {lay.pipeline_parallel}, {_pipeline_terms(base, closest.candidate)}): "
        f"{closest.reason}; and this engine has neither tensor nor pipeline parallelism"
    )


def _fewer_devices_what_if(
    counts: list[int],
    model: ErnieConfig,
    base: TrainConfig,
    kind: str,
    devices: int,
    pool: list[NodeFacts],
    stage_pin: int | None,
    weigh,
) -> str:
    """Where tensor parallelism alone does not fit on all ``devices``: would it on fewer of them (``counts``,
    the fewest first)? Expert parallelism needs a degree that divides both the experts and the devices, so
    fewer devices can split the experts further (64 experts: 16 ways on 112 devices, 32 on 32). The clause
    that says so, or nothing."""
    per_node = max(n.devices for n in pool)
    for d in counts:
        for tp in PLAN_TENSOR_PARALLEL:
            if tp > per_node or d % tp:
                continue
            cands = _candidates(model, kind, base.fine_tuning, d, pool, None, stage_pin, tp=tp)
            cands = _with_references(cands, base.stage, base.fine_tuning, base.reference_free)
            fit = sorted((v for v in map(weigh, cands) if v.fits), key=_preference)
            if fit:
                return (
                    f"; tensor parallelism alone would fit on {d} of the {devices} devices: "
                    f"tensor_parallel_degree {tp} ({_tensor_parallel_terms(base, fit[0].candidate)}) would take "
                    f"{fit[0].memory['peak'] / GIB:.1f} GiB per device ({fit[0].candidate.describe()})"
                )
    return ""


def _pipeline_terms(cfg: TrainConfig, cand: Candidate) -> str:
    """What the pipeline what-if assumes beyond the degrees: fleet's layer split and 1F1B schedule."""
    pp = cand.layout.pipeline_parallel
    return (
        f"{_tensor_parallel_terms(cfg, cand)}, the decoder layers split evenly over {pp} stages (fleet's "
        f"uniform segmentation) with the embedding on the first and the head on the last, 1F1B with "
        f"gradient_accumulation_steps {pp}: stage s keeps {pp} - s micro-batches in flight"
    )


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
