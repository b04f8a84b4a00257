"""oneDNN's GEMMs through Paddle's bundled libdnnl (``engine.models.onednn``): results against numpy in float64,
the backward against the plain path, bad input refused, and the decision that takes them."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import paddle
import pytest

from engine.models import kernels, onednn

HAS_GPU = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
BF16 = kernels.cpu_bf16_features()


def _bf16_values(a: np.ndarray) -> np.ndarray:
    """The float32 values of ``a`` rounded to bfloat16, as Paddle rounds them."""
    return paddle.to_tensor(a).astype("bfloat16").astype("float32").numpy()


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_sgemm_equals_float64_products_for_every_transpose(trans_a: bool, trans_b: bool) -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(37, 19) if trans_a else (19, 37)).astype(np.float32)
    b = rng.normal(size=(23, 37) if trans_b else (37, 23)).astype(np.float32)
    out = onednn.gemm(paddle.to_tensor(a), paddle.to_tensor(b), trans_a, trans_b).numpy()
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    assert out.shape == (19, 23) and out.dtype == np.float32
    # measured 9.5e-7 of the largest |value| (fp32 rounding of 37-term sums)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not BF16, reason="oneDNN's bf16 GEMM: the CPU has no bf16 instructions")
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_bf16_gemm_accumulates_the_bf16_inputs_in_fp32(trans_a: bool, trans_b: bool) -> None:
    """The inputs are bf16, the sums are fp32: the result equals the float64 product of the bf16 values to
    fp32 rounding, not to bf16's 2^-8 (an output rounded to bf16 would be ~100x further off)."""
    rng = np.random.default_rng(1)
    a = _bf16_values(rng.normal(size=(300, 64) if trans_a else (64, 300)).astype(np.float32))
    b = _bf16_values(rng.normal(size=(48, 300) if trans_b else (300, 48)).astype(np.float32))
    ta = paddle.to_tensor(a).astype("bfloat16")
    tb = paddle.to_tensor(b).astype("bfloat16")
    out = onednn.gemm(ta, tb, trans_a, trans_b).numpy()
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    # measured 3e-7 of the largest |value|; a bf16 output would be off by up to 2^-9 = 2e-3
    assert np.abs(out - want).max() <= 3e-6 * np.abs(want).max()


def test_a_strided_view_is_made_contiguous_before_the_call() -> None:
    """A column slice is not contiguous in memory: gemm must copy it, not read past its rows."""
    x = paddle.randn([8, 32])
    w = paddle.randn([32, 40])[:, 5:17]
    out = onednn.gemm(x, w).numpy()
    assert np.abs(out - (x.numpy() @ w.numpy())).max() < 1e-5


def test_bad_operands_are_refused_with_their_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match=r"inner sizes differ \(3x4 @ 5x2"):
        onednn.gemm(paddle.ones([3, 4]), paddle.ones([5, 2]))
    with pytest.raises(TypeError, match=r"float32 or two bfloat16.*float64"):
        onednn.gemm(paddle.ones([3, 4]), paddle.ones([4, 2], dtype="float64"))
    with pytest.raises(ValueError, match="2-D matrices"):
        onednn.gemm(paddle.ones([2, 3, 4]), paddle.ones([4, 2]))
    assert onednn.gemm(paddle.ones([0, 4]), paddle.ones([4, 2])).shape == [0, 2]
    assert float(onednn.gemm(paddle.ones([3, 0]), paddle.ones([0, 2])).abs().sum()) == 0.0


def _grads(fn, x: np.ndarray, w: paddle.Tensor, frozen: bool = False):
    xt = paddle.to_tensor(x)
    xt.stop_gradient = False
    wt = w.detach()
    wt.stop_gradient = frozen
    y = fn(xt, wt)
    (y * y).sum().backward()
    return y.numpy(), xt.grad.numpy(), None if frozen else wt.grad.astype("float32").numpy()


