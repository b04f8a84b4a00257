"""What a generated sequence is made of, one token at a time: its sampling parameters (temperature, top-k /
top-p, penalties), the sampling itself, log-probabilities, streaming detokenisation and stop strings. The
engine (`engine.serve.generate`) runs them for every sequence of its batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NEG_INF = float("-inf")


# ---- sampling parameters ---------------------------------------------------------------------------
@dataclass
class SamplingParams:
    """What and how much to generate; the defaults are greedy decoding of up to 256 tokens."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: the chosen token's log-probability plus the top N

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (disabled) or a positive number"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray, output_counts: dict[int, int]
) -> np.ndarray:
    """Repetition penalty (prompt + output, HF rule) then OpenAI presence / frequency penalties (output)."""
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([prompt_ids, np.fromiter(output_counts, dtype=np.int64)]))
        seen = seen[(seen >= 0) & (seen < logits.shape[0])]
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_counts:
        ids = np.fromiter(output_counts, dtype=np.int64)
        counts = np.fromiter(output_counts.values(), dtype=np.float32)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts
    return logits


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token from fp32 logits [V] after penalties: argmax, or temperature/top-k/top-p/min-p."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth] = NEG_INF
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.min_p > 0:
        probs[probs < params.min_p * probs.max()] = 0.0
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least the most likely token).
        cutoff = int(np.searchsorted(cum, params.top_p * cum[-1])) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cutoff]] = True
        probs[~keep] = 0.0
    probs /= probs.sum()
    return int(rng.choice(probs.shape[0], p=probs))


# ---- streaming detokenisation and stop strings ------------------------------------------------------
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever emitting half a UTF-8 character.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits the
    difference, as vLLM does, so each step costs O(window) rather than O(all tokens).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        # U+FFFD at the end means the byte-fallback pieces of a character have not all arrived yet.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end becomes U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"


@dataclass
class TokenLogprobs:
    """The model's log-probability of a generated token and of the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    """Log-softmax of the model's raw logits (before penalties and temperature), as OpenAI reports them."""
    x = logits.astype(np.float64)
    lse = x.max() + np.log(np.exp(x - x.max()).sum())
    top = np.argsort(-x, kind="stable")[:top_n] if top_n else []
    return TokenLogprobs(token, float(x[token] - lse), [(int(i), float(x[i] - lse)) for i in top])


class SequenceState:
    """One sequence's sampling state: output tokens, penalties, RNG, detokeniser and stop handling."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer, stop_token_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.prompt_array = np.asarray(prompt_ids, dtype=np.int64)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_token_ids))
        self.rng = np.random.default_rng(params.seed)
        self.output_ids: list[int] = []
        self.counts: dict[int, int] = {}
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""  # everything decoded so far (stop string cut off once found)
        self.emitted = 0  # characters of self.text already handed out
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.finish_reason: str | None = None
        self.last_logprobs: TokenLogprobs | None = None

    def next_token(self, logits: np.ndarray) -> int:
        raw = logits.copy() if self.params.logprobs is not None else None
        logits = apply_penalties(logits, self.params, self.prompt_array, self.counts)
        token = sample_token(logits, self.params, self.rng)
        if raw is not None:
            self.last_logprobs = token_logprobs(raw, token, self.params.logprobs)
        return token

    def append(self, token_id: int, max_total_len: int) -> str:
        """Record a sampled token; return the text that may be shown now (held back near stop strings)."""
        self.output_ids.append(token_id)
        self.counts[token_id] = self.counts.get(token_id, 0) + 1
        if token_id in self.stop_ids:
            self.finish_reason = FINISH_STOP
            self.text += self.detok.flush()
        else:
            before = len(self.text)
            self.text += self.detok.add(token_id)
            if self.params.stop and len(self.text) > before:
                start = max(0, before - self.hold)
                hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    self.finish_reason = FINISH_STOP
        if self.finish_reason is None and (
            len(self.output_ids) >= self.params.max_tokens
            or len(self.prompt_ids) + len(self.output_ids) >= max_total_len
        ):
            self.finish_reason = FINISH_LENGTH
            self.text += self.detok.flush()
        end = len(self.text) if self.finish_reason else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
