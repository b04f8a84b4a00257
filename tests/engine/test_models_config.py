"""ErnieConfig reads the official config.json files (dense, MoE, VL) and the presets are what they say."""

from __future__ import annotations

import json

import pytest

from engine.models import ErnieConfig, preset_config, preset_names

# Shaped like baidu/ERNIE-4.5-0.3B-Paddle's config.json, with training-only keys.
DENSE = {
    "architectures": ["Ernie4_5_ForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 131072,
    "model_type": "ernie4_5",
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_hidden_layers": 18,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "use_cache": False,
    "vocab_size": 103424,
    "rope_theta": 500000,
    "use_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "fuse_rms_norm": True,
    "fuse_attn_ffn": True,
    "use_flash_attention": True,
    "compression_ratio": 1.0,
    "paddlenlp_version": "3.0.0",
}

MOE = {
    **DENSE,
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "moe_num_experts": 64,
    "moe_k": 6,
    "moe_num_shared_experts": 2,
    "moe_intermediate_size": 1536,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 27,
    "moe_layer_interval": 1,
    "moe_capacity": [64, 64, 64],
    "moe_gate": "topk",
    "moe_norm_min": 1e-12,
    "moe_use_aux_free": True,
    "moe_aux_loss_lambda": 1e-5,
    "moe_z_loss_lambda": 0.0,
    "moe_orthogonal_loss_lambda": 0.0,
    "num_nextn_predict_layers": 1,
    "multi_token_pred_lambda": 0.3,
}

VL = {
    **MOE,
    "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
    "model_type": "ernie4_5_moe_vl",
    "moe_num_experts": [64, 64],
    "moe_intermediate_size": [1536, 512],
    "moe_layer_start_index": [1, 1],
    "moe_layer_end_index": [29, 28],
    "im_patch_id": 100295,
    "pixel_hidden_size": 1280,
    "rope_3d": True,
    "freq_allocation": 20,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1280,
        "num_heads": 16,
        "mlp_ratio": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "in_chans": 3,
        "attn_implementation": "eager",
    },
}


def test_dense_official_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    c = ErnieConfig.from_file(tmp_path)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (1024, 16, 2, 128)
    assert c.rope_theta == 500000 and c.dtype == "bfloat16" and c.tie_word_embeddings
    assert not c.is_moe and not c.is_vl and c.architecture == "Ernie4_5_ForCausalLM"


def test_moe_official_config_and_layer_rule() -> None:
    c = ErnieConfig.from_dict(MOE)
    assert c.is_moe and c.expert_counts == [64] and c.expert_intermediate_sizes == [1536]
    assert c.moe_k == 6 and c.moe_num_shared_experts == 2 and c.moe_norm_min == 1e-12
    assert [i for i in range(28) if c.is_moe_layer(i)] == list(range(1, 28))


def test_vl_official_config() -> None:
    c = ErnieConfig.from_dict(VL)
    assert c.is_vl and c.expert_counts == [64, 64] and c.expert_intermediate_sizes == [1536, 512]
    v = c.vision_config
    assert (v.depth, v.hidden_size, v.num_heads, v.patch_size, v.spatial_merge_size) == (32, 1280, 16, 14, 2)
    assert c.im_patch_id == 100295


def test_rope_parameters_form_of_hf_configs() -> None:
    d = {k: v for k, v in DENSE.items() if k != "rope_theta"}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert ErnieConfig.from_dict(d).rope_theta == 10000.0
    assert ErnieConfig.from_dict({**d, "rope_theta": 123.0}).rope_theta == 123.0


def test_training_only_keys_are_ignored_silently_and_unknown_ones_logged(caplog) -> None:
    with caplog.at_level("INFO", logger="engine.models.config"):
        ErnieConfig.from_dict(MOE)
    assert "not used" not in caplog.text
    with caplog.at_level("INFO", logger="engine.models.config"):
        ErnieConfig.from_dict({**DENSE, "brand_new_key": 1})
    assert "brand_new_key" in caplog.text


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    d = {k: v for k, v in DENSE.items() if k != "head_dim"}
    assert ErnieConfig.from_dict(d).head_dim == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"moe_k": 65}, "moe_k"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"hidden_size": "wide"}, "hidden_size"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, change, message) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**MOE, **change}))
    with pytest.raises(ValueError, match=message) as e:
        ErnieConfig.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_save_and_reload_round_trip(tmp_path) -> None:
    c = ErnieConfig.from_dict(VL)
    c.save(tmp_path)
    again = ErnieConfig.from_file(tmp_path)
    assert again == c