@pytest.mark.parametrize("transpose", [False, True])
def test_the_fp32_layer_matches_paddle_matmul_forward_and_backward(transpose: bool) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 5, 24)).astype(np.float32)
    w = paddle.to_tensor(rng.normal(size=(40, 24) if transpose else (24, 40)).astype(np.float32))
    fast = _grads(lambda x, w: onednn.matmul(x, w, transpose), x, w)
    plain = _grads(lambda x, w: paddle.matmul(x, w, transpose_y=transpose), x, w)
    for f, p in zip(fast, plain, strict=True):
        assert f.shape == p.shape and np.abs(f - p).max() <= 1e-5 * np.abs(p).max()  # measured 2e-7


@pytest.mark.skipif(not BF16, reason="oneDNN's bf16 GEMM: the CPU has no bf16 instructions")
@pytest.mark.parametrize("transpose", [False, True])
def test_the_bf16_layer_computes_what_a_bf16_matmul_computes(transpose: bool) -> None:
    """Forward: the fp32 product of the bf16-rounded activation and weight. Backward: the output's gradient
    rounded to bf16 too, so gradients sit within bf16's relative step of the plain path's; the weight's
    comes back in bf16, a frozen weight's not at all."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 7, 64)).astype(np.float32)
    w = paddle.to_tensor(rng.normal(size=(96, 64) if transpose else (64, 96)).astype(np.float32) * 0.1)
    w = w.astype("bfloat16")

    def plain(x, w):
        return paddle.matmul(
            x.astype("bfloat16").astype("float32"), w.astype("float32"), transpose_y=transpose
        )

    fast = _grads(lambda x, w: onednn.matmul(x, w, transpose, "bfloat16"), x, w)
    want = _grads(plain, x, w)
    assert np.abs(fast[0] - want[0]).max() <= 1e-5 * np.abs(want[0]).max()  # measured 1.6e-7
    for f, p in zip(fast[1:], want[1:], strict=True):  # measured 2.3e-3 and 4.2e-3
        assert np.abs(f - p).max() <= 1e-2 * np.abs(p).max()
    frozen = _grads(lambda x, w: onednn.matmul(x, w, transpose, "bfloat16"), x, w, frozen=True)
    assert frozen[2] is None and np.array_equal(frozen[1], fast[1])


@pytest.mark.skipif(HAS_GPU, reason="the CPU paths' decision (a GPU process keeps them off)")
def test_the_cpu_paths_are_on_here_and_off_by_environment(monkeypatch) -> None:
    caps = kernels.capabilities()
    assert caps["onednn_matmul"].on, caps["onednn_matmul"]
    refusal = kernels.bf16_gemm_refusal()
    if refusal is None:
        assert caps["onednn_bf16_matmul"].on, caps["onednn_bf16_matmul"]
    else:
        assert not caps["onednn_bf16_matmul"].on and caps["onednn_bf16_matmul"].reason == refusal
    monkeypatch.setenv(kernels.DISABLE_ENV, "onednn_matmul,onednn_bf16_matmul")
    kernels.capabilities.cache_clear()
    try:
        caps = kernels.capabilities()
        assert not caps["onednn_matmul"].on and not caps["onednn_bf16_matmul"].on
    finally:
        monkeypatch.delenv(kernels.DISABLE_ENV)
        kernels.capabilities.cache_clear()


@pytest.mark.parametrize(
    "vendor,flags,pays",
    [
        ("AuthenticAMD", {"avx512f", "avx512_bf16"}, True),  # Zen 4 / Zen 5: the bf16 GEMM ran 2x the sgemm
        ("GenuineIntel", {"avx512f", "avx512_bf16", "amx_bf16"}, True),
        ("GenuineIntel", {"avx512f", "avx512_bf16", "avx512_fp16"}, False),  # half-rate VDPBF16PS
        ("GenuineIntel", {"avx512f"}, False),
        ("AuthenticAMD", {"avx2"}, False),
    ],
)
def test_the_bf16_gemm_is_taken_where_the_cpus_bf16_instructions_outrun_its_fp32_fmas(
    monkeypatch, vendor: str, flags: set[str], pays: bool
) -> None:
    monkeypatch.setattr(kernels, "_cpuinfo", lambda: (vendor, frozenset(flags)))
    refusal = kernels.bf16_gemm_refusal()
    assert (refusal is None) is pays, refusal
    if not pays:
        assert ("no bf16 instructions" in refusal) is ("avx512_bf16" not in flags), refusal


@pytest.mark.parametrize(
    "flags,fast",
    [
        ({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}, True),  # Zen 4 / 5, Intel
        ({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, True),  # AVX-512, no bf16: emulated
        ({"avx2", "fma"}, False),  # Zen 3: the reorder's scalar loop, 19x Paddle's cast
        ({"avx2", "avx512f"}, False),  # Xeon Phi's AVX-512 subset
    ],
)
@pytest.mark.skipif(HAS_GPU, reason="the CPU paths' decision (a GPU process keeps them off)")
def test_the_bf16_reorder_is_taken_only_where_onednn_vectorises_it(
    monkeypatch, flags: set[str], fast: bool
) -> None:
    monkeypatch.setattr(kernels, "_cpuinfo", lambda: ("AuthenticAMD", frozenset(flags)))
    kernels.capabilities.cache_clear()
    try:
        refusal = kernels.bf16_reorder_refusal()
        cast = kernels.capabilities()["onednn_cast"]
        if fast:
            assert refusal is None and cast.on, cast
        else:
            assert not cast.on and cast.reason == refusal and "avx512bw" in refusal, cast
    finally:
        monkeypatch.undo()
        kernels.capabilities.cache_clear()


def test_this_machines_cpuinfo_is_read() -> None:
    vendor, flags = kernels._cpuinfo()
    assert vendor in ("GenuineIntel", "AuthenticAMD") and "sse2" in flags, (vendor, sorted(flags)[:10])


@pytest.mark.skipif(HAS_GPU, reason="the CPU paths' decision (a GPU process keeps them off)")
def test_a_library_without_the_gemms_keeps_the_paths_off_with_the_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(onednn, "library_path", lambda: tmp_path / "libdnnl.so.3")
    onednn._functions.cache_clear()
    onednn._lib.cache_clear()
    kernels.capabilities.cache_clear()
    try:
        caps = kernels.capabilities()
        for name in ("onednn_matmul", "onednn_bf16_matmul"):
            if name == "onednn_bf16_matmul" and kernels.bf16_gemm_refusal():
                continue  # off here before the library is looked at
            assert not caps[name].on and "not callable" in caps[name].reason, caps[name]
    finally:
        monkeypatch.undo()
        onednn._functions.cache_clear()
        onednn._lib.cache_clear()
        kernels.capabilities.cache_clear()


def test_a_thread_paddle_did_not_set_up_runs_its_gemms_on_the_set_team() -> None:
    """A server's worker thread starts with a team of OMP_NUM_THREADS (1 after importing Paddle); its first
    GEMM sets the team to ``kernels.CPU_THREADS`` in every OpenMP runtime oneDNN may call."""
    seen = {}

    def work() -> None:
        onednn.gemm(paddle.ones([4, 4]), paddle.ones([4, 4]))
        seen["team"] = onednn.team_size()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["team"] and set(seen["team"]) == {kernels.CPU_THREADS}


def test_convert_gives_paddles_cast_values_both_ways_and_writes_in_place() -> None:
    rng = np.random.default_rng(4)
    x = paddle.to_tensor((rng.normal(size=(333, 77)) * 10).astype(np.float32))
    want = x.astype("bfloat16")
    down = onednn.convert(x, "bfloat16")
    assert down.dtype == paddle.bfloat16 and down.shape == x.shape
    assert np.array_equal(down.astype("float32").numpy(), want.astype("float32").numpy())
    assert np.array_equal(onednn.convert(want, "float32").numpy(), want.astype("float32").numpy())
    target = paddle.zeros([333 * 77], dtype="bfloat16")
    assert onednn.convert(x, "bfloat16", out=target) is target
    assert np.array_equal(target.astype("float32").numpy().reshape(333, 77), want.astype("float32").numpy())
    with pytest.raises(ValueError, match="contiguous bfloat16 tensor of 25641 values"):
        onednn.convert(x, "bfloat16", out=paddle.zeros([5], dtype="bfloat16"))
    with pytest.raises(TypeError, match="float32 and bfloat16, not float64 -> bfloat16"):
        onednn.convert(x.astype("float64"), "bfloat16")


def test_cast_into_writes_a_master_weight_into_its_bf16_parameter() -> None:
    master = paddle.randn([64, 48])
    param = paddle.zeros([64, 48], dtype="bfloat16")
    kernels.cast_into(master, param)
    assert np.array_equal(
        param.astype("float32").numpy(), master.astype("bfloat16").astype("float32").numpy()
    )
    with kernels.forced(onednn_cast=False):  # the plain path writes the same values
        other = paddle.zeros([64, 48], dtype="bfloat16")
        kernels.cast_into(master, other)
    assert np.array_equal(other.astype("float32").numpy(), param.astype("float32").numpy())


@pytest.mark.skipif(not BF16, reason="oneDNN's bf16 GEMM: the CPU has no bf16 instructions")
@pytest.mark.parametrize("why_off", [None, kernels.INTEL_AVX512_BF16_ONLY, "switched off by the environment"])
def test_decoding_rows_take_the_bf16_gemm_where_only_its_arithmetic_is_slow(monkeypatch, why_off) -> None:
    """Which product a bf16-held weight gets, told apart by its numbers: the bf16 GEMM rounds the activation to
    bf16, the upcast multiplies it as it is. Where the GEMM is on, every product takes it; where it is off
    because the CPU's bf16 arithmetic is slow (Intel without AMX), decoding's few rows still take it (they are
    memory-bound: half the bytes, no upcast), and training's rows and anything under autograd do not."""
    from engine.models.quantized import low_precision_matmul

    decided = dict(kernels.capabilities())
    decided["onednn_bf16_matmul"] = kernels.FastPath("onednn_bf16_matmul", why_off is None, why_off or "on")
    monkeypatch.setattr(kernels, "capabilities", lambda: decided)
    rng = np.random.default_rng(0)
    w = paddle.to_tensor(rng.normal(size=(48, 40)).astype(np.float32)).astype("bfloat16")
    w64 = w.astype("float32").numpy().astype(np.float64)

    def path(rows: int, grad: bool) -> str:
        x = rng.normal(size=(rows, 48)).astype(np.float32)
        with paddle.set_grad_enabled(grad):
            y = low_precision_matmul(paddle.to_tensor(x), w).numpy()
        gemm, up = _bf16_values(x).astype(np.float64) @ w64, x.astype(np.float64) @ w64
        assert np.abs(gemm - up).max() > 1e-3  # the two paths are told apart
        return "gemm" if np.abs(y - gemm).max() < 1e-4 else "upcast" if np.abs(y - up).max() < 1e-4 else "?"

    few, many = kernels.BF16_GEMM_FEW_ROWS, kernels.BF16_GEMM_FEW_ROWS + 1
    if why_off is None:
        assert [path(1, False), path(many, False), path(1, True)] == ["gemm"] * 3
    elif why_off == kernels.INTEL_AVX512_BF16_ONLY:
        assert [path(1, False), path(few, False), path(many, False), path(1, True)] == [
            "gemm",
            "gemm",
            "upcast",
            "upcast",
        ]
    else:
        assert [path(1, False), path(many, False)] == ["upcast", "upcast"]
