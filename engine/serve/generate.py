"""Text generation: a slot KV cache and a continuous-batching engine that lets concurrent requests share
every decode step (each sequence's sampling, stop handling and streaming detokenisation: `engine.serve.sampling`).

The engine thread owns the model and the cache. Waiting requests are prefilled into free cache rows (text
prompts of similar length in one right-padded forward, image prompts alone), then join the running batch;
each decode step feeds one token per running sequence with its own position and an additive mask that
hides the unused tail of shorter rows.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import paddle

from engine.models.positions import batch_positions
from engine.serve.sampling import (
    FINISH_ABORT,
    FINISH_ERROR,
    NEG_INF,
    SamplingParams,
    SequenceState,
    TokenLogprobs,
)

log = logging.getLogger(__name__)


# ---- KV cache -------------------------------------------------------------------------------------
class SlotKVCache:
    """Preallocated per-layer K/V buffers, one row (slot) per running sequence, grown by doubling.

    Stored as [slots, kv_heads, capacity, head_dim]: ``update`` scatters the new keys in place instead of
    concatenating, and returns the active rows up to the longest sequence as a [B, S, kv_heads, head_dim]
    *view* of a [B, kv_heads, S, head_dim] gather. The model's attention transposes K/V back to heads-first;
    on this layout that transpose is free, while Paddle's CPU transpose of a real [B, S, H, D] tensor is
    ~10x slower than the whole attention once B > 1. Running rows are kept compact at the front (0..B-1).
    """

    def __init__(
        self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, max_len: int, dtype="float32"
    ):
        self.num_layers, self.num_slots, self.kv_heads, self.head_dim = (
            num_layers,
            num_slots,
            kv_heads,
            head_dim,
        )
        self.max_len, self.dtype = max_len, dtype
        self.capacity = 0
        self.keys: list[paddle.Tensor] = []
        self.values: list[paddle.Tensor] = []
        self.lengths = np.zeros(num_slots, dtype=np.int64)
        self._rows: tuple[int, int] = (0, 0)
        self._new = 0
        self._write_index: paddle.Tensor | None = None
        self._read_index: paddle.Tensor | None = None
        self._read_len = 0
        self.reserve(min(256, max_len))

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens per row (grows geometrically; copies what is there)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the cache limit of {self.max_len}")
        cap = min(self.max_len, max(length, 2 * self.capacity))
        shape = [self.num_slots, self.kv_heads, cap, self.head_dim]
        keys = [paddle.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        values = [paddle.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        if self.capacity:
            for new, old in zip(keys + values, self.keys + self.values, strict=True):
                new[:, :, : self.capacity] = old
        self.keys, self.values, self.capacity = keys, values, cap

    def move_row(self, src: int, dst: int) -> None:
        """Copy a sequence's cache row (used to keep the running rows compact)."""
        n = int(self.lengths[src])
        for buf in self.keys + self.values:
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def prepare(self, first_row: int, num_rows: int, new_tokens: int) -> None:
        """Say which rows the next forward covers and how many tokens each adds (1 when decoding)."""
        rows = np.arange(first_row, first_row + num_rows, dtype=np.int64)
        if new_tokens > 1 and (self.lengths[rows] != self.lengths[first_row]).any():
            raise ValueError(f"rows {first_row}..{first_row + num_rows - 1} prefill from different lengths")
        self._read_len = int(self.lengths[rows].max()) + new_tokens
        self.reserve(self._read_len)
        self._rows, self._new = (first_row, num_rows), new_tokens
        heads = np.arange(self.kv_heads, dtype=np.int64)
        base = (
            rows[:, None] * self.kv_heads + heads[None, :]
        ) * self.capacity  # [B, H] start of each (row, head)
        self._write_index = (
            paddle.to_tensor((base + self.lengths[rows][:, None]).reshape(-1)) if new_tokens == 1 else None
        )
        cols = np.arange(self._read_len, dtype=np.int64)
        self._read_index = paddle.to_tensor((base[:, :, None] + cols[None, None, :]).reshape(-1))

    def commit(self) -> None:
        first, n = self._rows
        self.lengths[first : first + n] += self._new

    def get_seq_length(self) -> int:
        first, n = self._rows
        return int(self.lengths[first : first + n].max()) if n else 0

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        first, n = self._rows
        h, d = self.kv_heads, self.head_dim
        flat = [self.num_slots * h * self.capacity, d]
        kbuf, vbuf = self.keys[layer], self.values[layer]
        if self._write_index is not None:  # decode: one token per row, each at its own length
            kbuf.reshape(flat).scatter_(self._write_index, k.reshape([n * h, d]))
            vbuf.reshape(flat).scatter_(self._write_index, v.reshape([n * h, d]))
        else:  # prefill: T tokens per row, all rows from the same length
            start = int(self.lengths[first])
            kbuf[first : first + n, :, start : start + self._new] = k.transpose([0, 2, 1, 3])
            vbuf[first : first + n, :, start : start + self._new] = v.transpose([0, 2, 1, 3])
        shape = [n, h, self._read_len, d]
        k_all = paddle.index_select(kbuf.reshape(flat), self._read_index).reshape(shape)
        v_all = paddle.index_select(vbuf.reshape(flat), self._read_index).reshape(shape)
        return k_all.transpose([0, 2, 1, 3]), v_all.transpose([0, 2, 1, 3])


