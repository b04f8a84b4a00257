"""The native CPU ops (engine/models/cpu_ops.c): built once per source and machine, refused loudly without a
compiler, and equal to the plain ops at the model's sizes (the probes and kernel self-tests use tiny ones)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle

from engine.models import kernels, native
from engine.models.plain_ops import apply_rotary_plain, rms_norm_plain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_library_is_built_once_per_source_and_a_changed_source_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv(native.HOME_ENV, str(tmp_path / "native"))
    first = native.build()
    built_at = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == built_at  # found, not compiled again
    changed = tmp_path / "cpu_ops.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* another source */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    second = native.build()
    assert second != first and second.exists()
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == sorted([first.name, second.name])


def test_without_a_working_compiler_the_paths_are_off_and_say_why(tmp_path):
    code = (
        "from engine.models import kernels\n"
        "for name in ('cpu_rms_norm', 'cpu_rope'):\n"
        "    p = kernels.capabilities()[name]\n"
        "    print(name, p.on, p.reason)\n"
    )
    env = {**os.environ, "CC": "/bin/false", native.HOME_ENV: str(tmp_path / "empty")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("cpu_")]
    assert len(lines) == 2, out
    for line in lines:
        assert " False the native CPU ops are not available: building cpu_ops.c failed" in line, line
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").glob("*.so"))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _with_grads(fn, *inputs):
    leaves = [t.detach() for t in inputs]
    for t in leaves:
        t.stop_gradient = False
    out = fn(*leaves)
    (out * out).sum().backward()
    return [out.numpy(), *(t.grad.numpy() for t in leaves)]


def test_rms_norm_equals_the_plain_op_at_the_models_width():
    """Measured 2026-11-29 over three seeds: output 5.5e-7, dx 2.3e-6, dw 4.1e-7 relative (bound 1e-5)."""
    paddle.seed(1)
    x, w = paddle.randn([2, 300, 1024]) * 3, paddle.rand([1024]) + 0.5
    fast = _with_grads(lambda x, w: native.rms_norm(x, w, 1e-6), x, w)
    plain = _with_grads(lambda x, w: rms_norm_plain(x, w, 1e-6), x, w)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-5


def test_rope_equals_the_plain_rotation_and_its_backward_turns_back():
    """Measured 2026-11-29 over three seeds: at most 1.9e-7 relative (bound 1e-6); the backward is the
    rotation by the opposite angle, and turning there and back returns x within 2e-7 (bound 1e-6)."""
    paddle.seed(2)
    angles = paddle.rand([2, 300, 1, 64]) * 100
    cos, sin = angles.cos(), angles.sin()
    x = paddle.randn([2, 300, 18, 128])
    fast = _with_grads(lambda x: kernels.rope_native(x, cos, sin), x)
    plain = _with_grads(lambda x: apply_rotary_plain(x, cos, sin), x)
    for f, p in zip(fast, plain, strict=True):
        assert _rel(f, p) < 1e-6
    back = native.rotate(native.rotate(x, cos, sin), cos, sin, -1.0)
    assert _rel(back.numpy(), x.numpy()) < 1e-6
    assert not native.fits_rope(x, cos[:, :1])  # one angle per row and pair, or the plain path
