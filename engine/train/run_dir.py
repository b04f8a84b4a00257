"""The run directory: metrics.jsonl (one line per logged step, never duplicated), checkpoints, summary.

Checkpoints are written to ``checkpoint-N.tmp`` and renamed when complete, so a run killed while saving
resumes from the previous good checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import paddle

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def read_append_log(path: Path, key: str, writer: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file written one fsynced row at a time (metrics.jsonl, eval_samples.jsonl):
    the first row of each ``key``; a line a kill cut short, or a repeat, is dropped and the file rewritten
    without it (readers that tail it by byte offset start again when it shrinks)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    rows, good, seen, bad = [], [], set(), 0 if not text or text.endswith("\n") else 1
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and key in row and row[key] not in seen:
            seen.add(row[key])
            rows.append(row)
            good.append(line)
        else:
            bad += 1
    if bad:
        log.warning("%s: dropping %d partly written line(s) left by %s", path, bad, writer)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(g + "\n" for g in good), encoding="utf-8")
        os.replace(tmp, path)
    return rows


class MetricsLog:
    """Appends one JSON object per logged step; steps already in the file are not written again."""

    def __init__(self, path: Path):
        self.path = path
        rows = read_append_log(path, "step", "an interrupted run")
        self.steps: set[int] = {row["step"] for row in rows}
        self.last: dict[str, Any] = rows[-1] if rows else {}

    def write(self, row: dict[str, Any]) -> bool:
        if row["step"] in self.steps:
            return False
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.steps.add(row["step"])
        self.last = row
        return True


def list_checkpoints(output_dir: Path) -> list[Path]:
    found = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = CHECKPOINT_RE.match(p.name)
            if m and p.is_dir() and (p / "trainer_state.json").exists():
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    cps = list_checkpoints(output_dir)
    return cps[-1] if cps else None


def prune_checkpoints(output_dir: Path, keep: int) -> list[Path]:
    """``save_total_limit``: delete the oldest complete checkpoints beyond the newest ``keep`` (at least the
    newest one stays; one being written is still ``.tmp`` and not listed). Returns the deleted ones."""
    old = list_checkpoints(output_dir)[: -max(keep, 1)]
    for p in old:
        shutil.rmtree(p)
        log.info("deleted %s (save_total_limit %d)", p, keep)
    return old


def begin_checkpoint(output_dir: Path, step: int) -> Path:
    tmp = output_dir / f"checkpoint-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(tmp: Path) -> Path:
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---- checkpoint contents ----------------------------------------------------------------------------


def optimizer_state_by_name(optimizer, params: dict[str, paddle.Tensor]) -> dict:
    """Optimizer state keyed by parameter *path* (auto-generated tensor names differ between processes)."""
    state = optimizer.state_dict()
    by_internal = sorted(((p.name, n) for n, p in params.items()), key=lambda x: -len(x[0]))
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == "master_weights":  # AMP's fp32 copies of low-precision weights, keyed like the rest
            names = dict(by_internal)
            out[key] = {names.get(k, k): v for k, v in value.items()}
            continue
        if key == "LR_Scheduler":
            out[key] = value
            continue
        for internal, path in by_internal:
            if key.startswith(internal + "_"):
                out[f"{path}::{key[len(internal) :]}"] = value
                break
        else:
            out[key] = value
    return out


def _state_from_names(state: dict, params: dict[str, paddle.Tensor]) -> dict:
    out = {}
    for key, value in state.items():
        if key == "master_weights":
            out[key] = {params[k].name if k in params else k: v for k, v in value.items()}
            continue
        if "::" in key:
            path, suffix = key.split("::", 1)
            if path not in params:
                raise ValueError(f"checkpoint optimizer state names parameter {path}, which this model lacks")
            out[params[path].name + suffix] = value
        else:
            out[key] = value
    return out


def persistent_state(model, trainable: dict | None = None) -> dict[str, paddle.Tensor]:
    """What a checkpoint must hold besides the optimizer: trainable weights, biases and QAT scales.

    A weight ``trainable`` holds in another tensor (the fp32 master of an emulated bf16 weight) is saved
    from there, so a resumed run continues from the exact fp32 values."""
    trainable = trainable or {}
    keep = {}
    for name, t in model.state_dict().items():
        p = t
        if (not getattr(p, "stop_gradient", True)) or "moe_statics" in name or name.endswith("act_scale"):
            keep[name] = trainable.get(name, t)
    return keep


def checkpoint_states(model, optimizer, trainable: dict) -> tuple[dict, dict]:
    """(weights, optimizer state) a checkpoint holds, keyed by parameter path."""
    return persistent_state(model, trainable), optimizer_state_by_name(optimizer, trainable)


def save_checkpoint(
    out_dir: Path,
    step: int,
    model,
    optimizer,
    trainable: dict,
    data,
    ema,
    elapsed: float,
    elastic=None,
    states: tuple[dict, dict] | None = None,
    optimizer_state: dict | None = None,
) -> Path:
    """Model (trainable part), optimizer, RNG, data position, EMA and the elastic sampler as
    ``checkpoint-<step>``, always un-split so any rank count resumes it. ``states``: the weights and
    optimizer state when the caller gathered them (expert parallelism: every rank's experts);
    ``optimizer_state``: the whole state by parameter name when ``optimizer`` holds a shard of it
    (``engine.train.sharding``)."""
    import paddle  # the run directory's other helpers (a worker's) need no Paddle

    tmp = begin_checkpoint(out_dir, step)
    weights, optim = states or checkpoint_states(model, optimizer, trainable)
    if optimizer_state is not None:
        optim = optimizer_state
    paddle.save(weights, str(tmp / "model.pdparams"))
    paddle.save(optim, str(tmp / "optimizer.pdopt"))
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "paddle": list(paddle.get_rng_state()),
        "data": data.state_dict(),
        "ema": ema.shadow if ema is not None else None,
        "elastic": elastic.state_dict() if elastic is not None else None,
    }
    with open(tmp / "rng_state.pkl", "wb") as f:
        pickle.dump(rng, f)
    write_json(tmp / "trainer_state.json", {"global_step": step, "elapsed_s": elapsed})
    final = commit_checkpoint(tmp)
    log.info("saved %s", final)
    return final


def load_checkpoint(
    ckpt: Path, model, optimizer, trainable: dict, data, ema, elastic=None, held=None
) -> tuple[int, float]:
    """Restore everything ``save_checkpoint`` wrote; returns (step, elapsed seconds). ``held(name)`` says
    whether a weight of the un-split layout lives in this process (expert parallelism: others' experts
    are skipped)."""
    import paddle  # the run directory's other helpers (a worker's) need no Paddle

    state = json.loads((ckpt / "trainer_state.json").read_text())
    weights = paddle.load(str(ckpt / "model.pdparams"))
    current = model.state_dict()
    for name, value in weights.items():
        if held is not None and not held(name):
            continue
        if name not in current:
            raise ValueError(f"{ckpt}/model.pdparams: tensor {name} does not fit this run's model")
        trainable.get(name, current[name]).set_value(value)
    optim = paddle.load(str(ckpt / "optimizer.pdopt"))
    if held is not None:
        optim = {k: v for k, v in optim.items() if "::" not in k or held(k.split("::", 1)[0])}
    optimizer.set_state_dict(_state_from_names(optim, trainable))
    with open(ckpt / "rng_state.pkl", "rb") as f:
        rng = pickle.load(f)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    paddle.set_rng_state(rng["paddle"])
    data.load_state_dict(rng["data"])
    if ema is not None and rng.get("ema") is not None:
        ema.shadow = {k: v for k, v in rng["ema"].items() if held is None or held(k)}
    if elastic is not None:
        elastic.load_state_dict(rng.get("elastic"), str(ckpt))
    return int(state["global_step"]), float(state.get("elapsed_s", 0.0))
