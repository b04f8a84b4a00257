"""Every malformed dataset under data_cases/ gets its own located problem (file:line: message)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.data import detect_format, validate_file

CASES = Path(__file__).parent / "data_cases"

# file -> [(line, fragment of the message)]: exactly these lines have problems.
EXPECTED: dict[str, list[tuple[int, str]]] = {
    "bad_json.jsonl": [(2, "invalid JSON: Expecting ',' delimiter")],
    "missing_tgt.jsonl": [(3, "missing field 'tgt'")],
    "missing_src.jsonl": [(2, "missing field 'src': a record with only 'tgt' is ERNIEKit pretraining text")],
    "src_tgt_mismatch.jsonl": [(2, "src has 2 turns but tgt has 1")],
    "empty_turn.jsonl": [(2, "'src[1]' is an empty turn")],
    "wrong_type_src.jsonl": [(1, "'src' must be a list of strings, got a number")],
    "tgt_item_not_string.jsonl": [(2, "'tgt[0]' must be a string, got a number")],
    "label_bad_value.jsonl": [(1, "label values must be 0 or 1: label[0]=2")],
    "label_length.jsonl": [(2, "'label' has 2 values but there are 1 turns")],
    "all_label_zero.jsonl": [(1, "every turn has label 0")],
    "system_not_string.jsonl": [(1, "'system' must be a string, got a list")],
    "is_system_mismatch.jsonl": [(1, "with is_system=1 src[0] is the system prompt")],
    "dpo_equal_sort.jsonl": [(2, "'sort' values are equal (1, 1)")],
    "dpo_three_responses.jsonl": [(1, "exactly two responses [[chosen], [rejected]], got 3")],
    "dpo_src_tgt_len.jsonl": [(2, "DPO needs len(src) == len(tgt) + 1")],
    "dpo_missing_sort.jsonl": [(1, "missing field 'sort'")],
    "dpo_empty_response.jsonl": [(1, "'response[1]' is empty")],
    "alpaca_missing_output.jsonl": [(2, "missing field 'output'")],
    "alpaca_bad_history.jsonl": [(1, "'history[0]' must be a [question, answer] pair")],
    "alpaca_dpo_identical.jsonl": [(1, "'chosen' and 'rejected' are identical")],
    "array_empty_prompt.json": [(3, "'instruction' and 'input' are both empty")],
    "array_bad_element.json": [(4, "invalid JSON: Expecting ',' delimiter")],
    "array_unclosed.json": [(4, "the array is not closed with ']'")],
    "array_non_utf8.json": [(3, "not valid UTF-8")],
    "array_trailing_comma.json": [(4, "a trailing ',' before ']'")],
    "chatml_bad_role.jsonl": [(2, 'messages[1].role is "bot"')],
    "chatml_assistant_first.jsonl": [
        (1, "messages[0] is an assistant message that does not follow a user message")
    ],
    "chatml_ends_with_user.jsonl": [(1, "the last message must be the assistant's")],
    "chatml_second_system.jsonl": [(1, "messages[2] is a system message")],
    "chatml_empty_content.jsonl": [(1, "messages[1] (assistant) has empty content")],
    "chatml_tools_not_list.jsonl": [(1, "'tools' must be a list of tool definitions")],
    "vl_missing_image.jsonl": [(2, "image 'images/nope.png' not found")],
    "vl_escaping_path.jsonl": [(1, "escapes the dataset directory")],
    "vl_remote_image.jsonl": [(1, "image 'https://example.com/cat.png' could not be fetched: ")],
    "vl_corrupt_image.jsonl": [(1, "image 'images/corrupt.png': not an image PIL can read")],
    # checked from the header, before anything is decoded
    "vl_huge_image.jsonl": [(1, "9000x9000 pixels (81,000,000) is more than max_image_pixels=64,000,000")],
    "vl_sliver_image.jsonl": [
        (1, "image 'images/sliver.png': 3000x10 pixels has an aspect ratio of 300.0, over the 200")
    ],
    "vl_bad_tag.jsonl": [(1, 'text_info[1].tag is "answer"')],
    "vl_bad_index.jsonl": [(1, "matched_text_index 5 is not an index into text_info")],
    "vl_answer_first.jsonl": [(1, "text_info[0] must be a prompt"), (1, "the last tag must be 'no_mask'")],
    # videos: a directory of frames or an animated image, checked from the frames' headers
    "vl_video_no_frames.jsonl": [(2, "video_info[0]: video 'videos/empty': has no frames")],
    "vl_video_mixed_sizes.jsonl": [
        (1, "video_info[0]: video 'videos/mixed': frame 002.png is 84x56 pixels but 000.png is 56x56")
    ],
    "vl_video_escaping_path.jsonl": [
        (1, "video_info[0]: video path '../images' escapes the dataset directory")
    ],
    "vl_video_mp4.jsonl": [
        (
            2,
            "video_info[0]: video 'videos/clip.mp4' is a .mp4 file, and this engine decodes no video formats",
        ),
        (2, "`ffmpeg -i videos/clip.mp4 -vf fps=2 videos/clip/%05d.png`"),
    ],
    "vl_video_remote.jsonl": [
        (1, "video 'https://example.com/clip.gif' is remote; training reads local files only")
    ],
    "vl_video_missing_order.jsonl": [
        (2, "missing field 'order': a record with both image_info and video_info needs order")
    ],
    "vl_video_bad_order.jsonl": [
        (1, "order leaves out video_info[0]; it must list every text, image and video once"),
        (2, "'order.type' has 4 entries but 'order.index' has 3"),
        (3, "order.index[2] is 1, not an index into video_info (0..0)"),
        (4, "order lists image_info[0] twice (order positions 0 and 1)"),
        (5, "order.type[1] is \"audio\"; use 'text', 'image' or 'video'"),
        (6, "'order' places the media differently from their matched_text_index"),
    ],
    "non_utf8.jsonl": [(2, "not valid UTF-8: byte 0xe9 at column 14")],
    "empty.jsonl": [(1, "the file is empty")],
    "blank_lines_only.jsonl": [(1, "the file is empty")],
    "unknown_format.jsonl": [(1, "unknown dataset format (line 1: keys ['bar', 'foo'])")],
    "not_an_object.jsonl": [(2, "a record must be a JSON object, got a list")],
    "reserved_token.jsonl": [(1, "tgt[0] contains the reserved token(s) ['<|end_of_sentence|>']")],
    "unknown_field.jsonl": [(1, "unknown field 'lable'; did you mean 'label'?")],
    "text_empty.jsonl": [(2, "'text' is empty")],
}


def test_every_case_file_is_covered():
    files = {p.name for p in CASES.iterdir() if p.is_file()}
    assert files == set(EXPECTED) | {"multi_problem.jsonl"}
    assert len(EXPECTED) >= 30


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_malformed_file_reports_its_located_problem(name: str):
    path = CASES / name
    report = validate_file(path, fetch_urls=True)  # as `ernie-studio data validate` and a run read them
    texts = [str(p) for p in report.problems]
    for line, fragment in EXPECTED[name]:
        hits = [t for t in texts if t.startswith(f"{path}:{line}: ") and fragment in t]
        assert hits, f"expected {path}:{line}: ...{fragment}... in {texts}"
    # No other line is blamed: the valid records around the bad one pass.
    assert {p.line for p in report.problems} == {line for line, _ in EXPECTED[name]}
    assert not report.ok


def test_several_problems_are_all_reported():
    path = CASES / "multi_problem.jsonl"
    report = validate_file(path)
    got = [(p.line, p.message) for p in report.problems]
    expected = [
        (2, "src has 2 turns but tgt has 1"),
        (3, "invalid JSON"),
        (5, "'system' must be a string, got a number"),
        (5, "'tgt[0]' is an empty turn"),
        (5, "label values must be 0 or 1: label[0]=3"),
        (6, "missing field 'tgt'"),
    ]
    assert len(got) == len(expected)
    for (line, msg), (want_line, fragment) in zip(got, expected, strict=True):
        assert line == want_line and fragment in msg
    assert (report.num_records, report.num_valid) == (7, 3)
    assert report.format == "erniekit" and report.kind == "sft"


def test_max_problems_caps_the_list_but_counts_the_rest(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text('{"src": ["q"], "tgt": [""]}\n' * 30)
    report = validate_file(path, max_problems=10)
    assert len(report.problems) == 10 and report.truncated_problems == 20
    assert report.num_records == 30 and report.num_valid == 0
    assert "... and 20 more problems" in report.summary(limit=10)


def test_missing_file_and_wrong_kind_are_reported_not_raised(tmp_path):
    report = validate_file(tmp_path / "nope.jsonl")
    assert str(report.problems[0]) == f"{tmp_path / 'nope.jsonl'}:0: file not found"
    report = validate_file(CASES / "text_empty.jsonl", format="chatml", kind="dpo")
    assert "format 'chatml' holds sft data, not 'dpo'" in report.problems[0].message
    report = validate_file(CASES / "text_empty.jsonl", format="nonsense")
    assert "unknown dataset format 'nonsense'" in report.problems[0].message


def test_metadata_fields_are_allowed(tmp_path):
    path = tmp_path / "meta.jsonl"
    path.write_text('{"src": ["q"], "tgt": ["a"], "category": "math", "difficulty": 2}\n')
    assert validate_file(path).ok


def test_a_record_of_another_format_says_what_it_looks_like(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"src": ["q"], "tgt": ["a"]}\n{"instruction": "Say hi.", "output": "Hi."}\n')
    report = validate_file(path)
    assert {p.line for p in report.problems} == {2}
    assert "looks like alpaca/sft data, but the file is read as erniekit/sft" in report.problems[-1].message


def test_detect_format_of_each_demo_file():
    demo = Path(__file__).resolve().parents[2] / "examples" / "data"
    assert detect_format(demo / "sft_demo.jsonl") == ("erniekit", "sft")
    assert detect_format(demo / "sft_demo_alpaca.json") == ("alpaca", "sft")
    assert detect_format(demo / "dpo_demo.jsonl") == ("erniekit", "dpo")
    assert detect_format(demo / "pt_demo.jsonl") == ("text", "pt")
    assert detect_format(demo / "chatml_demo.jsonl") == ("chatml", "sft")
    assert detect_format(demo / "vl_demo.jsonl") == ("erniekit_vl", "sft")
    assert detect_format(demo / "vl_video_demo.jsonl") == ("erniekit_vl", "sft")
    for f in demo.glob("*.json*"):
        report = validate_file(f)
        assert report.ok, report.summary()
        assert report.num_valid == report.num_records > 0
    with pytest.raises(ValueError, match="unknown dataset format"):
        detect_format(CASES / "unknown_format.jsonl")


def test_data_cli_validates_and_previews(capsys, tiny_model_dir):
    from engine.cli import main

    assert main(["data", "validate", str(CASES / "multi_problem.jsonl")]) == 1
    out = capsys.readouterr().out
    assert f"{CASES / 'multi_problem.jsonl'}:5: label values must be 0 or 1: label[0]=3" in out
    demo = Path(__file__).resolve().parents[2] / "examples" / "data"
    assert main(["data", "validate", str(demo / "dpo_demo.jsonl")]) == 0
    assert main(["data", "preview", str(demo / "sft_demo.jsonl"), "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- line 1" in out and "[loss] '13 - 1 = 12.<|end_of_sentence|>'" not in out
    assert "[loss] '1, 2, 3, 4, 5, 6.<|end_of_sentence|>'" in out  # the label-0 first turn has no loss
    assert main(["data", "stats", str(demo / "pt_demo.jsonl"), "--model", str(tiny_model_dir)]) == 0
    assert '"num_records": 120' in capsys.readouterr().out


def test_think_blocks_in_vl_answers_are_not_reserved_tokens(tmp_path, tiny_model_dir):
    """VL-Thinking records put <think>...</think> into their answers; a thinking model's tokenizer holds
    the tags as added tokens, and they still are answer text, while template tokens stay refused."""
    import shutil

    from engine import load_tokenizer
    from engine.tokenizer import ErnieTokenizer

    base = load_tokenizer(str(tiny_model_dir))
    n = base.vocab_size
    thinking = ErnieTokenizer(
        base.model_file, base.config, {**base.added_tokens, "<think>": n, "</think>": n + 1}
    )
    shutil.copytree(CASES / "images", tmp_path / "images")
    answer = "<think>\nThe square is red.\n</think>\n\nIt is red."
    rec = {
        "image_info": [{"matched_text_index": 0, "image_url": "images/ok.png"}],
        "text_info": [{"text": "Colour?", "tag": "mask"}, {"text": answer, "tag": "no_mask"}],
    }
    bad = json.loads(json.dumps(rec))
    bad["text_info"][1]["text"] = "<|IMAGE_START|>" + answer
    path = tmp_path / "thinking.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps(bad) + "\n")
    for tok in (None, base, thinking):
        report = validate_file(path, tokenizer=tok)
        assert [(p.line, p.message) for p in report.problems] == [
            (
                2,
                "text_info[1].text contains the reserved token(s) ['<|IMAGE_START|>']; the chat template adds them",
            )
        ]
