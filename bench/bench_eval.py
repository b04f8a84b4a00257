"""Eval generation speed: the predictions of an eval set through the serving engine's continuous batching
(what ``ernie-studio eval`` does) against the same predictions one prompt at a time, same model, same data.

Run: `.venv/bin/python bench/bench_eval.py [--samples 48] [--hidden 512] [--layers 8]`. The model is random
(bench-dense shape at the given width and depth, as bench_generate.py) so decode is compute-bound as with
real checkpoints; prompts are the chat-template prompts of examples/eval/qa_eval.jsonl's questions with a
varying item number; every answer is max_new_tokens long (ignore_eos) so both ways generate the same tokens.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_generate import build_model

from engine.eval.generation import generate_batch, generate_one_by_one
from engine.serve.generate import GenerationEngine
from engine.serve.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Translate to English: 你好",
    "中国的首都是哪里？",
    "What colour is the sky on a clear day?",
    "Name a primary colour.",
]


def prompts(tok, n: int) -> list[list[int]]:
    texts = [f"Item {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(n)]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def run(engine: GenerationEngine, fn, ps: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True) for _ in ps]
    t0 = time.perf_counter()
    out = fn(engine, ps, params)
    dt = time.perf_counter() - t0
    return dt, sum(p.completion_tokens for p in out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_model(Path(tmp), args.hidden, args.layers)
    ps = prompts(tok, args.samples)
    batched = GenerationEngine(model, tok, max_num_seqs=args.max_num_seqs, max_model_len=512)
    single = GenerationEngine(model, tok, max_num_seqs=1, max_model_len=512)
    run(batched, generate_batch, ps[:4], 4)  # warm-up: first forward, cache allocation
    run(single, generate_one_by_one, ps[:2], 4)
    rows = []
    for name, engine, fn in (
        ("one prompt at a time", single, generate_one_by_one),
        (f"batched (max_num_seqs {args.max_num_seqs})", batched, generate_batch),
    ):
        dt, tokens = run(engine, fn, ps, args.new_tokens)
        rows.append((name, dt, args.samples / dt, tokens / dt))
    batched.shutdown()
    single.shutdown()
    load = os.getloadavg()[0]
    print(f"\n{args.samples} samples x {args.new_tokens} new tokens, hidden {args.hidden}, {args.layers} layers, "
          f"load average {load:.1f}")  # fmt: skip
    print("| way | seconds | samples/s | tokens/s | speed-up |\n|---|---|---|---|---|")
    for name, dt, sps, tps in rows:
        print(f"| {name} | {dt:.1f} | {sps:.2f} | {tps:.0f} | {sps / rows[0][2]:.1f}x |")


if __name__ == "__main__":
    main()
