"""What ``compute_type: bf16 | fp16`` really does on this node, decided in one place.

``resolve_precision(compute_type)`` is the one capability check. Three outcomes:

- **amp** (a GPU with bf16 / fp16 kernels): ``paddle.amp.decorate`` level O2 holds the weights in bf16 /
  fp16 (MoE router gates and correction biases stay fp32) and AdamW keeps fp32 master weights and
  moments; fp16 scales the loss with ``paddle.amp.GradScaler``. No ``auto_cast``: the model already casts
  where ERNIE needs fp32 (norm statistics, rotary, attention softmax, router, loss), and O2's casting
  could move the router's fp32 matmul down to low precision. Without ``auto_cast`` nothing tells Paddle
  the run's AMP dtype, which ``GradScaler`` reads, so ``set_up_amp`` records it (see there).
- **emulated** bf16 (no bf16 kernels, e.g. Paddle's CPU build, which has bf16 cast, multiply and
  embedding but no matmul, add or softmax): the weights are held in bf16
  (``engine.models.quantized.hold_in_low_precision``), every linear upcasts its weight to fp32 and rounds
  its output to bf16, and ``MasterWeights`` keeps the fp32 copies AdamW updates (Paddle's
  ``multi_precision`` AdamW has no bf16 CPU kernel). The linears' weight gradients go in fp32 straight onto
  those copies (``engine.models.master_grads``); other weights' come back in bf16. On a CPU with
  ``avx512_bf16`` / ``amx_bf16`` the linears and the head skip the upcast: they run oneDNN's bf16 GEMM (fp32
  accumulation, the ``onednn_bf16_matmul`` fast path of ``engine.models.kernels``), so ``matmuls`` says
  bfloat16.
- fp16 without fp16 kernels is refused: the loss scaling fp16 gradients need (``GradScaler``) works on
  GPUs only, and training unscaled fp16 gradients would silently lose the small ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

import paddle
from paddle import nn
from paddle.amp.auto_cast import amp_global_state

from engine.models import kernels, master_grads

LOW_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# compute types that keep fp32 arithmetic: (what the linears hold, how)
OTHER_COMPUTE_TYPES = {
    "fp8": ("float32", "FP8 QAT: linear weights and inputs rounded to float8 e4m3 in each forward"),
    "wint8": ("int8", "frozen base linears weight-only int8, dequantized per call"),
    "wint4/8": (
        "int8",
        "frozen base linears weight-only int8, experts in the int4 range, dequantized per call",
    ),
}
# ERNIEKit's default initial loss scale (its ``scale_loss``); GradScaler then adapts it every step.
INITIAL_LOSS_SCALE = 2.0**15


class PrecisionMode(StrEnum):
    FP32 = "fp32"
    AMP = "amp"
    EMULATED = "emulated"


@dataclass(frozen=True)
class Precision:
    """The precision a run really trains in: where its weights live and what its matmuls run in."""

    compute_type: str
    mode: PrecisionMode
    weights: str  # dtype the model's linears, embedding and head are held in
    matmuls: str  # dtype the linears compute in
    loss_scaling: bool
    reason: str

    @property
    def activations(self) -> str:
        """The dtype between the layers: float32 wherever bf16 is emulated (oneDNN's bf16 GEMMs take bf16
        inputs but hand back fp32), the weights' dtype under AMP."""
        return self.weights if self.mode is PrecisionMode.AMP else "float32"

    @property
    def low_precision(self) -> bool:
        return self.mode is not PrecisionMode.FP32

    def describe(self) -> str:
        """One line for the log: what is held and computed in which dtype, and why."""
        if not self.low_precision:
            line = f"precision: {self.compute_type}: weights {self.weights}, matmuls and AdamW state float32"
            return f"{line} ({self.reason})" if self.reason else line
        line = (
            f"precision: {self.compute_type} ({self.mode}): weights {self.weights}, matmuls {self.matmuls}, "
            "norms / router / loss float32, AdamW master weights and moments float32"
        )
        if self.loss_scaling:
            line += ", loss scaled by paddle.amp.GradScaler"
        return f"{line} ({self.reason})"

    def as_dict(self) -> dict[str, str | bool]:
        return {**asdict(self), "mode": str(self.mode)}


