"""Predictions of many prompts at once through the serving engine's continuous batching (KV cache, up to
``max_num_seqs`` sequences per decode step), not one prompt after another."""

from __future__ import annotations

import queue
from dataclasses import dataclass

from engine.serve.generate import GenerationEngine

# A generation that sends nothing for this long is stuck (the engine thread died).
from engine.serve.sampling import SamplingParams

STALL_S = 600.0


@dataclass
class Prediction:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def generate_batch(
    engine: GenerationEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    images: list[list] | None = None,
) -> list[Prediction]:
    """Submit every prompt (with its processed images, for a VL model), then collect each one's text as the
    engine finishes it (in prompt order)."""
    events: queue.Queue = queue.Queue()
    texts: list[list[str]] = [[] for _ in prompts]
    done: list[Prediction | None] = [None] * len(prompts)
    images = images or [[] for _ in prompts]
    requests = [
        engine.submit(p, sp, lambda out, i=i: events.put((i, out)), im)
        for i, (p, sp, im) in enumerate(zip(prompts, params, images, strict=True))
    ]
    try:
        remaining = len(prompts)
        while remaining:
            try:
                i, out = events.get(timeout=STALL_S)
            except queue.Empty:
                raise RuntimeError(f"generation stalled: nothing for {STALL_S:.0f} s") from None
            texts[i].append(out.text)
            if out.finish_reason is None:
                continue
            if out.error:
                raise RuntimeError(out.error)
            done[i] = Prediction(
                "".join(texts[i]), out.finish_reason, out.prompt_tokens, out.completion_tokens
            )
            remaining -= 1
    finally:
        for req in requests:
            req.cancel()
    return [d for d in done if d is not None]


def generate_one_by_one(
    engine: GenerationEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Prediction]:
    """The same predictions one prompt at a time (the baseline bench/bench_eval.py measures against)."""
    out = []
    for p, sp in zip(prompts, params, strict=True):
        r = engine.generate(p, sp)
        out.append(Prediction(r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens))
    return out
