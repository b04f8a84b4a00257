"""The self-tests: devices usable and big enough, fast paths equal to the plain ones, a tiny model that learns,
and its training throughput against the operator's floor."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from engine.doctor.report import Check, DoctorFloors
from engine.models.kernel_self_tests import SelfTestResult
from engine.models.loading import load_plain_model

# The training probe: this many AdamW steps on one fixed batch must cut its loss by at least this fraction
# (a healthy node goes from ~7.0 to ~1.4 in 20 steps; broken kernels, NaNs or a stuck optimizer do not).
PROBE_STEPS = 20
PROBE_LR = 3e-3
MIN_LOSS_DROP = 0.5


@dataclass(frozen=True)
class ProbeShape:
    batch: int
    seq_len: int


TRAIN_SHAPE = ProbeShape(batch=4, seq_len=64)
THROUGHPUT_SHAPE = ProbeShape(batch=4, seq_len=128)


def device_check(facts: dict[str, Any], floors: DoctorFloors) -> Check:
    """A CUDA build must see a GPU; every GPU must be readable and at least `min_device_memory_gb` big."""
    build = facts["paddle"]
    devices = facts["devices"]
    if not build["compiled_with_cuda"]:
        return Check("devices", True, "CPU build of Paddle: training runs on the CPU")
    if not devices:
        return Check(
            "devices",
            False,
            "Paddle is a CUDA build but sees no GPU: check the driver (nvidia-smi), the container's GPU "
            "access (--gpus / device_ids) and CUDA_VISIBLE_DEVICES",
        )
    problems = [f"gpu:{d['index']}: {d['error']}" for d in devices if d.get("error")]
    floor = floors.min_device_memory_gb
    if floor > 0:
        problems += [
            f"gpu:{d['index']} has {d.get('total_memory_bytes', 0) / 2**30:.1f} GiB, below the floor of "
            f"{floor:g} GiB (ERNIE_STUDIO_DOCTOR_MIN_DEVICE_MEMORY_GB)"
            for d in devices
            if d.get("total_memory_bytes", 0) < floor * 2**30
        ]
    if problems:
        return Check("devices", False, "; ".join(problems))
    names = ", ".join(f"gpu:{d['index']} {d.get('name')}" for d in devices)
    return Check("devices", True, f"{len(devices)} GPU(s): {names}")


def fast_path_checks(quick: bool) -> list[Check]:
    """Each fast path this device has against its plain path (``engine.models.kernel_self_tests.self_tests``, the
    same comparisons the tests run); a path the device lacks is reported as skipped, with the reason."""
    from engine.models import kernel_self_tests

    start = time.perf_counter()
    try:
        results = kernel_self_tests.self_tests(quick)
    except Exception as e:
        return [Check("fast_paths", False, f"the fast-path self-tests raised {type(e).__name__}: {e}")]
    each = round((time.perf_counter() - start) / max(len(results), 1), 3)
    return [fast_path_check(r, each) for r in results]


def fast_path_check(result: SelfTestResult, duration_s: float = 0.0) -> Check:
    """One kernel self-test as a doctor check: a skipped path passes (the node simply does not take it)."""
    if not result.ran:
        detail = f"skipped: {result.reason}"
    else:
        grads = result.max_abs_diff_grads
        detail = (
            f"max |diff| forward {result.max_abs_diff_fwd:.2e}, "
            + (f"gradients {grads:.2e} " if grads is not None else "forward only ")
            + f"(tolerance {result.tolerance:.0e})"
        )
        if not result.passed:
            detail += f"; {result.reason}. The path is switched off by "
            detail += "ERNIE_STUDIO_DISABLE_FAST_PATHS=" + result.name
    passed = result.passed or not result.ran
    return Check(f"fast_path:{result.name}", passed, detail, duration_s, result.as_dict())


def _batch(vocab_size: int, shape: ProbeShape, seed: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Fixed random token ids and their next-token labels (the last position has none)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (shape.batch, shape.seq_len)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((shape.batch, 1), -100, np.int64)], axis=1)
    return paddle.to_tensor(ids), paddle.to_tensor(labels)


def _train_model(model_dir: Path):
    paddle.seed(0)
    model = load_plain_model(model_dir)
    model.train()
    optimizer = paddle.optimizer.AdamW(learning_rate=PROBE_LR, parameters=model.parameters())
    return model, optimizer


def _step(model, optimizer, ids, labels) -> float:
    loss = model(ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
    return float(loss)  # also waits for the device


def training_probe(model_dir: Path, name: str = "training_probe", steps: int = PROBE_STEPS) -> Check:
    """`steps` AdamW steps on one batch: the loss must be finite and fall by at least MIN_LOSS_DROP."""
    model, optimizer = _train_model(model_dir)
    ids, labels = _batch(model.config.vocab_size, TRAIN_SHAPE, seed=1)
    losses = [_step(model, optimizer, ids, labels) for _ in range(steps)]
    first, last = losses[0], losses[-1]
    values = {"first_loss": first, "last_loss": last, "steps": steps}
    if not all(math.isfinite(x) for x in losses):
        return Check(name, False, f"the loss became {last} within {steps} steps (NaN / inf)", values=values)
    drop = 1.0 - last / first if first > 0 else 0.0
    values["drop"] = round(drop, 4)
    summary = f"loss {first:.3f} -> {last:.3f} in {steps} steps, fell {drop:.0%} (needs {MIN_LOSS_DROP:.0%})"
    if drop < MIN_LOSS_DROP:
        return Check(name, False, f"{summary}: this node's training does not learn", values=values)
    return Check(name, True, summary, values=values)


def throughput_probe(model_dir: Path, floors: DoctorFloors, timed_steps: int) -> Check:
    """Tokens per second of forward + backward + optimizer step on the tiny model at a fixed shape."""
    model, optimizer = _train_model(model_dir)
    shape = THROUGHPUT_SHAPE
    ids, labels = _batch(model.config.vocab_size, shape, seed=2)
    for _ in range(2):  # warm-up: kernel selection, allocator growth
        _step(model, optimizer, ids, labels)
    start = time.perf_counter()
    for _ in range(timed_steps):
        _step(model, optimizer, ids, labels)
    elapsed = time.perf_counter() - start
    tokens_per_s = shape.batch * shape.seq_len * timed_steps / elapsed
    floor = floors.min_tokens_per_s
    values = {"tokens_per_second": round(tokens_per_s, 1), "batch": shape.batch, "seq_len": shape.seq_len}
    summary = f"{tokens_per_s:,.0f} tokens/s (tiny model, batch {shape.batch} x {shape.seq_len})"
    if floor > 0 and tokens_per_s < floor:
        return Check(
            "throughput",
            False,
            f"{summary}, below the floor of {floor:,.0f} (ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S): the node is "
            "slower than the operator requires (busy, throttled, or running on the wrong device)",
            values=values,
        )
    return Check("throughput", True, summary + (f", floor {floor:,.0f}" if floor > 0 else ""), values=values)


def sharding_check() -> Check:
    """Which of ERNIEKit's ``sharding`` settings this node runs: stage 1 needs fleet's
    DygraphShardingOptimizer and its collectives (a node without them fails); stage 2, its offload and
    tensorwise_offload_optimizer need a GPU (a CPU node passes and says so)."""
    from engine.train.sharding import sharding_support

    support = sharding_support()
    runs = [name for name, why in support.items() if why is None]
    detail = "runs " + ", ".join(runs) if runs else "runs no sharding"
    detail += "".join(f"; {why}" for why in support.values() if why)
    return Check("sharding", support["stage1"] is None, detail, values={"supported": runs})
