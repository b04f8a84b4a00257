"""One check of every JSON request body before any route parses it: its size, its nesting depth and its text.

FastAPI parses a JSON body with `json.loads`, which recurses once per level: a body of 100,000 `[` ends in a
RecursionError (answered as an unhelpful 400 "error parsing the body", or deeper in a route as a 500), and a
depth just under the interpreter's limit parses but breaks whatever recurses over it later. `\\ud800` (or its
raw UTF-8 bytes, which `json.loads` lets through) parses to a string that cannot be encoded again. Refusing
these once here covers every JSON route, the REST API's and the mounted UI's alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Far deeper than any request the studio takes (a chat message with content parts is ~6 levels), far
# shallower than the ~1000 frames Python allows.
MAX_JSON_DEPTH = 64
# Requests are small; the largest are chats with inline base64 images. Datasets come as multipart uploads,
# which this never reads.
MAX_JSON_BYTES = 32 * 2**20

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# An escape: a surrogate pair (fine), a lone surrogate (group 1), or any other escape (skipped whole, so
# the `\\` of an escaped backslash never starts a match of its own).
_ESCAPE = re.compile(
    rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|(u[dD][89a-fA-F][0-9a-fA-F]{2})|.)", re.S
)


def nested_deeper_than(body: bytes, limit: int) -> bool:
    """Whether arrays and objects nest (or stay open) more than `limit` levels in `body`; brackets inside
    strings do not count.

    Each round removes the innermost pairs, one level, with `bytes.replace` (a placeholder keeps a pair
    that only meets once its inside is gone for the next round): a megabyte of brackets takes milliseconds.
    """
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    for _ in range(limit + 1):
        if not brackets:
            return False
        inner = brackets.replace(b"[]", b"0").replace(b"{}", b"0").replace(b"0", b"")
        if len(inner) == len(brackets):
            # No pair left, only unbalanced brackets: the parser recurses into each one left open.
            return brackets.count(b"[") + brackets.count(b"{") > limit
        brackets = inner
    return True


def json_body_problem(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why a JSON request body is refused before parsing, naming the field where it can; None when fine."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (
            f"body: byte {e.start} is not valid UTF-8 ({e.reason}); send the JSON as UTF-8 text "
            "(a lone surrogate is not a character)"
        )
    if nested_deeper_than(body, max_depth):
        return f"body: arrays and objects nest more than {max_depth} levels deep (or are left open); send a flatter body"
    if b"\\u" in body:
        for m in _ESCAPE.finditer(body):
            if m.group(1):
                # the field's own name may hold the surrogate: shown escaped, so the answer encodes
                where = (_field_of_surrogate(body) or "body").encode("utf-8", "backslashreplace").decode()
                return (
                    f"{where}: \\{m.group(1).decode()} is a lone UTF-16 surrogate, not a character; "
                    "send valid Unicode text"
                )
    return None


def _field_of_surrogate(body: bytes) -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate; the depth is checked first."""
    try:
        stack: list[tuple[str, Any]] = [("", json.loads(body))]
    except ValueError:
        return None
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and not _encodable(value):
            return where or "body"
        items = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        )
        for key, item in reversed(list(items)):
            name = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and not _encodable(key):
                return name
            stack.append((name, item))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_json(scope: Scope) -> bool:
    """FastAPI parses a body as JSON when the content type says JSON, and when there is none at all."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return True


class JSONBodyGuard:
    """ASGI middleware: reads a JSON body (up to `max_bytes`), refuses it with a 413 / 422 `{message,
    details}` when it is too large, too deep or not valid text, else hands the same bytes on."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS") or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay(message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                limit = f"{self.max_bytes / 2**20:g} MB"
                problem = f"body: larger than {limit}; send less at once (datasets go as multipart uploads)"
                await _refuse(scope, receive, send, 413, problem)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_body_problem(body, self.max_depth) if body else None
        if problem:
            await _refuse(scope, receive, send, 422, problem)
            return
        await self.app(
            scope, _replay({"type": "http.request", "body": body, "more_body": False}, receive), send
        )


def _replay(first: Message, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A `receive` that gives `first` (the whole body read here), then defers to the real one."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    await JSONResponse({"message": message, "details": None}, status_code=status)(scope, receive, send)


GRADIO_UPLOAD_PATHS = ("/gradio_api/upload", "/upload")


class GradioUploadLimit:
    """ASGI middleware: Gradio's upload route under the studio's ERNIE_STUDIO_MAX_UPLOAD_MB, for the whole
    body (Gradio's own ``max_file_size`` counts each file of a request that may carry a thousand).

    A declared length over the limit is refused before anything is read; a body that grows past it while it
    streams stops Gradio's parser, which deletes what it wrote and answers 413.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, overhead: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.overhead = overhead

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GRADIO_UPLOAD_PATHS:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes + self.overhead
        problem = (
            f"file: the upload is over the limit of {self.max_bytes / 2**20:g} MB (maximum allowed size); "
            "split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _refuse(scope, receive, send, 413, problem)
                return
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > limit:
                from starlette.formparsers import MultiPartException

                raise MultiPartException(problem)
            return message

        await self.app(scope, counted, send)
