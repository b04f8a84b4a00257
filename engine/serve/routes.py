"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Routes are module-level functions on one ``APIRouter``; they find the engine and limits through the
``serving_state`` dependency (``request.app.state.serving``), so each can be called and tested alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from engine.serve.generate import GenerationOutput
from engine.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage,
)
from engine.serve.sampling import FINISH_ERROR
from engine.serve.state import ServingState

router = APIRouter()


def serving_state(request: Request) -> ServingState:
    """The app's ServingState, set by ``create_app``."""
    return request.app.state.serving


@router.get("/health")
async def health(state: ServingState = Depends(serving_state)):
    if not state.engine.is_alive():  # the decode thread is gone: nothing would ever answer
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(state: ServingState = Depends(serving_state)):
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(state: ServingState = Depends(serving_state)):
    card = {
        "id": state.name,
        "object": "model",
        "created": state.created,
        "owned_by": "ernie-studio",
        "root": state.model_dir,
        "max_model_len": state.engine.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: ServingState = Depends(serving_state)
):
    state.check_model(body.model)
    prompt, images = state.chat_prompt(body)
    return await serve_completion(state, body, request, prompt, chat=True, images=images)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, state: ServingState = Depends(serving_state)
):
    state.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    prompt = state.completion_prompt(body)
    return await serve_completion(state, body, request, prompt, chat=False)


# ---- one completion request -------------------------------------------------------------------------
@dataclass
class Reply:
    """Identity of one response: its id, creation time, kind (chat or text) and the served model name."""

    id: str
    created: int
    chat: bool
    model: str


async def serve_completion(
    state: ServingState, body: SamplingFields, request: Request, prompt: list[int], chat: bool, images=None
):
    """Run the body's ``n`` choices on the engine; a streamed response or one JSON body."""
    params = state.sampling_params(body, len(prompt))
    if state.in_flight >= state.max_concurrent:
        raise APIError(
            429,
            f"the server is at its limit of {state.max_concurrent} concurrent requests; retry shortly",
            type="rate_limit_error",
            code="rate_limit_exceeded",
        )
    # n choices are n engine requests; with a seed, choice i samples with seed + i so they differ.
    choice_params = [
        replace(params, seed=None if params.seed is None else params.seed + i) for i in range(body.n)
    ]
    streams = [state.engine.astream(prompt, p, images) for p in choice_params]
    state.in_flight += 1
    reply = Reply(
        ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), chat, state.name
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        state.metrics.count_request(request.url.path, 200)
        release = _Release(state)
        return _TrackedStream(
            stream_events(state, streams, reply, include_usage, release),
            release,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        outs = await asyncio.gather(*(_collect(st, request) for st in streams))
    finally:
        state.in_flight -= 1
    if any(out is None for out in outs):  # the client is gone; nobody reads this
        return JSONResponse({}, status_code=499)
    for out in outs:
        if out.finish_reason == FINISH_ERROR:
            raise APIError(500, out.error or "generation failed", type="server_error")
    state.metrics.count_request(request.url.path, 200)
    return completion_body(state, reply, outs)


def completion_body(state: ServingState, reply: Reply, outs: list[GenerationOutput]) -> dict:
    """The non-streamed response: one choice per output, usage over all of them."""
    choices = []
    for i, out in enumerate(outs):
        if reply.chat:
            lp = chat_logprobs(state.tokenizer, out.logprobs) if out.logprobs is not None else None
            message = {"role": "assistant", "content": out.text}
            choices.append(
                {"index": i, "message": message, "logprobs": lp, "finish_reason": out.finish_reason}
            )
        else:
            lp = completion_logprobs(state.tokenizer, out.logprobs) if out.logprobs is not None else None
            choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason})
    return {
        "id": reply.id,
        "object": "chat.completion" if reply.chat else "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        "usage": usage(outs[0].prompt_tokens, sum(o.completion_tokens for o in outs)),
    }


