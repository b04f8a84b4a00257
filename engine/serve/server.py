"""OpenAI-compatible HTTP server over the Paddle generation engine.

Same routes, request fields and response shapes as FastDeploy's api_server (and OpenAI's), so clients
cannot tell which backend answers: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.serve.generate import FINISH_ERROR, GenerationEngine, GenerationOutput, SamplingParams
from engine.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


# ---- errors -----------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    problems, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        param = param or where
        problems.append(f"{where}: {err.get('msg', 'invalid value')}")
    return APIError(400, "invalid request: " + "; ".join(problems), param=param, code="invalid_value")


# ---- request bodies ---------------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions, including FastDeploy's extras (top_k, min_p, ...)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False


# ---- the app ----------------------------------------------------------------------------------------
def read_generation_defaults(model_dir: str | Path | None) -> dict[str, float]:
    """Sampling defaults from the model's generation_config.json (what FastDeploy applies too)."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        log.warning("%s:%d: ignoring invalid generation_config.json: %s", path, e.lineno, e.msg)
        return {}
    keys = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")
    return {k: cfg[k] for k in keys if isinstance(cfg.get(k), int | float)}


class ServingState:
    """What the routes need: the engine, tokenizer, served name, limits and metrics."""

    def __init__(
        self, engine: GenerationEngine, served_model_name: str, max_concurrent_requests: int, model_dir=None
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.name = served_model_name
        self.model_dir = str(model_dir) if model_dir else None
        self.max_concurrent = max_concurrent_requests
        self.in_flight = 0
        self.defaults = read_generation_defaults(model_dir)
        self.metrics = ServerMetrics(engine.stats, served_model_name)
        self.created = int(time.time())
        self.vision_config = getattr(engine.model.config, "vision_config", None)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def sampling_params(self, req: SamplingFields, prompt_len: int) -> SamplingParams:
        if req.n > 16:
            raise APIError(400, f"n={req.n}: at most 16 choices per request", param="n")
        if isinstance(req, ChatCompletionRequest):
            if isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool):
                raise APIError(
                    400,
                    "logprobs: must be true or false for chat (use top_logprobs for a count)",
                    param="logprobs",
                )
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = None if req.logprobs is None or req.logprobs is False else int(req.logprobs)
            if logprobs is not None and not 0 <= logprobs <= 20:
                raise APIError(400, "logprobs: must be between 0 and 20", param="logprobs")
        d = self.defaults
        limit = self.engine.max_model_len
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if prompt_len >= limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, but you asked for {prompt_len + max_tokens} "
                f"({prompt_len} in the prompt, {max_tokens} in the completion); lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop")
        vocab = self.engine.model.config.vocab_size
        for t in req.stop_token_ids or []:
            if not 0 <= t < vocab:
                raise APIError(
                    400, f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})", param="stop_token_ids"
                )

        def pick(name: str, default: float) -> float:
            value = getattr(req, name)
            return value if value is not None else d.get(name, default)

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=int(pick("top_k", 0)),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return params

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], list]:
        # Said plainly rather than ignored: a client relying on these would silently get plain text.
        if req.tools:
            raise APIError(400, "tools: tool calling is not supported by the Paddle backend", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(
                400,
                f"response_format: only type 'text' is supported, not {req.response_format.get('type')!r}",
                param="response_format",
            )
        messages, images = [], []
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list):
                texts = []
                for j, part in enumerate(m.content):
                    if part.type == "image_url" and self.vision_config is not None:
                        texts.append(self.image_part(part, images, f"messages.{i}.content.{j}"))
                    elif part.type != "text" or part.text is None:
                        kinds = (
                            "text and image_url parts"
                            if self.vision_config is not None
                            else "only text parts"
                        )
                        raise APIError(
                            400,
                            f"messages[{i}].content[{j}]: this model takes {kinds}, got type {part.type!r}",
                            param=f"messages.{i}.content.{j}",
                        )
                    else:
                        texts.append(part.text)
                content = "".join(texts)
            else:
                content = m.content or ""
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content})
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **(req.chat_template_kwargs or {})
            )
        except Exception as e:  # a template error is the request's fault (bad kwargs, unsupported roles)
            raise APIError(
                400, f"the chat template could not render these messages: {e}", param="messages"
            ) from e
        return self.tokenizer.encode(text), images

    def image_part(self, part: ContentPart, images: list, where: str) -> str:
        """Decode a base64 ``data:`` image into pixels; return its placeholder run for the prompt text."""
        from engine.data.images import grid_factor, load_image
        from engine.tokenizer import IMAGE_END, IMAGE_PLACEHOLDER, IMAGE_START

        url = (getattr(part, "image_url", None) or {}).get("url", "")
        if not url.startswith("data:") or ";base64," not in url:
            raise APIError(
                400,
                f"{where}: send images inline as data:image/...;base64,... URLs (this server fetches nothing)",
                param=where,
            )
        try:
            raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
            factor = grid_factor(self.vision_config)
            pixels = load_image(io.BytesIO(raw), factor)
        except (binascii.Error, OSError, ValueError) as e:
            raise APIError(400, f"{where}: not a readable image: {e}", param=where) from e
        images.append(pixels)
        n = (pixels.shape[1] // factor) * (pixels.shape[2] // factor)
        return IMAGE_START + IMAGE_PLACEHOLDER * n + IMAGE_END

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, f"prompt: send one prompt per request (got {len(p)})", param="prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt: must not be empty", param="prompt")
            return self.tokenizer.encode(p)
        vocab = self.engine.model.config.vocab_size
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        return list(p)


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as OpenAI shows it: its text (SentencePiece's "▁" as a space) and its UTF-8 bytes."""
    piece = tokenizer.convert_ids_to_tokens([token_id])[0]
    m = _BYTE_PIECE.match(piece)
    if m:  # a byte-fallback piece: one byte of a character split across tokens
        return f"bytes:\\x{m.group(1).lower()}", [int(m.group(1), 16)]
    text = piece.replace("\u2581", " ")
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer, items) -> dict:
    content = []
    for it in items:
        text, raw = _token_text(tokenizer, it.token_id)
        top = []
        for tid, lp in it.top:
            t, b = _token_text(tokenizer, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": it.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokenizer, items, offset: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for it in items:
        text, _ = _token_text(tokenizer, it.token_id)
        tokens.append(text)
        lps.append(it.logprob)
        tops.append({_token_text(tokenizer, tid)[0]: lp for tid, lp in it.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


def create_app(
    engine: GenerationEngine,
    served_model_name: str = "default",
    max_concurrent_requests: int = 64,
    model_dir: str | Path | None = None,
) -> FastAPI:
    """The OpenAI-compatible app; the engine thread starts with the app and stops when it shuts down."""
    state = ServingState(engine, served_model_name, max_concurrent_requests, model_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="ERNIE Studio OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        state.metrics.count_request(request.url.path, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        state.metrics.count_request(request.url.path, 400)
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind
        ).response()

    @app.get("/health")
    async def health():
        if not engine.is_alive():  # the decode thread is gone: nothing would ever answer
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {
            "id": state.name,
            "object": "model",
            "created": state.created,
            "owned_by": "ernie-studio",
            "root": state.model_dir,
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        prompt, images = state.chat_prompt(body)
        return await _serve(body, request, prompt, chat=True, images=images)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = state.completion_prompt(body)
        return await _serve(body, request, prompt, chat=False)

    async def _serve(body: SamplingFields, request: Request, prompt: list[int], chat: bool, images=None):
        params = state.sampling_params(body, len(prompt))
        if state.in_flight >= state.max_concurrent:
            raise APIError(
                429,
                f"the server is at its limit of {state.max_concurrent} concurrent requests; retry shortly",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )
        route = request.url.path
        # n choices are n engine requests; with a seed, choice i samples with seed + i so they differ.
        choice_params = [
            replace(params, seed=None if params.seed is None else params.seed + i) for i in range(body.n)
        ]
        streams = [engine.astream(prompt, p, images) for p in choice_params]
        state.in_flight += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            state.metrics.count_request(route, 200)
            release = _Release(state)
            return _TrackedStream(
                _stream_events(streams, rid, created, chat, include_usage, release),
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
        state.metrics.count_request(route, 200)
        choices = []
        for i, out in enumerate(outs):
            if chat:
                lp = chat_logprobs(state.tokenizer, out.logprobs) if out.logprobs is not None else None
                message = {"role": "assistant", "content": out.text}
                choices.append(
                    {"index": i, "message": message, "logprobs": lp, "finish_reason": out.finish_reason}
                )
            else:
                lp = completion_logprobs(state.tokenizer, out.logprobs) if out.logprobs is not None else None
                choices.append(
                    {"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
                )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": state.name,
            "choices": choices,
            "usage": _usage(outs[0].prompt_tokens, sum(o.completion_tokens for o in outs)),
        }

    async def _stream_events(
        streams, rid: str, created: int, chat: bool, include_usage: bool, release: _Release
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(streams)

        def chunk(
            i: int, delta_text: str | None, finish: str | None, role: bool = False, logprobs=None
        ) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if delta_text:
                    delta["content"] = delta_text
                lp = chat_logprobs(state.tokenizer, logprobs) if logprobs else None
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                lp = completion_logprobs(state.tokenizer, logprobs, offsets[i]) if logprobs else None
                offsets[i] += len(delta_text or "")
                choice = {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
            c = {"id": rid, "object": obj, "created": created, "model": state.name, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return c

        # One pump task per choice feeds a shared queue, so the choices stream interleaved as they decode.
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream) -> None:
            async for out in stream:
                await merged.put((i, out))

        pumps = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
        try:
            if chat:
                for i in range(len(streams)):
                    yield _sse(chunk(i, None, None, role=True))
            done, prompt_tokens, completion_tokens = 0, 0, 0
            while done < len(streams):
                i, out = await merged.get()
                if out.finish_reason == FINISH_ERROR:
                    err = {
                        "message": out.error or "generation failed",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                    yield _sse({"error": err})
                    break
                if out.text or out.logprobs:
                    yield _sse(chunk(i, out.text, None, logprobs=out.logprobs))
                if out.finish_reason is not None:
                    done += 1
                    prompt_tokens, completion_tokens = (
                        out.prompt_tokens,
                        completion_tokens + out.completion_tokens,
                    )
                    yield _sse(chunk(i, None, out.finish_reason))
            else:
                if include_usage:
                    usage = _usage(prompt_tokens, completion_tokens)
                    yield _sse(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": state.name,
                            "choices": [],
                            "usage": usage,
                        }
                    )
            yield "data: [DONE]\n\n"
        finally:
            # Runs on normal end and when the client disconnects (Starlette cancels this generator):
            # cancelling a pump cancels its engine request.
            release()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    return app
