"""Direct preference optimisation: sigmoid (DPO), IPO and hinge losses over chosen / rejected pairs.

The reference policy is a frozen copy of the base model, or for LoRA the same model with its adapters
switched off; ``reference_free`` drops it. Log-probabilities are sums over the response tokens.
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F

from engine.models.ernie import CausalLMOutput, per_token_loss
from engine.train.lora import adapters_disabled
from engine.train.sft import router_penalty, to_tensor_batch


def sequence_logps(model, t: dict) -> tuple[paddle.Tensor, paddle.Tensor, CausalLMOutput]:
    """Summed log-probability of the labelled tokens of every pair slot, their CE sum, the model output.

    Padded batches give one slot per row; packed rows hold several pairs, slot k of a row being the
    k-th segment (the data pipeline packs chosen and rejected sides identically).
    """
    out = model(**t["inputs"])
    ce, _ = per_token_loss(out.logits, t["labels"])
    seg = t["inputs"].get("segment_ids")
    if seg is None:
        return -ce.sum(axis=-1), ce.sum(), out
    slots = int(seg.max()) + 1
    onehot = F.one_hot(paddle.clip(seg, min=0), slots).astype("float32") * (seg >= 0).astype(
        "float32"
    ).unsqueeze(-1)
    per_slot = (ce.unsqueeze(-1) * onehot).sum(axis=1)  # [B, slots]
    present = onehot.sum(axis=1) > 0
    return -paddle.masked_select(per_slot, present), ce.sum(), out


def preference_loss(
    logits: paddle.Tensor, loss_type: str, beta: float, label_smoothing: float
) -> paddle.Tensor:
    """Per-pair loss from ``logits = (pi_c - pi_r) - (ref_c - ref_r)``."""
    if loss_type == "sigmoid":
        return (
            -F.log_sigmoid(beta * logits) * (1 - label_smoothing)
            - F.log_sigmoid(-beta * logits) * label_smoothing
        )
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return F.relu(1 - beta * logits)
    raise ValueError(f"loss_type must be sigmoid, ipo or hinge, not {loss_type!r}")


class DPOLoss:
    """Callable stage: one micro-batch of pairs -> loss contribution and metric contributions."""

    def __init__(self, config, reference=None, lora: bool = False):
        self.cfg = config
        self.reference = reference
        self.lora = lora

    def reference_logps(self, model, chosen: dict, rejected: dict) -> tuple[paddle.Tensor, paddle.Tensor]:
        if self.cfg.reference_free:
            return paddle.zeros([1], dtype="float32"), paddle.zeros([1], dtype="float32")
        ref = self.reference if self.reference is not None else model
        ctx = adapters_disabled(model) if self.reference is None and self.lora else contextlib.nullcontext()
        with paddle.no_grad(), ctx:
            was_training = ref.training
            ref.eval()
            c = sequence_logps(ref, chosen)[0]
            r = sequence_logps(ref, rejected)[0]
            if was_training:
                ref.train()
        return c.detach(), r.detach()

    def __call__(self, model, batch: dict, pair_norm: float, token_norm: float, share: float):
        cfg = self.cfg
        chosen = to_tensor_batch(batch, "chosen_")
        rejected = to_tensor_batch(batch, "rejected_")
        ref_c, ref_r = self.reference_logps(model, chosen, rejected)
        pi_c, ce_c, out_c = sequence_logps(model, chosen)
        pi_r, _, out_r = sequence_logps(model, rejected)
        router_c, router_r = out_c.router_losses, out_r.router_losses
        logits = (pi_c - pi_r) - (ref_c - ref_r)
        pref = preference_loss(logits, cfg.loss_type, cfg.beta, cfg.label_smoothing).sum() / pair_norm
        sft = ce_c / token_norm
        loss = cfg.pref_loss_ratio * pref
        if cfg.sft_loss_ratio:
            loss = loss + cfg.sft_loss_ratio * sft
        router = {k: (router_c[k] + router_r[k]) / 2 for k in router_c}
        loss = loss + router_penalty(model, router) * share
        chosen_rewards = (cfg.beta * (pi_c - ref_c)).detach()
        rejected_rewards = (cfg.beta * (pi_r - ref_r)).detach()
        metrics = {
            "loss": float(loss),
            "dpo_loss": float(pref),
            "sft_loss": float(sft),
            "rewards/chosen": float(chosen_rewards.sum()) / pair_norm,
            "rewards/rejected": float(rejected_rewards.sum()) / pair_norm,
            "rewards/accuracy": float((chosen_rewards > rejected_rewards).astype("float32").sum())
            / pair_norm,
            "rewards/margins": float((chosen_rewards - rejected_rewards).sum()) / pair_norm,
            "logps/chosen": float(pi_c.detach().sum()) / pair_norm,
            "logps/rejected": float(pi_r.detach().sum()) / pair_norm,
        }
        for name, value in router.items():
            metrics[name] = float(value) * share
        return loss, metrics, [(out_c.router_stats, "chosen_"), (out_r.router_stats, "rejected_")]


def count_pairs(batch: dict) -> int:
    seg = batch.get("chosen_segment_ids")
    if seg is None:
        return len(batch["chosen_input_ids"])
    seg = np.asarray(seg)
    return int(sum(len(np.unique(row[row >= 0])) for row in seg))


@paddle.no_grad()
def evaluate_dpo(model, batches, stage: DPOLoss) -> dict:
    """Preference accuracy, mean margin and loss over a finite set of pair batches."""
    sums = {"eval_loss": 0.0, "eval_rewards/accuracy": 0.0, "eval_rewards/margins": 0.0}
    pairs = 0
    for batch in batches:
        tokens = float((np.asarray(batch["chosen_labels"]) != -100).sum())
        _, m, _ = stage(model, batch, pair_norm=1.0, token_norm=max(tokens, 1.0), share=1.0)
        sums["eval_loss"] += m["dpo_loss"]
        sums["eval_rewards/accuracy"] += m["rewards/accuracy"]
        sums["eval_rewards/margins"] += m["rewards/margins"]
        pairs += count_pairs(batch)
    return {k: v / max(pairs, 1) for k, v in sums.items()} | {"eval_pairs": pairs}
