"""ERNIE 4.5's documented tokenizer facts (shared/REFERENCE.md, "Tokenizer and chat template" and the config
keys) pinned against the tokenizer `ernie-studio init-model` writes and what engine/tokenizer.py does with it.

The official ``tokenizer.model`` is not in the repository: it could not be had here. It ships with the
checkpoints on the model hubs (not reachable from this machine, and tests run without network), and the one
public repository that carries it, PaddlePaddle/ERNIE (examples/pre-training/ernie/src/tokenizers/), could
be read only as text: the binary SentencePiece model was not retrievable and the snapshot that could be
cloned predates ERNIE 4.5. So the facts below are written out from REFERENCE.md, as literals (not the
engine's constants, so a renamed token fails here), and checked on the tiny tokenizer, which init-model
trains with the same special tokens.
"""

from __future__ import annotations

import json

import pytest
from sentencepiece import sentencepiece_model_pb2

import engine

# REFERENCE: `<unk>` (0, also pad in some configs), `<s>` (bos, 1), `</s>` (eos, 2); config.json's
# bos_token_id 1, eos_token_id 2, pad_token_id 0.
UNK, BOS, EOS = ("<unk>", 0), ("<s>", 1), ("</s>", 2)
CLS = "<|begin_of_sentence|>"
SEP = "<|end_of_sentence|>"
MASKS = [f"<mask:{i}>" for i in range(8)]
IMAGE_MARKERS = ["<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>"]
DOCUMENTED = [CLS, SEP, *MASKS, *IMAGE_MARKERS]
# REFERENCE (PaddleOCR-VL, transformers' defaults): ids of an official vocabulary of 103,424 whose added
# tokens lie past the SentencePiece pieces.
OFFICIAL_VOCAB = 103424
OFFICIAL_ADDED = {"<|IMAGE_PLACEHOLDER|>": 100295, "<|IMAGE_START|>": 101305, "<|IMAGE_END|>": 101306}

# SentencePiece's ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return engine.load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def proto(tiny_model_dir):
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString((tiny_model_dir / "tokenizer.model").read_bytes())
    return model


def test_unk_bos_eos_and_pad_ids_in_the_model_the_config_and_the_tokenizer(tok, proto, tiny_model_dir):
    pieces = [(p.piece, p.type) for p in proto.pieces[:3]]
    assert pieces == [(UNK[0], UNKNOWN), (BOS[0], CONTROL), (EOS[0], CONTROL)]
    spec = proto.trainer_spec
    assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (UNK[1], BOS[1], EOS[1], -1)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (UNK[1], BOS[1], EOS[1])
    assert tok.pad_token_id == UNK[1]  # no pad piece: pad is <unk>, as in the official configs
    assert tok.convert_ids_to_tokens([0, 1, 2]) == [UNK[0], BOS[0], EOS[0]]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    names = {"bos_token": BOS[0], "eos_token": EOS[0], "unk_token": UNK[0], "pad_token": UNK[0]}
    names |= {"cls_token": CLS, "sep_token": SEP}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        written = json.loads((tiny_model_dir / name).read_text())
        assert {k: written[k] for k in names} == names, name


def test_documented_special_tokens_are_single_unsplittable_special_ids(tok, proto):
    types = {p.piece: p.type for p in proto.pieces}
    ids = {t: tok.convert_tokens_to_ids(t) for t in DOCUMENTED}
    assert len(set(ids.values())) == len(DOCUMENTED) and UNK[1] not in ids.values()
    for t, i in ids.items():
        assert types.get(t) == USER_DEFINED, f"{t}: SentencePiece would split it (type {types.get(t)})"
        assert tok.encode(t) == [i] and tok.is_special(i), t
        assert tok.decode([i]) == "" and tok.decode([i], skip_special_tokens=False) == t
    plain = tok.encode("ab")
    for t in DOCUMENTED:  # inside text too, with the text around it tokenized as on its own
        assert tok.encode(f"ab{t}ab") == [*plain, ids[t], *plain], t
    assert (tok.cls_token, tok.sep_token) == (CLS, SEP)


def test_chat_template_renders_as_documented(tok):
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert (
        tok.apply_chat_template(convo) == f"{CLS}Be brief.\nUser: q1\nAssistant: a1{SEP}User: q2\nAssistant: "
    )
    # the system line only when present; the generation prompt is "Assistant: "
    assert tok.apply_chat_template(convo[1:]) == f"{CLS}User: q1\nAssistant: a1{SEP}User: q2\nAssistant: "
    # every assistant turn ends with <|end_of_sentence|>, a stop token of generation
    assert (
        tok.apply_chat_template(convo[1:3], add_generation_prompt=False)
        == f"{CLS}User: q1\nAssistant: a1{SEP}"
    )
    ids = tok.apply_chat_template(convo, tokenize=True)
    sep = tok.convert_tokens_to_ids(SEP)
    assert ids[0] == tok.convert_tokens_to_ids(CLS) and ids.count(sep) == 1
    assert ids[ids.index(sep) + 1 :] == tok.encode("User: q2\nAssistant: ")
    assert tok.stop_token_ids == [EOS[1], sep]


def test_official_layout_added_tokens_past_the_pieces_keep_their_ids(tiny_model_dir, tmp_path):
    """An official tokenizer directory names its added tokens in added_tokens.json at ids past the
    SentencePiece pieces (the VL markers at 100295, 101305, 101306 of 103,424): the checkpoint's ids win over
    the pieces the tiny model holds for the same tokens, in both directions."""
    from engine.tokenizer import copy_tokenizer_files

    d = tmp_path / "official-layout"
    copy_tokenizer_files(tiny_model_dir, d)
    (d / "added_tokens.json").write_text(json.dumps(OFFICIAL_ADDED))
    tok = engine.load_tokenizer(str(d))
    assert tok.sp.get_piece_size() < min(OFFICIAL_ADDED.values())
    text = "".join(f"x{t}" for t in OFFICIAL_ADDED)
    ids = tok.encode(text)
    assert [i for i in ids if i in OFFICIAL_ADDED.values()] == list(OFFICIAL_ADDED.values())
    assert tok.decode(ids, skip_special_tokens=False) == text and tok.decode(ids) == "xxx"
    assert tok.convert_ids_to_tokens(list(OFFICIAL_ADDED.values())) == list(OFFICIAL_ADDED)
    assert all(tok.holds(i) and tok.is_special(i) for i in OFFICIAL_ADDED.values())
    assert max(OFFICIAL_ADDED.values()) < tok.vocab_size <= OFFICIAL_VOCAB
