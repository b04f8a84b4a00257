"""Whether this node's Paddle has the collectives multi-rank runs call (data and expert parallelism)."""

from __future__ import annotations

from typing import Any

from engine.doctor.report import Check

# What each kind of run calls on every node (gloo on CPU, NCCL on GPUs), by paddle.distributed name.
NEEDED = {
    "data parallel": ("init_parallel_env", "all_reduce", "all_gather"),
    # send / recv: checkpoints gather the experts to the writing rank (expert_parallel.gather_to_writer)
    "expert parallel": ("new_group", "all_gather", "all_gather_object", "all_reduce", "send", "recv"),
}
# GPU nodes dispatch expert-parallel tokens with all-to-all (engine.models.expert_parallel.Exchange).
NEEDED_ON_GPU = {"expert parallel (all-to-all)": ("alltoall_single",)}


def collective_check(facts: dict, api: Any = None) -> Check:
    """Every collective the node's runs need exists in ``api`` (default ``paddle.distributed``)."""
    if api is None:
        import paddle.distributed as api
    gpu = bool(facts.get("devices")) and bool(facts["paddle"].get("compiled_with_cuda"))
    needed = {**NEEDED, **(NEEDED_ON_GPU if gpu else {})}
    missing = {what: [n for n in names if not hasattr(api, n)] for what, names in needed.items()}
    missing = {what: names for what, names in missing.items() if names}
    transport = "all-to-all (NCCL)" if gpu else "all_gather (gloo: no all_to_all, no reduce_scatter)"
    if missing:
        lacks = "; ".join(f"{what} needs paddle.distributed.{', '.join(n)}" for what, n in missing.items())
        return Check("collectives", False, f"{lacks}: install Paddle 3.x (paddlepaddle / paddlepaddle-gpu)")
    return Check(
        "collectives",
        True,
        f"data and expert parallelism's collectives are present; expert dispatch: {transport}",
        values={"expert_dispatch": "alltoall" if gpu else "allgather"},
    )
