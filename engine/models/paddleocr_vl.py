"""PaddleOCR-VL (0.9B) in plain Paddle ops: a NaViT-style vision encoder, a projector, the ERNIE 4.5 decoder.

Read from transformers 5.24 ``models/paddleocr_vl/modeling_paddleocr_vl.py`` (an independent port of
Baidu's remote code; tests/engine/test_paddleocr_vl.py holds our logits to it):

- Vision encoder (``PaddleOCRVisionTransformer``): a patch embedding (a 14 x 14 stride-14 convolution with
  bias, here the equivalent linear over each flattened patch), plus a learned square position table
  (``image_size / patch_size`` per side) resampled bilinearly (half-pixel centres, edges clamped) to each
  image's patch grid (``get_vision_interpolation_indices_and_weights``); SigLIP encoder layers (LayerNorm,
  attention with q / k / v / out projections with bias, LayerNorm, fc1 -> gelu-tanh -> fc2) with 2-D axial
  rotary on q and k (the same rotate-half form as ERNIE VL's tower: ``vision.VisionRotary``) over raster
  (row, column) patch positions, each image attending only to itself; a final ``post_layernorm``.
- Projector (``PaddleOCRProjector``, ``mlp_AR`` in the official checkpoint): LayerNorm (eps 1e-5) per patch,
  then each 2 x 2 window of the raster patch grid concatenated (row-major inside the window), linear ->
  GELU (erf) -> linear to the decoder width.
- Decoder: ERNIE-4.5-0.3B (``ErnieModel``: GQA, SwiGLU, RMSNorm). Its RoPE is transformers'
  ``PaddleOCRRotaryEmbedding``: 3-D positions with contiguous sections of rotary pairs (time, row, column =
  ``mrope_section``, [16, 24, 24] for the 0.9B) in the rotate-half form (dimension i pairs with i + d/2).
  ERNIE's own decoder rotates interleaved pairs (2i, 2i+1); the two are the same attention once the q and k
  projections' output dimensions are permuted per head, which ``paddleocr_vl_checkpoint`` does on load
  and undoes on save. Positions (``get_rope_index``) are ERNIE VL's for images: text counts up, an image's
  tokens take (start, start + row, start + column) over its merged grid, then counting resumes at
  start + max(rows, columns) (``positions.batch_positions``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from engine.models.ernie import (
    CausalLMOutput,
    DynamicCache,
    ErnieModel,
    decoder_mask,
    head_logits,
    token_loss,
)
from engine.models.paddleocr_vl_config import OCRVisionConfig, PaddleOCRVLConfig
from engine.models.positions import batch_positions
from engine.models.vision import VisionRotary, patch_positions, rotate_half

Grid = tuple[int, int, int]


def position_taps(grids: Sequence[Grid], side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps into the ``side`` x ``side`` position table for every patch (raster order, frames
    repeated): flat indices int64 [N, 4] and weights float32 [N, 4]. ``F.interpolate(bilinear,
    align_corners=False)`` of the table to each (h, w) grid, as transformers computes it."""
    indices, weights = [], []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        h_taps, h_w = _axis_taps(rows.reshape(-1), h, side)
        w_taps, w_w = _axis_taps(cols.reshape(-1), w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wt = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        indices.append(np.tile(idx, (t, 1)))
        weights.append(np.tile(wt, (t, 1)))
    return np.concatenate(indices).astype(np.int64), np.concatenate(weights).astype(np.float32)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    # float32 arithmetic in transformers' order, so the weights are its weights bit for bit
    f = np.float32
    src = (index.astype(f) + f(0.5)) * f(side) / f(size) - f(0.5)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weight = np.clip(f(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(f)), 0, None)
    return taps, weight.astype(f)


def window_order(grids: Sequence[Grid], merge: int) -> np.ndarray:
    """Row indices that take raster-ordered patches to merge-window order (windows row-major, patches
    row-major inside each): the projector's reshape (t, h/m, m, w/m, m) -> (t, h/m, w/m, m, m)."""
    out, offset = [], 0
    for t, h, w in grids:
        pos = patch_positions([(1, h, w)], merge)
        frame = pos[:, 0] * w + pos[:, 1]
        out += [frame + offset + f * h * w for f in range(t)]
        offset += t * h * w
    return np.concatenate(out).astype(np.int64)


class OCRVisionEmbeddings(nn.Layer):
    def __init__(self, cfg: OCRVisionConfig):
        super().__init__()
        self.side = cfg.grid_per_side
        # The convolution's weight [out, C, p, p] flattened and transposed: [C*p*p, out]
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size**2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(self.side**2, cfg.hidden_size)

    def forward(self, pixel_values: paddle.Tensor, grids: Sequence[Grid]) -> paddle.Tensor:
        x = self.patch_embedding(pixel_values.reshape([pixel_values.shape[0], -1]))
        idx, wt = position_taps(grids, self.side)
        table = self.position_embedding.weight
        taps = paddle.gather(table, paddle.to_tensor(idx.reshape(-1))).reshape([idx.shape[0], 4, -1])
        return x + (taps * paddle.to_tensor(wt, dtype=table.dtype).unsqueeze(-1)).sum(axis=1)


class OCRVisionAttention(nn.Layer):
    def __init__(self, cfg: OCRVisionConfig):
        super().__init__()
        self.num_heads, d = cfg.num_attention_heads, cfg.hidden_size
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: paddle.Tensor, cos, sin, lengths: list[int]) -> paddle.Tensor:
        n, d = x.shape
        hd = d // self.num_heads
        q = rotate_half(self.q_proj(x).reshape([n, self.num_heads, hd]), cos, sin)
        k = rotate_half(self.k_proj(x).reshape([n, self.num_heads, hd]), cos, sin)
        v = self.v_proj(x).reshape([n, self.num_heads, hd])
        outs, start = [], 0
        for length in lengths:  # every image attends only to itself
            qs, ks, vs = (a[start : start + length].transpose([1, 0, 2]) for a in (q, k, v))
            scores = paddle.matmul(qs, ks, transpose_y=True) * (1.0 / math.sqrt(hd))
            probs = F.softmax(scores.astype("float32"), axis=-1).astype(vs.dtype)
            outs.append(paddle.matmul(probs, vs).transpose([1, 0, 2]).reshape([length, d]))
            start += length
        return self.out_proj(paddle.concat(outs, axis=0))


