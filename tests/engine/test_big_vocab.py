"""A 100,000-piece SentencePiece tokenizer (the size of ERNIE 4.5's, whose vocabulary is 103,424) through the
whole pipeline a user takes: dataset statistics, the chat template, training, the OpenAI-compatible server,
and GGUF export read by llama.cpp.

The tokenizer is trained in the test, by the route `ernie-studio init-model` uses (engine.tokenizer's
train_tokenizer: BPE with ERNIE's special tokens at REFERENCE's places), on a synthetic corpus of 60,000
made-up words that takes it to exactly 100,000 pieces in about two seconds. The dataset is written in words
the tokenizer holds as single pieces with ids past 65,535, so a stage that squeezes ids through 16 bits, cuts
the vocabulary to the 1,024 pieces of the tiny tokenizer, or sizes a table by the wrong count gets them wrong.
One module fixture trains the model once; the tokenizer is trained once per session.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import engine
from tests.engine.serve_support import needs_llamacpp, running_server, start_llama

PIECES = 100_000
CORPUS_WORDS = 60_000
HIGH_ID = 65_536  # ids at or past it do not fit 16 bits
# Steps (of 2 samples) after which the model answers every prompt with the records' one answer: from each of six
# inits tried (3 seeds, 2 vocabulary sizes); 16 steps of 4 at twice the learning rate missed one.
TRAIN_STEPS = 24


def synthetic_corpus(path: Path, n_words: int, seed: int = 0) -> list[str]:
    """``n_words`` distinct made-up lowercase words, each twice, twelve to a line in random order."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < n_words:
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9))))
    ordered = sorted(words)
    tokens = ordered * 2
    rng.shuffle(tokens)
    path.write_text("".join(" ".join(tokens[i : i + 12]) + "\n" for i in range(0, len(tokens), 12)))
    return ordered


@pytest.fixture(scope="session")
def big_tokenizer(tmp_path_factory):
    """(tokenizer directory, words of the corpus that are one piece with an id >= HIGH_ID); trained once."""
    from engine.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("big-vocab")
    words = synthetic_corpus(d / "corpus.txt", CORPUS_WORDS)
    tok = train_tokenizer(d / "corpus.txt", d / "tokenizer", vocab_size=PIECES)
    high = []
    for w in words:
        ids = tok.encode(w)
        if len(ids) == 1 and ids[0] >= HIGH_ID:
            high.append(w)
    return d / "tokenizer", high


def records(words: list[str], n: int, seed: int) -> list[dict]:
    """``n`` erniekit SFT records in the corpus's words: "say <w1> <w2>", every one answered with the same
    three words (a reply a few training steps teach), every other one with a system line."""
    rng = random.Random(seed)
    motto = " ".join(words[:3])
    rows = []
    for i in range(n):
        a, b = rng.sample(words[3:], 2)
        row = {"src": [f"say {a} {b}"], "tgt": [motto]}
        if i % 2:
            row["system"] = f"{rng.choice(words[3:])} mode"
        rows.append(row)
    return rows


def messages(row: dict, with_answer: bool = True) -> list[dict]:
    out = [{"role": "system", "content": row["system"]}] if "system" in row else []
    out.append({"role": "user", "content": row["src"][0]})
    if with_answer:
        out.append({"role": "assistant", "content": row["tgt"][0]})
    return out


@dataclass
class Pipeline:
    base: Path  # the untrained model directory
    data: Path  # its SFT records, one JSON object a line
    rows: list[dict]
    run: Path  # the run directory: the trained model and its tokenizer
    status: str
    losses: list[float]


