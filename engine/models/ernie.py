"""The ERNIE 4.5 decoder (dense, MoE and multimodal MoE) in plain Paddle ops.

Parameter names follow the official Paddle checkpoint layout (``ernie.layers.{i}.self_attn.qkv_proj``,
Linear weights [in, out]) so saving is a plain state dict; ``checkpoint.py`` converts the PyTorch layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from engine.models import kernels, plain_ops
from engine.models.config import ErnieConfig
from engine.models.gpas import GPASGate
from engine.models.layers import MLP, Attention, PackedKeyStarts, RMSNorm, RotaryEmbedding
from engine.models.moe import (
    MoELayer,
    RouterStats,
    aux_loss,
    global_router_losses,
    orthogonal_loss,
    z_loss,
)
from engine.models.plain_ops import packed_causal_mask
from engine.models.positions import batch_positions, vision_routed_ids
from engine.models.quantized import low_precision_matmul
from engine.models.vision import Grid, Resampler, VisionTransformer, check_grids

IGNORE_INDEX = -100
# What recompute may rebuild in backward (ERNIEKit's recompute_granularity names).
RECOMPUTE_GRANULARITIES = ("full", "full_attn", "core_attn")


class DynamicCache:
    """Key/value cache that grows by concatenation: ``update`` returns all keys/values seen so far."""

    def __init__(self, num_layers: int):
        self.keys: list[paddle.Tensor | None] = [None] * num_layers
        self.values: list[paddle.Tensor | None] = [None] * num_layers

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[1])

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        if self.keys[layer] is not None:
            k = paddle.concat([self.keys[layer], k], axis=1)
            v = paddle.concat([self.values[layer], v], axis=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v


@dataclass
class CausalLMOutput:
    logits: paddle.Tensor
    loss: paddle.Tensor | None = None
    lm_loss: paddle.Tensor | None = None
    router_losses: dict[str, paddle.Tensor] = field(default_factory=dict)
    router_stats: list[RouterStats] = field(default_factory=list)
    past_key_values: DynamicCache | None = None
    hidden_states: paddle.Tensor | None = None


class DecoderLayer(nn.Layer):
    def __init__(self, config: ErnieConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(index)
        self.mlp = (
            MoELayer(config)
            if self.is_moe
            else MLP(config.hidden_size, config.intermediate_size, config.use_bias)
        )
        # Dropout on the attention and FFN outputs before each residual add (ERNIEKit's hidden dropout);
        # training sets it per step, and at 0 (the default) the layer is exactly the plain decoder layer.
        self.hidden_dropout = 0.0
        # GPAS (engine.models.gpas): a gate after each residual add; None keeps the plain Pre-LN layer.
        self.gpas_attn = GPASGate() if config.gpas else None
        self.gpas_mlp = GPASGate() if config.gpas else None
        # Under recompute, whether this MoE block is recomputed too (ERNIEKit's ``use_recompute_moe``). With
        # expert parallelism only its expert FFNs are: the exchange runs collectives inside the block, and a
        # replay of those in backward could interleave with other ranks' backward collectives.
        self.recompute_moe = True

    def forward(
        self,
        x,
        cos,
        sin,
        attn_mask,
        cache,
        token_type_ids,
        recompute: str | None = None,
        causal: bool | tuple = False,
    ):
        """``recompute``: None, or what is rebuilt in backward (``RECOMPUTE_GRANULARITIES``): ``full`` every
        block, ``full_attn`` the attention block, ``core_attn`` the softmax attention inside it; MoE blocks
        under any of them while ``recompute_moe`` holds and their experts are not split."""
        if recompute is not None and recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute granularity {recompute!r}: expected one of {RECOMPUTE_GRANULARITIES}"
            )
        # Non-reentrant recompute (saved-tensor hooks) keeps each block's input and replays the block in
        # backward; its outputs need not be tensors, so an MoE block returns its router statistics as they
        # are: the router losses and expert counts are computed once, from these outputs, and the replay's
        # own statistics are dropped (see moe_ffn_block).
        from paddle.distributed.fleet.utils import recompute as checkpoint

        if recompute in ("full", "full_attn"):
            x = checkpoint(self.attention_block, x, cos, sin, attn_mask, None, causal, use_reentrant=False)
        else:
            x = self.attention_block(x, cos, sin, attn_mask, cache, causal, recompute == "core_attn")
        if not self.is_moe:
            if recompute == "full":
                return checkpoint(self.dense_ffn_block, x, use_reentrant=False), None
            return self.dense_ffn_block(x), None
        if recompute is not None and self.recompute_moe:
            if self.mlp.expert_group is None:
                return checkpoint(self.moe_ffn_block, x, token_type_ids, use_reentrant=False)
            # Expert parallelism: the exchange's collectives stay out of any replay; the expert FFNs on
            # either side of it are recomputed (MoELayer.forward, expert_parallel.run_split_experts).
            return self.moe_ffn_block(x, token_type_ids, recompute_experts=True)
        return self.moe_ffn_block(x, token_type_ids)

    def attention_block(
        self, x, cos, sin, attn_mask, cache=None, causal: bool | tuple = False, recompute_core: bool = False
    ):
        y = self.self_attn(
            self.input_layernorm(x), cos, sin, attn_mask, cache, self.index, causal, recompute_core
        )
        return self.scaled(x + self.dropout(y), self.gpas_attn)

    def dense_ffn_block(self, x):
        return self.scaled(x + self.dropout(self.mlp(self.post_attention_layernorm(x))), self.gpas_mlp)

    def moe_ffn_block(self, x, token_type_ids, recompute_experts: bool = False):
        """The MoE block: router, routed and shared experts, residual. It has no side effect (the aux-free
        bias moves after the optimizer step, from the statistics this returns), so replaying it in backward
        routes every token exactly as the forward did (same input, same bias, same RNG state) and changes
        nothing but the activations it rebuilds."""
        y, stats = self.mlp(self.post_attention_layernorm(x), token_type_ids, recompute_experts)
        return self.scaled(x + self.dropout(y), self.gpas_mlp), stats

    @staticmethod
    def scaled(x, gate):
        return x if gate is None else gate(x)

    def dropout(self, y):
        if self.hidden_dropout and self.training:
            return F.dropout(y, self.hidden_dropout, training=True)
        return y


class ErnieModel(nn.Layer):
    def __init__(self, config: ErnieConfig):
        super().__init__()
        # The fast paths are decided (their probes run forward and backward) when the model is built, never
        # inside its first forward: under non-reentrant recompute that forward runs within saved-tensor
        # hooks, which would take the probes' saved tensors as the block's and misalign its replay.
        kernels.capabilities()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.freq_allocation if config.rope_3d else None,
            config.mrope_section,
        )
        self.gradient_checkpointing = False
        # What recompute rebuilds in backward (DecoderLayer.forward): full, full_attn or core_attn.
        self.recompute_granularity = "full"
        # Elastic training (engine.models.elastic): the decoder layers a sub-model runs; None runs all.
        self.active_layers: frozenset[int] | None = None

    def forward(self, embeds, position_ids, attn_mask, cache, token_type_ids, causal: bool | tuple = False):
        """``causal``: ``attn_mask`` is known to hide all later keys (built by our padding/packing helpers);
        a tuple also gives each query block's first visible key (see ``layers.attention``)."""
        cos, sin = self.rotary(position_ids)
        x = embeds
        all_stats = []
        recompute = self.recompute_granularity if self.gradient_checkpointing and self.training else None
        for layer in self.layers:
            if self.active_layers is not None and layer.index not in self.active_layers:
                continue
            x, stats = layer(
                x, cos, sin, attn_mask, cache, token_type_ids, recompute=recompute, causal=causal
            )
            if stats is not None:
                all_stats.append(stats)
        return self.norm(x), all_stats


