"""Elastic MoE training: every optimizer step trains one member of the model's family (ERNIE 5.0's elastic
training over depth, expert count and top-k), so one run yields sub-models that need no training of their
own (``ernie-studio export ... elastic_depth= elastic_experts= elastic_topk=`` cuts one out).

The schedule (docs/training.md, Elastic MoE training): with probability ``elastic_full_share`` a step trains
the full model; otherwise it trains a member drawn uniformly from the others the ``elastic_*`` lists allow
(every depth x experts x top-k with k' <= experts). The draw comes from the sampler's own generator, seeded
by ``seed`` and saved in every checkpoint, so a resumed run trains the same members at the same steps. All
micro-batches (and data-parallel ranks) of a step train the same member.

Inside a step the member is a mask of the full model (``engine.models.elastic.use_submodel``): skipped
layers do not run, routers softmax over the kept experts only, and tokens take k' experts. The router losses
are those of the member's routers; aux-free balancing moves only the correction biases of the layers and
experts the member used (an expert a member drops is not under-loaded, it is absent).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.models.elastic import (
    SubModel,
    active_parameters,
    decode_tokens_per_second,
    family,
    set_submodel,
)
from engine.train.config import TrainConfig
from engine.train.options import ConfigError
from engine.train.run_checks import elastic_model_problems


class ElasticTraining:
    """The family of one elastic run, the per-step sampler and its checkpointed state."""

    def __init__(self, cfg: TrainConfig, model):
        config = model.config
        self.pattern = cfg.elastic_depth_pattern
        where = f"elastic options for {cfg.model_name_or_path}"
        problems = elastic_model_problems(cfg, config)
        if problems:
            raise ConfigError(f"{where}: " + "; ".join(problems))
        depths = cfg.elastic_choices("elastic_depth_choices")
        experts = cfg.elastic_choices("elastic_experts_choices")
        topks = cfg.elastic_choices("elastic_topk_choices")
        self.members = family(config, depths, experts, topks, self.pattern)
        self.full = self.members[0]
        if len(self.members) == 1 and cfg.elastic_full_share < 1:
            raise ConfigError(
                f"{where}: the elastic_*_choices keys name only the full model "
                f"({self.full.name}); list smaller values"
            )
        self.full_share = cfg.elastic_full_share
        self.rng = np.random.default_rng([cfg.seed, 0xE1A57])  # its own stream: data and dropout keep theirs
        self.steps: dict[str, int] = {m.name: 0 for m in self.members}
        self.current: SubModel = self.full

    # ---- the schedule ----------------------------------------------------------------------------------
    def sample(self) -> SubModel:
        others = self.members[1:]
        if not others or self.rng.random() < self.full_share:
            return self.full
        return others[int(self.rng.integers(len(others)))]

    def begin_step(self, model) -> SubModel:
        """Draw this step's member and make ``model`` compute it."""
        self.current = self.sample()
        self.steps[self.current.name] += 1
        set_submodel(model, self.current)
        return self.current

    def end_step(self, model) -> None:
        set_submodel(model, None)

    # ---- what the loop records -----------------------------------------------------------------------------
    def routed(self, model) -> tuple[list[int] | None, int | None]:
        """For aux-free balancing: the MoE layers (positions among the model's MoE layers) and the expert
        prefix the current member routed through (None, None: the full model)."""
        if self.current == self.full:
            return None, None
        from engine.models.elastic import kept_layers

        config = model.config
        moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        kept = set(kept_layers(config.num_hidden_layers, self.current.depth, self.pattern))
        return [j for j, i in enumerate(moe) if i in kept], self.current.experts

    def step_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The step's loss under the member's own key (``elastic_loss/d2-e4-k1``) and its step count."""
        name = self.current.name
        return {
            f"elastic_loss/{name}": metrics["loss"],
            "elastic_full_step": float(self.current == self.full),
        }

    def evaluate(self, model, batches: list[dict]) -> dict[str, float]:
        """``eval_loss/<member>`` of every smaller member (the full model's is ``eval_loss``)."""
        from engine.train.sft import evaluate_lm

        out = {}
        for m in self.members[1:]:
            set_submodel(model, m)
            try:
                out[f"eval_loss/{m.name}"] = evaluate_lm(model, batches)["eval_loss"]
            finally:
                set_submodel(model, None)
        return out

    def family_table(self, model, last_metrics: dict[str, Any]) -> list[dict[str, Any]]:
        """One row per member: its numbers, weights (total, active per token), steps trained, eval loss and
        greedy decoding speed here (batch 1, the masked full model)."""
        config = model.config
        rows = []
        for m in self.members:
            total, active = active_parameters(config, m)
            key = "eval_loss" if m == self.full else f"eval_loss/{m.name}"
            rows.append(
                {
                    "member": m.name,
                    "depth": m.depth,
                    "experts": m.experts,
                    "topk": m.k,
                    "depth_pattern": m.pattern,
                    "parameters": total,
                    "active_parameters": active,
                    "steps_trained": self.steps[m.name],
                    "eval_loss": last_metrics.get(key),
                    "decode_tokens_per_second": round(decode_tokens_per_second(model, m), 1),
                }
            )
        return rows

    def summary(self, model, last_metrics: dict[str, Any]) -> dict[str, Any]:
        """``elastic_family.json``: the schedule and the family table at the end of the run."""
        return {
            "depth_pattern": self.pattern,
            "full_share": self.full_share,
            "members": self.family_table(model, last_metrics),
        }

    # ---- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "steps": dict(self.steps),
            "members": [m.name for m in self.members],
            "full_share": self.full_share,
        }

    def load_state_dict(self, state: dict[str, Any] | None, where: str) -> None:
        if state is None:
            raise ConfigError(
                f"{where}: this checkpoint was written without elastic training; resume it with elastic: false "
                "or start the elastic run in a new output_dir"
            )
        names = [m.name for m in self.members]
        if state["members"] != names or state["full_share"] != self.full_share:
            raise ConfigError(
                f"{where}: the checkpoint's elastic family {state['members']} (full share "
                f"{state['full_share']}) differs from this config's {names} ({self.full_share}); resume with "
                "the elastic_* keys the run started with"
            )
        self.rng.bit_generator.state = state["rng"]
        self.steps = dict(state["steps"])