# ---- requests and outputs -------------------------------------------------------------------------
@dataclass
class GenerationOutput:
    """One event of a request: new text (may be empty), new token ids, and the finish reason at the end."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)


_request_ids = itertools.count()


class Request:
    """A submitted generation; outputs go to ``sink`` from the engine thread."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[GenerationOutput], None],
        images: list | None = None,
    ):
        self.id = next(_request_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.state: SequenceState | None = None
        # VL: processed images / videos (``VisionInput``: patches and grid) for the prompt's placeholder runs
        self.images = images or []
        # VL: decoding continues at the prompt's largest 3-D position + 1, not at its length
        self.rope_delta = 0

    def cancel(self) -> None:
        """Stop generating (e.g. the client went away); the engine drops it before the next step."""
        self.cancelled.set()


@dataclass
class EngineStats:
    """Counters for /metrics; written by the engine thread, read by the server."""

    running: int = 0
    waiting: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    ttft: deque = field(default_factory=lambda: deque(maxlen=100_000))  # drained by the metrics exporter
    e2e: deque = field(default_factory=lambda: deque(maxlen=100_000))  # request latency, arrival to finish
    per_token: deque = field(default_factory=lambda: deque(maxlen=100_000))  # mean gap after the first token
    recent_tokens: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, n_tokens)

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        items = [(t, n) for t, n in list(self.recent_tokens) if now - t <= window]
        if not items:
            return 0.0
        span = max(now - items[0][0], 1e-3)
        return sum(n for _, n in items) / span


