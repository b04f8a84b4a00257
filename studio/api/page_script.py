"""A script put first in the <head> of the studio's page, before any of Gradio's own scripts run."""

from __future__ import annotations

import re

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_HEAD = re.compile(rb"<head(\s[^>]*)?>", re.IGNORECASE)


class HeadScript:
    """Inserts ``<script>{script}</script>`` right after ``<head ...>`` in the HTML answer to ``GET path``.

    Gradio's own ``head`` option adds its tags from the page's code once the app has loaded, after Gradio's
    modules have run; a script that must be in place before them (studio.ui.STATUS_TIMER_JS) goes into the
    served HTML instead. A compressed answer, one that is not HTML, or one without a <head> passes untouched.
    The script is the studio's own constant: nothing from a request reaches it."""

    def __init__(self, app: ASGIApp, script: str, path: str = "/") -> None:
        if "</script" in script.lower():
            raise ValueError("the head script may not contain </script>")
        self.app = app
        self.tag = f"<script>{script}</script>".encode()
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        start: Message | None = None  # an HTML answer's start, held until its body is whole
        chunks: list[bytes] = []

        async def edit(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = Headers(raw=message["headers"])
                if (
                    headers.get("content-type", "").startswith("text/html")
                    and "content-encoding" not in headers
                ):
                    start = message
                else:
                    await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            found = _HEAD.search(body)
            if found:
                body = body[: found.end()] + self.tag + body[found.end() :]
            headers = MutableHeaders(raw=list(start["headers"]))
            headers["content-length"] = str(len(body))
            await send({**start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, edit)
