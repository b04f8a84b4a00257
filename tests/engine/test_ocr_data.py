"""PaddleOCR-VL training data: OCR pairs, ERNIEKit's VL records (its docs/paddleocr_vl_sft.md), PaddleOCR label
files and zips of images with a labels file; the chat template's prompt form; and every bad record a clear
error naming its line and field, before any step runs."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import engine
from engine.data import DatasetError, build_train_data, detect_format, validate_file
from engine.data import archive as archive_mod
from engine.data.archive import ArchiveError, dataset_file
from engine.data.formats import parse_record
from engine.data.loader import check_ocr_file
from engine.data.ocr import OCRSampleEncoder
from engine.data.paddleocr_vl_processor import (
    CHAT_TEMPLATE,
    OCRProcessorSettings,
    expand_image_placeholders,
    preprocess_image,
    task_messages,
)
from engine.data.record_types import RecordError
from engine.tokenizer import compile_chat_template

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "data" / "ocr_demo"
CASES = Path(__file__).parent / "data_cases"


@pytest.fixture(scope="module")
def tok(tiny_ocr_model_dir):
    return engine.load_tokenizer(str(tiny_ocr_model_dir))


@pytest.fixture(scope="module")
def settings(tiny_ocr_model_dir):
    return OCRProcessorSettings.from_model_dir(tiny_ocr_model_dir)


def _image(path: Path, size=(120, 32), shade: int = 230) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (shade, shade, shade)).save(path)
    return path


def _jsonl(path: Path, records: list) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records)
    )
    return path


# ---- formats -------------------------------------------------------------------------------------------


def test_the_demo_set_reads_as_ocr_pairs(tok, settings):
    for name in ("lines_train", "lines_eval", "receipts_train", "receipts_eval"):
        path = DEMO / f"{name}.jsonl"
        assert detect_format(path) == ("ocr", "sft")
        assert validate_file(path).ok
        report = check_ocr_file(path, tok, 512, settings)
        assert report.ok and report.num_valid == report.num_records > 0, report.summary()


def test_ocr_pairs_choose_their_task_prompt(tmp_path):
    _image(tmp_path / "a.png")
    convs = [
        parse_record(r, "ocr", "sft", tmp_path)
        for r in (
            {"image": "a.png", "text": "x"},
            {"image": "a.png", "text": "x", "task": "table"},
            {"image": "a.png", "text": "x", "prompt": "Read the stamp:"},
        )
    ]
    assert [c.turns[0].user[1:] for c in convs] == ["OCR:", "Table Recognition:", "Read the stamp:"]
    with pytest.raises(RecordError, match=r"'task' is \"latex\"; choose one of ocr, table, formula, chart"):
        parse_record({"image": "a.png", "text": "x", "task": "latex"}, "ocr", "sft", tmp_path)
    with pytest.raises(RecordError, match="give 'task' or 'prompt', not both"):
        parse_record({"image": "a.png", "text": "x", "task": "ocr", "prompt": "p"}, "ocr", "sft", tmp_path)


def test_erniekit_configs_dataset_type_reads_ocr_pairs_too(tok, settings):
    """ERNIEKit's OCR configs say train_dataset_type: erniekit; image records decide their format."""
    spec = {"train_dataset_path": str(DEMO / "lines_eval.jsonl"), "train_dataset_type": "erniekit"}
    data = build_train_data(spec, tok, stage="OCR-VL-SFT", max_seq_len=96, vision=settings)
    assert data.num_items == 12


def test_paddleocr_label_files_are_read_as_pairs(tmp_path):
    _image(tmp_path / "imgs" / "a.png")
    labels = tmp_path / "labels.txt"
    labels.write_text("imgs/a.png\tTOTAL 12.50\n\nno tab on this line\nimgs/a.png\ttabs\tinside\n")
    assert detect_format(labels) == ("ocr", "sft")
    report = validate_file(labels)
    assert [(p.line, p.message) for p in report.problems] == [
        (3, "expected '<image path><TAB><text>' (PaddleOCR's label format); this line has no tab")
    ]
    assert report.num_valid == 2
    ex = parse_record({"image": "imgs/a.png", "text": "tabs\tinside"}, "ocr", "sft", tmp_path)
    assert ex.turns[0].assistant == "tabs\tinside"


