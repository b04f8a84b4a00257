"""Data parallelism under ``python -m paddle.distributed.launch`` (gloo on CPU, NCCL on GPUs).

Every rank reads the same global batch (``batch_size x world`` rows) and trains on its own slice; losses are
normalised by global token counts, so summing the gradients gives exactly the one-process update.
"""

from __future__ import annotations

import os

import numpy as np
import paddle


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

    def sum_grads(self, params: list[paddle.Tensor]) -> None:
        if self.world == 1:
            return
        import paddle.distributed as dist

        grads = [p.grad for p in params]
        flat = paddle.concat([g.reshape([-1]) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            n = int(np.prod(g.shape))
            g.set_value(flat[offset : offset + n].reshape(g.shape))
            offset += n

    def slice(self, batch: dict, config) -> dict:
        """This rank's rows of a global batch (the data is built for batch_size x world rows)."""
        if self.world == 1:
            return batch
        out = {}
        for k, v in batch.items():
            if isinstance(v, np.ndarray) and v.ndim >= 1:
                rows = v.shape[0] // self.world
                out[k] = v[self.rank * rows : (self.rank + 1) * rows]
        if batch.get("images"):
            # images are one flat list in row order; each fills its row's placeholder tokens
            ids = np.asarray(batch["input_ids"])
            rows = ids.shape[0] // self.world
            before = int((ids[: self.rank * rows] == config.im_patch_id).sum())
            mine = int((out["input_ids"] == config.im_patch_id).sum())
            g = config.vision_config.patch_size * config.vision_config.spatial_merge_size
            seen, picked = 0, []
            for img in batch["images"]:
                n = (img.shape[-2] // g) * (img.shape[-1] // g)
                if before <= seen < before + mine:
                    picked.append(img)
                seen += n
            out["images"] = picked
        return out