def resolve_precision(compute_type: str) -> Precision:
    """What ``compute_type`` becomes on this node; raises for fp16 where no fp16 kernels exist."""
    dtype = LOW_PRECISION_DTYPES.get(compute_type)
    if dtype is None:
        weights, why = OTHER_COMPUTE_TYPES.get(compute_type, ("float32", ""))
        return Precision(compute_type, PrecisionMode.FP32, weights, "float32", False, why)
    device = _gpu_with_kernels(dtype)
    if device:
        return Precision(
            compute_type, PrecisionMode.AMP, dtype, dtype, dtype == "float16", f"paddle.amp O2 on {device}"
        )
    if dtype == "bfloat16" and paddle.get_device() == "cpu" and kernels.enabled("onednn_bf16_matmul"):
        return Precision(
            compute_type,
            PrecisionMode.EMULATED,
            dtype,
            dtype,
            False,
            f"no bfloat16 matmul in Paddle's CPU build; the linears and head run oneDNN's bf16 GEMM on the "
            f"CPU's {' / '.join(kernels.cpu_bf16_features())} (fp32 accumulation, "
            "engine.models.onednn), the other ops in float32 on bfloat16-rounded outputs",
        )
    if dtype == "bfloat16":
        return Precision(
            compute_type,
            PrecisionMode.EMULATED,
            dtype,
            "float32",
            False,
            f"no bfloat16 kernels on {paddle.get_device()}{_cpu_bf16_note()}: weights held in bfloat16, "
            "each linear upcast to float32 and its output rounded to bfloat16",
        )
    raise ValueError(
        f"compute_type fp16: {paddle.get_device()} has no float16 kernels, and fp16 training needs "
        "paddle.amp.GradScaler's loss scaling, which runs on GPUs only; use compute_type bf16 (held in "
        "bfloat16 here, computed in float32) or fp32, or run on a GPU node"
    )


def cpu_bf16_matmul() -> bool:
    """Whether Paddle runs a bfloat16 matmul on the CPU. Paddle 3.3.1 does not: its oneDNN bf16 matmul
    serves Paddle Inference only, the eager kernel is fp32 / fp64 (also under ``paddle.amp.auto_cast``
    and with ``FLAGS_use_mkldnn``), and add / softmax / silu have no CPU bf16 kernel either."""
    x = paddle.ones([2, 2], dtype="float32").astype("bfloat16").cpu()
    try:
        paddle.matmul(x, x)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def _cpu_bf16_note() -> str:
    features = kernels.cpu_bf16_features() if paddle.get_device() == "cpu" else []
    if not features or cpu_bf16_matmul():
        return ""
    path = kernels.capabilities()["onednn_bf16_matmul"]
    why = path.reason if not path.on else "forced off here"
    return (
        f" (the CPU has {' / '.join(features)}, but Paddle's CPU build has no bfloat16 matmul kernel and "
        f"oneDNN's bf16 GEMM is off: {why})"
    )


def _gpu_with_kernels(dtype: str) -> str | None:
    """``gpu:N`` when Paddle can train in ``dtype`` there, else None."""
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return None
    device = f"gpu:{paddle.distributed.ParallelEnv().dev_id}"
    supported = paddle.amp.is_bfloat16_supported if dtype == "bfloat16" else paddle.amp.is_float16_supported
    return device if supported(device) else None


# ---- the emulated path: fp32 master weights kept by hand ---------------------------------------------