# ---- the prompt form -----------------------------------------------------------------------------------


def test_samples_are_the_published_chat_template_with_the_answer_trained(tok, settings):
    """ids = the rendered template's prompt (placeholders expanded as transformers' processor does) + the
    answer + eos; the loss covers the answer and eos only."""
    image = DEMO / "images" / "line_000.png"
    encoder = OCRSampleEncoder(tok, 256, settings)
    ex = parse_record({"image": str(image.name), "text": "TOTAL 12.50"}, "ocr", "sft", image.parent)
    (sample,) = encoder.encode(ex)
    template = compile_chat_template(CHAT_TEMPLATE, "PaddleOCR-VL")
    prompt = template.render(messages=task_messages("ocr"), add_generation_prompt=True)
    grid = [preprocess_image(image, settings).grid_thw]
    want_prompt = tok.encode(expand_image_placeholders(prompt, grid, settings.merge_size))
    want = [*want_prompt, *tok.encode("TOTAL 12.50"), tok.eos_token_id]
    assert sample.input_ids.tolist() == want
    trained = [int(x) for x in sample.labels if x != -100]
    assert trained == want[len(want_prompt) :]  # label[t] is token t+1: the answer and its eos
    assert sample.labels[len(want_prompt) - 2] == -100 and sample.labels[-1] == -100


def test_a_batch_holds_the_official_pixels_and_the_model_trains_on_it(tok, settings, tiny_ocr_model_dir):
    from engine.train.sft import to_tensor_batch

    def batch(**kw):
        spec = {"train_dataset_path": str(DEMO / "lines_train.jsonl")}
        data = build_train_data(
            spec, tok, stage="OCR-VL-SFT", max_seq_len=128, batch_size=2, vision=settings, shuffle=False, **kw
        )
        return next(iter(data))

    padded = batch(packing=False)
    records = [json.loads(line) for line in (DEMO / "lines_train.jsonl").read_text().splitlines()]
    images = [preprocess_image(DEMO / r["image"], settings) for r in records[:2]]
    assert padded["grid_thw"] == [i.grid_thw for i in images]
    np.testing.assert_array_equal(padded["pixel_values"], np.concatenate([i.pixel_values for i in images]))
    model = engine.load_model(str(tiny_ocr_model_dir))
    t = to_tensor_batch(padded)
    loss = model(**t["inputs"], labels=t["labels"]).loss
    assert np.isfinite(float(loss)) and float(loss) > 1.0
    # packed rows hold as many samples as fit, or at most packing_size (ERNIEKit's OCR configs)
    assert int(np.asarray(batch(packing=True)["segment_ids"]).max()) > 1
    assert int(np.asarray(batch(packing=True, packing_size=2)["segment_ids"]).max()) == 1


# ---- bad input: each a clear error naming the record (line) and the field -------------------------------


