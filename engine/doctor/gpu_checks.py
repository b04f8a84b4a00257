"""`doctor --full` on a GPU node: the GPU-only corrections of the engine run for real (issue 35).

- ``fp16_loss_scale``: the fp16 AMP set-up a run builds keeps GradScaler on, and scaled steps stay finite;
- ``rotary_fp32``: after AMP's O2 decorate and after ``cast_model``, cos / sin at position 8,191 equal the
  fp32 model's (decoder, 3-D decoder, vision tower);
- ``sum_grads_mixed_dtypes``: 2 ranks on 2 GPUs all-reduce bf16 / fp16 gradients beside fp32 router gates.

The weight-only GEMM (per channel only, forward-only probe) and flash attention are among the fast-path
self-tests (``engine.models.kernel_self_tests.SELF_TESTS``). A CPU node reports these checks skipped: the tests
cover the same code there (tests/engine/test_precision.py, test_distributed.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle

import engine
from engine.doctor.probes import TRAIN_SHAPE, _batch
from engine.doctor.report import Check

NAMES = ("gpu:fp16_loss_scale", "gpu:rotary_fp32", "gpu:sum_grads_mixed_dtypes")
FAR_POSITION = 8191  # where a bf16-rounded rotary frequency turns cos / sin far off
ROTARY_TOLERANCE = 1e-6
SUM_GRADS_TIMEOUT_S = 300


def gpu_checks(facts: dict, model_dir: Callable[[str], Path], workdir: Path) -> list[Check]:
    """The three checks on a GPU node; each reported skipped, with the reason, elsewhere."""
    if not facts["paddle"]["compiled_with_cuda"] or not facts["devices"]:
        return [Check(name, True, "skipped: needs a GPU (the tests run this code on CPU)") for name in NAMES]
    gpus = len(facts["devices"])
    return [
        fp16_loss_scale_check(model_dir("tiny")),
        rotary_fp32_check(model_dir("tiny-vl")),
        sum_grads_check(model_dir("tiny-moe"), workdir / "sum_grads", gpus),
    ]


def _low_precision() -> str:
    return "bfloat16" if paddle.amp.is_bfloat16_supported() else "float16"


def fp16_loss_scale_check(model_dir: Path, steps: int = 3) -> Check:
    """``set_up_amp`` for fp16 as a run builds it: the scaler must be on, scale 1.0 to the initial loss
    scale, and a few scaled AdamW steps must keep the loss finite."""
    from paddle.amp.auto_cast import amp_global_state

    from engine.models.loading import load_plain_model
    from engine.train.precision import INITIAL_LOSS_SCALE, PrecisionMode, resolve_precision, set_up_amp

    name = NAMES[0]
    try:
        precision = resolve_precision("fp16")
    except ValueError as e:
        return Check(name, True, f"skipped: {e}")
    if precision.mode is not PrecisionMode.AMP:
        return Check(name, True, f"skipped: fp16 resolves to {precision.mode} here")
    state = amp_global_state()
    before = state.amp_dtype
    try:
        paddle.seed(0)
        model = load_plain_model(model_dir)
        model.train()
        optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        model, optimizer, scaler = set_up_amp(model, optimizer, precision)
        scale = float(scaler.scale(paddle.to_tensor(1.0)).item())
        values = {"scale_of_one": scale, "enabled": bool(scaler.is_enable())}
        if not scaler.is_enable() or scale != INITIAL_LOSS_SCALE:
            return Check(
                name,
                False,
                f"GradScaler scaled 1.0 to {scale:g} (enabled: {scaler.is_enable()}), expected "
                f"{INITIAL_LOSS_SCALE:g}: fp16 runs would train with unscaled gradients",
                values=values,
            )
        ids, labels = _batch(model.config.vocab_size, TRAIN_SHAPE, seed=1)
        losses = []
        for _ in range(steps):
            loss = model(ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.clear_grad()
            losses.append(float(loss))
    finally:
        state.amp_dtype = before
    values["losses"] = losses
    if not all(math.isfinite(x) for x in losses) or not scaler.is_enable():
        return Check(
            name, False, f"fp16 steps gave losses {losses} (scaler on: {scaler.is_enable()})", values=values
        )
    return Check(
        name,
        True,
        f"GradScaler on at {scale:g}; {steps} fp16 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        values=values,
    )


def rotary_tables(model, far: int = FAR_POSITION) -> dict[str, list[np.ndarray]]:
    """cos and sin of the decoder (1-D and 3-D positions) and, for a VL model, of the vision tower."""
    out = {
        "decoder": model.ernie.rotary(paddle.to_tensor([[0, far]])),
        "decoder 3-D": model.ernie.rotary(paddle.to_tensor([[[far]], [[far // 3]], [[far - 1]]])),
    }
    if getattr(model, "vision_model", None) is not None:
        out["vision"] = model.vision_model.rotary(paddle.to_tensor([[far, 5], [7, far]]))
    return {k: [t.numpy() if t.dtype == paddle.float32 else None for t in v] for k, v in out.items()}


def rotary_fp32_check(model_dir: Path) -> Check:
    """The rotary tables after AMP's O2 decorate and after ``cast_model`` against the fp32 model's."""
    from paddle.amp.auto_cast import amp_global_state

    from engine.models.checkpoint import cast_model
    from engine.models.loading import load_plain_model
    from engine.train.precision import Precision, PrecisionMode, decorate_for_amp

    dtype = _low_precision()
    reference = rotary_tables(load_plain_model(model_dir))
    state = amp_global_state()
    before = state.amp_dtype
    try:
        model = load_plain_model(model_dir)
        precision = Precision(dtype, PrecisionMode.AMP, dtype, dtype, dtype == "float16", "doctor")
        optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
        decorated, _ = decorate_for_amp(model, optimizer, precision)
    finally:
        state.amp_dtype = before
    cast = cast_model(load_plain_model(model_dir), dtype)
    worst, problems = 0.0, []
    for how, model in (("O2 decorate", decorated), ("cast_model", cast)):
        for part, tables in rotary_tables(model).items():
            for got, want in zip(tables, reference[part], strict=True):
                if got is None:
                    problems.append(f"{part} after {how} is not float32")
                    continue
                worst = max(worst, float(np.abs(got - want).max()))
    values = {"dtype": dtype, "position": FAR_POSITION, "max_abs_diff": worst}
    if problems or worst > ROTARY_TOLERANCE:
        detail = (
            "; ".join(problems) or f"cos / sin differ from fp32 by {worst:.2e} at position {FAR_POSITION}"
        )
        return Check(
            NAMES[1], False, f"{detail} ({dtype}): rotary tables were cast with the weights", values=values
        )
    return Check(
        NAMES[1],
        True,
        f"{dtype}: cos / sin at position {FAR_POSITION} within {worst:.1e} of fp32",
        values=values,
    )


def run_sum_grads_ranks(model_dir: Path, out_dir: Path, dtype: str) -> tuple[int, list[dict], str]:
    """``sum_grads_rank.py`` on 2 ranks under ``paddle.distributed.launch``: (exit code, each rank's
    result, the ranks' logs)."""
    from engine.train.parallel import launch_command

    out_dir.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).with_name("sum_grads_rank.py")
    cmd = launch_command(
        [str(script), str(model_dir), str(out_dir), dtype], 2, str(out_dir / "logs"), "sum_grads"
    )
    root = str(Path(engine.__file__).resolve().parents[1])  # the ranks import this engine
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=SUM_GRADS_TIMEOUT_S
    )
    logs = "".join(p.read_text(errors="replace") for p in sorted((out_dir / "logs").glob("*")) if p.is_file())
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    return proc.returncode, results, logs


def sum_grads_check(model_dir: Path, out_dir: Path, gpus: int) -> Check:
    """2 ranks, 2 GPUs, NCCL: low-precision gradients beside fp32 router gates sum exactly."""
    name = NAMES[2]
    if gpus < 2:
        return Check(name, True, f"skipped: needs 2 GPUs, this node has {gpus}")
    dtype = _low_precision()
    code, results, logs = run_sum_grads_ranks(model_dir, out_dir, dtype)
    values = {"dtype": dtype, "ranks": results}
    if code != 0 or len(results) != 2:
        return Check(name, False, f"the 2-rank all-reduce exited {code}: {logs[-600:]}", values=values)
    bad = [r for r in results if r["max_diff"] != 0.0 or "paddle.float32" not in r["dtypes"]]
    if bad:
        return Check(
            name, False, f"a rank's summed gradients differ from the per-dtype sum: {bad[0]}", values=values
        )
    return Check(name, True, f"2 GPUs: {dtype} and float32 gradients all-reduced exactly", values=values)
