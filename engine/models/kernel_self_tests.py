"""The fast paths' self-tests: each fast path against its plain path on a tiny model, forward logits and the
gradient of every parameter. The tests and ``ernie-studio doctor`` both call ``self_tests``.

They build whole models, so they live above the models: ``kernels`` (which the layers import to ask
``enabled``) builds nothing and imports no model module.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import paddle

from engine.models import kernels
from engine.models.checkpoint import cast_model
from engine.models.ernie import ErnieForCausalLM
from engine.models.initialize import init_weights
from engine.models.moe import MoELayer, can_group
from engine.models.presets import preset_config
from engine.models.quantized import apply_weight_only, hold_in_low_precision


@dataclass
class SelfTestResult:
    """One fast path against its plain path on a tiny model."""

    name: str
    ran: bool
    passed: bool
    reason: str
    max_abs_diff_fwd: float | None = None
    max_abs_diff_grads: float | None = None  # None: not compared (a forward-only case, or not run)
    tolerance: float | None = None  # on both differences; see ``self_tests``

    def as_dict(self) -> dict:
        return dict(self.__dict__)


FP32_TOLERANCE = 1e-5  # absolute, on logits and on every gradient
HALF_TOLERANCE = 2e-2  # bf16 paths: relative to the plain path's largest |value|, per tensor


@dataclass(frozen=True)
class _Case:
    paths: tuple[str, ...]  # what the case switches on (the plain run has them off)
    preset: str
    dtype: str
    inputs: str  # "causal" | "packed" | "vl"
    full_only: bool = False
    weight_only: bool = False
    grads: bool = True  # False: forward only, under no_grad (as serving runs)
    group_size: int = -1  # weight-only cases: the scales' group size (-1 per channel)
    held: bool = False  # dtype is the linears' storage (hold_in_low_precision), computing in fp32
    tolerance: float | None = None  # instead of the dtype's (see ``self_test``)
    held_off: tuple[str, ...] = ()  # paths kept off in both runs (to reach the path under test)
    clip: bool = False  # the gradient clip's square sums and scaling, on the model's gradients


SELF_TESTS = {
    "grouped_moe": _Case(("grouped_moe",), "tiny-moe", "float32", "packed"),
    "grouped_moe_vl": _Case(("grouped_moe",), "tiny-vl", "float32", "vl", full_only=True),
    "swiglu": _Case(("swiglu",), "tiny", "float32", "causal"),
    "flash_attention": _Case(("flash_attention",), "tiny", "bfloat16", "causal"),
    "flash_attention_varlen": _Case(("flash_attention_varlen",), "tiny", "bfloat16", "packed"),
    "fused_rms_norm": _Case(("fused_rms_norm",), "tiny", "float32", "packed"),
    "rms_norm_backward": _Case(
        ("rms_norm_backward",), "tiny", "float32", "packed", held_off=("cpu_rms_norm",)
    ),
    "fused_rope": _Case(("fused_rope",), "tiny", "float32", "packed"),
    "rope_backward": _Case(("rope_backward",), "tiny", "float32", "packed", held_off=("cpu_rope",)),
    # against the truly plain ops: the written backwards stay off in both runs
    "cpu_rms_norm": _Case(("cpu_rms_norm",), "tiny", "float32", "packed", held_off=("rms_norm_backward",)),
    # every gradient's square sum (relative) and its clipped values (absolute) against Paddle's ops
    "cpu_grad_clip": _Case(("cpu_grad_clip",), "tiny-moe", "float32", "packed", clip=True, tolerance=1e-6),
    "cpu_rope": _Case(("cpu_rope",), "tiny", "float32", "packed", held_off=("rope_backward",)),
    # packed rows (mask and key starts), and plain causal rows (no mask)
    "cpu_attention": _Case(("cpu_attention",), "tiny", "float32", "packed"),
    "cpu_attention_causal": _Case(("cpu_attention",), "tiny", "float32", "causal"),
    "weight_only_linear": _Case(("weight_only_linear",), "tiny", "bfloat16", "causal", weight_only=True),
    "onednn_matmul": _Case(("onednn_matmul",), "tiny", "float32", "causal"),
    "onednn_matmul_moe": _Case(("onednn_matmul",), "tiny-moe", "float32", "packed", full_only=True),
    # against the fp32 upcast of the same bf16 weights: the GEMM also rounds activations to bf16
    "onednn_bf16_matmul": _Case(("onednn_bf16_matmul",), "tiny", "bfloat16", "causal", held=True),
    # the same conversions as Paddle's cast, so the same numbers (fp32 subnormals may flush to zero)
    "onednn_cast": _Case(("onednn_cast",), "tiny", "bfloat16", "causal", held=True, tolerance=1e-6),
    # bf16-held weights upcast and run through the sgemm, where the bf16 GEMM does not pay (Intel without AMX);
    # fp32 sums in another order, so outputs and weight gradients rounded to bf16 may differ by one bf16 step
    "onednn_matmul_upcast": _Case(
        ("onednn_matmul",),
        "tiny",
        "bfloat16",
        "causal",
        held=True,
        held_off=("onednn_bf16_matmul",),
    ),
    "weight_only_linear_inference": _Case(
        ("weight_only_linear",), "tiny", "bfloat16", "causal", weight_only=True, grads=False
    ),
    # group-wise scales must take the dequantize path with the kernel on (weight_only_refusal)
    "weight_only_linear_group64": _Case(
        ("weight_only_linear",),
        "tiny",
        "bfloat16",
        "causal",
        full_only=True,
        weight_only=True,
        grads=False,
        group_size=64,
    ),
}


def self_tests(quick: bool = True) -> list[SelfTestResult]:
    """Every fast path against the plain path (see ``self_test``); ``quick`` uses short rows and leaves
    out the VL MoE case."""
    return [self_test(name, quick) for name, case in SELF_TESTS.items() if not (quick and case.full_only)]


def self_test(name: str, quick: bool = True, force: bool = False) -> SelfTestResult:
    """Forward logits and the gradient of every parameter with ``name``'s paths on against off.

    Tolerances: fp32 cases ``FP32_TOLERANCE`` absolute; bf16 cases (flash attention, weight-only GEMM:
    the kernels exist only in half precision; oneDNN's bf16 GEMM on weights held in bf16) compare with the plain path in bf16, each tensor's
    difference divided by the plain path's largest |value|, against ``HALF_TOLERANCE``. Gradients must
    exist for the same parameters in both runs (an expert without tokens has none in either).
    ``force`` runs a path this process decided against (a kernel that works but does not pay here).
    """
    case = SELF_TESTS[name]
    caps = kernels.capabilities()
    off = [] if force else [p for p in case.paths if not caps[p].on]
    if off:
        return SelfTestResult(name, ran=False, passed=False, reason=f"{off[0]} is off: {caps[off[0]].reason}")
    if case.weight_only and case.grads:
        refusal = kernels.weight_only_refusal(case.group_size, True, kernels.compute_capability())
        if refusal:
            return SelfTestResult(name, False, False, f"weight_only_linear with gradients is off: {refusal}")
    tol = case.tolerance or (FP32_TOLERANCE if case.dtype == "float32" else HALF_TOLERANCE)
    relative = case.dtype != "float32"
    if case.clip:
        return _clip_self_test(name, case, 64 if quick else 2 * 128 + 32, tol)
    try:
        model, inputs = _tiny_model_and_inputs(case, 64 if quick else 2 * 128 + 32)
        if "grouped_moe" in case.paths and not _all_groups_grouped(model):
            return SelfTestResult(name, True, False, "the tiny model's experts do not take the grouped path")
        grad_mode = paddle.enable_grad if case.grads else paddle.no_grad
        held_off = dict.fromkeys(case.held_off, False)
        with grad_mode(), kernels.forced(**dict.fromkeys(case.paths, False), **held_off):
            plain = _logits_and_grads(model, inputs, case.grads)
        with grad_mode(), kernels.forced(**dict.fromkeys(case.paths, True), **held_off):
            fast = _logits_and_grads(model, inputs, case.grads)
    except Exception as exc:
        return SelfTestResult(name, ran=True, passed=False, reason=f"{type(exc).__name__}: {exc}"[:300])
    missing = sorted(set(plain[1]) ^ set(fast[1]))
    if missing:
        return SelfTestResult(
            name, True, False, f"gradients exist in one path only, e.g. {missing[0]}", tolerance=tol
        )
    fwd = _diff(plain[0], fast[0], relative)
    grads = max((_diff(plain[1][k], fast[1][k], relative) for k in plain[1]), default=0.0)
    passed = fwd <= tol and grads <= tol
    if not case.grads:
        grads = None
    kind = "relative to the largest |value|" if relative else "absolute"
    reason = f"{case.dtype} on {case.preset}, {kind}: " + (
        "agrees" if passed else "differs beyond the tolerance"
    )
    return SelfTestResult(name, True, passed, reason, fwd, grads, tol)


def _clip_self_test(name: str, case: _Case, seq: int, tol: float) -> SelfTestResult:
    """The model's gradients' square sums (relative difference) and the gradients scaled by 0.37 (absolute)
    with ``case.paths`` on against off."""
    try:
        model, inputs = _tiny_model_and_inputs(case, seq)
        model(**inputs).loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        sums, scaled = {}, {}
        for on in (False, True):
            with kernels.forced(**dict.fromkeys(case.paths, on)):
                sums[on] = np.array([float(kernels.square_sum(g)) for g in grads])
                copies = [g.clone() for g in grads]
                for c in copies:
                    kernels.scale_grad_(c, 0.37)
                scaled[on] = [c.numpy() for c in copies]
    except Exception as exc:
        return SelfTestResult(name, ran=True, passed=False, reason=f"{type(exc).__name__}: {exc}"[:300])
    fwd = float(np.max(np.abs(sums[True] - sums[False]) / np.maximum(sums[False], 1e-30)))
    worst = max(_diff(a, b, False) for a, b in zip(scaled[False], scaled[True], strict=True))
    passed = fwd <= tol and worst <= tol
    reason = f"{len(grads)} gradients of {case.preset}: square sums relative, scaled values absolute: " + (
        "agree" if passed else "differ beyond the tolerance"
    )
    return SelfTestResult(name, True, passed, reason, fwd, worst, tol)


def _diff(a: np.ndarray, b: np.ndarray, relative: bool) -> float:
    d = float(np.abs(a - b).max()) if a.size else 0.0
    return d / max(float(np.abs(a).max()), 1e-12) if relative and a.size else d


def _tiny_model_and_inputs(case: _Case, seq: int):
    paddle.seed(0)
    cfg = preset_config(case.preset, vocab_size=512)
    model = ErnieForCausalLM(cfg)
    init_weights(model, seed=0, std=0.05)
    for layer in model.sublayers():
        if hasattr(layer, "moe_statics"):
            # Shut one expert of every group out of routing: the paths must agree on experts without tokens.
            bias = np.zeros(layer.moe_statics.e_score_correction_bias.shape, np.float32)
            bias[:, 0] = -10.0
            layer.moe_statics.e_score_correction_bias.set_value(paddle.to_tensor(bias))
    if case.held:
        hold_in_low_precision(model, case.dtype)
    else:
        cast_model(model, case.dtype)
    if case.weight_only:
        apply_weight_only(model, "wint8", case.group_size)
    model.train()
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(16, cfg.vocab_size, size=(2, seq)))
    inputs = {"input_ids": ids, "labels": ids}
    if case.inputs in ("packed", "vl"):
        # Samples of uneven lengths packed into each row, positions restarting per sample, padding at the end.
        seg = np.full((2, seq), -1)
        pos = np.zeros((2, seq), np.int64)
        for r, cuts in enumerate(([0, seq // 3, seq // 2, seq - 5], [0, seq // 4, seq - 1])):
            for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                seg[r, a:b] = i
                pos[r, a:b] = np.arange(b - a)
        inputs |= {"segment_ids": paddle.to_tensor(seg), "position_ids": paddle.to_tensor(pos)}
    if case.inputs == "vl":
        inputs["token_type_ids"] = paddle.to_tensor((rng.random((2, seq)) < 0.4).astype(np.int64))
    return model, inputs


def _all_groups_grouped(model) -> bool:
    """Whether every expert group of the model would run grouped (else the comparison proves nothing)."""
    for layer in model.sublayers():
        if isinstance(layer, MoELayer):
            bounds = np.cumsum([0, *layer.group_sizes])
            if not all(can_group(layer.experts[a:b]) for a, b in itertools.pairwise(bounds)):
                return False
    return True


def _logits_and_grads(model, inputs, grads: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The logits and (with ``grads``) every parameter's gradient of the loss; no gradients: ``{}``."""
    if not grads:
        return model(**inputs).logits.astype("float32").numpy(), {}
    model.clear_gradients(set_to_zero=False)  # None, not zeros: which parameters got a gradient matters
    out = model(**inputs)
    out.loss.backward()
    grads = {
        n: p.grad.astype("float32").numpy()
        for n, p in model.named_parameters()
        if not p.stop_gradient and p.grad is not None
    }
    model.clear_gradients(set_to_zero=False)
    return out.logits.astype("float32").numpy(), grads