@pytest.fixture()
def bad_set(tmp_path):
    """A dataset directory, a secret file beside it, and one good image."""
    root = tmp_path / "data"
    _image(root / "good.png")
    _image(tmp_path / "secret.png")
    noise = np.random.default_rng(0).integers(0, 255, (32, 120, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "whole.jpg")
    data = (root / "whole.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(data[: len(data) // 2])  # its header reads, its pixels do not
    shutil.copy(CASES / "images" / "huge.png", root / "huge.png")  # a 9000 x 9000 header, 45 bytes
    os.symlink(tmp_path / "secret.png", root / "link.png")
    return root


BAD_PAIRS = [
    ({"image": "truncated.jpg", "text": "x"}, "field 'image': image 'truncated.jpg': truncated or corrupt"),
    (
        {"image": "../secret.png", "text": "x"},
        "field 'image': image path '../secret.png' escapes the dataset",
    ),
    (
        {"image": "link.png", "text": "x"},
        "field 'image': image path 'link.png' escapes the dataset directory",
    ),
    ({"text": "no picture"}, "missing field 'image': an OCR record pairs one image with the text it shows"),
    (
        {"image": "good.png", "text": "word " * 200},
        "field 'text': text longer than max_seq_len after the image",
    ),
    (
        {"image": "huge.png", "text": "x"},
        "field 'image': image 'huge.png': 9000x9000 pixels (81,000,000) is more",
    ),
]


def test_every_bad_ocr_pair_is_a_located_error(bad_set, tok, settings):
    records = [{"image": "good.png", "text": "fine"}]
    for record, _ in BAD_PAIRS:
        records += [record, {"image": "good.png", "text": "fine"}]
    records.append({"image": str(bad_set.parent / "secret.png"), "text": "absolute"})
    path = _jsonl(bad_set / "train.jsonl", records)
    report = check_ocr_file(path, tok, 96, settings)
    got: dict[int, str] = {}
    for p in report.problems:
        got[p.line] = got.get(p.line, "") + p.message + " | "
    want = {2 * k + 2: fragment for k, (_, fragment) in enumerate(BAD_PAIRS)}
    want[len(records)] = "escapes the dataset directory"
    assert sorted(got) == sorted(want), report.summary()
    for line, fragment in want.items():
        assert fragment in got[line], (line, got[line])
    # a run reads the file the same way and stops before any step, listing them all
    with pytest.raises(DatasetError) as e:
        build_train_data(
            {"train_dataset_path": str(path)}, tok, stage="OCR-VL-SFT", max_seq_len=96, vision=settings
        )
    assert e.value.report.problems == report.problems
    assert f"{path}:4: field 'image': image path '../secret.png' escapes the dataset directory" in str(
        e.value
    )


def test_data_validate_with_a_paddleocr_vl_model_runs_its_checks(bad_set, tiny_ocr_model_dir, capsys):
    from engine.cli import main

    path = _jsonl(bad_set / "cli.jsonl", [{"image": "good.png", "text": "fine"}, *[r for r, _ in BAD_PAIRS]])
    assert main(["data", "validate", str(path)]) == 1  # the format's checks alone (no max_seq_len)
    plain = capsys.readouterr().out
    assert (
        main(["data", "validate", str(path), "--model", str(tiny_ocr_model_dir), "--max-seq-len", "96"]) == 1
    )
    ocr = capsys.readouterr().out
    for line, (_, fragment) in enumerate(BAD_PAIRS, start=2):
        assert f"{path}:{line}: {fragment}" in ocr, ocr
    assert "truncated.jpg" in plain and "text longer than max_seq_len" not in plain


def test_erniekit_vl_records_are_checked_by_field_for_paddleocr_vl(bad_set, tok, settings):
    """ERNIEKit's format (text_info / image_info): the same checks name its fields."""

    def rec(image: str | None, answer: str = "x") -> dict:
        r = {"text_info": [{"text": "OCR:", "tag": "mask"}, {"text": answer, "tag": "no_mask"}]}
        if image is not None:
            r["image_info"] = [{"matched_text_index": 0, "image_url": image}]
        return r

    path = _jsonl(
        bad_set / "vl.jsonl",
        [
            rec("good.png"),
            rec("truncated.jpg"),
            rec(None),
            rec("good.png", "word " * 200),
            rec("../secret.png"),
        ],
    )
    assert detect_format(path) == ("erniekit_vl", "sft")
    report = check_ocr_file(path, tok, 96, settings)
    got = [(p.line, p.message) for p in report.problems]
    assert [line for line, _ in got] == [2, 3, 4, 5]
    assert got[0][1].startswith("image_info[0]: image 'truncated.jpg': truncated or corrupt")
    assert got[1][1].startswith("the record has no image")
    assert got[2][1].startswith(
        "field 'text_info[1].text': text longer than max_seq_len after the image tokens"
    )
    assert "the sample takes" in got[2][1] and "of them the image's" in got[2][1]
    assert got[3][1].startswith("image_info[0]: image path '../secret.png' escapes the dataset directory")
    # the format's own checks (ERNIE 4.5 VL's stage) read headers only, and records without images are
    # text turns there: only the escaping path is refused
    assert validate_file(path).num_valid == 4


# ---- zips of images with a labels file -----------------------------------------------------------------


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_a_zip_of_images_and_a_labels_file_trains(tmp_path, tok, settings):
    png = (DEMO / "images" / "line_000.png").read_bytes()
    archive = _zip(
        tmp_path / "scans.zip",
        {
            "scans/a.png": png,
            "scans/b.png": png,
            "labels.txt": b"scans/a.png\tTOTAL 12.50\nscans/b.png\tThank you!\n",
        },
    )
    data = build_train_data(
        {"train_dataset_path": str(archive)}, tok, stage="OCR-VL-SFT", max_seq_len=128, vision=settings
    )
    assert data.num_items == 2 and next(iter(data))["grid_thw"]
    read, label = dataset_file(archive)
    assert label == f"{archive}/labels.txt" and read.parent == archive.parent / ".scans.zip.unpacked"
    # a labels line naming a file outside the unpacked folder, and one missing, by line of the labels file
    bad = _zip(
        tmp_path / "bad.zip", {"a.png": png, "labels.txt": b"a.png\tok\n../scans.zip\tx\nnope.png\ty\n"}
    )
    report = check_ocr_file(bad, tok, 128, settings)
    assert [(p.path, p.line) for p in report.problems] == [(f"{bad}/labels.txt", 2), (f"{bad}/labels.txt", 3)]
    assert "image path '../scans.zip' escapes the dataset directory" in report.problems[0].message
    assert "image 'nope.png' not found" in report.problems[1].message


@pytest.mark.parametrize(
    ("member", "why"),
    [
        ("../evil.png", "its path contains '..' and would land outside the dataset folder"),
        ("/etc/evil.png", "it has an absolute path"),
        ("a/../../evil.png", "its path contains '..'"),
    ],
)
def test_a_zip_member_that_would_leave_its_folder_is_refused(tmp_path, member, why):
    archive = _zip(tmp_path / "attack.zip", {member: b"x", "labels.txt": b"a.png\tx\n"})
    with pytest.raises(ArchiveError, match=f"member '{member}' refused: {why}"):
        dataset_file(archive)
    assert not (tmp_path / "evil.png").exists() and not any(tmp_path.glob(".attack.zip.unpacked"))


def test_a_zip_symlink_member_is_refused(tmp_path):
    archive = tmp_path / "links.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        info = zipfile.ZipInfo("a.png")
        info.external_attr = 0o120777 << 16  # a symbolic link to ...
        zf.writestr(info, "/etc/passwd")
        zf.writestr("labels.txt", "a.png\tx\n")
    with pytest.raises(ArchiveError, match=r"'a\.png' refused: it is a symbolic link"):
        dataset_file(archive)
    report = validate_file(archive)
    assert not report.ok and "symbolic link" in report.problems[0].message


def test_a_zip_member_twice_or_a_bomb_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The checks the studio's upload makes (one copy, engine.data.archive): a path that comes twice (the
    second copy would replace what the first one's check passed), and a directory whose declared sizes are
    over the limit, refused before a byte is written."""
    twice = tmp_path / "twice.zip"
    with zipfile.ZipFile(twice, "w") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr("a.png", b"x")
        zf.writestr("a.png", b"y")
        zf.writestr("labels.txt", "a.png\tx\n")
    with pytest.raises(ArchiveError, match=r"member 'a\.png' appears twice"):
        dataset_file(twice)
    monkeypatch.setattr(archive_mod, "MAX_UNPACKED_BYTES", 1000)
    big = _zip(tmp_path / "big.zip", {"a.png": b"\0" * 2000, "labels.txt": b"a.png\tx\n"})
    with pytest.raises(ArchiveError, match=r"big\.zip unpacks to 0\.0 MB, over the limit of") as e:
        dataset_file(big)
    assert e.value.too_large and not any(tmp_path.glob(".big.zip*"))
