"""What a stage optimises, one class each: a micro-batch's loss, the step's normalisers and the evaluation.

The stage registry (``engine.train.stages``, which imports no Paddle) names each stage's objective; ``OBJECTIVES``
builds it for a run. The step (``engine.train.step.accumulate_gradients``) and the trainer's evaluation call
the objective and never ask which one it is, so a new objective is one class and one entry below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import paddle

from engine.train.build import build_dpo_loss
from engine.train.config import TrainConfig
from engine.train.dpo import DPOLoss, count_pairs, evaluate_dpo
from engine.train.parallel import DataParallel
from engine.train.precision import Precision
from engine.train.sft import evaluate_lm, labelled_tokens, language_model_loss
from engine.train.stages import LM, PREFERENCE, stage_info


@dataclass(frozen=True)
class StepNorms:
    """What one optimiser step's losses are divided by, over every micro-batch and rank: labelled tokens,
    and for preference objectives the pairs (so accumulation and ranks give one big batch's update)."""

    tokens: float
    pairs: float = 0.0


class Objective(Protocol):
    """One micro-batch -> (loss contribution, metric contributions, [(router stats, batch key prefix)])."""

    def norms(self, micro: list[dict], dp: DataParallel) -> StepNorms: ...

    def loss(
        self, model, batch: dict, norms: StepNorms, share: float
    ) -> tuple[paddle.Tensor, dict, list]: ...

    def evaluate(self, model, batches: list[dict]) -> dict: ...


def _step_sum(dp: DataParallel, value: float) -> float:
    return float(dp.sum(np.array([value]))[0])


class LanguageModel:
    """SFT, VL-SFT and pretraining: token-balanced cross entropy plus router losses (engine.train.sft)."""

    def norms(self, micro: list[dict], dp: DataParallel) -> StepNorms:
        return StepNorms(max(_step_sum(dp, sum(labelled_tokens(b) for b in micro)), 1.0))

    def loss(self, model, batch: dict, norms: StepNorms, share: float) -> tuple[paddle.Tensor, dict, list]:
        return language_model_loss(model, batch, norms.tokens, share)

    def evaluate(self, model, batches: list[dict]) -> dict:
        return evaluate_lm(model, batches)


class Preference:
    """DPO (sigmoid, IPO, hinge) over chosen / rejected pairs against a reference (engine.train.dpo)."""

    def __init__(self, dpo: DPOLoss) -> None:
        self.dpo = dpo

    def norms(self, micro: list[dict], dp: DataParallel) -> StepNorms:
        tokens = _step_sum(dp, sum(labelled_tokens(b, "chosen_") for b in micro))
        return StepNorms(max(tokens, 1.0), _step_sum(dp, sum(count_pairs(b) for b in micro)))

    def loss(self, model, batch: dict, norms: StepNorms, share: float) -> tuple[paddle.Tensor, dict, list]:
        return self.dpo(model, batch, norms.pairs, norms.tokens, share)

    def evaluate(self, model, batches: list[dict]) -> dict:
        return evaluate_dpo(model, batches, self.dpo)


# objective name (a stage's ``objective``) -> how a run builds it from its config and precision
OBJECTIVES: dict[str, Callable[[TrainConfig, Precision | None], Objective]] = {
    LM: lambda cfg, precision: LanguageModel(),
    PREFERENCE: lambda cfg, precision: Preference(build_dpo_loss(cfg, precision)),
}


def build_objective(cfg: TrainConfig, precision: Precision | None = None) -> Objective:
    """The objective ``cfg.stage`` trains (a preference objective builds its reference model here)."""
    return OBJECTIVES[stage_info(cfg.stage).objective](cfg, precision)