@pytest.fixture(scope="module")
def big(big_tokenizer, tmp_path_factory) -> Pipeline:
    """The tiny preset with the 100,000-piece tokenizer (its config's vocab rounded up to 64, as init-model
    rounds) and SFT data in its words, trained TRAIN_STEPS steps."""
    import paddle

    from engine.models import save_model
    from engine.models.ernie import ErnieForCausalLM
    from engine.models.initialize import init_weights, round_up
    from engine.models.presets import preset_config
    from engine.tokenizer import copy_tokenizer_files
    from engine.train import run_training
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict

    tok_dir, high = big_tokenizer
    d = tmp_path_factory.mktemp("big-model")
    base = d / "base"
    config = preset_config("tiny", vocab_size=round_up(engine.load_tokenizer(str(tok_dir)).vocab_size))
    paddle.seed(0)
    model = ErnieForCausalLM(config)
    init_weights(model, seed=0)
    save_model(model, base)
    copy_tokenizer_files(tok_dir, base)
    rows = records(high, 16, seed=1)
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses: list[float] = []

    def on_event(event: dict) -> None:
        if event.get("type") == "metrics" and "loss" in event:
            losses.append(float(event["loss"]))

    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(base), output_dir=str(d / "run"), fine_tuning="Full",
            train_dataset_path=str(data), max_seq_len=64, batch_size=2, max_steps=TRAIN_STEPS,
            learning_rate=5e-3, save_steps=10_000, logging_steps=1, disable_tqdm=True, report_to="none",
        ),
    )  # fmt: skip
    summary = run_training(cfg, on_event=on_event)
    return Pipeline(base, data, rows, Path(summary.output_dir), summary.status, losses)


def test_tokenizer_reaches_100k_pieces_with_ernies_special_ids(big_tokenizer, big, tiny_model_dir):
    tok_dir, high = big_tokenizer
    tok = engine.load_tokenizer(str(tok_dir))
    assert tok.sp.get_piece_size() == tok.vocab_size == PIECES
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 0)
    tiny = engine.load_tokenizer(str(tiny_model_dir))
    assert tok.added_tokens == tiny.added_tokens  # ERNIE's special tokens at the same ids as init-model's
    assert tok.stop_token_ids == [2, tok.convert_tokens_to_ids("<|end_of_sentence|>")]
    assert len(high) >= 1000, f"only {len(high)} words are one piece past id {HIGH_ID}"
    text = " ".join(high[:50]) + " 文心 ✓ 42"  # unseen characters fall back to bytes
    assert tok.decode(tok.encode(text)) == text
    assert json.loads((big.base / "config.json").read_text())["vocab_size"] == 100_032  # rounded up to 64


def test_stats_count_tokens_with_the_big_vocabulary(big, tiny_model_dir):
    """Each sample is its prompt as the server will see it, then the answer and <|end_of_sentence|>."""
    from engine.data.stats import dataset_stats

    tok = engine.load_tokenizer(str(big.base))
    sep = tok.convert_tokens_to_ids("<|end_of_sentence|>")
    prompts = [tok.apply_chat_template(messages(r, with_answer=False), tokenize=True) for r in big.rows]
    answers = [[*tok.encode(r["tgt"][0]), sep] for r in big.rows]
    assert all(len(a) == 4 and min(a[:3]) >= HIGH_ID for a in answers)  # three words, one id each
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers, strict=True)]
    stats = dataset_stats(big.data, "erniekit", "sft", tok, max_seq_len=64)
    assert stats["num_valid"] == len(big.rows) and stats["truncated_share"] == 0
    assert (stats["total_tokens"], stats["max_length"]) == (sum(lengths), max(lengths))
    assert stats["trained_tokens"] == 4 * len(big.rows)
    tiny = engine.load_tokenizer(str(tiny_model_dir))
    small = dataset_stats(big.data, "erniekit", "sft", tiny, max_seq_len=64)
    assert small["trained_tokens"] > 2 * stats["trained_tokens"]  # the tiny tokenizer spells the words out


def test_chat_template_ids_hold_the_words_as_single_high_ids(big):
    tok = engine.load_tokenizer(str(big.base))
    row = next(r for r in big.rows if "system" in r)
    text = tok.apply_chat_template(messages(row), add_generation_prompt=False)
    ids = tok.apply_chat_template(messages(row), add_generation_prompt=False, tokenize=True)
    for w in [*row["src"][0].split()[1:], row["system"].split()[0], *row["tgt"][0].split()]:
        (wid,) = tok.encode(w)
        assert wid >= HIGH_ID and wid in ids, w
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_sentence|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|end_of_sentence|>")


