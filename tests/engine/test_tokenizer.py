"""ERNIE tokenizer: SentencePiece + special tokens + chat template (file, config or ERNIE default)."""

from __future__ import annotations

import json
import shutil

import pytest

import engine
from engine.tokenizer import CLS_TOKEN, IMAGE_PLACEHOLDER, SEP_TOKEN, SPECIAL_TOKENS, copy_tokenizer_files

MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture
def tok(tiny_model_dir):
    return engine.load_tokenizer(str(tiny_model_dir))


def test_special_tokens_are_single_ids_inside_text(tok) -> None:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    text = f"{CLS_TOKEN}a{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}b{SEP_TOKEN}"
    got = tok.encode(text)
    assert got[0] == ids[CLS_TOKEN] and got[-1] == ids[SEP_TOKEN]
    assert got.count(ids[IMAGE_PLACEHOLDER]) == 2
    assert tok.decode(got, skip_special_tokens=False) == text
    assert tok.decode(got) == "ab"


def test_plain_text_round_trips_including_unseen_characters(tok) -> None:
    for text in ["The quick brown fox, 12345.", "  two  spaces\nnew line", "文心一言 ERNIE 4.5 ✓"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id == 1
    assert tok.encode("hi")[0] != 1


def test_default_chat_template_is_ernies(tok) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == (
        "<|begin_of_sentence|>You are helpful.\nUser: Hi\nAssistant: Hello!<|end_of_sentence|>User: 2+2?\nAssistant: "
    )
    no_prompt = tok.apply_chat_template(MESSAGES[1:3], add_generation_prompt=False)
    assert no_prompt == "<|begin_of_sentence|>User: Hi\nAssistant: Hello!<|end_of_sentence|>"
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    assert ids[0] == tok.convert_tokens_to_ids(CLS_TOKEN)
    assert tok.convert_tokens_to_ids(SEP_TOKEN) in ids


def test_stop_tokens_and_named_tokens(tok, tiny_model_dir) -> None:
    assert tok.stop_token_ids == [tok.eos_token_id, tok.convert_tokens_to_ids(SEP_TOKEN)]
    assert (tok.cls_token, tok.sep_token) == (CLS_TOKEN, SEP_TOKEN)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert tok.vocab_size <= vocab < tok.vocab_size + 64  # the model's vocab is the tokenizer's, rounded up


def test_chat_template_from_jinja_file_then_tokenizer_config(tiny_model_dir, tmp_path) -> None:
    d = tmp_path / "tok"
    copy_tokenizer_files(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert engine.load_tokenizer(str(d)).apply_chat_template(MESSAGES[1:2]) == "[user]Hi"
    (d / "chat_template.jinja").write_text("{{ cls_token }}{{ messages[-1]['content'] }}|")
    assert engine.load_tokenizer(str(d)).apply_chat_template(MESSAGES) == f"{CLS_TOKEN}2+2?|"


def test_bad_messages_are_named(tok) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\] must be an object with 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])


def test_save_and_copy_keep_the_same_ids(tok, tiny_model_dir, tmp_path) -> None:
    tok.save_pretrained(tmp_path / "saved")
    again = engine.load_tokenizer(str(tmp_path / "saved"))
    text = f"{CLS_TOKEN}Hello world{SEP_TOKEN}"
    assert again.encode(text) == tok.encode(text)
    copied = copy_tokenizer_files(tiny_model_dir, tmp_path / "copied")
    assert "tokenizer.model" in copied and "tokenizer_config.json" in copied
    assert (tmp_path / "copied" / "tokenizer.model").read_bytes() == (
        tiny_model_dir / "tokenizer.model"
    ).read_bytes()


def test_missing_or_broken_files_are_explained(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.model"):
        engine.load_tokenizer(str(tmp_path))
    d = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, d)
    (d / "tokenizer_config.json").write_text('{"chat_template": "x",\n}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json:2: invalid JSON"):
        engine.load_tokenizer(str(d))


def test_hf_style_token_objects_in_tokenizer_config(tiny_model_dir, tmp_path) -> None:
    d = tmp_path / "tok"
    copy_tokenizer_files(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["sep_token"] = {"content": SEP_TOKEN, "lstrip": False, "normalized": False, "special": True}
    cfg["cls_token"] = {"content": CLS_TOKEN, "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = engine.load_tokenizer(str(d))
    assert (tok.cls_token, tok.sep_token) == (CLS_TOKEN, SEP_TOKEN)
    assert tok.apply_chat_template(MESSAGES[1:3], add_generation_prompt=False).endswith("Hello!" + SEP_TOKEN)


def test_ids_past_the_tokenizer_decode_as_nothing_with_one_warning(tok, caplog) -> None:
    """Padded official vocabularies are larger than their tokenizer: a model may emit such ids."""
    ids = tok.encode("hello world")
    past = tok.sp.get_piece_size()
    with caplog.at_level("WARNING", logger="engine.tokenizer"):
        assert tok.decode([*ids[:1], past, *ids[1:], past + 7, 10**6]) == tok.decode(ids) == "hello world"
        assert tok.decode([past], skip_special_tokens=False) == ""
        assert tok.convert_ids_to_tokens(past) == tok.convert_ids_to_tokens(tok.unk_token_id)
    assert sum("past this tokenizer" in r.message for r in caplog.records) == 1
    assert not tok.is_special(past)


def test_convert_ids_to_tokens_takes_an_int_or_a_list(tok) -> None:
    ids = tok.encode("hello")
    pieces = tok.convert_ids_to_tokens(ids)
    assert isinstance(pieces, list) and len(pieces) == len(ids)
    assert tok.convert_ids_to_tokens(ids[0]) == pieces[0] and isinstance(pieces[0], str)
    sep = tok.convert_tokens_to_ids(SEP_TOKEN)
    assert tok.convert_ids_to_tokens(sep) == SEP_TOKEN


def test_id_helpers_take_one_or_many_as_python_numpy_or_paddle_values(tok) -> None:
    import numpy as np
    import paddle

    ids = tok.encode("hello world")
    pieces = tok.convert_ids_to_tokens(ids)
    as_array = np.array(ids, dtype="int64")
    assert tok.convert_ids_to_tokens(as_array) == pieces
    assert tok.convert_ids_to_tokens(as_array[1]) == pieces[1]  # a NumPy int64, as argmax gives
    assert tok.convert_ids_to_tokens(paddle.to_tensor(ids)) == pieces
    assert tok.convert_ids_to_tokens(paddle.to_tensor(ids[1])) == pieces[1]
    assert tok.convert_tokens_to_ids(pieces) == ids and tok.convert_tokens_to_ids(pieces[0]) == ids[0]
    assert tok.decode(ids[0]) == tok.decode([ids[0]]) and tok.decode(as_array[0]) == tok.decode([ids[0]])
    assert tok.decode(as_array) == tok.decode(ids) == "hello world"


def test_streaming_detokenizer_skips_ids_past_the_tokenizer(tok) -> None:
    from engine.serve.sampling import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("hello world")
    text = "".join(detok.add(i) for i in [ids[0], tok.sp.get_piece_size() + 3, *ids[1:]]) + detok.flush()
    assert text == "hello world"
