"""The VL image/video processor against the official transformers 5.23 outputs (tools/make_vl_processor_goldens.py)."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from engine.data.vl_processor import (
    ProcessorSettings,
    VisionInput,
    VisionInputError,
    preprocess_image,
    smart_resize,
)
from engine.data.vl_video import format_timestamp, preprocess_video, read_video_frames, sample_frame_indices

GOLDEN = Path(__file__).parent / "golden" / "vl_processor"
FONT = str(GOLDEN / "aileron.ttf")
TOL = 1e-5
# The max_pixels each golden image was made with (tools/make_vl_processor_goldens.py IMAGES); None: default.
IMAGE_MAX_PIXELS = {"a": None, "b": 28 * 28 * 16, "c": 28 * 28 * 4, "d": None, "e": 28 * 28 * 9}
VIDEO_SETTINGS = {
    "a": dict(video_min_pixels=28 * 28 * 2, video_max_pixels=28 * 28 * 4, timestamp_font=FONT),
    "c": dict(
        video_min_pixels=784, video_max_pixels=784, video_fps=2.0, video_min_frames=4, video_max_frames=6
    ),
    "d": dict(video_min_pixels=784, video_max_pixels=28 * 28 * 8),
}


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "expected.npz") as z:
        return {k: z[k] for k in z.files}


def image_settings(name: str) -> ProcessorSettings:
    cap = IMAGE_MAX_PIXELS[name]
    return ProcessorSettings(max_pixels=cap) if cap else ProcessorSettings()


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


# --- images -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(IMAGE_MAX_PIXELS))
def test_image_matches_official_pil_backend(golden, name):
    got = preprocess_image(GOLDEN / f"{name}.png", image_settings(name))
    grid = tuple(int(v) for v in golden[f"img_{name}_grid"])
    assert got.kind == "image" and got.grid_thw == grid
    assert got.pixel_values.dtype == np.float32
    assert max_diff(got.pixel_values, golden[f"img_{name}_pixel_values"]) <= TOL
    assert got.num_tokens == grid[0] * grid[1] * grid[2] // 4


def test_image_from_bytes_and_path_agree():
    data = (GOLDEN / "b.png").read_bytes()
    a = preprocess_image(data, image_settings("b"))
    b = preprocess_image(str(GOLDEN / "b.png"), image_settings("b"))
    assert a.grid_thw == b.grid_thw and np.array_equal(a.pixel_values, b.pixel_values)


def test_pil_image_with_alpha_is_composited_on_white_but_a_file_drops_alpha(golden):
    """The official PIL backend composites a PIL image's alpha onto white; load_image (paths) drops it."""
    settings = image_settings("e")
    from_pil = preprocess_image(Image.open(GOLDEN / "e.png"), settings)
    assert from_pil.grid_thw == tuple(int(v) for v in golden["img_e_pil_grid"])
    assert max_diff(from_pil.pixel_values, golden["img_e_pil_pixel_values"]) <= TOL
    from_file = preprocess_image(GOLDEN / "e.png", settings)
    assert max_diff(from_file.pixel_values, from_pil.pixel_values) > 0.5  # the two paths really differ


def test_torchvision_backend_stays_within_the_documented_gap(golden):
    """The module docstring says the default torchvision backend is up to ~0.03 from the PIL backend."""
    gaps = [float(golden[f"img_{n}_tv_max_diff"]) for n in IMAGE_MAX_PIXELS]
    assert 0 < max(gaps) <= 0.03