class OCRVisionMLP(nn.Layer):
    def __init__(self, cfg: OCRVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.tanh = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.tanh))


class OCRVisionLayer(nn.Layer):
    def __init__(self, cfg: OCRVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps)
        self.self_attn = OCRVisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps)
        self.mlp = OCRVisionMLP(cfg)

    def forward(self, x: paddle.Tensor, cos, sin, lengths: list[int]) -> paddle.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, lengths)
        return x + self.mlp(self.layer_norm2(x))


class OCRVisionEncoder(nn.Layer):
    """pixel_values [N, C, p, p] (or [N, C*p*p]) + (t, h, w) grids -> patch features [N, hidden], raster order."""

    def __init__(self, cfg: OCRVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = OCRVisionEmbeddings(cfg)
        self.rotary = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.LayerList([OCRVisionLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps)

    def forward(self, pixel_values: paddle.Tensor, grids: Sequence[Grid]) -> paddle.Tensor:
        cos, sin = self.rotary(paddle.to_tensor(patch_positions(grids, 1)))  # merge 1: raster (row, col)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        x = self.embeddings(pixel_values, grids)
        for layer in self.layers:
            x = layer(x, cos, sin, lengths)
        return self.post_layernorm(x)


class OCRProjector(nn.Layer):
    """Patch features -> decoder tokens: LayerNorm, 2 x 2 windows concatenated, linear, GELU, linear."""

    def __init__(self, cfg: OCRVisionConfig, text_hidden: int):
        super().__init__()
        self.merge = cfg.spatial_merge_size
        merged = cfg.hidden_size * self.merge**2
        self.pre_norm = nn.LayerNorm(cfg.hidden_size, epsilon=1e-5)
        self.linear_1 = nn.Linear(merged, merged)
        self.linear_2 = nn.Linear(merged, text_hidden)

    def forward(self, feats: paddle.Tensor, grids: Sequence[Grid]) -> paddle.Tensor:
        x = paddle.gather(self.pre_norm(feats), paddle.to_tensor(window_order(grids, self.merge)))
        x = x.reshape([-1, feats.shape[-1] * self.merge**2])
        return self.linear_2(F.gelu(self.linear_1(x)))


def check_image_inputs(pixel_values: paddle.Tensor, grids: Sequence[Grid], cfg: OCRVisionConfig) -> None:
    """Clear errors for inputs that do not come from this model's image processor."""
    c, p, m = cfg.num_channels, cfg.patch_size, cfg.spatial_merge_size
    flat = pixel_values.ndim == 2 and pixel_values.shape[1] == c * p * p
    if not flat and list(pixel_values.shape[1:]) != [c, p, p]:
        raise ValueError(
            f"pixel_values must be [patches, {c}, {p}, {p}] (or [patches, {c * p * p}]), "
            f"got {list(pixel_values.shape)}"
        )
    for t, h, w in grids:
        if t < 1 or h % m or w % m:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) does not divide into {m}x{m} merge windows")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"the grids hold {total} patches but pixel_values has {pixel_values.shape[0]}")


class PaddleOCRVLForConditionalGeneration(nn.Layer):
    """PaddleOCR-VL. Parameters: ``ernie.*`` (the decoder, Paddle layout: fused qkv / up_gate, [in, out]),
    ``lm_head.weight`` [H, V] when untied, ``visual.*`` (encoder) and ``projector.*``."""

    def __init__(self, config: PaddleOCRVLConfig):
        super().__init__()
        self.config = config
        # What the training loop asks of a model (engine.train.trainer): a dense decoder splits no experts
        # over ranks and has no router losses to gather.
        self.expert_group = None
        self.router_comm = None
        self.ernie = ErnieModel(config.text)
        if not config.text.tie_word_embeddings:
            self.lm_head = nn.Layer()
            self.lm_head.weight = self.lm_head.create_parameter(
                [config.text.hidden_size, config.text.vocab_size]
            )
        self.visual = OCRVisionEncoder(config.vision)
        self.projector = OCRProjector(config.vision, config.text.hidden_size)

    def image_features(self, pixel_values: paddle.Tensor, grids: Sequence[Grid]) -> paddle.Tensor:
        """Decoder-width features of the images, (h/2)(w/2) tokens each, in order."""
        return self.projector(self.visual(pixel_values, grids), grids)

    def embed(
        self, input_ids: paddle.Tensor, pixel_values: paddle.Tensor | None, grids: Sequence[Grid] | None
    ) -> paddle.Tensor:
        """Token embeddings with image features written over the image placeholders, in order."""
        x = self.ernie.embed_tokens(input_ids)
        if pixel_values is None:
            return x
        feats = self.image_features(pixel_values.astype(x.dtype), grids).astype(x.dtype)
        flat = x.reshape([-1, x.shape[-1]])
        slots = paddle.nonzero(input_ids.reshape([-1]) == self.config.image_token_id).reshape([-1])
        if slots.shape[0] != feats.shape[0]:
            raise ValueError(
                f"the prompt has {slots.shape[0]} image placeholder tokens but the images give "
                f"{feats.shape[0]} tokens"
            )
        return paddle.scatter(flat, slots, feats, overwrite=True).reshape(x.shape)

    def logits_from_hidden(self, h: paddle.Tensor) -> paddle.Tensor:
        tied = self.config.text.tie_word_embeddings
        return head_logits(h, self.ernie.embed_tokens.weight if tied else self.lm_head.weight, tied)

    def forward(
        self,
        input_ids: paddle.Tensor,
        *,
        position_ids: paddle.Tensor | None = None,
        attention_mask: paddle.Tensor | None = None,
        segment_ids: paddle.Tensor | None = None,
        pixel_values: paddle.Tensor | None = None,
        grid_thw: Sequence[Grid] | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        labels: paddle.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """As ``ErnieForCausalLM.forward``. ``pixel_values`` [patches, C, p, p] and one ``grid_thw``
        (1, h, w) per image in prompt order (``engine.data.paddleocr_vl_processor``); without 3-D
        ``position_ids`` [3, B, T] they are computed from the image placeholders."""
        b, t = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(self.config.text.num_hidden_layers)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = paddle.arange(past, past + t, dtype="int64").unsqueeze(0).expand([b, t])
        mask, causal = decoder_mask(attention_mask, segment_ids, t)
        if pixel_values is not None:
            grid_thw = [tuple(int(v) for v in g) for g in grid_thw or []]
            check_image_inputs(pixel_values, grid_thw, self.config.vision)
            if position_ids.ndim == 2 and not past:
                seg = segment_ids.numpy() if segment_ids is not None else None
                pos, _ = batch_positions(input_ids.numpy(), grid_thw, self.config, seg)
                position_ids = paddle.to_tensor(pos)
        x = self.embed(input_ids, pixel_values, grid_thw)
        h, _ = self.ernie(x, position_ids, mask, past_key_values, None, causal=causal)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        out = CausalLMOutput(
            logits=self.logits_from_hidden(h), past_key_values=past_key_values, hidden_states=h
        )
        if labels is not None:
            out.lm_loss = out.loss = token_loss(out.logits, labels)
        return out
