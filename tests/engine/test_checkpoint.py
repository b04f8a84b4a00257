"""Checkpoint save/load: round trips, shards, bf16, head orientations and the errors a person reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.models import CheckpointError, ErnieForCausalLM, save_model
from engine.models.safetensors_io import SafetensorsFile, f32_to_bf16_bits, save_file

IDS = np.random.default_rng(0).integers(16, 300, size=(2, 10))


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


def _logits(model) -> np.ndarray:
    with paddle.no_grad():
        return model(paddle.to_tensor(IDS)).logits.numpy()


def _assert_same_state(a, b) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_moe_model_dir", "tiny_vl_model_dir"])
def test_save_load_round_trip_is_bit_exact(fixture, request, tmp_path) -> None:
    src = engine.load_model(str(request.getfixturevalue(fixture)))
    save_model(src, tmp_path / "single")
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_state(src, engine.load_model(str(tmp_path / "single")))


def test_sharded_save_respects_the_size_limit_and_reloads_bit_exact(tiny_moe_model_dir, tmp_path) -> None:
    src = engine.load_model(str(tiny_moe_model_dir))
    out = tmp_path / "sharded"
    save_model(src, out, max_shard_size="200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert set(index["weight_map"]) == set(src.state_dict())
    assert all(k.startswith(("ernie.", "lm_head")) for k in index["weight_map"])  # Paddle layout
    biggest = max(np.prod(v.shape) * 4 for v in src.state_dict().values())
    for p in shards:
        f = SafetensorsFile(p)
        data = sum(int(np.prod(f.shape(k))) * 4 for k in f)
        assert data <= max(200_000, biggest)
    assert index["metadata"]["total_size"] == sum(
        int(np.prod(v.shape)) * 4 for v in src.state_dict().values()
    )
    _assert_same_state(src, engine.load_model(str(out)))


def test_paddle_layout_on_disk_is_in_out_and_fused(tiny_moe_model_dir) -> None:
    f = SafetensorsFile(tiny_moe_model_dir / "model.safetensors")
    cfg = engine.load_model(str(tiny_moe_model_dir)).config
    h, hd = cfg.hidden_size, cfg.head_dim
    assert f.shape("ernie.layers.0.self_attn.qkv_proj.weight") == [
        h,
        (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd,
    ]
    assert f.shape("ernie.layers.0.mlp.up_gate_proj.weight") == [h, 2 * cfg.intermediate_size]
    assert f.shape("ernie.layers.1.mlp.gate.weight") == [h, 8]
    assert f.dtype("ernie.layers.1.mlp.gate.weight") == "F32"
    assert f.shape("ernie.layers.1.mlp.moe_statics.e_score_correction_bias") == [1, 8]
    assert f.shape("ernie.layers.1.mlp.experts.7.down_proj.weight") == [96, h]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_moe_model_dir"])
def test_hf_layout_round_trip_is_bit_exact(fixture, request, tmp_path) -> None:
    src = engine.load_model(str(request.getfixturevalue(fixture)))
    save_model(src, tmp_path / "hf", layout="hf", max_shard_size="300KB")
    keys = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.embed_tokens.weight" in keys
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == ("ernie4_5_moe" if src.config.is_moe else "ernie4_5")
    _assert_same_state(src, engine.load_model(str(tmp_path / "hf")))


def test_bf16_checkpoint_matches_fp32_source_within_bf16_rounding(tiny_moe_model_dir, tmp_path) -> None:
    src = engine.load_model(str(tiny_moe_model_dir))
    save_model(src, tmp_path / "bf16", dtype="bfloat16")
    f = SafetensorsFile(tmp_path / "bf16" / "model.safetensors")
    assert {f.dtype(k) for k in f} == {"BF16"}
    loaded = engine.load_model(str(tmp_path / "bf16"))  # no bf16 matmul on CPU: upcast to fp32
    for name, arr in _state(src).items():
        got = loaded.state_dict()[name].numpy()
        rounded = (f32_to_bf16_bits(arr).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(got, rounded, err_msg=name)  # exactly the bf16 rounding of the source
        np.testing.assert_allclose(got, arr, rtol=2**-8, atol=0)
    diff = np.abs(_logits(loaded) - _logits(src)).max()
    assert 0 < diff < 0.05


def test_bf16_rounding_is_round_to_nearest_even() -> None:
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 0.0], np.float32)
    # 1+2^-8 is a tie between 1 and 1+2^-7: even mantissa wins (1.0); 1+3*2^-8 rounds up to 1+2^-6.
    got = (f32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, [1.0, 1.0, 1 + 2**-6, -2.5, 0.0])


def _rewrite(directory: Path, edit) -> None:
    f = SafetensorsFile(directory / "model.safetensors")
    tensors = {k: f.get(k) for k in f}
    edit(tensors)
    del f
    save_file(tensors, directory / "model.safetensors")


def test_tied_checkpoint_with_a_stored_head_loads(tiny_model_dir, tmp_path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    _rewrite(d, lambda t: t.__setitem__("lm_head.weight", t["ernie.embed_tokens.weight"].copy()))
    np.testing.assert_array_equal(
        _logits(engine.load_model(str(d))), _logits(engine.load_model(str(tiny_model_dir)))
    )


@pytest.mark.parametrize("orientation", ["hidden_vocab", "vocab_hidden"])
def test_untied_head_in_either_orientation(tiny_model_dir, tmp_path, orientation) -> None:
    src = engine.load_model(str(tiny_model_dir))
    cfg = src.config.replace(tie_word_embeddings=False)
    model = ErnieForCausalLM(cfg)
    model.set_state_dict(
        {**src.state_dict(), "lm_head.weight": paddle.randn([cfg.hidden_size, cfg.vocab_size])}
    )
    d = tmp_path / orientation
    save_model(model, d)
    if orientation == "vocab_hidden":
        _rewrite(d, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].T.copy()))
    loaded = engine.load_model(str(d))
    np.testing.assert_array_equal(loaded.lm_head.weight.numpy(), model.lm_head.weight.numpy())


def test_missing_tensor_is_named(tiny_moe_model_dir, tmp_path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_moe_model_dir, d)
    _rewrite(d, lambda t: t.pop("ernie.layers.1.mlp.experts.3.down_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing 1 tensor.*ernie\.layers\.1\.mlp\.experts\.3\.down_proj\.weight"
    ):
        engine.load_model(str(d))


def test_mis_shaped_tensor_names_tensor_file_and_shapes(tiny_model_dir, tmp_path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    _rewrite(d, lambda t: t.__setitem__("ernie.layers.1.mlp.down_proj.weight", np.zeros((5, 7), np.float32)))
    with pytest.raises(CheckpointError) as e:
        engine.load_model(str(d))
    msg = str(e.value)
    assert "ernie.layers.1.mlp.down_proj.weight" in msg and "model.safetensors" in msg
    assert "[5, 7]" in msg and "[352, 128]" in msg


def test_hf_mis_shaped_source_is_named(tmp_path) -> None:
    d = tmp_path / "hf"
    shutil.copytree(Path(__file__).parent / "golden" / "dense_tied" / "hf", d)
    _rewrite(
        d, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((8, 64), np.float32))
    )
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight in model\.safetensors"
    ):
        engine.load_model(str(d))


def test_missing_shard_and_missing_weights_and_bad_config(tiny_model_dir, tmp_path) -> None:
    src = engine.load_model(str(tiny_model_dir))
    d = tmp_path / "sharded"
    save_model(src, d, max_shard_size="100KB")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {victim.name} .*is missing"):
        engine.load_model(str(d))

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_model_dir / "config.json", empty)
    with pytest.raises(CheckpointError, match="no model weights"):
        engine.load_model(str(empty))

    (empty / "config.json").write_text('{\n  "hidden_size": 64,\n  "oops"\n}')
    with pytest.raises(ValueError, match=r"config\.json:4: config.json is not valid JSON: Expecting"):
        engine.load_model(str(empty))

    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_model(str(tmp_path / "nowhere"))


def test_unknown_layout_is_explained(tiny_model_dir, tmp_path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_model_dir / "config.json", d)
    save_file({"transformer.wte.weight": np.zeros((2, 2), np.float32)}, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"neither with 'ernie\.' .* nor 'model\.'"):
        engine.load_model(str(d))


def test_cast_model_keeps_router_in_fp32(tiny_moe_model_dir) -> None:
    from engine.models.checkpoint import cast_model

    model = cast_model(engine.load_model(str(tiny_moe_model_dir)), "bfloat16")
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["ernie.layers.1.mlp.gate.weight"] == paddle.float32
    assert dtypes["ernie.layers.1.mlp.moe_statics.e_score_correction_bias"] == paddle.float32
    assert dtypes["ernie.layers.1.mlp.experts.0.up_gate_proj.weight"] == paddle.bfloat16
    assert dtypes["ernie.embed_tokens.weight"] == paddle.bfloat16


@pytest.mark.parametrize("compute_type", ["fp32", "wint8"])
def test_export_streams_a_lora_run_into_the_files_the_merged_model_writes(
    tiny_model_dir, tmp_path, compute_type
):
    """run_export reads the base tensor by tensor with the adapter folded in (loading.TensorSource) and writes
    each as it comes; the files are byte for byte those of saving the loaded, merged model."""
    from engine.models.loading import TensorSource, load_model
    from engine.models.lora import apply_lora, lora_layers
    from engine.models.quantized import apply_weight_only
    from engine.train import run_export
    from engine.train.config_load import config_from_dict
    from engine.train.export_config import ExportConfig
    from engine.train.lora import save_adapter

    model = engine.load_model(str(tiny_model_dir))
    if compute_type == "wint8":
        apply_weight_only(model, "wint8")
    apply_lora(model, 4, 8.0)
    for _, layer in lora_layers(model):
        layer.lora_B.set_value(paddle.full(layer.lora_B.shape, 0.01))
    run = tmp_path / "run"
    save_adapter(model, run, dict(base_model=str(tiny_model_dir), r=4, lora_alpha=8.0, rslora=False,
                                  target_modules=["qkv_proj", "o_proj", "up_gate_proj", "down_proj"],
                                  compute_type=compute_type, weight_quant_group_size=-1))  # fmt: skip
    source = TensorSource(run)
    assert source.merged and not source.left_quantized
    run_export(config_from_dict(ExportConfig, dict(output_dir=str(run), lora=True, export_dir=str(tmp_path / "a"),
                                                   dtype="bfloat16", copy_tokenizer=False)))  # fmt: skip
    save_model(load_model(run), tmp_path / "b", dtype="bfloat16")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
