"""ERNIE 4.5 VL as Baidu built it: logits and 3-D positions equal transformers' ``ernie4_5_vl_moe`` port.

Goldens from tools/make_vl_parity_goldens.py (random weights; cases: text only, one image, two images of
different sizes, an image and a 4-frame video) in three forms of the same tensors: ``pt`` as transformers
writes it, ``pt_hub`` as Baidu's -PT repos hold it (top-level ``vision_model``, flat config) and ``paddle``,
the -Paddle layout converted by hand (fused projections, [in, out]).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.models.config import ErnieConfig
from engine.models.ernie import ErnieForCausalLM
from engine.models.loading import load_state
from engine.models.positions import batch_positions, moe_token_types
from tests.engine.test_models_parity import PARITY_ATOL

GOLDEN = Path(__file__).parent / "golden" / "vl_moe"
CASES = ["text", "image", "two_images", "image_video"]
LAYOUTS = ["pt", "pt_hub", "paddle"]


def _case(data, case: str) -> tuple[np.ndarray, np.ndarray | None, list[tuple[int, int, int]]]:
    """input ids, all patches in prompt order (images come before the video in every case), grids."""
    pix, grids = [], []
    for kind in ("", "_videos"):
        if f"{case}/pixel_values{kind}" in data:
            pix.append(data[f"{case}/pixel_values{kind}"])
            grid_key = f"{case}/{'video' if kind else 'image'}_grid_thw"
            grids += [tuple(int(v) for v in g) for g in data[grid_key]]
    return data[f"{case}/input_ids"], (np.concatenate(pix) if pix else None), grids


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN / "expected.npz")


@pytest.fixture(scope="module")
def models():
    return {layout: engine.load_model(str(GOLDEN / layout)) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def pt_model(models):
    return models["pt"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(models, golden, case: str, layout: str) -> None:
    """Within PARITY_ATOL = 1e-5; measured 1.13e-6 (text) to 2.26e-6 (two_images), AMD EPYC AVX-512."""
    ids, pix, grids = _case(golden, case)
    kwargs = {"pixel_values": paddle.to_tensor(pix), "grid_thw": grids} if pix is not None else {}
    with paddle.no_grad():
        logits = models[layout](paddle.to_tensor(ids), **kwargs).logits.numpy()
    expected = golden[f"{case}/logits"]
    assert logits.shape == expected.shape
    gap = float(np.abs(logits - expected).max())
    print(f"{case} ({layout}): max |logit diff| against transformers {gap:.2e}")
    assert gap <= PARITY_ATOL


@pytest.mark.parametrize("case", CASES[1:])
def test_3d_positions_match_transformers(pt_model, golden, case: str) -> None:
    ids, _, grids = _case(golden, case)
    positions, deltas = batch_positions(ids, grids, pt_model.config)
    np.testing.assert_array_equal(positions, golden[f"{case}/position_ids"])
    # decoding continues after the largest position, not after the token count
    assert deltas[0] == positions.max() + 1 - ids.shape[1]


def test_the_golden_model_exercises_every_official_part(pt_model, golden) -> None:
    c = pt_model.config
    assert c.rope_3d and c.freq_allocation == 2 and c.vision_config.hidden_act == "quick_gelu"
    assert c.expert_counts == [4, 4] and c.expert_intermediate_sizes == [32, 16]
    assert [layer.is_moe for layer in pt_model.ernie.layers] == [False, True, True]
    # start / end tokens route to the vision experts, but count as text for positions
    ids, _, _ = _case(golden, "image")
    types = moe_token_types(ids, c)[0]
    assert types.sum() == 8 and types[5] == 1 and types[12] == 1
    bias = pt_model.ernie.layers[1].mlp.moe_statics.e_score_correction_bias.numpy()
    assert bias.shape == (2, 4) and np.abs(bias).min() > 0


def test_without_3d_rope_or_start_end_routing_the_logits_differ(pt_model, golden) -> None:
    """The parity above really covers 3-D positions and the official token types."""
    ids, pix, grids = _case(golden, "two_images")
    expected = golden["two_images/logits"]
    kwargs = {"pixel_values": paddle.to_tensor(pix), "grid_thw": grids}
    flat = paddle.arange(ids.shape[1]).unsqueeze(0)
    placeholders_only = paddle.to_tensor((ids == pt_model.config.im_patch_id).astype(np.int64))
    with paddle.no_grad():
        one_d = pt_model(paddle.to_tensor(ids), position_ids=flat.unsqueeze(0).expand([3, 1, -1]), **kwargs)
        types = pt_model(paddle.to_tensor(ids), token_type_ids=placeholders_only, **kwargs)
    assert np.abs(one_d.logits.numpy() - expected).max() > 1e-2
    assert np.abs(types.logits.numpy() - expected).max() > 1e-2


def test_pt_router_gates_are_stored_hidden_by_experts(tmp_path) -> None:
    """-PT VL checkpoints keep gate.weight / gate.weight_1 as [H, E] (text MoE ones as [E, H])."""
    config = ErnieConfig.from_file(GOLDEN / "pt")
    model = ErnieForCausalLM(config)
    load_state(model, GOLDEN / "pt")
    gate = model.ernie.layers[1].mlp.gate
    assert list(gate.weight.shape) == [64, 4] and list(gate.weight_1.shape) == [64, 4]


# Keys transformers writes that describe its training defaults, not the model.
_HF_ONLY = {"transformers_version", "initializer_range", "output_router_logits", "router_aux_loss_coef"}


def _same_config(ours: dict, theirs: dict, where: str = "") -> list[str]:
    diffs = []
    for k, v in theirs.items():
        if k in _HF_ONLY:
            continue
        if isinstance(v, dict):
            diffs += _same_config(ours.get(k) or {}, v, f"{where}{k}.")
        elif ours.get(k) != v:
            diffs.append(f"{where}{k}: ours {ours.get(k)!r}, transformers {v!r}")
    return diffs


def _same_tensors(ours, theirs) -> bool:
    return sorted(ours.keys()) == sorted(theirs.keys()) and all(
        np.array_equal(ours.get(k), theirs.get(k)) for k in theirs
    )


def test_layouts_round_trip_bit_identical_and_pt_export_is_what_transformers_writes(models, tmp_path):
    """hub -PT -> Paddle (= Baidu's layout, bit for bit) -> load -> -PT (= what transformers writes)."""
    import json

    from engine.models.checkpoint import TensorStore
    from engine.models.saving import save_model

    save_model(models["pt_hub"], tmp_path / "paddle", layout="paddle")
    assert _same_tensors(TensorStore(tmp_path / "paddle"), TensorStore(GOLDEN / "paddle"))
    again = engine.load_model(str(tmp_path / "paddle"))
    save_model(again, tmp_path / "pt", layout="hf", max_shard_size="200KB")
    assert _same_tensors(TensorStore(tmp_path / "pt"), TensorStore(GOLDEN / "pt"))
    assert (tmp_path / "pt" / "model.safetensors.index.json").exists()  # sharded, with an index
    written = json.loads((tmp_path / "pt" / "config.json").read_text())
    assert _same_config(written, json.loads((GOLDEN / "pt" / "config.json").read_text())) == []


def test_paddle_config_is_baidus_flat_form(models, tmp_path) -> None:
    """The Paddle export's config.json has the keys FastDeploy and ERNIEKit read (MoE layer rule, 3-D RoPE,
    vision_config with embed_dim / mlp_ratio), and it means the same model as transformers' nested one."""
    import json

    from engine.models.saving import save_model

    save_model(models["pt"], tmp_path, layout="paddle")
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "ernie4_5_moe_vl" and d["rope_3d"] and d["freq_allocation"] == 2
    assert (d["moe_layer_start_index"], d["moe_layer_end_index"], d["moe_num_experts"]) == (1, 2, [4, 4])
    assert "mlp_layer_types" not in d
    v = d["vision_config"]
    assert (
        v["embed_dim"] == v["hidden_size"] == 32 and v["mlp_ratio"] == 2 and v["hidden_act"] == "quick_gelu"
    )
    ours, baidu = ErnieConfig.from_file(tmp_path), models["pt_hub"].config
    assert [ours.is_moe_layer(i) for i in range(3)] == [baidu.is_moe_layer(i) for i in range(3)]
    same = ("vision_config", "freq_allocation", "expert_counts", "expert_intermediate_sizes", "im_patch_id")
    same += (
        "video_token_id",
        "image_start_token_id",
        "head_dim",
        "rope_theta",
        "moe_k",
        "tie_word_embeddings",
    )
    assert {k: getattr(ours, k) for k in same} == {k: getattr(baidu, k) for k in same}


@pytest.mark.skipif(
    not os.environ.get("ERNIE_STUDIO_REFERENCE_PYTHON"),
    reason="set ERNIE_STUDIO_REFERENCE_PYTHON to a Python with torch + transformers 5 to run it",
)
def test_transformers_reads_our_pt_export(models, tmp_path):
    """transformers' own from_pretrained on our -PT export gives the golden logits (its reference env)."""
    import subprocess
    import sys

    from engine.models.saving import save_model

    save_model(models["paddle"], tmp_path, layout="hf", max_shard_size="200KB")
    tool = Path(__file__).resolve().parents[2] / "tools" / "check_vl_export.py"
    done = subprocess.run(
        [os.environ["ERNIE_STUDIO_REFERENCE_PYTHON"], str(tool), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    sys.stdout.write(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    # one line per golden case: its name and the largest logit difference (measured 6.0e-7 to 1.7e-6)
    cases = {"text", "image", "two_images", "image_video"}
    rows = [line.split() for line in done.stdout.splitlines()]
    gaps = {row[0]: float(row[1]) for row in rows if len(row) == 2 and row[0] in cases}
    assert set(gaps) == cases, done.stdout
    assert max(gaps.values()) <= PARITY_ATOL, gaps
