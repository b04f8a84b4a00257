"""GPAS (Gradient-Preserving Activation Scaling, Chen et al. 2025, arXiv 2506.22049).

After each residual add of a Pre-LN block the stream is scaled down in the forward pass while its gradient
passes unchanged: ``x' = x - SiLU(a) * stop_gradient(x)``, one learnable scalar ``a`` per site (after the
attention add and after the FFN add of every decoder layer). ``a`` starts at 0 and SiLU(0) = 0, so a model
with fresh gates computes exactly what the plain model computes (the reference code, dandingsky/GPAS,
initialises its gate to 0.0 for the same reason). The reference shares one gate between the two sites of a
layer; here every site has its own, as the issue that asked for GPAS specifies.

The gate's gradient is ``dL/da = -SiLU'(a) * sum(g * x)`` with ``g = dL/dx'``; the stream's gradient is
``g`` itself (``tests/engine/test_gpas.py`` checks both against this formula).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

# The two sites of a decoder layer: parameter names are ``ernie.layers.{i}.gpas_attn.gate`` and
# ``ernie.layers.{i}.gpas_mlp.gate``.
SITES = ("gpas_attn", "gpas_mlp")


class GPASGate(nn.Layer):
    """``x - SiLU(gate) * stop_gradient(x)``; the gate is a [1] float32 parameter starting at 0."""

    def __init__(self):
        super().__init__()
        self.gate = self.create_parameter(
            [1], dtype="float32", default_initializer=nn.initializer.Constant(0.0)
        )

    def scale(self) -> paddle.Tensor:
        """SiLU(gate): the share of the stream taken away in the forward pass."""
        return F.silu(self.gate)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x - self.scale().astype(x.dtype) * x.detach()


def add_gates(model: nn.Layer) -> int:
    """Give a plain model fresh GPAS gates (it computes the same until they train); returns the sites added."""
    n = 0
    for layer in model.ernie.layers:
        for site in SITES:
            if getattr(layer, site, None) is None:
                setattr(layer, site, GPASGate())
                n += 1
    model.config.gpas = True
    return n


def gate_parameters(model: nn.Layer) -> dict[str, paddle.Tensor]:
    """Every GPAS gate by parameter name (empty for a model without GPAS)."""
    return {n: p for n, p in model.named_parameters() if n.endswith(tuple(f"{s}.gate" for s in SITES))}


def gate_values(model: nn.Layer) -> dict[str, float]:
    """Metrics: SiLU(a) of every site (``gpas/<layer>.attn``, ``gpas/<layer>.mlp``) and their mean."""
    out: dict[str, float] = {}
    for layer in model.ernie.layers:
        for site in SITES:
            gate = getattr(layer, site, None)
            if gate is not None:
                out[f"gpas/{layer.index}.{site[len('gpas_') :]}"] = float(gate.scale().item())
    if out:
        out["gpas_scale_mean"] = sum(out.values()) / len(out)
    return out


def clip_gate_grads(model: nn.Layer, max_norm: float) -> float:
    """The reference's ``clip_gate_grad``: clip the gates' gradients by their own global norm (after the
    model-wide clip). Returns their norm before clipping (0 when no gate has a gradient)."""
    grads = [p for p in gate_parameters(model).values() if p.grad is not None]
    if not grads:
        return 0.0
    return float(paddle.nn.utils.clip_grad_norm_(grads, max_norm))


def fold_gates(model: nn.Layer) -> nn.Layer:
    """Turn a GPAS model into a plain one that computes the same up to RMSNorm's epsilon, in place.

    With ``P`` the product of ``1 - SiLU(a)`` over the sites before a block, the stream is ``P * z`` where
    ``z`` is a plain model's stream whose blocks add their output divided by ``P``: RMSNorm ignores the
    scale (all but its epsilon: ``norm(P z)`` divides by ``sqrt(P^2 mean(z^2) + eps)``) and takes its sign
    into its weight. So each block's output projection (``o_proj``, ``down_proj``, every expert's and the
    shared experts' ``down_proj``) is divided by ``P`` and each norm's weight multiplied by ``sign(P)``.
    The gates are removed and ``config.gpas`` is false afterwards.
    """
    scale = 1.0
    with paddle.no_grad():
        for layer in model.ernie.layers:
            for site, norm, outputs in (
                ("gpas_attn", layer.input_layernorm, [layer.self_attn.o_proj]),
                ("gpas_mlp", layer.post_attention_layernorm, _ffn_outputs(layer.mlp)),
            ):
                _fold_block(norm, outputs, scale)
                gate = getattr(layer, site, None)
                if gate is not None:
                    scale *= 1.0 - float(gate.scale().item())
                    setattr(layer, site, None)
        if scale < 0:
            model.ernie.norm.weight.set_value(-model.ernie.norm.weight)
    model.config.gpas = False
    return model


def _fold_block(norm: nn.Layer, outputs: list[nn.Layer], scale: float) -> None:
    """One block of a stream scaled by ``scale``: its norm takes the sign, its outputs divide by it."""
    if scale < 0:
        norm.weight.set_value(-norm.weight)
    for linear in outputs:
        linear.weight.set_value(linear.weight / scale)
        if getattr(linear, "bias", None) is not None:
            linear.bias.set_value(linear.bias / scale)


def _ffn_outputs(mlp: nn.Layer) -> list[nn.Layer]:
    """The linears whose outputs an FFN block adds to the stream (dense, or every expert and shared one)."""
    if hasattr(mlp, "experts"):
        out = [e.down_proj for e in mlp.experts]
        return out + ([mlp.shared_experts.down_proj] if mlp.shared_experts is not None else [])
    return [mlp.down_proj]