async def _collect(stream: AsyncIterator[GenerationOutput], request: Request) -> GenerationOutput | None:
    """Gather a whole generation; return None (and cancel it) when the client disconnects first."""
    parts: list[str] = []
    logprobs: list = []

    async def run() -> GenerationOutput:
        last = None
        async for out in stream:
            parts.append(out.text)
            logprobs.extend(out.logprobs or [])
            last = out
        return last

    task = asyncio.ensure_future(run())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            last = task.result()
            last.text = "".join(parts)
            last.logprobs = logprobs if last.logprobs is not None or logprobs else None
            return last
        if await request.is_disconnected():
            # Cancelling the task raises inside the stream's await, whose finally cancels the request.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


# ---- streaming --------------------------------------------------------------------------------------
class _Release:
    """Gives back a streaming request's concurrency slot exactly once, whichever cleanup path runs first."""

    def __init__(self, state: ServingState):
        self.state, self.done = state, False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.state.in_flight -= 1


class _TrackedStream(StreamingResponse):
    """A streaming response that frees its slot even when the client leaves before the body starts
    (then the generator, whose ``finally`` normally does it, never runs)."""

    def __init__(self, content, release: _Release, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class ChunkWriter:
    """Builds the SSE chunks of one streamed reply (text completions track each choice's text offset)."""

    def __init__(self, state: ServingState, reply: Reply, choices: int, include_usage: bool):
        self.tokenizer, self.reply, self.include_usage = state.tokenizer, reply, include_usage
        self.object = "chat.completion.chunk" if reply.chat else "text_completion"
        self.offsets = [0] * choices

    def chunk(
        self, i: int, delta_text: str | None, finish: str | None, role: bool = False, logprobs=None
    ) -> dict:
        if self.reply.chat:
            choice = self._chat_choice(i, delta_text, finish, role, logprobs)
        else:
            choice = self._text_choice(i, delta_text, finish, logprobs)
        c = self._envelope([choice])
        if self.include_usage:
            c["usage"] = None
        return c

    def _chat_choice(self, i: int, delta_text: str | None, finish: str | None, role: bool, logprobs) -> dict:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if delta_text:
            delta["content"] = delta_text
        lp = chat_logprobs(self.tokenizer, logprobs) if logprobs else None
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def _text_choice(self, i: int, delta_text: str | None, finish: str | None, logprobs) -> dict:
        lp = completion_logprobs(self.tokenizer, logprobs, self.offsets[i]) if logprobs else None
        self.offsets[i] += len(delta_text or "")
        return {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._envelope([]), "usage": usage(prompt_tokens, completion_tokens)}

    def _envelope(self, choices: list[dict]) -> dict:
        r = self.reply
        return {"id": r.id, "object": self.object, "created": r.created, "model": r.model, "choices": choices}


def _error_event(out: GenerationOutput) -> str:
    err = {"message": out.error or "generation failed", "type": "server_error", "param": None, "code": None}
    return sse({"error": err})


async def _pump(i: int, stream, merged: asyncio.Queue) -> None:
    async for out in stream:
        await merged.put((i, out))


async def stream_events(
    state: ServingState, streams: list, reply: Reply, include_usage: bool, release: _Release
) -> AsyncIterator[str]:
    """SSE events of all choices as they decode, interleaved; then usage (if asked) and ``[DONE]``."""
    writer = ChunkWriter(state, reply, len(streams), include_usage)
    # One pump task per choice feeds a shared queue, so the choices stream interleaved as they decode.
    merged: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, st, merged)) for i, st in enumerate(streams)]
    try:
        if reply.chat:
            for i in range(len(streams)):
                yield sse(writer.chunk(i, None, None, role=True))
        done, prompt_tokens, completion_tokens = 0, 0, 0
        while done < len(streams):
            i, out = await merged.get()
            if out.finish_reason == FINISH_ERROR:
                yield _error_event(out)
                break
            if out.text or out.logprobs:
                yield sse(writer.chunk(i, out.text, None, logprobs=out.logprobs))
            if out.finish_reason is not None:
                done += 1
                prompt_tokens, completion_tokens = (
                    out.prompt_tokens,
                    completion_tokens + out.completion_tokens,
                )
                yield sse(writer.chunk(i, None, out.finish_reason))
        else:
            if include_usage:
                yield sse(writer.usage_chunk(prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        # Runs on normal end and when the client disconnects (Starlette cancels this generator):
        # cancelling a pump cancels its engine request.
        release()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