# ---- the engine -----------------------------------------------------------------------------------
class GenerationEngine:
    """Continuous batching over one model: up to ``max_num_seqs`` sequences share each decode step."""

    def __init__(self, model, tokenizer, max_num_seqs: int = 8, max_model_len: int | None = None):
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, 8192))
        self.stop_token_ids = list(tokenizer.stop_token_ids)
        dtype = str(model.ernie.embed_tokens.weight.dtype).replace("paddle.", "")
        self.cache = SlotKVCache(
            cfg.num_hidden_layers,
            max_num_seqs,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.max_model_len,
            dtype,
        )
        self.stats = EngineStats()
        self._incoming: queue.Queue[Request | None] = queue.Queue()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # row i of the cache belongs to _running[i]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle --
    def start(self) -> GenerationEngine:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="generation-engine", daemon=True)
            self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._incoming.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # -- submitting --
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when the prompt cannot be served (empty or longer than the context)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens; shorten it or raise --max-model-len"
            )
        params.validate()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[GenerationOutput], None],
        images: list[np.ndarray] | None = None,
    ) -> Request:
        self.check_prompt(prompt_ids, params)
        req = Request(prompt_ids, params, sink, images)
        self.start()
        self._incoming.put(req)
        return req

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, images: list[np.ndarray] | None = None
    ) -> Iterator[GenerationOutput]:
        """Blocking iterator over a request's outputs (for scripts, tests and benchmarks)."""
        q: queue.Queue[GenerationOutput] = queue.Queue()
        req = self.submit(prompt_ids, params, q.put, images)
        try:
            while True:
                out = q.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            req.cancel()

    async def astream(
        self, prompt_ids: list[int], params: SamplingParams, images: list[np.ndarray] | None = None
    ) -> AsyncIterator[GenerationOutput]:
        """Async iterator over a request's outputs; leaving early (client gone) cancels the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        req = self.submit(
            prompt_ids, params, lambda out: loop.call_soon_threadsafe(q.put_nowait, out), images
        )
        try:
            while True:
                out = await q.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            req.cancel()

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, images: list[np.ndarray] | None = None
    ) -> GenerationResult:
        text, ids, logprobs, last = [], [], [], None
        for out in self.stream(prompt_ids, params, images):
            text.append(out.text)
            ids.extend(out.token_ids)
            logprobs.extend(out.logprobs or [])
            last = out
        if last.error:
            raise RuntimeError(last.error)
        return GenerationResult(
            "".join(text), ids, last.finish_reason, last.prompt_tokens, last.completion_tokens, logprobs
        )

    # -- the loop (engine thread) --
    def _loop(self) -> None:
        with paddle.no_grad():
            while not self._stop.is_set():
                self._drain_incoming(block=not self._running and not self._waiting)
                self._drop_cancelled()
                self._admit()
                try:
                    if self._running:
                        self._decode_step()
                except Exception as e:  # a failed step fails its requests, never the server
                    log.exception("decode step failed")
                    for req in list(self._running):
                        self._finish(req, FINISH_ERROR, f"generation failed: {e}")
                self.stats.running, self.stats.waiting = len(self._running), len(self._waiting)
            for req in [*self._running, *self._waiting]:
                self._finish(req, FINISH_ABORT)

    def _drain_incoming(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=0.5) if block else self._incoming.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._incoming.get_nowait()
        except queue.Empty:
            pass
        self.stats.waiting = len(self._waiting)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self._waiting if r.cancelled.is_set()]:
            self._waiting.remove(req)
            self._emit_finish(req, FINISH_ABORT)
        for req in [r for r in self._running if r.cancelled.is_set()]:
            self._finish(req, FINISH_ABORT)

    def _admit(self) -> None:
        """Prefill waiting requests into the free rows; text prompts of similar length share one forward."""
        admitted: list[Request] = []
        while self._waiting and len(self._running) + len(admitted) < self.max_num_seqs:
            admitted.append(self._waiting.popleft())
        groups = [[r] for r in admitted if r.images]
        for req in sorted((r for r in admitted if not r.images), key=lambda r: len(r.prompt_ids)):
            group = groups[-1] if groups and not groups[-1][0].images else None
            if group is not None and _padding_fraction([*group, req]) <= PREFILL_MAX_PADDING:
                group.append(req)
            else:
                groups.append([req])
        for group in groups:
            try:
                self._prefill(group)
            except Exception as e:  # a prompt the model rejects fails its own forward's requests only
                log.exception("prefill failed")
                for req in group:
                    if req in self._running or req.state is None:  # not yet finished by its first token
                        self._finish(req, FINISH_ERROR, f"generation failed: {e}")

    def _prefill(self, group: list[Request]) -> None:
        """One forward over the prompts of ``group`` (right-padded to the longest) into fresh cache rows.

        Positions are the cache columns, so right padding keeps every real token at its own position and
        the causal mask alone is exact for them; the pads' keys land past each row's length, where decode
        masks never look and the row's next tokens overwrite them.
        """
        first = len(self._running)
        lens = np.array([len(r.prompt_ids) for r in group], dtype=np.int64)
        t = int(lens.max())
        ids = np.empty((len(group), t), dtype=np.int64)
        for i, req in enumerate(group):
            # Pad with the row's own last token: any fixed id could be a special one (an image placeholder).
            ids[i] = req.prompt_ids[-1]
            ids[i, : lens[i]] = req.prompt_ids
            req.state = SequenceState(req.prompt_ids, req.params, self.tokenizer, self.stop_token_ids)
            self.cache.lengths[first + i] = 0
            self._running.append(req)
        self.cache.prepare(first, len(group), t)
        pos, vision = self._prompt_positions(group, ids)
        keep = t - int(lens.min()) + 1  # enough trailing positions to hold every row's last prompt token
        out = self.model(
            paddle.to_tensor(ids),
            position_ids=paddle.to_tensor(pos),
            **vision,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        self.cache.commit()
        self.cache.lengths[first : first + len(group)] = lens
        self.stats.prompt_tokens_total += int(lens.sum())
        logits = out.logits.astype("float32").numpy()
        for i, req in enumerate(group):
            self._accept(req, logits[i, lens[i] - 1 - (t - keep)])

    def _prompt_positions(self, group: list[Request], ids: np.ndarray) -> tuple[np.ndarray, dict]:
        """Positions of the prompts (3-D when they hold images) and the model's vision inputs."""
        items = [item for req in group for item in req.images]
        if not items:
            return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy(), {}
        grids = [item.grid_thw for item in items]
        pos, deltas = batch_positions(ids, grids, self.model.config)
        for req, delta in zip(group, deltas.tolist(), strict=True):
            req.rope_delta = int(delta)
        pixels = paddle.to_tensor(np.concatenate([item.pixel_values for item in items]))
        return pos, {"pixel_values": pixels, "grid_thw": grids}

    def _decode_step(self) -> None:
        b = len(self._running)
        lengths = self.cache.lengths[:b].copy()
        last = [r.state.output_ids[-1] for r in self._running]
        self.cache.prepare(0, b, 1)
        s = int(lengths.max()) + 1
        mask = None
        if b > 1 and (lengths != lengths[0]).any():
            keep = np.arange(s)[None, :] <= lengths[:, None]
            mask = paddle.to_tensor(np.where(keep, 0.0, NEG_INF).astype(np.float32)[:, None, None, :])
        ids = paddle.to_tensor(np.asarray(last, dtype=np.int64)[:, None])
        deltas = np.array([r.rope_delta for r in self._running], dtype=np.int64)
        pos = paddle.to_tensor((lengths + deltas)[:, None])
        out = self.model(
            ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache.commit()
        logits = out.logits[:, -1].astype("float32").numpy()
        for req, row_logits in zip(list(self._running), logits, strict=True):
            self._accept(req, row_logits)

    def _accept(self, req: Request, logits: np.ndarray) -> None:
        st = req.state
        token = st.next_token(logits)
        delta = st.append(token, self.max_model_len)
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.ttft.append(now - req.submitted)
        self.stats.generation_tokens_total += 1
        self.stats.recent_tokens.append((now, 1))
        # logprobs of tokens that become text (a stop token does not)
        lps = [st.last_logprobs] if st.last_logprobs is not None and token not in st.stop_ids else None
        if st.finish_reason is not None:
            self._finish(req, st.finish_reason, last_text=delta, last_ids=[token], logprobs=lps)
        else:
            _send(
                req, GenerationOutput(delta, [token], None, len(st.prompt_ids), len(st.output_ids), None, lps)
            )

    def _finish(
        self,
        req: Request,
        reason: str,
        error: str | None = None,
        last_text: str = "",
        last_ids: list[int] | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """Release the request's cache row (moving the last running row into it) and send its final event."""
        if req in self._running:
            row = self._running.index(req)
            last_row = len(self._running) - 1
            if row != last_row:
                self.cache.move_row(last_row, row)
                self._running[row] = self._running[last_row]
            self._running.pop()
            self.cache.lengths[last_row] = 0
        self._emit_finish(req, reason, error, last_text, last_ids or [], logprobs)

    def _emit_finish(
        self,
        req: Request,
        reason: str,
        error: str | None = None,
        text: str = "",
        ids: list[int] | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        st = req.state
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1
        now = time.perf_counter()
        self.stats.e2e.append(now - req.submitted)
        if st is not None and req.first_token_at is not None and len(st.output_ids) > 1:
            self.stats.per_token.append((now - req.first_token_at) / (len(st.output_ids) - 1))
        _send(
            req,
            GenerationOutput(
                text, ids or [], reason, len(req.prompt_ids), len(st.output_ids) if st else 0, error, logprobs
            ),
        )


# Waiting prompts are prefilled together while padding stays under this share of the padded batch: one
# forward over 8 x 32 tokens costs ~0.65x eight separate ones, while pads cost as much as real tokens.
PREFILL_MAX_PADDING = 0.25


def _padding_fraction(group: list[Request]) -> float:
    lens = [len(r.prompt_ids) for r in group]
    return 1.0 - sum(lens) / (len(lens) * max(lens))


def _send(req: Request, out: GenerationOutput) -> None:
    """Hand an output to the request's consumer; a consumer that is gone (closed event loop) is ignored."""
    try:
        req.sink(out)
    except RuntimeError as e:
        log.debug("request %d: dropping output, consumer gone: %s", req.id, e)
        req.cancel()


# ---- single-sequence reference loops (benchmarks, tests, scripts) -----------------------------------
def generate_without_cache(
    model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] | None = None
) -> list[int]:
    """Greedy decoding that re-runs the whole sequence every step (the no-KV-cache baseline)."""
    ids = list(prompt_ids)
    out: list[int] = []
    with paddle.no_grad():
        for _ in range(max_new_tokens):
            logits = model(paddle.to_tensor([ids], dtype="int64"), logits_to_keep=1).logits
            token = int(paddle.argmax(logits[0, -1]).item())
            out.append(token)
            if stop_ids and token in stop_ids:
                break
            ids.append(token)
    return out


__all__ = [
    "GenerationEngine",
    "GenerationOutput",
    "GenerationResult",
    "SlotKVCache",
    "generate_without_cache",
]
