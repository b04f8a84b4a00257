"""Generation engine: KV-cached and batched decoding equal the plain no-cache argmax loop; sampling,
penalties, stop strings / tokens, streaming detokenisation and cancellation."""

from __future__ import annotations

import threading

import numpy as np
import paddle
import pytest
from serve_support import sharp_model

import engine
from engine.serve.generate import GenerationEngine, SlotKVCache, generate_without_cache
from engine.serve.sampling import IncrementalDetokenizer, SamplingParams, apply_penalties, sample_token

QUESTIONS = [
    "Hello there, how are you?",
    "What is the capital of France?",
    "Write a poem about the moon over the river",
    "2 + 2 = ?",
    "Tell me a story",
    "翻译成英文：今天天气很好",
    "List three colours",
    "Why is the sky blue? Explain briefly and clearly.",
]


@pytest.fixture(scope="module")
def sharp_dir(tiny_model_dir, tmp_path_factory):
    return sharp_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "sharp-tiny")


def _load(path):
    return engine.load_model(str(path)), engine.load_tokenizer(str(path))


def _prompt(tok, q: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))


@pytest.fixture(scope="module")
def dense(sharp_dir):
    model, tok = _load(sharp_dir)
    eng = GenerationEngine(model, tok, max_num_seqs=8).start()
    yield model, tok, eng
    eng.shutdown()


def test_greedy_equals_no_cache_argmax_loop(dense):
    model, tok, eng = dense
    for q in QUESTIONS[:3]:
        prompt = _prompt(tok, q)
        ref = generate_without_cache(model, prompt, 24, set(tok.stop_token_ids))
        got = eng.generate(prompt, SamplingParams(max_tokens=24))
        assert got.token_ids == ref
        assert len(set(ref)) > 3, "the test model must produce varied tokens"
        assert got.completion_tokens == len(ref) and got.prompt_tokens == len(prompt)
        assert got.finish_reason == ("stop" if ref[-1] in tok.stop_token_ids else "length")
        assert got.text == tok.decode(ref)


@pytest.mark.parametrize("fixture", ["tiny_moe_model_dir", "tiny_vl_model_dir"])
def test_moe_and_vl_text_prompts_match_reference(fixture, request):
    model, tok = _load(request.getfixturevalue(fixture))
    eng = GenerationEngine(model, tok, max_num_seqs=4).start()
    try:
        prompts = [_prompt(tok, q) for q in QUESTIONS[:3]]
        refs = [generate_without_cache(model, p, 12, set(tok.stop_token_ids)) for p in prompts]
        results = [None] * 3

        def run(i):
            results[i] = eng.generate(prompts[i], SamplingParams(max_tokens=12)).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == refs
    finally:
        eng.shutdown()


