"""PaddleOCR-VL as PaddlePaddle built it: logits, 3-D positions and image preprocessing equal transformers'
``paddleocr_vl`` port (an independent port of the official remote code).

Goldens from tools/make_ocr_vl_goldens.py (random weights of a small configuration; cases: text only, one
image, two images of different sizes) in three forms of the same tensors: ``hf`` as transformers'
``save_pretrained`` writes it (official tensor names, nested config), ``hf_renamed`` with its in-memory
names (``save_original_format=False``) and ``official`` as the published repo holds it (flat config, plus
tensors the model never uses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.models.checkpoint import TensorStore
from engine.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration
from engine.models.paddleocr_vl_config import PaddleOCRVLConfig
from engine.models.positions import batch_positions
from engine.models.saving import save_model

GOLDEN = Path(__file__).parent / "golden" / "paddleocr_vl"
CASES = ["text", "image", "two_images"]
LAYOUTS = ["hf", "hf_renamed", "official"]
# Measured 1.49e-6 to 1.97e-6 (text), 1.64e-6 (image), 2.29e-6 to 2.32e-6 (two_images) on this machine's
# 2-core x86 CPU; transformers reading our exports gives the golden logits exactly (0.0).
PARITY_ATOL = 1e-5
REPO = Path(__file__).resolve().parents[2]


def _inputs(data, case: str) -> tuple[paddle.Tensor, dict]:
    ids = paddle.to_tensor(data[f"{case}/input_ids"])
    if f"{case}/pixel_values" not in data:
        return ids, {}
    grids = [tuple(int(v) for v in g) for g in data[f"{case}/image_grid_thw"]]
    return ids, {"pixel_values": paddle.to_tensor(data[f"{case}/pixel_values"]), "grid_thw": grids}


def _logits(model, data, case: str, **extra) -> np.ndarray:
    ids, kwargs = _inputs(data, case)
    with paddle.no_grad():
        return model(ids, **kwargs, **extra).logits.numpy()


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN / "expected.npz")


@pytest.fixture(scope="module")
def models():
    return {layout: engine.load_model(str(GOLDEN / layout)) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(models, golden, case: str, layout: str) -> None:
    model = models[layout]
    assert isinstance(model, PaddleOCRVLForConditionalGeneration)
    logits = _logits(model, golden, case)
    expected = golden[f"{case}/logits"]
    assert logits.shape == expected.shape
    gap = float(np.abs(logits - expected).max())
    print(f"{case} ({layout}): max |logit diff| against transformers {gap:.2e}")
    assert gap <= PARITY_ATOL


@pytest.mark.parametrize("case", CASES[1:])
def test_3d_positions_match_transformers(models, golden, case: str) -> None:
    ids = golden[f"{case}/input_ids"]
    grids = [tuple(int(v) for v in g) for g in golden[f"{case}/image_grid_thw"]]
    positions, deltas = batch_positions(ids, grids, models["hf"].config)
    np.testing.assert_array_equal(positions, golden[f"{case}/position_ids"])
    assert deltas[0] == positions.max() + 1 - ids.shape[1]  # decoding resumes after the largest position


def test_the_parity_covers_the_3d_rope_and_the_position_table(models, golden) -> None:
    """Flat positions, or the position table at its own size instead of resampled, change the logits."""
    model = models["official"]
    ids, _ = _inputs(golden, "two_images")
    flat = paddle.arange(ids.shape[1]).unsqueeze(0).unsqueeze(0).expand([3, 1, -1])
    expected = golden["two_images/logits"]
    assert np.abs(_logits(model, golden, "two_images", position_ids=flat) - expected).max() > 1e-2
    c = model.config
    assert c.text.mrope_section == [2, 3, 3] and c.vision.grid_per_side == 6
    assert [tuple(g) for g in golden["two_images/image_grid_thw"]] == [(1, 4, 6), (1, 8, 4)]
    assert not c.text.tie_word_embeddings and hasattr(model, "lm_head")


def test_both_config_forms_read_to_the_same_model() -> None:
    flat = PaddleOCRVLConfig.from_file(GOLDEN / "official")
    nested = PaddleOCRVLConfig.from_file(GOLDEN / "hf")
    assert flat == nested
    assert (flat.image_token_id, flat.vision_start_token_id, flat.vision_end_token_id) == (190, 188, 189)
    assert flat.vision.hidden_act == "gelu_pytorch_tanh" and flat.vision.image_size == 84


def _same_tensors(ours: TensorStore, theirs: TensorStore, skip: tuple[str, ...] = ()) -> list[str]:
    keys = [k for k in theirs if not k.startswith(skip)]
    if sorted(ours.keys()) != sorted(keys):
        return [f"keys differ: {sorted(set(ours.keys()) ^ set(keys))}"]
    return [k for k in keys if not np.array_equal(ours.get(k), theirs.get(k))]


def _config_diffs(ours: dict, theirs: dict, where: str = "") -> list[str]:
    diffs = []
    for k, v in theirs.items():
        if k in (
            "transformers_version",
            "initializer_range",
            "use_cache",
            "architectures",
            "use_flash_attention",
        ):
            continue
        if isinstance(v, dict):
            diffs += _config_diffs(ours.get(k) or {}, v, f"{where}{k}.")
        elif ours.get(k) != v:
            diffs.append(f"{where}{k}: ours {ours.get(k)!r}, theirs {v!r}")
    return diffs


def test_round_trip_is_bit_identical_in_both_forms(models, tmp_path) -> None:
    """official -> load -> save official / hf -> the golden files' tensors; reload -> the same parameters."""
    save_model(models["official"], tmp_path / "official", layout="paddle")  # PaddleOCR-VL: its published form
    skip = ("visual.vision_model.head.", "packing_position_embedding")
    assert _same_tensors(TensorStore(tmp_path / "official"), TensorStore(GOLDEN / "official"), skip) == []
    save_model(models["hf_renamed"], tmp_path / "hf", layout="hf", max_shard_size="200KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # sharded, with an index
    assert _same_tensors(TensorStore(tmp_path / "hf"), TensorStore(GOLDEN / "hf")) == []
    for form, golden_dir in (("official", "official"), ("hf", "hf")):
        written = json.loads((tmp_path / form / "config.json").read_text())
        theirs = json.loads((GOLDEN / golden_dir / "config.json").read_text())
        if form == "official":  # the remote code's vision keys we do not model
            theirs["vision_config"] = {
                k: v
                for k, v in theirs["vision_config"].items()
                if k not in ("temporal_patch_size", "model_type")
            }
        assert _config_diffs(written, theirs) == []
    again = engine.load_model(str(tmp_path / "hf"))
    before, after = models["official"].state_dict(), again.state_dict()
    assert sorted(before) == sorted(after)
    assert all(np.array_equal(before[k].numpy(), after[k].numpy()) for k in before)


def reference_python() -> str:
    """The reference environment's Python (ERNIE_STUDIO_REFERENCE_PYTHON, else the one `make reference`
    built); a missing environment fails the test: CI must provide it."""
    env = os.environ.get("ERNIE_STUDIO_REFERENCE_PYTHON")
    if env:
        return env
    home = Path(os.environ.get("ERNIE_STUDIO_REFERENCE_HOME", Path.home() / ".cache/ernie-studio/reference"))
    built = sorted(p for p in home.glob("torch-*-transformers-*") if (p / ".complete").exists())
    if not built:
        pytest.fail(
            "no transformers reference environment: run `make reference` (tools/build_reference_env.sh) or "
            "set ERNIE_STUDIO_REFERENCE_PYTHON"
        )
    return str(built[-1] / "bin" / "python")


def test_transformers_reads_our_exports(models, tmp_path) -> None:
    """transformers' own from_pretrained on our exports (both forms) gives the golden logits."""
    for layout in ("hf", "official"):
        save_model(models["hf_renamed"], tmp_path / layout, layout=layout)
    done = subprocess.run(
        [
            reference_python(),
            str(REPO / "tools" / "check_ocr_vl_export.py"),
            *(str(tmp_path / f) for f in ("hf", "official")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    sys.stdout.write(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    gaps = {
        (form, case): float(gap)
        for form, case, gap in (line.split() for line in done.stdout.strip().splitlines())
    }
    assert sorted(gaps) == sorted((form, case) for form in ("hf", "official") for case in CASES)
    assert max(gaps.values()) <= PARITY_ATOL


def test_image_inputs_that_do_not_fit_are_clear_errors(models, golden) -> None:
    model = models["hf"]
    ids, kwargs = _inputs(golden, "image")
    with pytest.raises(
        ValueError, match=r"grid \(1, 4, 6\) gives 6 tokens but the prompt has 2 placeholders"
    ):
        model(ids[:, :8], **kwargs)
    given = paddle.zeros([3, 1, 8], dtype="int64")  # positions given: the embedding finds the mismatch
    with pytest.raises(ValueError, match="2 image placeholder tokens but the images give 6 tokens"):
        model(ids[:, :8], position_ids=given, **kwargs)
    with pytest.raises(ValueError, match="the grids hold 24 patches but pixel_values has 23"):
        model(ids, pixel_values=kwargs["pixel_values"][:23], grid_thw=kwargs["grid_thw"])
    with pytest.raises(ValueError, match="merge windows"):
        model(ids, pixel_values=kwargs["pixel_values"], grid_thw=[(1, 3, 8)])


# ---- the image processor and prompts -------------------------------------------------------------------

PROCESSOR = GOLDEN / "processor"


@pytest.fixture(scope="module")
def processor_golden():
    return np.load(PROCESSOR / "expected.npz")


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "e"])
def test_pixels_and_grid_match_the_official_image_processor(processor_golden, name: str) -> None:
    """Odd sizes: min-pixels growth, max-pixels cuts, a side under 28, greyscale, RGBA; 0.5 mean / std."""
    from engine.data.paddleocr_vl_processor import OCRProcessorSettings, preprocess_images

    kwargs = json.loads((PROCESSOR / "settings.json").read_text())[name]
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    pix, grids = preprocess_images([PROCESSOR / f"{name}.png"], OCRProcessorSettings(**kwargs))
    np.testing.assert_array_equal(grids, processor_golden[f"{name}/image_grid_thw"])
    expected = processor_golden[f"{name}/pixel_values"]
    assert pix.shape == expected.shape and pix.dtype == np.float32
    assert float(np.abs(pix - expected).max()) <= 1e-5  # measured 0


def test_the_official_defaults(processor_golden) -> None:
    """384 x 384 to 1536 x 1536 pixels, CLIP mean / std: a 203 x 97 image grows to 20 x 40 patches."""
    from engine.data.paddleocr_vl_processor import preprocess_image

    image = preprocess_image(PROCESSOR / "f.png")
    assert [list(image.grid_thw)] == processor_golden["f/image_grid_thw"].tolist() and image.num_tokens == 200
    np.testing.assert_allclose(image.pixel_values.reshape(-1)[::997], processor_golden["f/sample"], atol=1e-5)
    assert abs(image.pixel_values.astype(np.float64).sum() - float(processor_golden["f/sum"])) < 1e-2


def test_processor_settings_round_trip_through_preprocessor_config(tmp_path) -> None:
    from engine.data.paddleocr_vl_processor import OCRProcessorSettings

    ours = OCRProcessorSettings(
        min_pixels=147384, max_pixels=2822400, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
    )
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(ours.to_preprocessor_config()))
    assert OCRProcessorSettings.from_model_dir(tmp_path) == ours
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 100, "max_pixels": 200}))
    assert OCRProcessorSettings.from_model_dir(tmp_path).max_pixels == 200  # the older keys