class MasterWeights:
    """fp32 copies of the low-precision weights that train. AdamW updates the copies (its moments are fp32
    too); after each step they are rounded into the model's bf16 parameters."""

    def __init__(self, params: dict[str, paddle.Tensor]):
        self.low = {n: p for n, p in params.items() if p.dtype != paddle.float32}
        self.master = {n: _fp32_copy(p) for n, p in self.low.items()}
        for n, p in self.low.items():  # the GEMMs' fp32 weight gradients go straight to the masters
            master_grads.register(p, self.master[n])

    def trainable(self, params: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        """``params`` with each low-precision weight replaced by its fp32 master (what the optimizer steps)."""
        return {n: self.master.get(n, p) for n, p in params.items()}

    def gather_grads(self) -> None:
        """Add what the low-precision weights' own gradients hold (ops other than the linears' GEMMs, which
        accumulate onto the masters in fp32 already: ``engine.models.master_grads``), upcast, to the masters'
        gradients; zero for a master that got none."""
        for n, p in self.low.items():
            m = self.master[n]
            if p.grad is not None:
                master_grads.accumulate(m, kernels.cast(p.grad, "float32"))
                p.clear_gradient(False)
            elif m.grad is None:
                m._copy_gradient_from(paddle.zeros_like(m))

    @paddle.no_grad()
    def write_back(self) -> None:
        """Round the masters into the model's weights (after a step, a checkpoint load, an EMA copy)."""
        for n, p in self.low.items():
            kernels.cast_into(self.master[n], p)


def _fp32_copy(p: paddle.Tensor) -> paddle.Tensor:
    return paddle.create_parameter(
        p.shape,
        "float32",
        name=f"{p.name}_fp32_master",
        default_initializer=nn.initializer.Assign(p.astype("float32")),
    )


# ---- the GPU path ------------------------------------------------------------------------------------


def set_up_amp(model: nn.Layer, optimizer, precision: Precision):
    """A GPU run's AMP: ``decorate_for_amp``, then for fp16 the loss scaler. Returns (model, optimizer,
    scaler or None)."""
    model, optimizer = decorate_for_amp(model, optimizer, precision)
    return model, optimizer, loss_scaler(precision)


def decorate_for_amp(model: nn.Layer, optimizer, precision: Precision):
    """``paddle.amp.decorate`` O2: low-precision weights, fp32 master weights in the optimizer; the MoE
    router gates and correction biases stay fp32 as ERNIE keeps them. Returns (model, optimizer).

    It also records the run's AMP dtype in Paddle's AMP state. ``GradScaler.scale`` switches itself off
    (scale 1.0, for good) unless ``amp_global_state().amp_dtype`` is 'float16' (Paddle 3.3.1,
    paddle/amp/grad_scaler.py ``AmpScaler.scale``), and only ``auto_cast`` / ``amp_guard`` set it
    (paddle/amp/auto_cast.py ``amp_guard``), never ``decorate``: without this an fp16 run trained unscaled.
    """
    keep_fp32 = [
        layer for name, layer in model.named_sublayers() if name.endswith(("mlp.gate", "moe_statics"))
    ]
    decorated = paddle.amp.decorate(
        models=model,
        optimizers=optimizer,
        level="O2",
        dtype=precision.weights,
        master_weight=True,
        excluded_layers=keep_fp32 or None,
    )
    amp_global_state().amp_dtype = precision.weights
    return decorated


def loss_scaler(precision: Precision) -> paddle.amp.GradScaler | None:
    """fp16 on a GPU: a dynamic loss scale starting where ERNIEKit's does. Call after ``decorate_for_amp``."""
    if not precision.loss_scaling:
        return None
    if amp_global_state().amp_dtype != "float16":
        raise RuntimeError(
            "loss_scaler: Paddle's AMP state says "
            f"{amp_global_state().amp_dtype!r}, so GradScaler would switch itself off; call decorate_for_amp "
            "(which records float16) first"
        )
    return paddle.amp.GradScaler(init_loss_scaling=INITIAL_LOSS_SCALE)
