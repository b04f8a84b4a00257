"""Data parallelism under ``python -m paddle.distributed.launch`` (gloo on CPU, NCCL on GPUs).

Every rank reads the same global batch (``batch_size x world`` rows) and trains on its own slice; losses are
normalised by global token counts, so summing the gradients gives exactly the one-process update.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import sys
from dataclasses import dataclass

import numpy as np
import paddle

# The flags of Paddle 3.x's launcher (python/paddle/distributed/launch/context/args_envs.py) that
# `launch_command` uses; tests/engine/test_distributed.py checks them against the installed `--help`.
LAUNCH_FLAGS = (
    "--nproc_per_node", "--devices", "--log_dir", "--job_id", "--max_restart",
    "--master", "--nnodes", "--rank", "--host",
)  # fmt: skip
_PR_SET_PDEATHSIG = 1


def launch_command(
    entry: list[str],
    nproc: int,
    log_dir: str,
    job_id: str,
    devices: list[int] | None = None,
    *,
    nodes: NodeGroup | None = None,
) -> list[str]:
    """``python -m paddle.distributed.launch`` running ``entry`` (a program and its arguments) on ``nproc``
    ranks of this node; ``devices`` are GPU indices as the launcher sees them (none: gloo on CPU);
    ``nodes`` places this node in a job over several nodes (every node runs the same command but its rank).

    The launcher has no ``-m``: its training script is a ``.py`` file it runs with Python or a program it
    runs as is, so ``entry`` starts with the ``ernie-studio`` script (or a ``.py`` runner). Each rank's
    output goes to ``log_dir/workerlog.<rank>``; the launcher echoes rank 0's to its own stdout. It never
    restarts a rank: with elastic mode off (``--elastic_level -1``, the default) a failed rank stops the
    others and the launcher exits with that rank's code; ``--max_restart 0`` says so for elastic jobs too.
    """
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc)]
    if nodes is not None:
        cmd += nodes.flags()
    if devices:
        cmd += ["--devices", ",".join(str(d) for d in devices)]
    return [*cmd, "--log_dir", log_dir, "--job_id", job_id, "--max_restart", "0", *entry]


@dataclass(frozen=True)
class NodeGroup:
    """One node's place in a job over ``nnodes`` nodes: the launcher of node ``rank`` 0 serves the
    rendezvous at ``master`` (``host:port``, Paddle's HTTP key-value master), the others join it there. The
    global ranks follow the node ranks: node ``r`` holds ranks ``r * nproc ... r * nproc + nproc - 1``."""

    master: str
    nnodes: int
    rank: int
    # This node's IPv4 address as the others reach it (``--host``); None: the launcher's own guess, the
    # address its host name resolves to. Node rank 0 serves the rendezvous only when ``master``'s host is
    # 127.0.0.1 or this address (launch/controllers/master.py: HTTPMaster.lazy_init).
    host: str | None = None

    def __post_init__(self) -> None:
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master: {self.master!r} is not host:port")
        if self.nnodes < 2 or not 0 <= self.rank < self.nnodes:
            raise ValueError(f"rank {self.rank} of {self.nnodes} nodes: need 2+ nodes and 0 <= rank < nnodes")
        if self.host is not None:
            try:
                ipaddress.IPv4Address(self.host)
            except ValueError:
                raise ValueError(f"host: {self.host!r} is not an IPv4 address") from None

    def flags(self) -> list[str]:
        host = ["--host", self.host] if self.host else []
        return ["--master", self.master, "--nnodes", str(self.nnodes), "--rank", str(self.rank), *host]


def die_with_launcher() -> None:
    """Under the launcher, have Linux SIGKILL this rank when the launcher dies: its ranks run in sessions of
    their own, so a launcher killed by its worker would otherwise leave them training on."""
    if "PADDLE_TRAINER_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() == 1:  # the launcher was gone before the request took hold
        os._exit(1)


class DataParallel:
    """Rank and world size under ``paddle.distributed.launch``; one process means no communication."""

    def __init__(self):
        self.world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
        self.rank = 0
        if self.world > 1:
            import paddle.distributed as dist

            dist.init_parallel_env()
            self.rank = dist.get_rank()
            self.world = dist.get_world_size()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: np.ndarray) -> np.ndarray:
        if self.world == 1:
            return values
        import paddle.distributed as dist

        t = paddle.to_tensor(np.asarray(values, dtype=np.float64))
        dist.all_reduce(t)
        return t.numpy()

    def check_same(self, value: int, what: str) -> None:
        """Raise unless every rank holds the same ``value`` (e.g. the checkpoint step it resumes from)."""
        if self.world == 1:
            return
        # all equal exactly when n * sum(v^2) == sum(v)^2 (Cauchy-Schwarz)
        total, squares = self.sum(np.array([value, value * value], dtype=np.float64))
        if self.world * squares != total * total:
            raise RuntimeError(f"rank {self.rank}: {what} is {value}, but another rank's is not")

    def sum_grads(self, params: list[paddle.Tensor]) -> None:
        """Sum every gradient over the ranks: one flat all-reduce per gradient dtype (AMP's bf16 / fp16
        weights beside the fp32 router gates; ``paddle.concat`` refuses mixed dtypes). Every rank holds the
        same parameters in the same order, so the buckets line up."""
        if self.world == 1:
            return
        import paddle.distributed as dist

        buckets: dict[paddle.dtype, list[paddle.Tensor]] = {}
        for p in params:
            buckets.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in buckets.values():
            flat = paddle.concat([g.reshape([-1]) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                n = int(np.prod(g.shape))
                g.set_value(flat[offset : offset + n].reshape(g.shape))
                offset += n

    def my_images(self, batch: dict, my_ids: np.ndarray, config) -> dict:
        """This rank's images: the global batch holds all patches in row order, one grid per image."""
        from engine.models.vision import vision_token_count

        ids = np.asarray(batch["input_ids"])
        rows = ids.shape[0] // self.world
        vision = (config.im_patch_id, config.video_token_id)
        before = int(np.isin(ids[: self.rank * rows], vision).sum())
        mine = int(np.isin(my_ids, vision).sum())
        tokens, start, grids = 0, 0, []
        for grid in batch["grid_thw"]:
            if tokens < before:
                start += int(np.prod(grid))  # patches of images on earlier ranks' rows
            elif tokens < before + mine:
                grids.append(grid)
            tokens += vision_token_count(grid, config.vision_config)
        if not grids:
            return {}
        end = start + sum(int(np.prod(g)) for g in grids)
        return {"pixel_values": np.asarray(batch["pixel_values"])[start:end], "grid_thw": grids}

    def slice(self, batch: dict, config) -> dict:
        """This rank's rows of a global batch (the data is built for batch_size x world rows)."""
        if self.world == 1:
            return batch
        out = {}
        for k, v in batch.items():
            if isinstance(v, np.ndarray) and v.ndim >= 1:
                rows = v.shape[0] // self.world
                out[k] = v[self.rank * rows : (self.rank + 1) * rows]
        if batch.get("grid_thw"):
            out.update(self.my_images(batch, out["input_ids"], config))
        return out