def test_patch_order_is_merge_window_major_then_channel_patch():
    """Rows go by 2x2 merge window (row-major inside it); a row is C x patch x patch, channel first."""
    patch = np.zeros((28, 56, 3), np.uint8)
    for r in range(2):
        for c in range(4):
            patch[r * 14 : (r + 1) * 14, c * 14 : (c + 1) * 14] = (r * 4 + c) * 10, 200, 100
    # already on the 28-pixel grid and within budget: no resize, so values map back exactly
    got = preprocess_image(Image.fromarray(patch), ProcessorSettings(min_pixels=28 * 28))
    assert got.grid_thw == (1, 2, 4) and got.pixel_values.shape == (8, 3 * 14 * 14)
    red = got.pixel_values[:, 0] * np.float32(0.26862954) + np.float32(0.48145466)
    order = np.rint(red * 255 / 10).astype(int).tolist()
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]  # window (0,0): patches 0,1,4,5; window (0,1): 2,3,6,7
    row = got.pixel_values[0]
    assert np.allclose(row[:196], row[0]) and np.allclose(row[196:392], row[196])  # R block, then G block
    assert not np.isclose(row[0], row[196])


def test_smart_resize_branches():
    assert smart_resize(57, 33) == (84, 56)  # too few pixels: scaled up
    assert smart_resize(41, 130) == (28, 140)  # rounded to the grid
    assert smart_resize(299, 401, max_pixels=28 * 28 * 16) == (84, 112)  # too many: scaled down
    assert smart_resize(17, 1000, max_pixels=28 * 28 * 4) == (28, 420)  # short side held at one factor
    assert smart_resize(1, 1) == (56, 56)


# --- video --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VIDEO_SETTINGS))
def test_video_matches_official_video_processor(golden, name):
    frames = golden[f"vid_{name}_frames"]
    got = preprocess_video(
        frames, ProcessorSettings(**VIDEO_SETTINGS[name]), fps=float(golden[f"vid_{name}_fps"])
    )
    grid = tuple(int(v) for v in golden[f"vid_{name}_grid"])
    assert got.kind == "video" and got.grid_thw == grid
    assert max_diff(got.pixel_values, golden[f"vid_{name}_pixel_values"]) <= TOL
    assert got.num_tokens == grid[0] * grid[1] * grid[2] // 4 // 2


def test_odd_frame_count_repeats_the_last_frame(golden):
    got = preprocess_video(golden["vid_a_frames"], ProcessorSettings(**VIDEO_SETTINGS["a"]), fps=2.0)
    assert len(golden["vid_a_frames"]) == 5 and got.grid_thw[0] == 6
    per_frame = got.grid_thw[1] * got.grid_thw[2]
    assert np.array_equal(got.pixel_values[4 * per_frame : 5 * per_frame], got.pixel_values[5 * per_frame :])


def test_video_from_pil_frames_equals_array(golden):
    frames = golden["vid_d_frames"]
    settings = ProcessorSettings(**VIDEO_SETTINGS["d"])
    a = preprocess_video([Image.fromarray(f) for f in frames], settings, fps=24.0)
    assert np.array_equal(a.pixel_values, preprocess_video(frames, settings, fps=24.0).pixel_values)
    channels_first = preprocess_video(np.ascontiguousarray(frames.transpose(0, 3, 1, 2)), settings, fps=24.0)
    assert np.array_equal(a.pixel_values, channels_first.pixel_values)


def test_timestamps_are_drawn_only_with_a_font(golden):
    settings = ProcessorSettings(**{**VIDEO_SETTINGS["a"], "timestamp_font": None})
    plain = preprocess_video(golden["vid_a_frames"], settings, fps=2.0)
    assert max_diff(plain.pixel_values, golden["vid_a_pixel_values"]) > 0.5


def test_default_video_settings(golden):
    got = preprocess_video(golden["vid_default_frames"])
    assert got.grid_thw == tuple(int(v) for v in golden["vid_default_grid"]) == (2, 36, 36)
    sample = got.pixel_values.reshape(-1)[:: int(golden["vid_default_stride"])]
    assert max_diff(sample, golden["vid_default_sample"]) <= TOL
    assert got.pixel_values.astype(np.float64).sum() == pytest.approx(
        float(golden["vid_default_sum"]), abs=1e-2
    )


