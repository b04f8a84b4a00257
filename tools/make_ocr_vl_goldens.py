"""Build the PaddleOCR-VL goldens under tests/engine/golden/paddleocr_vl/ from Hugging Face transformers.

Run by hand in the reference environment (tools/build_reference_env.sh: torch + transformers 5.24, never a
project dependency) with the Pillow the project locks (12.x) importable, for instance:

    mkdir -p /tmp/pil && ln -sf "$PWD/.venv/lib/python3.11/site-packages/PIL" /tmp/pil/PIL
    PYTHONPATH=/tmp/pil "$(tools/build_reference_env.sh)" tools/make_ocr_vl_goldens.py

transformers' ``paddleocr_vl`` is an independent port of Baidu's PaddleOCR-VL remote code. For a small
model with random weights this writes

  paddleocr_vl/hf/         what ``save_pretrained`` writes: the official tensor names (its default
                           ``save_original_format=True`` undoes its conversion_mapping) and its nested config.json
  paddleocr_vl/hf_renamed/ ``save_pretrained(save_original_format=False)``: transformers' in-memory names
                           (``model.language_model.*``, ``model.visual.*``, ``model.projector.*``)
  paddleocr_vl/official/   the published form, made from hf_renamed by hand: the official names (``model.*``,
                           ``visual.vision_model.*``, ``mlp_AR.*``: conversion_mapping ``paddleocr_vl`` read
                           backwards), the flat config.json, plus the SigLIP pooling head and
                           ``packing_position_embedding`` the published checkpoint carries and the model ignores
  paddleocr_vl/expected.npz   per case (text only, one image, two images of different sizes): input ids,
                           pixel patches, grids, transformers' 3-D position ids and logits (fp32)
  paddleocr_vl/processor/  five PNGs of odd sizes and ``expected.npz``: the official (PIL backend) image
                           processor's pixel_values and image_grid_thw for each, with the settings used
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.numpy import load_file, save_file
from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration
from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil

OUT = Path(__file__).resolve().parent.parent / "tests" / "engine" / "golden" / "paddleocr_vl"
VOCAB = 192
IMAGE, VIDEO, START, END = 190, 191, 188, 189
PATCH = (3, 14, 14)


def config() -> PaddleOCRVLConfig:
    return PaddleOCRVLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            # 8 rotary pairs: 2 for time, 3 for the row, 3 for the column
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        # 6 x 6 learned positions (image_size 84 / patch 14): the 4 x 6 image resamples them down on one
        # axis, the 8 x 4 image up on the other
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=84,
            patch_size=14,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are far from trivial (HF's default init is 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "position_embedding" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def sequence(g: torch.Generator, parts: list) -> list[int]:
    """Text runs (ints: that many random ids) and images (("image", n_tokens)) between start / end."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(3, 180, (part,), generator=g).tolist()
        else:
            ids += [START] + [IMAGE] * part[1] + [END]
    return ids


def run_case(model, g: torch.Generator, parts: list, grids: list) -> dict[str, np.ndarray]:
    ids = torch.tensor([sequence(g, parts)])
    kwargs: dict = {"input_ids": ids}
    out: dict[str, np.ndarray] = {"input_ids": ids.numpy()}
    if grids:
        grid = torch.tensor(grids)
        pix = torch.randn(int(grid.prod(-1).sum()), *PATCH, generator=g)
        mm = (ids == IMAGE).long()
        kwargs.update(pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=mm)
        out.update(pixel_values=pix.numpy(), image_grid_thw=grid.numpy())
        out["position_ids"] = model.model.get_rope_index(ids, mm, grid)[0].numpy()
    with torch.no_grad():
        out["logits"] = model(**kwargs).logits.float().numpy()
    return out


def official_name(key: str) -> str:
    """transformers' key -> the published one (conversion_mapping ``paddleocr_vl`` backwards)."""
    for ours, theirs in (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
        ("model.projector.", "mlp_AR."),
    ):
        if key.startswith(ours):
            return theirs + key[len(ours) :]
    return key


