"""The decoder's building blocks: RMSNorm, rotary embeddings, GQA attention and the SwiGLU MLP.

Each block that has a fused kernel asks ``kernels.enabled`` and otherwise runs its plain form
(``plain_ops.rms_norm_plain``, ``apply_rotary_plain``, ``attention_plain``): the reference the kernels are
probed and tested against.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from engine.models import kernels, native
from engine.models.config import ErnieConfig
from engine.models.plain_ops import apply_rotary_plain, attention_plain, rms_norm_plain


class Linear(nn.Linear):
    """``nn.Linear`` whose fp32 product goes through ``kernels.matmul`` (oneDNN's sgemm on a CPU, where that
    path is on); any other dtype, and the GPU, take ``nn.Linear``'s own ``F.linear``. Same parameters, same
    checkpoint names."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if x.dtype == self.weight.dtype == paddle.float32 and kernels.enabled("onednn_matmul"):
            y = kernels.matmul(x, self.weight)
            return y if self.bias is None else y + self.bias
        return super().forward(x)  # F.linear: one fused op where the device has it (a GPU's bias epilogue)


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if kernels.enabled("fused_rms_norm") and x.place.is_gpu_place():
            return kernels.rms_norm_fused(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype == paddle.float32 and kernels.enabled("cpu_rms_norm"):
            return native.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype == paddle.float32 and kernels.enabled("rms_norm_backward"):
            return kernels.rms_norm_written(x, self.weight, self.eps)
        return rms_norm_plain(x, self.weight, self.eps)


def rotary_frequencies(dim: int, theta: float) -> paddle.Tensor:
    """``theta ** (-2i / dim)`` for i < dim / 2, in fp32, made from Python floats at every call.

    Not a buffer: ``paddle.amp.decorate`` O2 and ``checkpoint.cast_model`` cast a layer's floating buffers
    with its weights (``Layer._to_impl(floating_only=True)``, Paddle 3.3.1 paddle/nn/layer/layers.py), and
    frequencies rounded to bf16 turn position 4,095 by an angle up to 1.9 rad off. Three tiny kernels per
    forward.
    """
    return 1.0 / (theta ** (paddle.arange(0, dim, 2, dtype="float32") / dim))


class RotaryEmbedding(nn.Layer):
    """Interleaved (even/odd pair) rotary position embedding, as in ERNIE 4.5.

    VL models (``rope_3d``) take positions per axis [3, B, T] = (time, row, column): the last
    ``freq_allocation`` pairs turn with time, the ones before alternate row (even) and column (odd).
    PaddleOCR-VL (``mrope_section``) gives the first pairs to time, the next to the row, the last to the
    column. Text
    tokens have equal positions on all three axes, which makes this the plain 1-D rotation. It holds no
    tensors (see ``rotary_frequencies``): nothing a cast of the model does reaches its tables.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        freq_allocation: int | None = None,
        mrope_section: list[int] | None = None,
    ):
        super().__init__()
        self.head_dim, self.theta, self.freq_allocation = head_dim, theta, freq_allocation
        self.mrope_section = list(mrope_section) if mrope_section is not None else None

    def forward(self, position_ids: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """position_ids [B, T] (or [3, B, T] for 3-D RoPE) -> cos, sin [B, T, 1, head_dim // 2] in fp32."""
        freqs = position_ids.astype("float32").unsqueeze(-1) * rotary_frequencies(self.head_dim, self.theta)
        if position_ids.ndim == 3:
            if self.freq_allocation is None and self.mrope_section is None:
                raise ValueError("3-D position ids need a model with rope_3d or mrope_section")
            freqs = (freqs * self.pair_axes()).sum(axis=0)
        return freqs.cos().unsqueeze(2), freqs.sin().unsqueeze(2)

    def pair_axes(self) -> paddle.Tensor:
        """[3, 1, 1, pairs] one-hot in fp32: which axis (time, row, column) each rotary pair turns with."""
        pairs = self.head_dim // 2
        if self.mrope_section is not None:  # PaddleOCR-VL: contiguous runs of pairs for time, row, column
            axis = np.repeat(np.arange(3), self.mrope_section)
            table = (axis[None, :] == np.arange(3)[:, None]).astype("float32")
            return paddle.to_tensor(table).reshape([3, 1, 1, pairs])
        j = paddle.arange(pairs)
        time = j >= pairs - self.freq_allocation
        row = paddle.logical_and(~time, j % 2 == 0)
        column = paddle.logical_and(~time, j % 2 == 1)
        return paddle.stack([time, row, column]).astype("float32").reshape([3, 1, 1, pairs])


def apply_rotary(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """Rotate each (even, odd) pair of the last axis of x [B, T, H, D] by the position angle."""
    if kernels.enabled("fused_rope") and x.place.is_gpu_place():
        return kernels.rope_fused(x, cos, sin)
    if x.dtype == paddle.float32 and kernels.enabled("cpu_rope") and native.fits_rope(x, cos):
        return kernels.rope_native(x, cos, sin)
    if x.dtype == paddle.float32 and not x.stop_gradient and kernels.enabled("rope_backward"):
        return kernels.rope_written(x, cos, sin)
    return apply_rotary_plain(x, cos, sin)


class Attention(nn.Layer):
    """Grouped-query attention with a fused Q/K/V projection (Paddle checkpoint layout)."""

    def __init__(self, config: ErnieConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_out, bias_attr=config.use_bias or False)
        self.o_proj = Linear(
            self.num_heads * self.head_dim, config.hidden_size, bias_attr=config.use_bias or False
        )

    def forward(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        attn_mask: paddle.Tensor | None,
        cache=None,
        layer_idx: int = 0,
        causal: bool | tuple[int, ...] = False,
        recompute_core: bool = False,
    ) -> paddle.Tensor:
        """``recompute_core``: keep only q, k, v for backward and rebuild the softmax attention from them
        (recompute_granularity core_attn), not its scores / probabilities."""
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # Q and K sit side by side in the fused projection: rotate them in one pass, then split.
        qk, v = paddle.split(qkv, [(nq + nkv) * hd, nkv * hd], axis=-1)
        qk = apply_rotary(qk.reshape([b, t, nq + nkv, hd]), cos, sin)
        q, k = paddle.split(qk, [nq, nkv], axis=2)
        v = v.reshape([b, t, nkv, hd])
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)
        if recompute_core:
            from paddle.distributed.fleet.utils import recompute as checkpoint

            out = checkpoint(attention, q, k, v, attn_mask, causal, use_reentrant=False)
        else:
            out = attention(q, k, v, attn_mask, causal)
        return self.o_proj(out.reshape([b, t, nq * hd]))


class PackedKeyStarts(tuple):
    """The first visible key of each query block (a plain tuple to ``attention_plain``) of packed rows,
    plus where each sample starts when the rows are laid end to end (``cu_seqlens`` [samples + 1], every
    padding position a sample of its own) for the varlen flash kernel."""

    cu_seqlens: np.ndarray
    max_seqlen: int

    def __new__(cls, starts, cu_seqlens: np.ndarray):
        self = super().__new__(cls, starts)
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = int(np.diff(cu_seqlens).max())
        self._cu_tensor = None
        return self

    def cu_seqlens_tensor(self) -> paddle.Tensor:
        if self._cu_tensor is None:  # made once per batch, on the current device
            self._cu_tensor = paddle.to_tensor(self.cu_seqlens, dtype="int32")
        return self._cu_tensor


def attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    mask: paddle.Tensor | None,
    causal: bool | tuple[int, ...] = False,
) -> paddle.Tensor:
    """Softmax attention; see ``attention_plain`` for the arguments.

    FlashAttention (fp16 / bf16 on a GPU that has it) takes the square causal case without a mask and
    packed rows (``causal`` a ``PackedKeyStarts``); on the CPU, fp32's square causal case (masked or not) takes
    cpu_ops.c's attention (``cpu_attention``); decoding against a cache and the rest take the plain path.
    """
    if q.dtype in kernels.HALF_DTYPES and q.shape[1] == k.shape[1] and q.place.is_gpu_place():
        if isinstance(causal, PackedKeyStarts) and kernels.enabled("flash_attention_varlen"):
            return kernels.flash_varlen(q, k, v, causal.cu_seqlens_tensor(), causal.max_seqlen)
        if mask is None and kernels.enabled("flash_attention"):
            return kernels.flash_causal(q, k, v)
    if (mask is None or causal) and kernels.enabled("cpu_attention") and native.fits_attention(q, k, mask):
        return native.attention(q, k, v, mask, causal if isinstance(causal, tuple) else None)
    return attention_plain(q, k, v, mask, causal)


class MLP(nn.Layer):
    """SwiGLU feed-forward with the fused gate/up projection of the Paddle layout (gate half first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, use_bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up_gate_proj = Linear(hidden_size, 2 * intermediate_size, bias_attr=use_bias or False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias_attr=use_bias or False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(kernels.swiglu(self.up_gate_proj(x)))
