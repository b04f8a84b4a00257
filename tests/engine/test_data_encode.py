"""Encoding round trips: labels cover exactly the answers, label-0 turns, truncation order, DPO, PT, VL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import load_tokenizer
from engine.data import IGNORE_INDEX, SampleEncoder, collate_padded, parse_record, render_record
from engine.models.config import VisionConfig
from engine.models.vision import vision_token_count
from engine.tokenizer import IMAGE_END, IMAGE_PLACEHOLDER, IMAGE_START

DEMO = Path(__file__).resolve().parents[2] / "examples" / "data"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def encode(tok, record, fmt="erniekit", kind="sft", max_seq_len=512, base_dir=None):
    ex = parse_record(record, fmt, kind, base_dir)
    items = SampleEncoder(tok, max_seq_len).encode(ex)
    assert len(items) == 1
    return items[0]


def trained_text(tok, sample) -> str:
    """The tokens that receive loss (label[t] predicts token t+1), decoded with special tokens."""
    targets = [int(x) for x in sample.labels if x != IGNORE_INDEX]
    return tok.decode(targets, skip_special_tokens=False)


def test_labels_cover_exactly_the_assistant_tokens(tok):
    rec = {
        "system": "Be brief.",
        "src": ["What is 2 + 3?", "And 4 + 4?"],
        "tgt": ["2 + 3 = 5.", "4 + 4 = 8."],
    }
    s = encode(tok, rec)
    ids = s.input_ids
    # Aligned labels: every labelled position predicts the next input token.
    pos = np.nonzero(s.labels != IGNORE_INDEX)[0]
    assert (s.labels[pos] == ids[pos + 1]).all()
    assert s.labels[-1] == IGNORE_INDEX
    sep = tok.sep_token
    assert trained_text(tok, s) == f"2 + 3 = 5.{sep}4 + 4 = 8.{sep}"
    # The labelled targets are exactly the answer ids (+ the closing sep of each), in order.
    answers = [*tok.encode("2 + 3 = 5."), tok.sep_token_id, *tok.encode("4 + 4 = 8."), tok.sep_token_id]
    assert [int(x) for x in s.labels[pos]] == answers
    # The prompt of the first turn is exactly what inference feeds the model.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids[: len(prompt)].tolist() == prompt
    assert s.labels[len(prompt) - 1] == tok.encode("2 + 3 = 5.")[0]
    assert (s.labels[: len(prompt) - 1] == IGNORE_INDEX).all()


def test_label_zero_turns_get_no_loss(tok):
    rec = {"src": ["q one", "q two", "q three"], "tgt": ["alpha", "beta", "gamma"], "label": [0, 1, 0]}
    s = encode(tok, rec)
    assert trained_text(tok, s) == f"beta{tok.sep_token}"
    full = tok.decode(s.input_ids.tolist(), skip_special_tokens=False)
    assert "alpha" in full and "gamma" in full  # the untrained turns stay as context


def test_is_system_moves_src0_into_the_system_line(tok):
    s = encode(tok, {"is_system": 1, "src": ["You are terse.", "hi"], "tgt": ["hello"]})
    text = tok.decode(s.input_ids.tolist(), skip_special_tokens=False)
    assert text.startswith(f"{tok.cls_token}You are terse.\nUser: hi\nAssistant:")


def test_truncation_drops_the_oldest_turns_first(tok):
    turns = [f"question number {i}" for i in range(4)]
    answers = [f"answer number {i}" for i in range(4)]
    rec = {"system": "SYS", "src": turns, "tgt": answers}
    whole = encode(tok, rec)
    # Room for the system line and the last two turns only.
    last_two = encode(tok, {"system": "SYS", "src": turns[2:], "tgt": answers[2:]})
    s = encode(tok, rec, max_seq_len=len(last_two) + 3)
    assert len(whole) > len(s) == len(last_two)
    assert s.dropped_turns == 2 and s.num_turns == 2 and not s.truncated
    assert s.input_ids.tolist() == last_two.input_ids.tolist()
    text = tok.decode(s.input_ids.tolist(), skip_special_tokens=False)
    assert "SYS" in text and "number 0" not in text and "number 1" not in text
    # A single turn that still does not fit is cut at the end (keeping its first answer tokens).
    one = encode(
        tok, {"src": ["q"], "tgt": ["a fairly long answer that cannot fit in the window"]}, max_seq_len=14
    )
    assert len(one) == 14 and one.truncated and (one.labels != IGNORE_INDEX).any()


def test_prompt_too_long_for_any_answer_is_skipped(tok):
    ex = parse_record({"src": ["word " * 200], "tgt": ["a"]}, "erniekit", "sft")
    assert SampleEncoder(tok, 32).encode(ex) == []


def test_dpo_pairs_share_the_prompt_and_sort_picks_the_chosen(tok):
    rec = {
        "src": ["hi", "What is 1 + 1?"],
        "tgt": ["hello"],
        "response": [["1 + 1 = 3."], ["1 + 1 = 2."]],
        "sort": [0, 1],
    }
    pair = encode(tok, rec, kind="dpo")
    c, r = pair.chosen, pair.rejected
    n = pair.prompt_length
    assert c.input_ids[:n].tolist() == r.input_ids[:n].tolist()
    assert trained_text(tok, c) == f"1 + 1 = 2.{tok.sep_token}"
    assert trained_text(tok, r) == f"1 + 1 = 3.{tok.sep_token}"
    assert (c.labels[: n - 1] == IGNORE_INDEX).all()
    # alpaca DPO renders the same way
    alp = encode(
        tok, {"question": "What is 1 + 1?", "chosen": "2", "rejected": "3"}, fmt="alpaca", kind="dpo"
    )
    assert trained_text(tok, alp.chosen) == f"2{tok.sep_token}"


def test_dpo_truncation_keeps_the_end_of_the_prompt_and_room_for_answers(tok):
    rec = {"question": "word " * 100 + "Which colour?", "chosen": "Red is the answer.", "rejected": "No."}
    ex = parse_record(rec, "alpaca", "dpo")
    (pair,) = SampleEncoder(tok, 64, max_prompt_len=1024).encode(ex)
    assert len(pair.chosen) <= 64 and pair.chosen.truncated
    assert trained_text(tok, pair.chosen) == f"Red is the answer.{tok.sep_token}"
    prompt = tok.decode(pair.chosen.input_ids[: pair.prompt_length].tolist(), skip_special_tokens=False)
    assert prompt.startswith(tok.cls_token) and prompt.endswith("Which colour?\nAssistant: ")
    (short,) = SampleEncoder(tok, 64, max_prompt_len=20).encode(ex)
    assert short.prompt_length == 20


def test_pretraining_text_trains_every_token_and_splits_long_documents(tok):
    ex = parse_record({"text": "The capital of France is Paris. " * 20}, "text", "pt")
    samples = SampleEncoder(tok, 64).encode(ex)
    assert len(samples) > 1 and all(len(s) <= 64 for s in samples)
    for s in samples:
        assert (s.labels[:-1] == s.input_ids[1:]).all()
    assert samples[0].input_ids[0] == tok.convert_tokens_to_ids(tok.cls_token)
    assert samples[-1].input_ids[-1] == tok.sep_token_id


def test_alpaca_history_and_chatml_tools(tok):
    rec = {
        "instruction": "Add",
        "input": "2 and 2",
        "output": "4",
        "history": [["hi", "hello"]],
        "system": "S",
    }
    s = encode(tok, rec, fmt="alpaca")
    text = tok.decode(s.input_ids.tolist(), skip_special_tokens=False)
    assert text.startswith(f"{tok.cls_token}S\nUser: hi\nAssistant:")
    assert "User: Add\n2 and 2\nAssistant:" in text
    assert trained_text(tok, s) == f"hello{tok.sep_token}4{tok.sep_token}"
    line = (DEMO / "chatml_demo.jsonl").read_text().splitlines()[0]
    chat = json.loads(line)
    spans = render_record(chat, "chatml", "sft", tok)
    assert "<tool_list>\n[" in spans[0]["text"] and '"name": "add"' in spans[0]["text"]
    assert '\n<tool_call>{"name": "add", "arguments": {"a": 89, "b": 42}}\n</tool_call>' in spans[1]["text"]
    assert 'User: <tool_response>\n[{"sum": 131}]\n</tool_response>' in "".join(x["text"] for x in spans)
    assert [x["trained"] for x in spans] == [False, True, False, True]


def test_render_record_matches_the_chat_template(tok):
    rec = {"system": "Be brief.", "src": ["q1", "q2"], "tgt": ["a1", "a2"], "label": [0, 1]}
    spans = render_record(rec, "erniekit", "sft", tok)
    messages = [{"role": "system", "content": "Be brief."}]
    for q, a in zip(rec["src"], rec["tgt"], strict=True):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    assert "".join(s["text"] for s in spans) == tok.apply_chat_template(messages, add_generation_prompt=False)
    assert [s for s in spans if s["trained"]] == [{"text": f"a2{tok.sep_token}", "trained": True}]
    bad = render_record({"src": ["q"], "tgt": [""]}, "erniekit", "sft", tok)
    assert bad == [{"text": "'tgt[0]' is an empty turn", "trained": False, "error": True}]
    dpo = render_record({"question": "q", "chosen": "good", "rejected": "bad"}, "alpaca", "dpo", tok)
    assert [(s.get("label"), s["trained"]) for s in dpo] == [
        (None, False),
        ("chosen", True),
        ("rejected", True),
    ]


def test_vl_prompt_holds_the_image_placeholders(tok):
    from engine.data.vl_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ProcessorSettings

    cfg = VisionConfig(patch_size=14, spatial_merge_size=2)
    rec = json.loads((DEMO / "vl_demo.jsonl").read_text().splitlines()[0])
    ex = parse_record(rec, "erniekit_vl", "sft", DEMO)
    (s,) = SampleEncoder(tok, 512, vision_config=cfg).encode(ex)
    placeholder = tok.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    ids = s.input_ids.tolist()
    n = vision_token_count((1, 8, 8), cfg)  # a 112 x 112 image: 8 x 8 patches, 4 x 4 tokens
    assert n == 16 and ids.count(placeholder) == n
    start = ids.index(tok.convert_tokens_to_ids(IMAGE_START))
    assert tok.decode(ids[start - 8 : start]).endswith("Picture 1:")  # the official template numbers them
    assert ids[start + 1 : start + 1 + n] == [placeholder] * n
    assert ids[start + 1 + n] == tok.convert_tokens_to_ids(IMAGE_END)
    assert (s.labels[[i for i, x in enumerate(ids) if x == placeholder]] == IGNORE_INDEX).all()
    batch = collate_padded([s, s], tok.pad_token_id, ProcessorSettings.from_vision_config(cfg))
    pixels = batch["pixel_values"]
    assert batch["grid_thw"] == [(1, 8, 8), (1, 8, 8)]
    assert pixels.shape == (2 * 64, 3 * 14 * 14) and pixels.dtype == np.float32
    # Red circle: the centre pixel (row 56, column 56) is red, CLIP-normalised. It is the first pixel of the
    # patch at grid (4, 4), which is the first patch of merge window (2, 2): window 2 * 4 + 2 = 10.
    centre = pixels[10 * 4].reshape(3, 14, 14)[:, 0, 0]
    expected = (np.array([220, 40, 40]) / 255 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    np.testing.assert_allclose(centre, expected, atol=1e-5)


TEXT = st.text(alphabet="abcdefgh xyz 0123456789+=?.,你好世界", min_size=1, max_size=20).filter(str.strip)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(TEXT, TEXT, st.booleans()), min_size=1, max_size=4), st.one_of(st.none(), TEXT))
def test_any_conversation_trains_exactly_its_labelled_answers(tok, turns, system):
    if not any(t for _, _, t in turns):
        turns = [*turns[:-1], (turns[-1][0], turns[-1][1], True)]
    rec = {
        "src": [q for q, _, _ in turns],
        "tgt": [a for _, a, _ in turns],
        "label": [int(t) for *_, t in turns],
    }
    if system:
        rec["system"] = system
    s = encode(tok, rec, max_seq_len=4096)
    assert s.full_length == len(s)  # the length before truncation, with nothing truncated (dataset stats)
    expected = [i for _, a, t in turns if t for i in [*tok.encode(a), tok.sep_token_id]]
    assert [int(x) for x in s.labels if x != IGNORE_INDEX] == expected
    pos = np.nonzero(s.labels != IGNORE_INDEX)[0]
    assert (s.labels[pos] == s.input_ids[pos + 1]).all()
    spans = render_record(rec, "erniekit", "sft", tok)
    assert "".join(x["text"] for x in spans if x["trained"]) == "".join(
        a + tok.sep_token for _, a, t in turns if t
    )


def test_vl_thinking_answers_train_as_written(tok):
    """ERNIEKit's VL-Thinking data keeps its reasoning in the no_mask text: it is trained and previewed as it
    is, and records without a think block get none added (our template has no think block)."""
    answer = "<think>\nThe shape has no corners.\n</think>\n\nIt is a circle."
    rec = {
        "image_info": [{"matched_text_index": 0, "image_url": "images/red_circle.png"}],
        "text_info": [{"text": "What shape is it?", "tag": "mask"}, {"text": answer, "tag": "no_mask"}],
    }
    ex = parse_record(rec, "erniekit_vl", "sft", DEMO)
    (s,) = SampleEncoder(tok, 512).encode(ex)
    assert trained_text(tok, s) == answer + tok.sep_token
    spans = render_record(rec, "erniekit_vl", "sft", tok, base_dir=DEMO)
    assert [x for x in spans if x["trained"]] == [{"text": answer + tok.sep_token, "trained": True}]
    plain = json.loads((DEMO / "vl_demo.jsonl").read_text().splitlines()[0])
    (p,) = SampleEncoder(tok, 512).encode(parse_record(plain, "erniekit_vl", "sft", DEMO))
    assert "<think>" not in tok.decode(p.input_ids.tolist(), skip_special_tokens=False)
