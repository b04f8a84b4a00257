"""fp32 weight gradients that go straight to a low-precision weight's fp32 master.

An emulated bf16 run (``engine.train.precision.MasterWeights``) holds each trained weight in bf16 and has
AdamW update an fp32 copy. The linears' and the head's weight gradients come out of an fp32-accumulating
GEMM (``onednn.OneDnnMatmul``, ``quantized.UpcastMatmul``). Rounding each to bf16 for the weight's ``.grad``,
only to upcast it again for the master before the step, cost two conversions of every trained value per
step (about 0.2 s of a 6 s bf16 step of the 0.3B shape on an Intel Xeon with AMX, by the profile's
``onednn_convert``; docs/benchmarks.md) and threw away precision: micro-batches then summed in bf16. With a
weight registered here, those GEMMs add their fp32 result to the master's gradient instead and give the bf16
weight none, as Megatron-LM's ``main_grad`` and Paddle's ``amp_master_grad`` keep fp32 gradients beside bf16
weights. Gradients that other ops give the weight (the tied embedding's lookup) still land on its ``.grad``
and ``MasterWeights`` adds them.
"""

from __future__ import annotations

import weakref

import paddle

# id(weight) -> weak references to (the weight, its fp32 master): neither kept alive by this table once the
# run that made them is gone; a weight's entry leaves with the weight (its reference's callback)
_SINKS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    if _SINKS.get(key, (None,))[0] is ref:
        del _SINKS[key]


def register(weight: paddle.Tensor, master: paddle.Tensor) -> None:
    """Send ``weight``'s GEMM gradients, in fp32, to ``master``'s gradient from now on."""
    if master.dtype != paddle.float32 or list(master.shape) != list(weight.shape):
        raise ValueError(
            f"a master gradient needs an fp32 tensor of the weight's shape {list(weight.shape)}, "
            f"got {master.dtype} {list(master.shape)}"
        )
    key = id(weight)
    _SINKS[key] = (weakref.ref(weight, lambda ref: _forget(key, ref)), weakref.ref(master))


def master_of(weight: paddle.Tensor) -> paddle.Tensor | None:
    """The fp32 master ``weight``'s GEMM gradients go to, or None. Ask in a PyLayer's forward: under
    recompute the backward's saved copy of the weight is another tensor."""
    entry = _SINKS.get(id(weight))
    if entry is None or entry[0]() is not weight:
        return None
    return entry[1]()


@paddle.no_grad()
def accumulate(master: paddle.Tensor, grad: paddle.Tensor, axis: int | None = None, start: int = 0) -> None:
    """Add an fp32 ``grad`` to ``master``'s gradient (set it when there is none yet). With ``axis``, ``grad``
    is the block of it from ``start`` along that axis (a large weight's gradient made block by block, so
    that no whole fp32 copy sits beside the gradient)."""
    if grad.dtype != paddle.float32:
        grad = grad.astype("float32")
    if axis is None:
        grad = grad.reshape(master.shape)
        if master.grad is None:
            master._copy_gradient_from(grad)
        else:
            master.grad.add_(grad)
        return
    if master.grad is None:
        master._copy_gradient_from(paddle.zeros_like(master))
    held = master.grad
    index = [slice(None)] * held.ndim
    index[axis] = slice(start, start + grad.shape[axis])
    held[tuple(index)] += grad