def test_bad_images_are_clear_errors(tmp_path) -> None:
    from engine.data.paddleocr_vl_processor import OCRProcessorSettings, preprocess_image
    from engine.data.vl_processor import VisionInputError

    small = OCRProcessorSettings(max_image_pixels=1000)
    with pytest.raises(
        VisionInputError, match=r"b\.png: 401x299 pixels \(119,899\) is more than max_image_pixels=1,000"
    ):
        preprocess_image(PROCESSOR / "b.png", small)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(VisionInputError, match=r"broken\.png: not an image PIL can read"):
        preprocess_image(broken)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes((PROCESSOR / "e.png").read_bytes()[:2000])
    with pytest.raises(VisionInputError, match=r"truncated\.png: truncated or corrupt"):
        preprocess_image(truncated)
    from PIL import Image

    Image.new("RGB", (2000, 8)).save(tmp_path / "strip.png")
    with pytest.raises(VisionInputError, match=r"strip\.png: .*aspect ratio of 250\.0, over the 200"):
        preprocess_image(tmp_path / "strip.png")


def test_the_chat_template_gives_the_published_prompt() -> None:
    from engine.data.paddleocr_vl_processor import CHAT_TEMPLATE, expand_image_placeholders, task_messages
    from engine.tokenizer import compile_chat_template

    template = compile_chat_template(CHAT_TEMPLATE, "PaddleOCR-VL")
    text = template.render(messages=task_messages("table"), add_generation_prompt=True)
    assert text == (
        "<|begin_of_sentence|>User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>Table Recognition:\nAssistant: "
    )
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "| a |"}]}]
    full = template.render(messages=task_messages("ocr") + answer, add_generation_prompt=False)
    assert full.endswith("OCR:\nAssistant: | a |</s>")
    expanded = expand_image_placeholders(text, [(1, 4, 6)])
    assert expanded.count("<|IMAGE_PLACEHOLDER|>") == 6
    with pytest.raises(ValueError, match="unknown PaddleOCR-VL task 'latex'"):
        task_messages("latex")