def causal_mask_from_padding(padding_mask: paddle.Tensor, query_len: int) -> paddle.Tensor:
    """[B, S] (1 keep, 0 pad) -> additive fp32 [B, 1, T, S], causal with queries aligned to the end.

    Every query also sees its own key, so a padded query row (left padding) is never all -inf: such a row
    would turn into NaN and, through the next layer's values, spread to the real tokens.
    """
    s = padding_mask.shape[1]
    causal = paddle.tril(paddle.ones([query_len, s], dtype="bool"), diagonal=s - query_len)
    own = paddle.triu(causal, diagonal=s - query_len)  # the diagonal aligned to the end of the keys
    keep = (causal.unsqueeze(0) & padding_mask.astype("bool").unsqueeze(1)) | own.unsqueeze(0)
    return paddle.where(keep, 0.0, float("-inf")).astype("float32").unsqueeze(1)


def packed_key_starts(segment_ids: paddle.Tensor, block: int | None = None) -> tuple[int, ...]:
    """For each block of query rows, the first key any of them can see under ``packed_causal_mask``.

    A query sees only earlier keys of its own sample, so a block of short packed samples needs only the keys
    from the start of its earliest sample: attention skips the rest instead of masking it.
    """
    block = (
        block or plain_ops.ATTENTION_BLOCK
    )  # read at call time: the blocks must be the ones attention uses
    seg = segment_ids.numpy()
    b, t = seg.shape
    first = np.empty_like(seg)
    sample_starts = []  # where each sample begins with the rows end to end (varlen kernels)
    for r in range(b):  # first position of every position's sample id in its row
        _, idx, inv = np.unique(seg[r], return_index=True, return_inverse=True)
        first[r] = idx[inv]
        row = seg[r]
        cuts = np.flatnonzero((row[1:] != row[:-1]) | (row[1:] == -1)) + 1  # every padding alone
        sample_starts.append(np.concatenate([[0], cuts]) + r * t)
    cu_seqlens = np.concatenate([*sample_starts, [b * t]]).astype(np.int32)
    starts = [int(first[:, s : s + block].min()) for s in range(0, t, block)]
    return PackedKeyStarts(starts, cu_seqlens)


