"""ERNIE 4.5 VL's vision side: the ViT with 2-D rotary positions and the variable-resolution resampler.

As Baidu built it (and as transformers' ``ernie4_5_vl_moe`` port and FastDeploy's ``dfnrope`` read it):

- Images and video frames arrive already cut into patches by the processor (``engine.data.vl_processor``):
  ``pixel_values`` [N, C*p*p] with the patches of every 2 x 2 merge window next to each other, and one
  grid (t, h, w) in patches per image or video.
- The ViT embeds patches with one bias-free linear layer, has no position table, and rotates q/k in every
  block by the patch's (row, column): half of each head's rotary pairs turn with the row, half with the
  column (theta 1e4). Attention stays inside one frame. MLPs use quick_gelu.
- The resampler concatenates each merge window (4 patches), runs ``spatial_linear`` (fc1, GELU, fc2,
  LayerNorm), then pairs frames in time (an image is paired with itself) through ``temporal_linear``, and
  projects to the decoder width with an RMSNorm after: one decoder token per window (per 2 frames).

Parameter names are those of the checkpoints (``blocks.N.attn.qkv``, ``mlp.fc1``, ``spatial_linear.0``),
Linear weights [in, out] as everywhere in Paddle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from engine.models.config import VisionConfig
from engine.models.layers import RMSNorm, rotary_frequencies
from engine.models.positions import grid_tokens

Grid = tuple[int, int, int]


def quick_gelu(x: paddle.Tensor) -> paddle.Tensor:
    return x * F.sigmoid(1.702 * x)


def patch_positions(grids: Sequence[Grid], merge: int) -> np.ndarray:
    """(row, column) of every patch, in the processor's order: merge windows row-major, then inside each
    window row-major; a video repeats its frame's positions. Returns int64 [N, 2]."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out, axis=0).astype(np.int64)


class VisionRotary(nn.Layer):
    """Axial 2-D RoPE: the first half of a head's rotary frequencies follow the row, the second the column."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # frequencies made per call, never stored: a cast of the model would round them (rotary_frequencies)
        self.quarter, self.theta = head_dim // 2, theta

    def forward(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """positions [N, 2] -> cos, sin [N, 1, head_dim] for the rotate-half form, in fp32."""
        inv_freq = rotary_frequencies(self.quarter, self.theta)
        freqs = positions.astype("float32").unsqueeze(-1) * inv_freq  # [N, 2, hd/4]
        half = paddle.concat([freqs[:, 0], freqs[:, 1]], axis=-1)  # [N, hd/2]
        full = paddle.concat([half, half], axis=-1)
        return full.cos().unsqueeze(1), full.sin().unsqueeze(1)


def rotate_half(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """RoPE in the rotate-half form (the vision tower's; the decoder rotates interleaved pairs)."""
    x32 = x.astype("float32")
    a, b = paddle.split(x32, 2, axis=-1)
    return (x32 * cos + paddle.concat([-b, a], axis=-1) * sin).astype(x.dtype)


class VisionAttention(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: paddle.Tensor, cos, sin, lengths: list[int]) -> paddle.Tensor:
        n, d = x.shape
        hd = d // self.num_heads
        qkv = self.qkv(x).reshape([n, 3, self.num_heads, hd])
        q = rotate_half(qkv[:, 0], cos, sin)
        k = rotate_half(qkv[:, 1], cos, sin)
        v = qkv[:, 2]
        outs = []
        start = 0
        for length in lengths:  # every frame attends only to itself
            sl = slice(start, start + length)
            qs, ks, vs = (t[sl].transpose([1, 0, 2]) for t in (q, k, v))  # [heads, L, hd]
            scores = paddle.matmul(qs * (1.0 / math.sqrt(hd)), ks, transpose_y=True)
            probs = F.softmax(scores.astype("float32"), axis=-1).astype(vs.dtype)
            outs.append(paddle.matmul(probs, vs).transpose([1, 0, 2]).reshape([length, d]))
            start += length
        return self.proj(paddle.concat(outs, axis=0))


class VisionMLP(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        if cfg.hidden_act not in ("quick_gelu", "gelu"):
            raise ValueError(
                f"vision hidden_act {cfg.hidden_act!r} is not supported (ERNIE 4.5 VL: quick_gelu)"
            )
        self.act = quick_gelu if cfg.hidden_act == "quick_gelu" else F.gelu

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, lengths: list[int]) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.in_channels * cfg.patch_size**2, cfg.hidden_size, bias_attr=False)

    def forward(self, pixel_values: paddle.Tensor) -> paddle.Tensor:
        return self.proj(pixel_values)  # in the model's compute dtype (``ErnieForCausalLM.embed`` casts)