def test_presets() -> None:
    assert set(preset_names()) >= {"tiny", "tiny-moe", "tiny-vl", "ernie-4.5-0.3b", "ernie-4.5-21b-a3b"}
    assert not preset_config("tiny").is_moe
    assert preset_config("tiny-moe").is_moe and not preset_config("tiny-moe").is_vl
    assert preset_config("tiny-vl").is_vl and preset_config("tiny-vl").expert_counts == [8, 8]
    big = preset_config("ernie-4.5-0.3b")
    assert big.to_dict()["hidden_size"] == DENSE["hidden_size"] == 1024
    assert preset_config("ernie-4.5-21b-a3b").num_hidden_layers == 28
    assert preset_config("ernie-4.5-vl-28b-a3b").expert_intermediate_sizes == [1536, 512]
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset_config("huge")


def test_official_sizes_have_the_published_parameter_counts() -> None:
    """Counted from the configs alone (nothing is built): 0.36B dense; 21B total / 3B active for A3B."""
    from engine.models.counts import count_parameters

    assert count_parameters(preset_config("ernie-4.5-0.3b")).total == pytest.approx(0.36e9, rel=0.03)
    total, active = (
        count_parameters(preset_config("ernie-4.5-21b-a3b")).total,
        count_parameters(preset_config("ernie-4.5-21b-a3b")).active,
    )
    assert total == pytest.approx(21.8e9, rel=0.03)
    assert active == pytest.approx(3.0e9, rel=0.15)  # 3.35B with the 0.26B embedding
    assert count_parameters(preset_config("ernie-4.5-300b-a47b")).total == pytest.approx(300e9, rel=0.05)


def _built_weights(config: ErnieConfig, skip_experts_from: int | None = None) -> int:
    """Sizes of the built model's weights (what count_parameters counts): no correction-bias statistics;
    ``skip_experts_from`` leaves out routed experts with that index or higher."""
    import re

    import numpy as np

    from engine.models import ErnieForCausalLM

    total = 0
    for name, p in ErnieForCausalLM(config).named_parameters():
        if "moe_statics" in name:
            continue
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if expert and skip_experts_from is not None and int(expert.group(1)) >= skip_experts_from:
            continue
        total += int(np.prod(p.shape))
    return total


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-vl"])
def test_parameter_count_equals_the_built_models_weights(preset: str) -> None:
    from engine.models.counts import count_parameters

    config = preset_config(preset, vocab_size=1024)
    assert count_parameters(config).total == _built_weights(config)


def test_active_parameter_count_keeps_moe_k_routed_experts() -> None:
    from engine.models.counts import count_parameters

    config = preset_config("tiny-moe", vocab_size=1024)
    assert count_parameters(config).active == _built_weights(config, skip_experts_from=config.moe_k)
    assert count_parameters(config).active < count_parameters(config).total


@pytest.mark.parametrize(
    ("start", "end", "moe_layers"),
    [
        (1, -1, [1, 2, 3]),  # end < 0: up to the last layer
        ([2, 1], [2, 3], [1, 2, 3]),  # one value per modality group: the smallest start, the largest end
        ([1, 1], [-1, -1], [1, 2, 3]),
        (2, 2, [2]),
    ],
)
def test_moe_layer_rule_and_parameter_count_follow_the_model(start, end, moe_layers) -> None:
    """Configs read from config.json dicts (as the studio does, without Paddle) count what the model builds."""
    from engine.models.counts import count_parameters

    raw = preset_config("tiny-moe", vocab_size=1024).to_dict()
    raw.update(num_hidden_layers=4, moe_layer_start_index=start, moe_layer_end_index=end)
    config = ErnieConfig.from_dict(raw)
    assert [i for i in range(4) if config.is_moe_layer(i)] == moe_layers
    from engine.models import ErnieForCausalLM

    assert [i for i, layer in enumerate(ErnieForCausalLM(config).ernie.layers) if layer.is_moe] == moe_layers
    assert count_parameters(config).total == _built_weights(config)


def test_config_and_presets_import_without_paddle() -> None:
    """The studio counts parameters of configs it lists; that must not load Paddle."""
    import subprocess
    import sys

    code = (
        "import sys, engine.models.config, engine.models.presets, engine.models.paths, engine.models, engine.models.counts; "
        "engine.models.ErnieConfig; engine.models.counts.count_parameters; "
        "print('paddle' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