def official_config(hf: dict) -> dict:
    """The flat config.json of the published repo (decoder keys at the top, rope_scaling)."""
    text = dict(hf["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in text.items() if k not in ("model_type", "dtype", "architectures")}
    flat.update(
        architectures=["PaddleOCRVLForConditionalGeneration"],
        model_type="paddleocr_vl",
        rope_theta=rope["rope_theta"],
        rope_scaling={"type": "default", "rope_type": "default", "mrope_section": rope["mrope_section"]},
        torch_dtype="float32",
        use_flash_attention=False,
        tie_word_embeddings=hf["tie_word_embeddings"],
    )
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        flat[k] = hf[k]
    vision = {k: v for k, v in hf["vision_config"].items() if k != "rope_parameters"}
    vision.update(model_type="paddleocr_vl", architectures=["SiglipVisionModel"], temporal_patch_size=2)
    flat["vision_config"] = vision
    return flat


def write_official(g: torch.Generator) -> None:
    hf_dir, d = OUT / "hf_renamed", OUT / "official"
    d.mkdir()
    tensors = {official_name(k): v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    # present in the published checkpoint, unused by the model
    tensors["visual.vision_model.head.probe"] = torch.randn(1, 1, 32, generator=g).numpy()
    tensors["visual.vision_model.head.layernorm.weight"] = np.ones(32, np.float32)
    tensors["packing_position_embedding.weight"] = torch.randn(8, 32, generator=g).numpy()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((hf_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(official_config(hf), indent=2) + "\n")


# name, width, height, PIL mode, pattern, processor settings (None: the official class defaults)
IMAGES = [
    ("a", 33, 57, "RGB", "noise", {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}),
    ("b", 401, 299, "RGB", "blocks", {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}),
    # a side under the factor: the official smart_resize scales it up to 28 first (2 x 22 patches, not 2 x 10)
    ("c", 120, 11, "RGB", "blocks", {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 16}),
    # greyscale, grown to the min-pixels bound, SigLIP's 0.5 mean / std (the published preprocessor config)
    (
        "d",
        61,
        41,
        "L",
        "blocks",
        {
            "min_pixels": 28 * 28 * 9,
            "max_pixels": 28 * 28 * 16,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
        },
    ),
    ("e", 250, 130, "RGBA", "noise", {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 12}),
]
# The class defaults (384 x 384 to 1536 x 1536 pixels): only grid, a strided sample and the sum are kept.
DEFAULT_IMAGE = ("f", 203, 97, "RGB", "blocks")


def make_image(width: int, height: int, mode: str, pattern: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if pattern == "noise":
        arr = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    else:
        arr = np.zeros((height, width, 4), np.uint8)
        for _ in range(12):
            y, x = rng.integers(0, height), rng.integers(0, width)
            arr[y : y + rng.integers(3, 40), x : x + rng.integers(3, 60)] = rng.integers(0, 256, 4)
        arr[..., 3] = np.maximum(arr[..., 3], 60)
    return Image.fromarray(arr, "RGBA").convert(mode)


def write_processor() -> None:
    d = OUT / "processor"
    d.mkdir()
    out: dict[str, np.ndarray] = {}
    settings = {}
    for i, (name, width, height, mode, pattern, kwargs) in enumerate(IMAGES):
        image = make_image(width, height, mode, pattern, seed=100 + i)
        image.save(d / f"{name}.png")
        with Image.open(io.BytesIO((d / f"{name}.png").read_bytes())) as im:
            loaded = im.convert("RGB")  # transformers' load_image: RGB, transparency dropped
        got = PaddleOCRVLImageProcessorPil(**kwargs)(images=[loaded], return_tensors="np")
        out[f"{name}/pixel_values"] = got["pixel_values"]
        out[f"{name}/image_grid_thw"] = got["image_grid_thw"]
        settings[name] = kwargs
        print(name, got["pixel_values"].shape, got["image_grid_thw"].tolist())
    name, width, height, mode, pattern = DEFAULT_IMAGE
    image = make_image(width, height, mode, pattern, seed=200)
    image.save(d / f"{name}.png")
    got = PaddleOCRVLImageProcessorPil()(images=[image.convert("RGB")], return_tensors="np")
    pix = got["pixel_values"]
    out[f"{name}/image_grid_thw"] = got["image_grid_thw"]
    out[f"{name}/sample"] = pix.reshape(-1)[::997]
    out[f"{name}/sum"] = np.asarray(pix.astype(np.float64).sum())
    print(name, pix.shape, got["image_grid_thw"].tolist())
    np.savez_compressed(d / "expected.npz", **out)
    (d / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")


def main() -> None:
    torch.manual_seed(0)
    model = PaddleOCRVLForConditionalGeneration(config())
    randomise(model, seed=21)
    model.eval()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    g = torch.Generator().manual_seed(22)
    cases = {
        "text": ([16], []),
        # a 4 x 6 patch image = 2 x 3 merged tokens
        "image": ([5, ("image", 6), 6], [[1, 4, 6]]),
        # two images of different sizes (the second taller than wide), text between and after
        "two_images": ([3, ("image", 6), 4, ("image", 8), 5], [[1, 4, 6], [1, 8, 4]]),
    }
    arrays: dict[str, np.ndarray] = {}
    for name, (parts, grids) in cases.items():
        for key, value in run_case(model, g, parts, grids).items():
            arrays[f"{name}/{key}"] = value
        print(name, arrays[f"{name}/logits"].shape, f"|max| {np.abs(arrays[name + '/logits']).max():.3f}")
    np.savez_compressed(OUT / "expected.npz", **arrays)
    for name, original in (("hf", True), ("hf_renamed", False)):
        model.save_pretrained(OUT / name, save_original_format=original)
        (OUT / name / "generation_config.json").unlink(missing_ok=True)
    write_official(g)
    write_processor()


if __name__ == "__main__":
    main()