def test_training_steps_learn_over_the_whole_vocabulary(big):
    from safetensors.numpy import load_file

    assert big.status == "succeeded"
    assert len(big.losses) == TRAIN_STEPS
    # uniform logits over 100,032 classes give ln(100,032) = 11.5: the loss spans the whole vocabulary
    assert abs(big.losses[0] - math.log(100_032)) < 0.3, big.losses
    assert big.losses[-1] < 1.0, big.losses  # measured: 11.5 down to 0.27-0.38 over six inits
    assert load_file(big.run / "model.safetensors")["ernie.embed_tokens.weight"].shape == (100_032, 128)
    assert (big.run / "tokenizer.model").read_bytes() == (big.base / "tokenizer.model").read_bytes()


def trained_reply(big: Pipeline, tok) -> list[int]:
    """The ids every record's answer trained the model to reply, <|end_of_sentence|> included."""
    return [*tok.encode(big.rows[0]["tgt"][0]), tok.convert_tokens_to_ids("<|end_of_sentence|>")]


def test_served_reply_decodes_with_the_big_vocabulary(big):
    """The trained model behind `ernie-studio serve`, asked with the openai client: the prompt is counted
    with the big tokenizer, and the reply is the trained answer, three ids past 65,535, decoded."""
    import openai

    tok = engine.load_tokenizer(str(big.run))
    asked = messages(big.rows[0], with_answer=False)
    prompt = tok.apply_chat_template(asked, tokenize=True)
    ids = trained_reply(big, tok)
    with running_server(big.run, "--max-model-len", "128") as (url, _):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="default", messages=asked, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == tok.decode(ids) == big.rows[0]["tgt"][0]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))


@needs_llamacpp
def test_gguf_vocabulary_reads_as_ours_in_llamacpp(big, tmp_path):
    """The GGUF export of the trained model carries all 100,000 pieces (padded to the model's 100,032);
    llama.cpp's tokenizer, reading them, gives our ids for the dataset's text, ERNIE's special tokens,
    digits and byte-fallback characters and decodes our ids to our text, and its greedy reply is the trained
    one."""
    import gguf

    from engine.train import run_export
    from engine.train.config_load import load_export_config

    tok = engine.load_tokenizer(str(big.run))
    out = tmp_path / "gguf"
    keys = [f"model_name_or_path={big.run}", f"export_dir={out}", "export_format=gguf", "gguf_types=f32"]
    path = Path(run_export(load_export_config(None, keys)).gguf[0]["path"])
    pieces = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert len(pieces) == 100_032 and pieces[-1] == "[PAD100031]"
    assert pieces[:PIECES] == [tok.sp.id_to_piece(i) for i in range(PIECES)]
    special = [tok.apply_chat_template(messages(r)) for r in big.rows[:4]] + ["tab\there <mask:3> 7"]
    plain = [" ".join(r["src"][0] for r in big.rows), "say 12345 文心一言 ✓\nnew line  two spaces"]
    assert sum(i >= HIGH_ID for i in tok.encode(plain[0])) == 2 * len(big.rows)  # each prompt's two words
    server = start_llama(path, tmp_path / "log", parallel=1, threads=1)
    port = server.port
    try:
        for text in special + plain:
            r = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"content": text, "parse_special": True})
            assert r.json()["tokens"] == tok.encode(text), text
        # llama.cpp keeps the word-start space SentencePiece drops after a special token: plain text only
        for text in plain:
            r = httpx.post(f"http://127.0.0.1:{port}/detokenize", json={"tokens": tok.encode(text)})
            assert r.json()["content"].removeprefix(" ") == text
        prompt = tok.apply_chat_template(messages(big.rows[1], with_answer=False), tokenize=True)
        body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "top_k": 1, "return_tokens": True}
        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=60)
        assert r.json()["tokens"] == trained_reply(big, tok)[:3]
    finally:
        server.stop()
