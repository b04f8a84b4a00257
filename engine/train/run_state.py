"""What a training run holds while it runs (`TrainRun`: model, optimizer, data, logs) and what it reports at its
end (`RunSummary`, written as run_summary.json). Every module of the loop reads them; none is imported back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import paddle

from engine.train.callbacks import WeightEMA
from engine.train.elastic import ElasticTraining
from engine.train.erniekit_keys import Notice
from engine.train.objectives import Objective
from engine.train.precision import (
    MasterWeights,
    Precision,
    resolve_precision,
)
from engine.train.run_dir import (
    MetricsLog,
)
from engine.train.scalars import ScalarWriters
from engine.train.sharding import (
    ShardedOptimizer,
)

EXIT_CANCELLED = 130


@dataclass
class RunSummary:
    status: str
    stage: str
    output_dir: str
    model_dir: str | None = None
    final_metrics: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[str] = field(default_factory=list)
    error: str | None = None
    started_at: str = ""
    ended_at: str = ""
    steps: int = 0
    notices: list[dict[str, str]] = field(default_factory=list)
    precision: dict[str, Any] = field(default_factory=dict)  # what compute_type became on this node
    # bytes of optimizer state each rank held at the end (sharding splits it), and how it was split
    optimizer_state_bytes: list[int] = field(default_factory=list)
    sharding: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return {"succeeded": 0, "cancelled": EXIT_CANCELLED}.get(self.status, 1)


@dataclass
class TrainRun:
    """The pieces the loop works with, built once by ``setup_run`` (a resumed run starts at ``step``)."""

    tokenizer: Any
    model: Any
    trainable: dict[str, paddle.Tensor]
    optimizer: Any
    data: Any
    total: int
    objective: Objective  # what the stage optimises (engine.train.objectives)
    ema: WeightEMA | None
    metrics_log: MetricsLog | None
    step: int = 0
    elapsed_before: float = 0.0
    epoch_steps: int = 1  # optimizer steps per epoch (evaluation_strategy / save_strategy "epoch")
    notices: list[Notice] = field(default_factory=list)
    precision: Precision = field(default_factory=lambda: resolve_precision("fp32"))
    masters: MasterWeights | None = None  # emulated bf16: the fp32 weights ``trainable`` holds
    scaler: Any = None  # fp16 on a GPU: paddle.amp.GradScaler
    scalars: ScalarWriters | None = None  # report_to: TensorBoard / VisualDL copies of metrics.jsonl rows
    elastic: ElasticTraining | None = None  # elastic: the family and the per-step sampler
    sharded: ShardedOptimizer | None = None  # sharding: the optimizer state split over the ranks

    def __post_init__(self) -> None:
        mc = self.model.config
        self.params = list(self.trainable.values())
        self.moe_groups = mc.expert_counts if mc.is_moe else []