class VisionTransformer(nn.Layer):
    """pixel_values [N, C*p*p] + grids -> patch features [N, hidden] (``vision_model`` in checkpoints)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.rotary = VisionRotary(cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        self.blocks = nn.LayerList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.ln = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps)

    def forward(self, pixel_values: paddle.Tensor, grids: Sequence[Grid]) -> paddle.Tensor:
        """Inputs as ``check_grids`` accepts them (``ErnieForCausalLM.forward`` checks before anything runs)."""
        cos, sin = self.rotary(paddle.to_tensor(patch_positions(grids, self.cfg.spatial_merge_size)))
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.ln(x)


def check_grids(pixel_values: paddle.Tensor, grids: Sequence[Grid], cfg: VisionConfig) -> None:
    """Clear errors for inputs that do not come from the processor of this model."""
    m = cfg.spatial_merge_size
    want = cfg.in_channels * cfg.patch_size**2
    if pixel_values.ndim != 2 or pixel_values.shape[1] != want:
        raise ValueError(
            f"pixel_values must be [patches, {want}] (channels x patch_size^2 = {cfg.in_channels} x "
            f"{cfg.patch_size}^2), got {list(pixel_values.shape)}"
        )
    for t, h, w in grids:
        if h % m or w % m or t < 1 or (t > 1 and t % cfg.temporal_merge_size):
            raise ValueError(
                f"grid (t={t}, h={h}, w={w}) does not divide into {m}x{m} merge windows"
                + (f" and pairs of {cfg.temporal_merge_size} frames" if t > 1 else "")
            )
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"the grids hold {total} patches but pixel_values has {pixel_values.shape[0]}")


class ResamplerMLP(nn.Layer):
    """fc1 -> GELU -> fc2 -> LayerNorm; checkpoints index them 0, 2, 3 (a Sequential with the GELU at 1)."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.add_sublayer("0", nn.Linear(d_in, d_out))
        self.add_sublayer("2", nn.Linear(d_out, d_out))
        self.add_sublayer("3", nn.LayerNorm(d_out, epsilon=eps))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        layers = self._sub_layers
        return layers["3"](layers["2"](F.gelu(layers["0"](x))))


class Resampler(nn.Layer):
    """Patch features -> decoder tokens: merge 2 x 2 windows, pair frames in time, project, RMSNorm."""

    def __init__(self, cfg: VisionConfig, text_hidden: int, text_eps: float):
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.temporal = cfg.temporal_merge_size
        spatial = cfg.hidden_size * self.merge**2
        self.spatial_linear = ResamplerMLP(spatial, spatial, cfg.layer_norm_eps)
        self.temporal_linear = ResamplerMLP(spatial * self.temporal, spatial, cfg.layer_norm_eps)
        self.mlp = nn.Linear(spatial, text_hidden)
        self.after_norm = RMSNorm(text_hidden, text_eps)

    def forward(self, feats: paddle.Tensor, grids: Sequence[Grid]) -> paddle.Tensor:
        x = self.spatial_linear(feats.reshape([-1, feats.shape[-1] * self.merge**2]))
        first, second = self.frame_pairs(grids)
        x = paddle.concat([paddle.gather(x, first), paddle.gather(x, second)], axis=-1)
        return self.after_norm(self.mlp(self.temporal_linear(x)))

    def frame_pairs(self, grids: Sequence[Grid]) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Row indices of the merged windows that go together in time: frames (0, 1), (2, 3) ... of a
        video, an image with itself. Official models merge exactly 2 frames."""
        if self.temporal != 2:
            raise ValueError(f"temporal_merge_size {self.temporal} is not supported (ERNIE 4.5 VL uses 2)")
        first, second = [], []
        offset = 0
        for t, h, w in grids:
            per_frame = h * w // self.merge**2
            for even in range(0, t, 2):
                odd = even + 1 if t > 1 else even
                first.append(np.arange(offset + even * per_frame, offset + (even + 1) * per_frame))
                second.append(np.arange(offset + odd * per_frame, offset + (odd + 1) * per_frame))
            offset += t * per_frame
        return paddle.to_tensor(np.concatenate(first)), paddle.to_tensor(np.concatenate(second))


def vision_token_count(grid: Grid, cfg: VisionConfig) -> int:
    """Decoder tokens one image or video of this patch grid becomes."""
    return grid_tokens(grid, cfg.spatial_merge_size, cfg.temporal_merge_size)