def test_init_model_writes_a_tiny_paddleocr_vl_that_reads_an_image(tmp_path) -> None:
    """`ernie-studio init-model --preset tiny-ocr-vl`: published form, image tokens in the tokenizer, the
    chat template and processor settings beside it; prompt + image run through the model."""
    from engine.data.paddleocr_vl_processor import (
        OCRProcessorSettings,
        expand_image_placeholders,
        preprocess_images,
        task_messages,
    )
    from engine.models.initialize import init_model

    out = init_model("tiny-ocr-vl", tmp_path / "ocr")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "paddleocr_vl" and "rope_scaling" in raw and "text_config" not in raw
    tok = engine.load_tokenizer(str(out))
    model = engine.load_model(str(out))
    c = model.config
    assert tok.convert_tokens_to_ids("<|IMAGE_PLACEHOLDER|>") == c.image_token_id
    assert tok.convert_tokens_to_ids("<|IMAGE_START|>") == c.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|IMAGE_END|>") == c.vision_end_token_id
    settings = OCRProcessorSettings.from_model_dir(out)
    pix, grids = preprocess_images([PROCESSOR / "a.png", PROCESSOR / "d.png"], settings)
    prompt = tok.apply_chat_template(task_messages("ocr", images=2), add_generation_prompt=True)
    ids = tok.encode(expand_image_placeholders(prompt, grids, settings.merge_size))
    assert ids.count(c.image_token_id) == sum(int(g.prod()) // 4 for g in grids)
    with paddle.no_grad():
        logits = model(
            paddle.to_tensor([ids]), pixel_values=paddle.to_tensor(pix), grid_thw=grids.tolist()
        ).logits
    assert logits.shape == [1, len(ids), c.text.vocab_size] and bool(paddle.isfinite(logits).all())
