"""Fast paths against their plain paths (``kernel_self_tests.self_tests``, the same checks ``ernie-studio doctor``
runs) and the capability decision that picks them."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from engine.models import kernel_self_tests, kernels
from engine.models.ernie import packed_key_starts
from engine.models.plain_ops import rms_norm_plain


@pytest.mark.parametrize("name", list(kernel_self_tests.SELF_TESTS))
def test_fast_path_matches_plain_path(name: str) -> None:
    # oneDNN's bf16 GEMM runs wherever the CPU has bf16 instructions, and its reorder on every CPU (a scalar
    # loop without AVX-512), also where they are off for speed
    force = (name == "onednn_bf16_matmul" and bool(kernels.cpu_bf16_features())) or (
        name == "onednn_cast" and kernels.bf16_reorder_refusal() is not None
    )
    result = kernel_self_tests.self_test(name, quick=False, force=force)
    if not result.ran:
        pytest.skip(result.reason)
    assert result.passed, result
    assert result.max_abs_diff_fwd <= result.tolerance
    assert result.max_abs_diff_grads is None or result.max_abs_diff_grads <= result.tolerance


def test_every_fast_path_has_a_self_test() -> None:
    covered = {p for case in kernel_self_tests.SELF_TESTS.values() for p in case.paths}
    assert covered == set(kernels.FAST_PATHS)


def test_self_tests_report_every_path_with_a_reason() -> None:
    results = kernel_self_tests.self_tests(quick=True)
    assert {r.name for r in results} == {
        n for n, c in kernel_self_tests.SELF_TESTS.items() if not c.full_only
    }
    for r in results:
        assert r.reason
        if not r.ran:  # a skipped check says which capability is missing
            assert "off:" in r.reason and not r.passed


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="checks the decision on a CPU-only build")
def test_cpu_build_keeps_gpu_kernels_off_with_a_reason() -> None:
    caps = kernels.capabilities()
    assert caps["grouped_moe"].on and caps["swiglu"].on
    for name in kernels.GPU_ONLY:
        assert not caps[name].on
        assert "needs a CUDA GPU" in caps[name].reason and "no CUDA" in caps[name].reason


def test_paths_can_be_switched_off_by_environment(monkeypatch) -> None:
    kernels.capabilities.cache_clear()
    monkeypatch.setenv(kernels.DISABLE_ENV, "grouped_moe, swiglu")
    try:
        caps = kernels.capabilities()
        assert not caps["grouped_moe"].on and kernels.DISABLE_ENV in caps["swiglu"].reason
        monkeypatch.setenv(kernels.DISABLE_ENV, "all")
        kernels.capabilities.cache_clear()
        assert not any(p.on for p in kernels.capabilities().values())
    finally:
        kernels.capabilities.cache_clear()


def test_forced_overrides_and_restores() -> None:
    before = kernels.enabled("swiglu")
    with kernels.forced(swiglu=not before):
        assert kernels.enabled("swiglu") is (not before)
        with kernels.forced(grouped_moe=False):
            assert kernels.enabled("swiglu") is (not before) and not kernels.enabled("grouped_moe")
    assert kernels.enabled("swiglu") is before
    with pytest.raises(ValueError, match="unknown fast paths"), kernels.forced(flash=True):
        pass


def test_swiglu_is_silu_of_the_first_half_times_the_second() -> None:
    x = paddle.randn([3, 8])
    gate, up = x.numpy()[:, :4], x.numpy()[:, 4:]
    expected = gate / (1 + np.exp(-gate)) * up
    for on in (True, False):
        with kernels.forced(swiglu=on):
            np.testing.assert_allclose(kernels.swiglu(x).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_packed_rows_give_sample_boundaries_for_varlen_kernels() -> None:
    seg = paddle.to_tensor([[0, 0, 0, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 1]])
    starts = packed_key_starts(seg, block=4)
    assert starts == (0, 0)  # still the plain tuple attention_plain reads (row 1 needs key 0)
    # Row 0: samples at 0 and 3, each padding position alone (5, 6); row 1 (offset 7): at 7 and 13.
    assert starts.cu_seqlens.tolist() == [0, 3, 5, 6, 7, 13, 14]
    assert starts.max_seqlen == 6


def _rope_kernel_reference(q, k, v, sin, cos, position_ids, use_neox_rotary_style):
    """What Paddle's CUDA fused_rotary_position_embedding computes with ``use_neox_rotary_style=True``
    (VectorizedFusedRopeWithRotateEveryTwoKernel): per adjacent pair (x0, x1) at element 2j, 2j + 1 and
    the table row ``position_ids[b, t]``: (cos[2j] x0 - sin[2j] x1, sin[2j+1] x0 + cos[2j+1] x1)."""
    assert use_neox_rotary_style and k is None and v is None
    x = q.numpy()
    table_sin, table_cos = sin.numpy()[0, :, 0], cos.numpy()[0, :, 0]  # [rows, D]
    s, c = table_sin[position_ids.numpy()][:, :, None], table_cos[position_ids.numpy()][:, :, None]
    out = np.empty_like(x)
    out[..., 0::2] = c[..., 0::2] * x[..., 0::2] - s[..., 0::2] * x[..., 1::2]
    out[..., 1::2] = s[..., 1::2] * x[..., 0::2] + c[..., 1::2] * x[..., 1::2]
    return paddle.to_tensor(out), None, None


def test_fused_rope_inputs_follow_the_kernels_layout(monkeypatch) -> None:
    """The kernel has no CPU build: check the sin / cos table and position lookup ``rope_fused`` hands it
    against the kernel's formula, with per-row positions as packing and 3-D RoPE give them."""
    from engine.models.layers import RotaryEmbedding
    from engine.models.plain_ops import apply_rotary_plain

    monkeypatch.setattr(
        paddle.incubate.nn.functional, "fused_rotary_position_embedding", _rope_kernel_reference
    )
    rotary = RotaryEmbedding(16, 10000.0)
    positions = paddle.to_tensor([[0, 1, 2, 0, 1], [7, 8, 9, 10, 11]])
    cos, sin = rotary(positions)
    x = paddle.randn([2, 5, 3, 16])
    np.testing.assert_allclose(
        kernels.rope_fused(x, cos, sin).numpy(), apply_rotary_plain(x, cos, sin).numpy(), atol=1e-6
    )


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="checks a probe failing on a CPU-only build")
def test_a_kernel_that_fails_its_probe_stays_off_with_the_error() -> None:
    path = kernels._probe("fused_rope")  # no CPU kernel: the probe's call raises NotFound
    assert (
        not path.on
        and "failed on a probe" in path.reason
        and "fused_rotary_position_embedding" in path.reason
    )