def test_frame_sampling_matches_official(golden):
    cases, indices, offsets = golden["sample_cases"], golden["sample_indices"], golden["sample_offsets"]
    for i, (total, fps, video_fps, lo, hi) in enumerate(cases):
        settings = ProcessorSettings(
            video_fps=video_fps or None, video_min_frames=int(lo), video_max_frames=int(hi)
        )
        got = sample_frame_indices(int(total), settings, fps or None)
        assert got.tolist() == indices[offsets[i] : offsets[i + 1]].tolist(), (total, fps, video_fps)


def test_timestamp_text_matches_official(golden):
    for (index, fps), text in zip(golden["stamp_seconds"], golden["stamp_texts"], strict=True):
        assert format_timestamp(np.float32(index) / np.float32(fps)) == str(text)


# --- positions and token types ------------------------------------------------------------------------------


def _ids(types) -> np.ndarray:
    """Token ids for a list of token types: 7 image placeholder, 8 video placeholder, 5 text."""
    types = np.asarray(types)
    return np.where(types == 1, 7, np.where(types == 2, 8, 5)).astype(np.int64)


@pytest.fixture(scope="module")
def vl_config():
    from engine.models.config import ErnieConfig, VisionConfig

    return ErnieConfig(
        vision_config=VisionConfig(),
        im_patch_id=7,
        video_token_id=8,
        image_start_token_id=900,
        image_end_token_id=901,
        video_start_token_id=910,
        video_end_token_id=911,
    )


def test_position_ids_match_official_get_rope_index(golden, vl_config):
    """engine.models.positions (what the model, the trainer and the server use) against the official."""
    from engine.models.positions import batch_positions

    grids = [tuple(int(v) for v in g) for g in golden["pos_grids"]]
    got, _ = batch_positions(_ids(golden["pos_token_types"])[None], grids, vl_config)
    assert got.dtype == np.int64 and np.array_equal(got[:, 0], golden["pos_ids"])


def test_position_ids_by_hand(vl_config):
    from engine.models.positions import batch_positions

    # 2 text, an image of grid (1, 4, 2) -> 2x1 tokens, 1 text
    got, deltas = batch_positions(_ids([0, 0, 1, 1, 0])[None], [(1, 4, 2)], vl_config)
    assert got[:, 0].tolist() == [[0, 1, 2, 2, 4], [0, 1, 2, 3, 4], [0, 1, 2, 2, 4]]
    assert deltas.tolist() == [0]  # next position 5 = length 5


def test_token_types(vl_config):
    from engine.models.positions import moe_token_types

    ids = np.array([5, 900, 7, 7, 901, 5, 910, 8, 8, 8, 8, 911, 5])
    assert moe_token_types(ids, vl_config).tolist() == [0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0]


def test_vision_input_token_counts():
    image = VisionInput(
        np.zeros((48, 588), np.float32), (1, 6, 8), "image", merge_size=2, temporal_merge_size=2
    )
    video = VisionInput(
        np.zeros((96, 588), np.float32), (2, 6, 8), "video", merge_size=2, temporal_merge_size=2
    )
    assert image.num_tokens == 12 and video.num_tokens == 12


# --- settings -----------------------------------------------------------------------------------------------


def write_official_configs(root: Path, font: bool) -> None:
    """What transformers' save_pretrained writes for the two processors (values changed to be told apart)."""
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "merge_size": 2,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
    }
    image = {
        **common,
        "image_processor_type": "Ernie4_5_VLMoeImageProcessor",
        "size": {"longest_edge": 1000000, "shortest_edge": 4000},
        "temporal_patch_size": 1,
    }
    video = {
        **common,
        "do_sample_frames": True,
        "draw_on_frames": True,
        "font": "Roboto-Regular.ttf",
        "max_frames": 64,
        "min_frames": 8,
        "return_metadata": False,
        "size": {"longest_edge": 900000, "shortest_edge": 200000},
        "temporal_patch_size": 2,
        "video_processor_type": "Ernie4_5_VLMoeVideoProcessor",
    }
    (root / "preprocessor_config.json").write_text(json.dumps(image))
    (root / "video_preprocessor_config.json").write_text(json.dumps(video))
    if font:
        (root / "Roboto-Regular.ttf").write_bytes(Path(FONT).read_bytes())


