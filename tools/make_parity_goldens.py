"""Build the logits-parity goldens under tests/engine/golden/ from Hugging Face transformers (PyTorch).

Run by hand in a separate environment that has torch and transformers 5 (never a project dependency):

    /tmp/refvenv/bin/python tools/make_parity_goldens.py

For each small random-weight model it writes
  <name>/hf/        what ``save_pretrained`` writes (hub key format: per-expert ``experts.{e}.*_proj``)
  <name>/hf_fused/  MoE only: ``save_pretrained(save_original_format=False)``, transformers' in-memory
                    format with experts fused into 3-D ``experts.gate_up_proj`` / ``experts.down_proj``
  <name>/paddle/    the Paddle layout (``ernie.*``, [in, out], fused qkv / up_gate), converted here by
                    hand from the torch tensors so the test does not check our converter against itself
  <name>/expected.npz  ``input_ids`` [2, 16] and the HF ``logits`` [2, 16, V] in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Ernie4_5Config, Ernie4_5ForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "engine" / "golden"
VOCAB = 192
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads per KV head
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    use_bias=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits and routing are far from trivial (HF's default init is 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                # Non-zero so that top-k by (prob + bias) picks other experts than top-k by prob alone.
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def paddle_layout(model: torch.nn.Module, config) -> dict[str, np.ndarray]:
    """The Paddle checkpoint layout, built directly from the torch modules."""

    def t(x: torch.Tensor) -> np.ndarray:
        return x.detach().float().numpy().T.copy()

    out: dict[str, np.ndarray] = {}
    m = model.model
    out["ernie.embed_tokens.weight"] = m.embed_tokens.weight.detach().numpy().copy()
    out["ernie.norm.weight"] = m.norm.weight.detach().numpy().copy()
    for i, layer in enumerate(m.layers):
        p = f"ernie.layers.{i}."
        a = layer.self_attn
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [t(a.q_proj.weight), t(a.k_proj.weight), t(a.v_proj.weight)], axis=1
        )
        out[p + "self_attn.o_proj.weight"] = t(a.o_proj.weight)
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach().numpy().copy()
        out[p + "post_attention_layernorm.weight"] = (
            layer.post_attention_layernorm.weight.detach().numpy().copy()
        )
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            out[p + "mlp.gate.weight"] = t(mlp.gate.weight)
            out[p + "mlp.moe_statics.e_score_correction_bias"] = (
                mlp.gate.moe_statics.e_score_correction_bias.detach().numpy().copy()
            )
            gate_up = mlp.experts.gate_up_proj.detach().numpy()  # [E, 2I, H], gate rows first
            down = mlp.experts.down_proj.detach().numpy()  # [E, H, I]
            for e in range(gate_up.shape[0]):
                out[p + f"mlp.experts.{e}.up_gate_proj.weight"] = gate_up[e].T.copy()
                out[p + f"mlp.experts.{e}.down_proj.weight"] = down[e].T.copy()
            if mlp.shared_experts is not None:
                s = mlp.shared_experts
                out[p + "mlp.shared_experts.up_gate_proj.weight"] = np.concatenate(
                    [t(s.gate_proj.weight), t(s.up_proj.weight)], axis=1
                )
                out[p + "mlp.shared_experts.down_proj.weight"] = t(s.down_proj.weight)
        else:
            out[p + "mlp.up_gate_proj.weight"] = np.concatenate(
                [t(mlp.gate_proj.weight), t(mlp.up_proj.weight)], axis=1
            )
            out[p + "mlp.down_proj.weight"] = t(mlp.down_proj.weight)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = t(model.lm_head.weight)  # [H, V]
    return out


def paddle_config(config, moe: bool) -> dict:
    """A config.json shaped like the official Paddle ones, with training-only keys the loader must ignore."""
    d = {
        "architectures": ["Ernie4_5_MoeForCausalLM" if moe else "Ernie4_5_ForCausalLM"],
        "model_type": "ernie4_5_moe" if moe else "ernie4_5",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": COMMON["head_dim"],
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": COMMON["rope_parameters"]["rope_theta"],
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
        "fuse_rms_norm": True,
        "fuse_attn_ffn": True,
        "use_flash_attention": True,
        "compression_ratio": 1.0,
        "num_nextn_predict_layers": 0,
    }
    if moe:
        d.update(
            moe_num_experts=config.moe_num_experts,
            moe_k=config.moe_k,
            moe_num_shared_experts=config.moe_num_shared_experts,
            moe_intermediate_size=config.moe_intermediate_size,
            moe_layer_start_index=config.moe_layer_start_index,
            moe_layer_end_index=config.moe_layer_end_index,
            moe_layer_interval=config.moe_layer_interval,
            moe_norm_min=config.moe_norm_min,
            moe_gate="topk",
            moe_use_aux_free=True,
            moe_aux_loss_lambda=1e-5,
            moe_z_loss_lambda=0.0,
            moe_orthogonal_loss_lambda=0.0,
        )
    return d


def build(name: str, model: torch.nn.Module, seed: int, shard: str | None) -> None:
    moe = hasattr(model.config, "moe_k")
    randomise(model, seed)
    model.eval()
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(3, VOCAB, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float().numpy()
    np.savez_compressed(d / "expected.npz", input_ids=input_ids.numpy(), logits=logits)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d / "hf", **kwargs)
    if moe:
        model.save_pretrained(d / "hf_fused", save_original_format=False)
    (d / "paddle").mkdir()
    save_file(
        paddle_layout(model, model.config), str(d / "paddle" / "model.safetensors"), metadata={"format": "pd"}
    )
    (d / "paddle" / "config.json").write_text(json.dumps(paddle_config(model.config, moe), indent=2) + "\n")
    for sub in d.iterdir():
        if sub.is_dir():
            (sub / "generation_config.json").unlink(missing_ok=True)
    print(f"{name}: logits {logits.shape}, |max| {np.abs(logits).max():.3f}")


def main() -> None:
    torch.manual_seed(0)
    dense_tied = Ernie4_5ForCausalLM(Ernie4_5Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True))
    build("dense_tied", dense_tied, seed=1, shard=None)
    dense_untied = Ernie4_5ForCausalLM(
        Ernie4_5Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    )
    build("dense_untied", dense_untied, seed=2, shard="120KB")
    moe_cfg = Ernie4_5_MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        moe_num_experts=6,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_intermediate_size=24,
        moe_layer_start_index=1,
        moe_layer_end_index=2,
        moe_layer_interval=1,
        moe_norm_min=1e-12,
    )
    build("moe", Ernie4_5_MoeForCausalLM(moe_cfg), seed=3, shard="120KB")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"goldens: {total / 1e6:.2f} MB in {OUT}")


if __name__ == "__main__":
    main()