def test_concurrent_requests_share_steps_and_match_alone(dense):
    _, tok, eng = dense
    prompts = [_prompt(tok, q) for q in QUESTIONS]
    # Different lengths so that requests join and leave the batch at different steps.
    params = [SamplingParams(max_tokens=10 + 3 * i) for i in range(8)]
    alone = [eng.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    together = [None] * 8
    start = threading.Barrier(8)

    def run(i):
        start.wait()
        together[i] = eng.generate(prompts[i], params[i]).token_ids

    steps_before = eng.stats.generation_tokens_total
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert eng.stats.generation_tokens_total - steps_before == sum(len(a) for a in alone)


def test_ragged_batch_logits_equal_full_forward(dense):
    """Decode logits from the slot cache with per-row positions and masks equal a no-cache forward."""
    model, tok, _ = dense
    cfg = model.config
    cache = SlotKVCache(cfg.num_hidden_layers, 3, cfg.num_key_value_heads, cfg.head_dim, 512)
    seqs = [_prompt(tok, q) for q in QUESTIONS[:3]]
    with paddle.no_grad():
        for row, s in enumerate(seqs):
            cache.prepare(row, 1, len(s))
            model(
                paddle.to_tensor([s]), position_ids=paddle.arange(len(s)).unsqueeze(0), past_key_values=cache
            )
            cache.commit()
        nxt = [7, 42, 99]
        lengths = cache.lengths[:3].copy()
        cache.prepare(0, 3, 1)
        keep = np.arange(lengths.max() + 1)[None, :] <= lengths[:, None]
        mask = paddle.to_tensor(np.where(keep, 0.0, -np.inf).astype(np.float32)[:, None, None, :])
        out = model(
            paddle.to_tensor(np.array(nxt)[:, None]),
            position_ids=paddle.to_tensor(lengths[:, None]),
            attention_mask=mask,
            past_key_values=cache,
        ).logits[:, -1]
        for i, s in enumerate(seqs):
            ref = model(paddle.to_tensor([[*s, nxt[i]]])).logits[0, -1]
            np.testing.assert_allclose(out[i].numpy(), ref.numpy(), atol=1e-4, rtol=1e-4)


def test_cache_grows_beyond_initial_capacity(dense):
    model, tok, eng = dense
    prompt = _prompt(tok, QUESTIONS[7] * 12)  # > 256 tokens: the cache doubles its capacity mid-stream
    assert len(prompt) > 256
    ref = generate_without_cache(model, prompt, 6, set(tok.stop_token_ids))
    assert eng.generate(prompt, SamplingParams(max_tokens=6)).token_ids == ref


def test_sampling_is_seeded_and_respects_filters():
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, 2.0, 0.5, 2.9], dtype=np.float32)
    top2 = {
        int(sample_token(logits.copy(), SamplingParams(temperature=1.0, top_k=2), rng)) for _ in range(200)
    }
    assert top2 == {1, 4}
    # top_p small enough keeps only the most likely token
    assert {
        sample_token(logits.copy(), SamplingParams(temperature=1.0, top_p=0.01), rng) for _ in range(50)
    } == {1}
    # min_p: keep tokens with p >= 0.5 * p_max -> {1, 4, 2} (2 has exp(-1) = 0.37 of the max: dropped)
    picked = {
        sample_token(logits.copy(), SamplingParams(temperature=1.0, min_p=0.5), rng) for _ in range(300)
    }
    assert picked == {1, 4}
    a = [
        sample_token(logits.copy(), SamplingParams(temperature=1.5), np.random.default_rng(7))
        for _ in range(1)
    ]
    b = [
        sample_token(logits.copy(), SamplingParams(temperature=1.5), np.random.default_rng(7))
        for _ in range(1)
    ]
    assert a == b
    assert sample_token(logits.copy(), SamplingParams(temperature=0.0), rng) == 1


def test_penalties_change_logits_by_the_documented_rules():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    out = apply_penalties(logits.copy(), SamplingParams(repetition_penalty=2.0), np.array([0, 1]), {})
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, 3.0])
    out = apply_penalties(
        logits.copy(),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        np.array([0]),
        {3: 2, 2: 1},
    )
    np.testing.assert_allclose(out, [2.0, -1.0, 0.5 - 0.75, 3.0 - 1.0])


def test_seeded_sampling_is_reproducible_through_the_engine(dense):
    _, tok, eng = dense
    p = _prompt(tok, QUESTIONS[4])
    sp = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=123, repetition_penalty=1.1)
    first = eng.generate(p, SamplingParams(**sp)).token_ids
    assert eng.generate(p, SamplingParams(**sp)).token_ids == first
    assert eng.generate(p, SamplingParams(**{**sp, "seed": 124})).token_ids != first