def test_weight_only_gemm_serves_per_channel_scales_only() -> None:
    """Paddle 3.3.1's GPU weight_quantize writes per-channel scales whatever its group_size, so its GEMM
    would read group scales never written: group-wise layers must take the dequantize path. Its backward
    exists per channel on sm80/86/90/100 only, while serving needs none."""
    for group_size in (64, 128):
        for needs_grad in (False, True):
            assert "group size" in kernels.weight_only_refusal(group_size, needs_grad, 80)
    assert kernels.weight_only_refusal(-1, needs_grad=False, compute_capability=89) is None
    assert "compute capability 8.9" in kernels.weight_only_refusal(-1, needs_grad=True, compute_capability=89)
    assert kernels.weight_only_refusal(-1, needs_grad=True, compute_capability=80) is None


def test_a_group_wise_weight_only_layer_never_reaches_paddles_gemm() -> None:
    from engine.models.quantized import WeightOnlyLinear

    rng = np.random.default_rng(0)
    base = paddle.nn.Linear(128, 32)
    grouped = WeightOnlyLinear.from_linear(base, 8, group_size=64)
    per_channel = WeightOnlyLinear.from_linear(base, 8)
    assert grouped.weight_scale.shape[0] == 2 and per_channel.weight_scale.shape[0] == 1
    x = paddle.to_tensor(rng.standard_normal((3, 128)).astype(np.float32))
    with kernels.forced(weight_only_linear=True):
        assert kernels.weight_only_linear(grouped, x.astype("float16")) is None
        # per channel goes to Paddle's weight_quantize + GEMM, which this CPU build cannot run
        if not paddle.is_compiled_with_cuda():
            with pytest.raises(Exception, match=r"weight_quantize|weight_only_linear"):
                kernels.weight_only_linear(per_channel, x.astype("float16"))
        want = x.numpy() @ grouped.dequantized().numpy() + base.bias.numpy()
        np.testing.assert_allclose(grouped(x).numpy(), want, rtol=1e-5, atol=1e-5)


def test_fast_paths_are_decided_when_the_model_is_built(tiny_model_dir) -> None:
    """Not in the first forward: under non-reentrant recompute that forward runs inside saved-tensor hooks,
    which took the probes' saved tensors as the block's (a VL LoRA run with recompute failed its backward)."""
    from engine.models.loading import load_plain_model

    kernels.capabilities.cache_clear()
    load_plain_model(tiny_model_dir)
    assert kernels.capabilities.cache_info().currsize == 1


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_the_written_rms_norm_gives_no_gradient_to_what_does_not_train(frozen: str) -> None:
    """A LoRA run's norms are frozen, and the first norm's input (a frozen embedding's rows) needs none:
    Paddle refuses a PyLayer that returns a gradient there. What trains gets the plain form's gradient."""
    grads = []
    for norm in (kernels.rms_norm_written, rms_norm_plain):
        x = paddle.to_tensor(np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32))
        w = paddle.to_tensor(np.linspace(0.5, 1.5, 16).astype(np.float32))
        x.stop_gradient, w.stop_gradient = frozen == "input", frozen == "weight"
        y = norm(x * 1.0, w, 1e-5)
        (y * y).sum().backward()
        assert (x.grad is None) == (frozen == "input") and (w.grad is None) == (frozen == "weight")
        grads.append((x.grad if frozen == "weight" else w.grad).numpy())
    assert np.abs(grads[0] - grads[1]).max() <= 1e-5 * np.abs(grads[1]).max()
