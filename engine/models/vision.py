"""The ViT image encoder and the adapter that merges patches into decoder-sized image tokens (VL models)."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from engine.models.config import VisionConfig


def patchify(images: paddle.Tensor, patch: int) -> tuple[paddle.Tensor, int, int]:
    """[B, C, H, W] -> patches [B, (H/p)*(W/p), C*p*p] in row-major grid order, plus the grid size."""
    b, c, h, w = images.shape
    gh, gw = h // patch, w // patch
    x = images[:, :, : gh * patch, : gw * patch].reshape([b, c, gh, patch, gw, patch])
    x = x.transpose([0, 2, 4, 1, 3, 5]).reshape([b, gh * gw, c * patch * patch])
    return x, gh, gw


class VisionBlock(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(d, epsilon=cfg.layer_norm_eps)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, epsilon=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, int(d * cfg.mlp_ratio))
        self.fc2 = nn.Linear(int(d * cfg.mlp_ratio), d)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        b, n, d = x.shape
        hd = d // self.num_heads
        qkv = self.attn_qkv(self.norm1(x)).reshape([b, n, 3, self.num_heads, hd])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.attn_proj(a.reshape([b, n, d]))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionEncoder(nn.Layer):
    """Patch embedding + learned 2-D position embedding (row and column) + transformer blocks."""

    def __init__(self, cfg: VisionConfig, max_grid: int = 64):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.patch_embed = nn.Linear(cfg.in_channels * cfg.patch_size**2, d, bias_attr=False)
        self.row_embed = nn.Embedding(max_grid, d)
        self.col_embed = nn.Embedding(max_grid, d)
        self.blocks = nn.LayerList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(d, epsilon=cfg.layer_norm_eps)

    def forward(self, images: paddle.Tensor) -> tuple[paddle.Tensor, int, int]:
        # Crop to whole image tokens (patch x merge pixels), as image_token_count counts them.
        g = self.cfg.patch_size * self.cfg.spatial_merge_size
        h, w = images.shape[-2:]
        if h < g or w < g:
            raise ValueError(f"image of {h}x{w} px is smaller than one image token ({g}x{g} px)")
        limit = self.row_embed.weight.shape[0] * self.cfg.patch_size
        if h > limit or w > limit:
            raise ValueError(f"image of {h}x{w} px is larger than {limit} px per side; resize it first")
        images = images[..., : h // g * g, : w // g * g]
        patches, gh, gw = patchify(images, self.cfg.patch_size)
        rows = paddle.arange(gh).unsqueeze(1).expand([gh, gw]).reshape([-1])
        cols = paddle.arange(gw).unsqueeze(0).expand([gh, gw]).reshape([-1])
        x = self.patch_embed(patches) + self.row_embed(rows) + self.col_embed(cols)
        for block in self.blocks:
            x = block(x)
        return self.norm(x), gh, gw


class VisionAdapter(nn.Layer):
    """Concatenates each merge x merge window of patches and projects it to the decoder width."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.merge = cfg.spatial_merge_size
        d_in = cfg.hidden_size * self.merge**2
        self.spatial_linear = nn.Sequential(nn.Linear(d_in, d_in), nn.GELU(), nn.Linear(d_in, d_in))
        self.mlp = nn.Linear(d_in, text_hidden)
        self.after_norm = nn.LayerNorm(text_hidden, epsilon=1e-6)

    def forward(self, feats: paddle.Tensor, gh: int, gw: int) -> paddle.Tensor:
        b, _, d = feats.shape
        m = self.merge
        x = feats.reshape([b, gh // m, m, gw // m, m, d]).transpose([0, 1, 3, 2, 4, 5])
        x = x.reshape([b, (gh // m) * (gw // m), m * m * d])
        return self.after_norm(self.mlp(self.spatial_linear(x)))


def image_token_count(height: int, width: int, cfg: VisionConfig) -> int:
    """How many decoder tokens one image of this size becomes."""
    g = cfg.patch_size * cfg.spatial_merge_size
    return (height // g) * (width // g)
