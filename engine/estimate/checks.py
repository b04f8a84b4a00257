"""The planner's refusals: settings that cannot run on the studio's nodes, each naming its key."""

from __future__ import annotations

from engine.estimate.candidates import PlanError
from engine.estimate.facts import NodeFacts
from engine.estimate.messages import ESTIMATE
from engine.models.config import ErnieConfig


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
            raise PlanError(ESTIMATE("sharding_one_device", sharding=sharding))
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
