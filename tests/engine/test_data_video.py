"""VL-SFT with videos: ERNIEKit video_info records, token counts from headers, batches the tiny VL model
trains on (pixel_values / grid_thw of images and videos in prompt order)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from PIL import Image

from engine import load_model, load_tokenizer
from engine.data import DatasetError, RecordError, SampleEncoder, build_train_data, parse_record
from engine.data.encode import media_token_count, render_record, video_frame_rate, video_grid
from engine.data.formats_vl import probe_video
from engine.data.record_types import VideoClip
from engine.data.vl_processor import ProcessorSettings
from engine.data.vl_video import preprocess_video, read_video_frames
from engine.tokenizer import (
    IMAGE_END,
    IMAGE_PLACEHOLDER,
    IMAGE_START,
    VIDEO_END,
    VIDEO_PLACEHOLDER,
    VIDEO_START,
)
from engine.train.sft import to_tensor_batch

DEMO = Path(__file__).resolve().parents[2] / "examples" / "data"
VIDEO_DEMO = DEMO / "vl_video_demo.jsonl"
# The official video processor scales every frame up to at least 299 merge windows; the tiny model's tests
# keep the demo's 56 x 56 frames as they are (2 x 2 windows, 8 tokens for 4 frames).
SMALL_VIDEOS = ProcessorSettings(video_min_pixels=56 * 56)


@pytest.fixture(scope="module")
def tok(tiny_vl_model_dir):
    return load_tokenizer(str(tiny_vl_model_dir))


def demo_records() -> list[dict]:
    return [json.loads(line) for line in VIDEO_DEMO.read_text().splitlines()]


def save_frames(directory: Path, count: int, size: tuple[int, int], suffix: str = ".png", **save) -> Path:
    directory.mkdir(parents=True)
    for i in range(count):
        pixels = np.random.default_rng(i).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(directory / f"{i:03d}{suffix}", **save)
    return directory


def test_video_token_count_from_headers_matches_preprocess_video(tmp_path):
    rotated = Image.Exif()
    rotated[0x0112] = 6  # the frames stand on their side until load_image turns them
    clips = {
        "odd": save_frames(tmp_path / "odd", 5, (84, 56)),
        "rotated": save_frames(tmp_path / "rotated", 3, (112, 56), ".jpg", exif=rotated),
        "many": save_frames(tmp_path / "many", 21, (60, 40)),
    }
    gif = [Image.new("RGB", (70, 42), (40 * i, 0, 0)) for i in range(6)]
    gif[0].save(tmp_path / "clip.gif", save_all=True, append_images=gif[1:], duration=250, loop=0)
    clips["gif"] = tmp_path / "clip.gif"
    settings = [
        SMALL_VIDEOS,
        ProcessorSettings(video_min_pixels=56 * 56, video_max_frames=8, video_min_frames=4),
        ProcessorSettings(video_min_pixels=28 * 28, video_max_pixels=56 * 56, video_fps=2.0),
    ]
    seen = set()
    for name, path in clips.items():
        clip = probe_video(path)
        frames, fps = read_video_frames(path)
        assert clip.fps == fps == (4.0 if name == "gif" else None)
        assert (clip.num_frames, (clip.width, clip.height)) == (len(frames), frames[0].size)
        for s in settings:
            processed = preprocess_video(frames, s, video_frame_rate(clip, s))
            assert video_grid(clip, s) == processed.grid_thw, (name, s)
            assert media_token_count(clip, s) == processed.num_tokens
            seen.add(processed.grid_thw)
    assert (6, 4, 6) in seen and (4, 4, 2) in seen  # odd frame counts pad to pairs; EXIF turns the frames
    assert len(seen) >= 6


def test_video_and_picture_runs_follow_the_official_template(tok, tiny_vl_model_dir):
    enc = SampleEncoder(tok, 512, vision=SMALL_VIDEOS)
    records = demo_records()
    mixed = parse_record(records[6], "erniekit_vl", "sft", DEMO)
    (sample,) = enc.encode(mixed)
    assert [type(m) for m in sample.media] == [type(DEMO), VideoClip]  # picture first, as 'order' says
    text = tok.decode(sample.input_ids.tolist(), skip_special_tokens=False)
    picture = f"Picture 1:{IMAGE_START}{IMAGE_PLACEHOLDER * 16}{IMAGE_END}"
    video = f"Video 1:{VIDEO_START}{VIDEO_PLACEHOLDER * 8}{VIDEO_END}"
    assert f"User: {picture}{video}Is the shape" in text
    assert (sample.labels[sample.input_ids == tok.convert_tokens_to_ids(VIDEO_PLACEHOLDER)] == -100).all()
    # Two turns: the video opens the first prompt, the picture the second; each kind counts from 1.
    (two,) = enc.encode(parse_record(records[7], "erniekit_vl", "sft", DEMO))
    text = tok.decode(two.input_ids.tolist(), skip_special_tokens=False)
    assert text.index("Video 1:") < text.index("Picture 1:") and "Video 2" not in text
    # A second video in the conversation is Video 2, whatever pictures come between.
    rec = dict(
        records[7], video_info=[*records[7]["video_info"], {"image_url": "videos/yellow_square_up.gif"}]
    )
    rec["order"] = {
        "type": [*rec["order"]["type"][:3], "video", *rec["order"]["type"][3:]],
        "index": [0, 0, 1, 1, 0, 2, 3],
    }
    (three,) = enc.encode(parse_record(rec, "erniekit_vl", "sft", DEMO))
    text = tok.decode(three.input_ids.tolist(), skip_special_tokens=False)
    assert re.findall(r"(Video \d|Picture \d):", text) == ["Video 1", "Video 2", "Picture 1"]
    # The model's video placeholder is the tokenizer's; Baidu's own tokenizers have none (video patches use
    # the image placeholder's id there), and the encoder follows.
    assert load_model(str(tiny_vl_model_dir)).config.video_token_id == tok.convert_tokens_to_ids(
        VIDEO_PLACEHOLDER
    )
    baidu = type(tok).__new__(type(tok))
    baidu.__dict__.update(tok.__dict__)
    baidu.added_tokens = {k: v for k, v in tok.added_tokens.items() if k != VIDEO_PLACEHOLDER}
    assert SampleEncoder(baidu, 512).video_placeholder == IMAGE_PLACEHOLDER


def test_preview_names_videos_and_their_token_counts(tok):
    spans = render_record(demo_records()[6], "erniekit_vl", "sft", tok, base_dir=DEMO)
    assert spans[0]["text"].endswith(
        f"Picture 1:{IMAGE_START}[image red_circle.png: 112x112, 16 tokens]{IMAGE_END}"
        f"Video 1:{VIDEO_START}[video red_square_right: 4 frames, 504x504, 648 tokens]{VIDEO_END}"
        "Is the shape in the picture the same colour as the square in the video?\nAssistant: "
    )


def test_video_batch_feeds_the_tiny_vl_model(tok, tiny_vl_model_dir):
    model = load_model(str(tiny_vl_model_dir))
    data = build_train_data(
        str(VIDEO_DEMO),
        tok,
        "VL-SFT",
        256,
        packing=False,
        batch_size=8,
        vision_config=model.config.vision_config,
        vision=SMALL_VIDEOS,
        shuffle=False,
    )
    batch = next(iter(data.one_pass()))
    image, video = (1, 8, 8), (4, 4, 4)
    # Row by row, each prompt's images and videos in the order its placeholder runs appear.
    assert batch["grid_thw"] == [video] * 6 + [image, video, video, image]
    assert batch["pixel_values"].shape == (8 * 64 + 2 * 64, 3 * 14 * 14)
    ids = batch["input_ids"]
    assert int((ids == model.config.im_patch_id).sum()) == 2 * 16
    assert int((ids == model.config.video_token_id).sum()) == 8 * 8
    t = to_tensor_batch(batch)  # what the trainer hands the model
    with paddle.no_grad():
        out = model(**t["inputs"], labels=t["labels"])
    assert np.isfinite(float(out.loss))


def test_a_bad_video_refuses_its_record_whole(tmp_path, tok):
    shutil.copytree(DEMO / "videos", tmp_path / "videos")
    shutil.copytree(DEMO / "images", tmp_path / "images")
    save_frames(tmp_path / "videos" / "ragged", 2, (56, 56))
    Image.new("RGB", (28, 56)).save(tmp_path / "videos" / "ragged" / "002.png")
    good, mixed = demo_records()[6], json.loads(json.dumps(demo_records()[6]))
    mixed["video_info"][0]["image_url"] = "videos/ragged"
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(mixed) + "\n")
    # The good picture of the bad record is not encoded on its own: the record is refused with its problem.
    with pytest.raises(RecordError, match=r"video_info\[0\]: video 'videos/ragged': frame 002.png is 28x56"):
        parse_record(mixed, "erniekit_vl", "sft", tmp_path)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: video_info[0]: video 'videos/ragged'")) as e:
        build_train_data(str(path), tok, "VL-SFT", 256, vision=SMALL_VIDEOS)
    assert (e.value.report.num_records, e.value.report.num_valid) == (2, 1)


def test_vl_sft_learns_from_videos_and_pictures(tiny_vl_model_dir, tmp_path):
    from engine.train import run_training
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict

    # The model directory's video processor config is what a run reads (as transformers writes it).
    model_dir = tmp_path / "tiny-vl"
    shutil.copytree(tiny_vl_model_dir, model_dir)
    processor = {"min_pixels": SMALL_VIDEOS.video_min_pixels, "draw_on_frames": False}
    (model_dir / "video_preprocessor_config.json").write_text(json.dumps(processor))
    out = tmp_path / "run"
    cfg = config_from_dict(
        TrainConfig,
        dict(
            output_dir=str(out),
            model_name_or_path=str(model_dir),
            stage="VL-SFT",
            fine_tuning="Full",
            train_dataset_path=str(VIDEO_DEMO),
            max_seq_len=256,
            batch_size=4,
            learning_rate=2e-3,
            max_steps=20,
            logging_steps=1,
            save_steps=1000,
            disable_tqdm=True,
            seed=7,
        ),
    )
    summary = run_training(cfg)
    assert summary.status == "succeeded"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    print(f"VL-SFT on videos and pictures: loss {first:.3f} -> {last:.3f}")
    assert last < 0.8 * first


def test_stats_count_pictures_and_videos(tok):
    from engine.data import dataset_stats

    stats = dataset_stats(VIDEO_DEMO, "erniekit_vl", "sft", tok)
    assert (stats["num_valid"], stats["num_images"], stats["num_videos"]) == (8, 2, 8)
    # every record holds a video, and under the official video settings (no video_preprocessor_config.json
    # in the tiny model) each 4-frame clip of 56 x 56 frames takes 648 tokens
    assert stats["p50_length"] > 648


def test_private_use_mark_characters_in_text(tok):
    """The encoder marks media with U+E000 / U+E001: a VL text holding them is refused (they would pair with
    the wrong file); in text-only data they are ordinary characters."""
    rec = demo_records()[0]
    rec["text_info"][0]["text"] += "\ue001"
    with pytest.raises(RecordError, match=r"text_info\[0\].text holds U\+E000 or U\+E001"):
        parse_record(rec, "erniekit_vl", "sft", DEMO)
    (s,) = SampleEncoder(tok, 64).encode(
        parse_record({"src": ["a\ue000\ue001"], "tgt": ["b"]}, "erniekit", "sft")
    )
    assert "a\ue000\ue001" in tok.decode(s.input_ids.tolist())