def test_settings_from_model_dir(tmp_path):
    write_official_configs(tmp_path, font=True)
    s = ProcessorSettings.from_model_dir(tmp_path)
    assert (s.min_pixels, s.max_pixels, s.video_min_pixels, s.video_max_pixels) == (
        4000,
        1000000,
        200000,
        900000,
    )
    assert (s.video_min_frames, s.video_max_frames, s.video_fps) == (8, 64, None)
    assert s.timestamp_font == str(tmp_path / "Roboto-Regular.ttf")
    assert ProcessorSettings.from_model_dir(tmp_path / "nothing-here") == ProcessorSettings()


def test_settings_without_the_font_draw_nothing_and_say_so(tmp_path, caplog):
    write_official_configs(tmp_path, font=False)
    with caplog.at_level(logging.WARNING):
        s = ProcessorSettings.from_model_dir(tmp_path)
    assert s.timestamp_font is None
    assert "Roboto-Regular.ttf is missing" in caplog.text


def test_settings_from_nested_processor_config_and_unsupported_keys(tmp_path):
    nested = {
        "image_processor": {"size": {"shortest_edge": 100, "longest_edge": 200}},
        "video_processor": {"fps": 2.0, "draw_on_frames": False},
    }
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    s = ProcessorSettings.from_model_dir(tmp_path)
    assert (s.min_pixels, s.max_pixels, s.video_fps, s.timestamp_font) == (100, 200, 2.0, None)
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"resample": 2}))
    with pytest.raises(ValueError, match="resample=2 is not supported"):
        ProcessorSettings.from_model_dir(tmp_path)


def test_settings_from_vision_config():
    vc = SimpleNamespace(patch_size=16, spatial_merge_size=3, temporal_merge_size=4)
    s = ProcessorSettings.from_vision_config(vc, ProcessorSettings(max_pixels=1234))
    assert (s.patch_size, s.merge_size, s.video_temporal_patch_size, s.max_pixels) == (16, 3, 4, 1234)
    assert s.factor == 48


# --- reading frames -----------------------------------------------------------------------------------------


def test_read_video_frames_from_directory_list_and_animated_file(tmp_path, golden):
    frames = [Image.fromarray(f) for f in golden["vid_d_frames"]]
    for i, f in enumerate(frames):
        f.save(tmp_path / f"{i:03d}.png")
    (tmp_path / "notes.txt").write_text("not a frame")
    got, fps = read_video_frames(tmp_path, fps=24.0)
    assert fps == 24.0 and [np.asarray(f).tolist() for f in got] == [np.asarray(f).tolist() for f in frames]
    got, fps = read_video_frames([tmp_path / "001.png", tmp_path / "000.png"])
    assert fps is None and np.array_equal(np.asarray(got[0]), np.asarray(frames[1]))
    gif = tmp_path / "clip.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=250, loop=0)
    got, fps = read_video_frames(gif)
    assert len(got) == 2 and fps == pytest.approx(4.0) and got[0].mode == "RGB"


# --- bad inputs ---------------------------------------------------------------------------------------------


def png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose header claims a size and holds no pixel data: decoding it would fail."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def test_truncated_png_names_the_file(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes((GOLDEN / "b.png").read_bytes()[:3000])
    with pytest.raises(VisionInputError, match=r"image file .*cut\.png: truncated or corrupt"):
        preprocess_image(path)


