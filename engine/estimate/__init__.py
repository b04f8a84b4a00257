"""The pre-flight estimate of a training run: memory, time and disk from the facts of the run, and the ETA
of a running one. The one place the REST API, the Train form and ``ernie-studio estimate`` read.

Imports no Paddle (the studio's web process uses it): the facts are the model's config.json, the run's
``TrainConfig``, the token statistics of its datasets (``engine.data.stats``) and what the node reports
(``ernie-studio doctor``: devices, memory, the throughput probe). Every figure is a point value with a
low / high range, and the estimate lists what it assumed.

How a run spends memory (docs/training.md, Precision; ``engine/train/precision.py``):

- fp32 and fp8 QAT: fp32 weights; what trains has an fp32 gradient and two fp32 AdamW moments.
- bf16 on a CPU (emulated): decoder linears, embedding and untied head held in bf16, the rest fp32; what
  trains also has an fp32 master copy with an fp32 gradient (the linears' GEMMs write it there; the
  embedding lookup's bf16 gradient is added at the step).
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
- The planner's what-ifs, which this engine does not run (tensor and pipeline parallelism, recompute
  replaying the MoE exchange), are weighed as ERNIEKit runs them: whole layers replayed under recompute,
  the MoE exchange included, and under tensor or pipeline parallelism a Full DPO reference split like the
  model (``recompute_plan``); a pipeline stage holds its layers and the micro-batches 1F1B keeps in
  flight on it (``stage_layers``, ``device_memory``).
- Saving a checkpoint serialises a copy of what it writes (trainable weights and optimizer state);
  saving a Full run's final model copies the weights again (fp32).

The modules: ``calibration`` (the reference node's figures and the constants), ``facts`` (data and node),
``memory`` and ``activations`` (bytes by part, per device), ``timing`` (steps, FLOPs, seconds), ``run``
(one run's estimate and the fit check), ``candidates``, ``checks`` and ``planner`` (the settings that fit),
``eta`` (a running run's ETA). This package re-exports what callers use.
"""

from engine.estimate.activations import recompute_plan
from engine.estimate.calibration import (
    CPU_PROCESS_BASELINE_BYTES,
    GIB,
    GPU_CONTEXT_BYTES,
    MEMORY_RANGE,
    REFERENCE_CPU_FLOPS,
    REFERENCE_PROBE_TOKENS_S,
    TIME_RANGE,
    cpu_speed,
)
from engine.estimate.candidates import (
    DPO_REFERENCE_CHOICES,
    GPU_USABLE_SHARE,
    PLAN_PRECISIONS,
    PLAN_SHOWN,
    PLAN_TENSOR_PARALLEL,
    Candidate,
    PlanError,
    Verdict,
)
from engine.estimate.checks import check_settings
from engine.estimate.eta import ETA_WINDOW, recent_step_seconds, remaining_seconds
from engine.estimate.facts import DatasetTokens, NodeFacts
from engine.estimate.memory import WEIGHT_ONLY_BYTES, Layout, device_memory, layout_of, local_counts
from engine.estimate.planner import Plan, plan_config, plan_run
from engine.estimate.run import Estimate, estimate_run, fit_warning
from engine.estimate.timing import StepShape
from engine.models.counts import ParameterCounts, count_parameters

__all__ = [
    "CPU_PROCESS_BASELINE_BYTES",
    "DPO_REFERENCE_CHOICES",
    "ETA_WINDOW",
    "GIB",
    "GPU_CONTEXT_BYTES",
    "GPU_USABLE_SHARE",
    "MEMORY_RANGE",
    "PLAN_PRECISIONS",
    "PLAN_SHOWN",
    "PLAN_TENSOR_PARALLEL",
    "REFERENCE_CPU_FLOPS",
    "REFERENCE_PROBE_TOKENS_S",
    "TIME_RANGE",
    "WEIGHT_ONLY_BYTES",
    "Candidate",
    "DatasetTokens",
    "Estimate",
    "Layout",
    "NodeFacts",
    "ParameterCounts",
    "Plan",
    "PlanError",
    "StepShape",
    "Verdict",
    "check_settings",
    "count_parameters",
    "cpu_speed",
    "device_memory",
    "estimate_run",
    "fit_warning",
    "layout_of",
    "local_counts",
    "plan_config",
    "plan_run",
    "recent_step_seconds",
    "recompute_plan",
    "remaining_seconds",
]
