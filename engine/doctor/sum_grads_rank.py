"""One rank of the mixed-dtype gradient all-reduce check, run as a file by ``paddle.distributed.launch``
(``python -m paddle.distributed.launch --nproc_per_node 2 sum_grads_rank.py MODEL_DIR OUT_DIR DTYPE``).

The tiny MoE model is cast to DTYPE with its router gates kept fp32, as AMP holds it; every gradient is set
to a rank-dependent value whose two-rank sum is exact in bf16 / fp16, ``DataParallel.sum_grads`` sums them,
and each rank writes ``OUT_DIR/rank<N>.json``: the dtypes seen and the largest difference from the per-dtype
reference (the two ranks' gradients summed, held in the gradient's dtype). The doctor runs it on 2 GPUs
(NCCL), the tests on 2 CPU processes (gloo).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import paddle

from engine.models.checkpoint import cast_model
from engine.models.loading import load_plain_model
from engine.startup import end_rank
from engine.train.parallel import DataParallel


def rank_gradient(index: int, shape: list[int], rank: int) -> np.ndarray:
    """Halves in [-1.5, 1.5], different per parameter and rank: the sum of two is exact in bf16 and fp16."""
    n = int(np.prod(shape))
    return (((np.arange(n) + 3 * index + rank) % 7 - 3) * 0.5).reshape(shape).astype(np.float32)


def main(argv: list[str]) -> int:
    model_dir, out_dir, dtype = argv
    dp = DataParallel()  # first: under the launcher it selects this rank's GPU
    if dp.world != 2:
        raise SystemExit(f"sum_grads_rank.py runs on 2 ranks, got {dp.world}")
    model = cast_model(load_plain_model(model_dir), dtype)
    params = model.parameters()
    for i, p in enumerate(params):
        p._copy_gradient_from(paddle.to_tensor(rank_gradient(i, p.shape, dp.rank)).astype(p.dtype))
    dp.sum_grads(params)
    worst = 0.0
    for i, p in enumerate(params):
        if p.grad.dtype != p.dtype:
            raise SystemExit(f"{p.name}: the summed gradient is {p.grad.dtype}, the parameter {p.dtype}")
        # the reference summed in fp32 and rounded once (CPU builds have no bf16 add)
        want = paddle.to_tensor(rank_gradient(i, p.shape, 0) + rank_gradient(i, p.shape, 1)).astype(p.dtype)
        diff = np.abs(p.grad.astype("float32").numpy() - want.astype("float32").numpy()).max()
        worst = max(worst, float(diff))
    result = {"world": dp.world, "dtypes": sorted({str(p.dtype) for p in params}), "max_diff": worst}
    (Path(out_dir) / f"rank{dp.rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    end_rank(main(sys.argv[1:]))  # no native teardown racing rank 0's TCP store thread
