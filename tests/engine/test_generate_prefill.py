"""Batched prefill: waiting prompts of similar length share one right-padded forward, and what they get
(cache contents, first-token logits, tokens) equals prefilling each alone."""

from __future__ import annotations

import queue
import re

import numpy as np
import paddle
import pytest
from serve_support import sharp_model

import engine
from engine.serve.generate import (
    PREFILL_MAX_PADDING,
    GenerationEngine,
    Request,
    SlotKVCache,
    generate_without_cache,
)
from engine.serve.sampling import SamplingParams

QUESTIONS = ["Hello there, how are you?", "What is the capital of France?", "List three colours"]


@pytest.fixture(scope="module")
def dense(tiny_model_dir, tmp_path_factory):
    path = sharp_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "sharp-tiny")
    return engine.load_model(str(path)), engine.load_tokenizer(str(path))


def _prompt(tok, q: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))


def test_padded_multi_row_prefill_then_ragged_decode_equals_full_forward(dense):
    model, tok = dense
    cfg = model.config
    seqs = [_prompt(tok, q) for q in QUESTIONS]
    lens = np.array([len(s) for s in seqs])
    assert len(set(lens.tolist())) > 1  # ragged, so rows carry pads
    t = int(lens.max())
    ids = np.array([s + [s[-1]] * (t - len(s)) for s in seqs], dtype=np.int64)
    cache = SlotKVCache(cfg.num_hidden_layers, 3, cfg.num_key_value_heads, cfg.head_dim, 512)
    with paddle.no_grad():
        cache.prepare(0, 3, t)
        prefill = model(
            paddle.to_tensor(ids),
            position_ids=paddle.arange(t).unsqueeze(0).expand([3, t]),
            past_key_values=cache,
            use_cache=True,
        ).logits.numpy()
        cache.commit()
        cache.lengths[:3] = lens
        nxt = [7, 42, 99]
        cache.prepare(0, 3, 1)
        keep = np.arange(lens.max() + 1)[None, :] <= lens[:, None]
        mask = paddle.to_tensor(np.where(keep, 0.0, -np.inf).astype(np.float32)[:, None, None, :])
        decode = model(
            paddle.to_tensor(np.array(nxt)[:, None]),
            position_ids=paddle.to_tensor(lens[:, None]),
            attention_mask=mask,
            past_key_values=cache,
        ).logits[:, -1]
        for i, s in enumerate(seqs):
            alone = model(paddle.to_tensor([[*s, nxt[i]]])).logits[0]
            np.testing.assert_allclose(prefill[i, len(s) - 1], alone[-2].numpy(), atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(decode[i].numpy(), alone[-1].numpy(), atol=1e-4, rtol=1e-4)


def test_prefill_rows_from_different_lengths_are_rejected(dense):
    model, _ = dense
    cfg = model.config
    cache = SlotKVCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim, 64)
    cache.lengths[:2] = [3, 5]
    with pytest.raises(ValueError, match=re.escape("rows 0..1 prefill from different lengths")):
        cache.prepare(0, 2, 4)


def test_waiting_requests_share_one_prefill_forward_and_match_alone(dense):
    model, tok = dense
    eng = GenerationEngine(model, tok, max_num_seqs=4)  # not started: the test drives the engine's steps
    prompts = [_prompt(tok, q) for q in QUESTIONS]
    lens = [len(p) for p in prompts]
    assert 1 - sum(lens) / (len(lens) * max(lens)) <= PREFILL_MAX_PADDING  # one group
    refs = [generate_without_cache(model, p, 5) for p in prompts]
    sinks = [queue.Queue() for _ in prompts]
    for p, q in zip(prompts, sinks, strict=True):
        eng._waiting.append(Request(p, SamplingParams(max_tokens=5, ignore_eos=True), q.put))
    forwards = []
    hook = model.register_forward_pre_hook(lambda layer, inputs: forwards.append(1))
    try:
        with paddle.no_grad():
            eng._admit()
            assert len(forwards) == 1 and len(eng._running) == 3
            assert sorted(eng.cache.lengths[:3].tolist()) == sorted(lens)  # rows go shortest first
            while eng._running:
                eng._decode_step()
    finally:
        hook.remove()
    assert len(forwards) == 1 + 4  # one prefill for all three, then four shared decode steps
    for q, ref in zip(sinks, refs, strict=True):
        got = []
        while not q.empty():
            got.extend(q.get().token_ids)
        assert got == ref