def test_text_file_named_png(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("these are notes, not pixels")
    with pytest.raises(VisionInputError, match=r"image file .*notes\.png: not an image PIL can read"):
        preprocess_image(path)


def test_missing_file(tmp_path):
    with pytest.raises(VisionInputError, match=r"image file .*gone\.png: no such file"):
        preprocess_image(tmp_path / "gone.png")


def test_huge_header_is_refused_before_decoding(tmp_path):
    path = tmp_path / "bomb.png"
    png_header_only(path, 9000, 9000)  # 81 MP: over our 64 MP limit, under PIL's own guard
    with pytest.raises(VisionInputError) as err:
        preprocess_image(path)
    # the pixel-limit message, not "truncated": the size was checked from the header, nothing was decoded
    assert (
        f"image file {path}: 9000x9000 pixels (81,000,000) is more than max_image_pixels=64,000,000"
        in str(err.value)
    )
    png_header_only(path, 100_000, 100_000)  # past PIL's own decompression-bomb limit
    with pytest.raises(VisionInputError, match=r"bomb\.png: larger than max_image_pixels=64,000,000"):
        preprocess_image(path)
    with pytest.raises(VisionInputError, match="max_image_pixels=1,000"):
        preprocess_image(GOLDEN / "a.png", ProcessorSettings(max_image_pixels=1000))


def test_extreme_aspect_ratio():
    with pytest.raises(
        VisionInputError, match=r"^image: 402x2 pixels has an aspect ratio of 201\.0, over the 200"
    ):
        preprocess_image(Image.new("RGB", (402, 2)))
    with pytest.raises(VisionInputError, match="aspect ratio"):
        smart_resize(1, 250)


def test_not_an_image():
    with pytest.raises(VisionInputError, match="expected a PIL image, a file path or bytes, got ndarray"):
        preprocess_image(np.zeros((28, 28, 3), np.uint8))
    with pytest.raises(VisionInputError, match="video frame 1: expected a PIL image, got str"):
        preprocess_video([Image.new("RGB", (30, 30)), "frame.png"])


def test_corrupt_model_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: not valid JSON"):
        ProcessorSettings.from_model_dir(tmp_path)


def test_empty_image():
    with pytest.raises(VisionInputError, match=r"0x5 pixels is empty; an image needs at least 1x1"):
        preprocess_image(Image.new("RGB", (0, 5)))


def test_video_errors(golden, tmp_path):
    with pytest.raises(VisionInputError, match=r"^video has no frames$"):
        preprocess_video([])
    with pytest.raises(VisionInputError, match=r"^video has no frames$"):
        preprocess_video(np.zeros((0, 30, 30, 3), np.uint8))
    frames = [Image.new("RGB", (30, 30)), Image.new("RGB", (30, 30)), Image.new("RGB", (31, 30))]
    with pytest.raises(VisionInputError, match="video frame 2 is 31x30 pixels but frame 0 is 30x30"):
        preprocess_video(frames)
    with pytest.raises(VisionInputError, match=r"video_fps=2\.0 needs the frame rate"):
        preprocess_video(golden["vid_c_frames"], ProcessorSettings(video_fps=2.0))
    with pytest.raises(VisionInputError, match="expected uint8"):
        preprocess_video(np.zeros((2, 30, 30, 3), np.float32))
    with pytest.raises(VisionInputError, match=r"video frame directory .*: no image files"):
        read_video_frames(tmp_path)


def test_position_id_mismatches(vl_config):
    from engine.models.positions import batch_positions

    with pytest.raises(ValueError, match=r"gives 2 tokens but the prompt has 3 placeholders at 1\.\.3"):
        batch_positions(_ids([0, 1, 1, 1])[None], [(1, 4, 2)], vl_config)
    with pytest.raises(ValueError, match=r"placeholder tokens at 1\.\.2 have no image or video"):
        batch_positions(_ids([0, 1, 1, 0])[None], [], vl_config)
    with pytest.raises(ValueError, match="more images / videos were given than the prompts have"):
        batch_positions(_ids([0, 0])[None], [(1, 2, 2)], vl_config)


def test_written_processor_configs_read_back_to_the_same_settings(tmp_path):
    from dataclasses import replace

    from engine.data.vl_processor import write_processor_configs

    settings = replace(
        ProcessorSettings(), min_pixels=4000, max_pixels=90000, video_min_frames=2, video_fps=2.0
    )
    write_processor_configs(settings, tmp_path)
    assert ProcessorSettings.from_model_dir(tmp_path) == settings