def test_stop_strings_and_stop_tokens(dense):
    _, tok, eng = dense
    p = _prompt(tok, QUESTIONS[1])
    full = eng.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(full.text) > 8
    stop = full.text[5:8]
    deltas = list(eng.stream(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])))
    streamed = "".join(d.text for d in deltas)
    assert streamed == full.text[: full.text.find(stop)]
    assert deltas[-1].finish_reason == "stop"
    # a stop token ends the turn before that token and is not part of the text
    k = 6
    stopped = eng.generate(
        p, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[full.token_ids[k]])
    )
    first = full.token_ids.index(full.token_ids[k])
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.text == tok.decode(full.token_ids[:first])


def test_streaming_detokenisation_never_splits_characters(dense):
    _, tok, _ = dense
    text = "naïve café — 今天天气很好 🌙✨ ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split()), "expect byte-fallback pieces for the rare characters"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_cancel_and_prompt_limits(dense):
    _, tok, eng = dense
    p = _prompt(tok, QUESTIONS[0])
    stream = eng.stream(p, SamplingParams(max_tokens=2000, ignore_eos=True))
    next(stream)
    before = eng.stats.requests_finished.get("abort", 0)
    stream.close()  # leaving the iterator cancels the request
    for _ in range(200):
        if eng.stats.requests_finished.get("abort", 0) > before:
            break
        threading.Event().wait(0.02)
    assert eng.stats.requests_finished.get("abort", 0) == before + 1
    with pytest.raises(ValueError, match="maximum context length"):
        eng.generate([5] * eng.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.generate([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(p, SamplingParams(top_p=0))


def test_lora_run_dir_generates_with_the_merged_adapter(sharp_dir, tmp_path):
    """A LoRA run dir (adapter + base path, no tokenizer files) serves through engine.load_model's merge."""
    from engine.models.lora import apply_lora, lora_layers
    from engine.serve.cli import tokenizer_dir
    from engine.train.lora import save_adapter

    model, tok = _load(sharp_dir)
    targets = ["qkv_proj", "o_proj", "up_gate_proj", "down_proj"]
    apply_lora(model, 4, 8.0, targets=targets)
    rng = np.random.default_rng(0)
    for _, layer in lora_layers(model):  # a "trained" adapter: B away from its zero init
        layer.lora_B.set_value(paddle.to_tensor(rng.normal(0, 0.2, layer.lora_B.shape).astype("float32")))
    run = tmp_path / "lora-run"
    save_adapter(
        model, run, {"base_model": str(sharp_dir), "r": 4, "lora_alpha": 8.0, "target_modules": targets}
    )
    prompt = _prompt(tok, QUESTIONS[0])
    stops = set(tok.stop_token_ids)
    with_adapter = generate_without_cache(model, prompt, 16, stops)
    base = generate_without_cache(engine.load_model(str(sharp_dir)), prompt, 16, stops)
    assert with_adapter != base, "the adapter must change the output for this test to mean anything"

    assert tokenizer_dir(run).resolve() == sharp_dir.resolve()
    eng = GenerationEngine(
        engine.load_model(str(run)), engine.load_tokenizer(str(tokenizer_dir(run)))
    ).start()
    try:
        assert eng.generate(prompt, SamplingParams(max_tokens=16)).token_ids == with_adapter
    finally:
        eng.shutdown()


def test_logprobs_are_the_models_log_softmax(dense):
    model, tok, eng = dense
    prompt = _prompt(tok, QUESTIONS[2])
    got = eng.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))
    assert len(got.logprobs) == 6
    ids = list(prompt)
    with paddle.no_grad():
        for item, token in zip(got.logprobs, got.token_ids, strict=True):
            logits = model(paddle.to_tensor([ids])).logits[0, -1].astype("float64")
            ref = paddle.nn.functional.log_softmax(logits).numpy()
            assert item.token_id == token
            np.testing.assert_allclose(item.logprob, ref[token], atol=1e-4)
            assert [t for t, _ in item.top] == list(np.argsort(-ref, kind="stable")[:3])
            assert item.top[0] == (token, pytest.approx(item.logprob))  # greedy picks the top token
            ids.append(token)