def decoder_mask(
    attention_mask: paddle.Tensor | None, segment_ids: paddle.Tensor | None, query_len: int
) -> tuple[paddle.Tensor | None, bool | tuple]:
    """The decoder's additive mask from a [B, S] padding mask, an additive [B, 1, T, S] mask or packed
    ``segment_ids`` (None: plain causal), and whether it hides every later key (``ErnieModel.forward``'s
    ``causal``), which lets attention skip those blocks."""
    if segment_ids is not None:
        return packed_causal_mask(segment_ids), packed_key_starts(segment_ids)
    if attention_mask is not None and attention_mask.ndim == 2:
        return causal_mask_from_padding(attention_mask, query_len), True
    return attention_mask, attention_mask is None


class ErnieForCausalLM(nn.Layer):
    """ERNIE 4.5 language model; with ``config.vision_config`` also the multimodal (VL) model."""

    def __init__(self, config: ErnieConfig):
        super().__init__()
        self.config = config
        self.ernie = ErnieModel(config)
        # Several ranks (engine.models.expert_parallel.RouterComm): router losses over the global batch.
        self.router_comm = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Layer()
            self.lm_head.weight = self.lm_head.create_parameter([config.hidden_size, config.vocab_size])
        if config.vision_config is not None:
            # Checkpoint names: the ViT at the top (``vision_model.*``), the resampler inside the decoder
            # (``ernie.resampler_model.*``), as in the official Paddle layout.
            self.vision_model = VisionTransformer(config.vision_config)
            self.ernie.resampler_model = Resampler(
                config.vision_config, config.hidden_size, config.rms_norm_eps
            )

    # ---- embeddings --------------------------------------------------------------------------------
    def embed(
        self, input_ids: paddle.Tensor, pixel_values: paddle.Tensor | None, grids: Sequence[Grid] | None
    ) -> paddle.Tensor:
        """Token embeddings with image / video features written over their placeholders, in order."""
        x = self.ernie.embed_tokens(input_ids)
        if pixel_values is None:
            return x
        if self.config.vision_config is None:
            raise ValueError("images were given but this model has no vision encoder")
        pixel_values = pixel_values.astype(x.dtype)  # the compute dtype (fp32, or bf16 on GPU nodes)
        feats = self.ernie.resampler_model(self.vision_model(pixel_values, grids), grids).astype(x.dtype)
        flat = x.reshape([-1, x.shape[-1]])
        ids = input_ids.reshape([-1])
        slots = paddle.nonzero((ids == self.config.im_patch_id) | (ids == self.config.video_token_id))
        slots = slots.reshape([-1])
        if slots.shape[0] != feats.shape[0]:
            raise ValueError(
                f"the prompt has {slots.shape[0]} image / video placeholder tokens but the images give "
                f"{feats.shape[0]} tokens"
            )
        flat = paddle.scatter(flat, slots, feats, overwrite=True)
        return flat.reshape(x.shape)

    def output_weight(self) -> paddle.Tensor:
        return self.ernie.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits_from_hidden(self, h: paddle.Tensor) -> paddle.Tensor:
        return head_logits(h, self.output_weight(), self.config.tie_word_embeddings)

    # ---- forward -----------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: paddle.Tensor,
        *,
        position_ids: paddle.Tensor | None = None,
        attention_mask: paddle.Tensor | None = None,
        segment_ids: paddle.Tensor | None = None,
        token_type_ids: paddle.Tensor | None = None,
        pixel_values: paddle.Tensor | None = None,
        grid_thw: Sequence[Grid] | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        labels: paddle.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """Run the model.

        - ``attention_mask``: [B, S] padding mask (1 keep) or an additive [B, 1, T, S] mask; None = causal.
        - ``segment_ids``: [B, T] packed-sample index per position; builds the block-diagonal causal mask.
        - ``labels``: already aligned with the positions (label[t] is the token predicted at t), -100 = no loss.
        - ``logits_to_keep``: compute logits only for the last N positions (decoding); 0 = all.
        - VL: ``pixel_values`` [patches, C*p*p] and one ``grid_thw`` (t, h, w) per image / video in prompt
          order, from ``engine.data.vl_processor``. Without 3-D ``position_ids`` [3, B, T] they are
          computed from the placeholders (per packed sample with ``segment_ids``); ``token_type_ids``
          (the routing modality) default to what ``moe_token_types`` says of the ids.
        """
        b, t = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(self.config.num_hidden_layers)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = paddle.arange(past, past + t, dtype="int64").unsqueeze(0).expand([b, t])
        mask, causal = decoder_mask(attention_mask, segment_ids, t)
        if self.config.vision_config is not None:
            if pixel_values is not None:
                check_grids(pixel_values, grid_thw or [], self.config.vision_config)
            position_ids, token_type_ids = self.vl_inputs(
                input_ids, position_ids, token_type_ids, segment_ids, grid_thw, past
            )
        x = self.embed(input_ids, pixel_values, grid_thw)
        h, stats = self.ernie(x, position_ids, mask, past_key_values, token_type_ids, causal=causal)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.logits_from_hidden(h)
        out = CausalLMOutput(
            logits=logits, router_stats=stats, past_key_values=past_key_values, hidden_states=h
        )
        if stats and (self.training or labels is not None):
            # Decoding never needs them, and the orthogonal loss costs a gate-matrix product per layer.
            out.router_losses = self.router_losses(stats)
        if labels is not None:
            out.lm_loss = token_loss(logits, labels)
            out.loss = out.lm_loss + self.weighted_router_loss(out.router_losses)
        return out

    def vl_inputs(self, input_ids, position_ids, token_type_ids, segment_ids, grids, past: int):
        """3-D positions for a prompt with images (decoding steps keep theirs) and routing types."""
        if token_type_ids is None:  # on the device: no host copy of the ids at every decoding step
            vision = paddle.to_tensor(vision_routed_ids(self.config), dtype=input_ids.dtype)
            token_type_ids = paddle.isin(input_ids, vision).astype("int64")
        if grids and position_ids.ndim == 2 and not past:
            seg = segment_ids.numpy() if segment_ids is not None else None
            pos, _ = batch_positions(input_ids.numpy(), grids, self.config, seg)
            position_ids = paddle.to_tensor(pos)
        return position_ids, token_type_ids

    def router_losses(self, stats: list[RouterStats]) -> dict[str, paddle.Tensor]:
        """Mean over MoE layers of the aux, z and orthogonal losses (summed over modality groups)."""
        if self.router_comm is not None and self.router_comm.world > 1:
            return global_router_losses(stats, self.router_comm)
        aux = zl = orth = paddle.zeros([], dtype="float32")
        for s in stats:
            for logits, probs, sel, w in zip(s.logits, s.probs, s.selected, s.gate_weights, strict=True):
                aux = aux + aux_loss(probs, sel)
                zl = zl + z_loss(logits)
                orth = orth + orthogonal_loss(w)
        n = max(len(stats), 1)
        return {"aux_loss": aux / n, "z_loss": zl / n, "orthogonal_loss": orth / n}

    def weighted_router_loss(self, losses: dict[str, paddle.Tensor]) -> paddle.Tensor | float:
        if not losses:
            return 0.0
        c = self.config
        total = 0.0
        for name, lam in (
            ("aux_loss", c.moe_aux_loss_lambda),
            ("z_loss", c.moe_z_loss_lambda),
            ("orthogonal_loss", c.moe_orthogonal_loss_lambda),
        ):
            if lam:
                total = total + lam * losses[name]
        return total


def per_token_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Cross entropy per position (0 where label is -100) and the fp32 mask of positions with a label."""
    mask = (labels != IGNORE_INDEX).astype("float32")
    safe = paddle.where(labels == IGNORE_INDEX, paddle.zeros_like(labels), labels)
    if logits.dtype != paddle.float32:
        logits = logits.astype("float32")
    flat = logits.reshape([-1, logits.shape[-1]])
    ce = F.cross_entropy(flat, safe.reshape([-1, 1]), reduction="none").reshape(labels.shape)
    return ce * mask, mask


def token_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Token-balanced loss: every labelled token counts once, whichever sample or modality it is in."""
    ce, mask = per_token_loss(logits, labels)
    return ce.sum() / paddle.clip(mask.sum(), min=1.0)


def head_logits(h: paddle.Tensor, w: paddle.Tensor, tied: bool) -> paddle.Tensor:
    """The language-model head: hidden states [..., H] times the output weight, the tied embedding [V, H]
    or an untied head [H, V]. One 2-D [B*T, H] product rather than a 3-D batched one (no slower, sometimes
    faster on CPU; see docs/benchmarks.md)."""
    h2 = h.reshape([-1, h.shape[-1]])
    if w.dtype != h.dtype:  # held in bf16 on a node without bf16 matmul (engine.models.quantized)
        flat = low_precision_matmul(h2, w, transpose_y=tied)
    else:
        flat = kernels.matmul(h2, w, transpose_w=tied)
    return flat.reshape([*h.shape[:-1], flat.shape[-1]])
