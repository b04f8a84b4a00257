"""Access token: `Authorization: Bearer <token>`, or a cookie set by opening any page with `?token=`."""

from __future__ import annotations

import hmac
import json
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "ernie_studio_token"
OPEN_PATHS = ("/api/v1/health",)


class TokenAuthMiddleware:
    """Pure ASGI (streaming responses pass through untouched); a no-op when no token is configured."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.token or scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        query_token = next((v for k, v in query if k == "token"), None)
        auth = headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed cookie header is simply no cookie
            cookie = SimpleCookie()
        cookie_token = cookie[COOKIE].value if COOKIE in cookie else None

        if query_token is not None and self._ok(query_token) and scope["type"] == "http":
            if scope["method"] == "GET" and not scope["path"].startswith("/api/"):
                # Browser login: remember the token in a cookie and drop it from the address bar.
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                location = scope["path"] + (f"?{rest}" if rest else "")
                await send(
                    {
                        "type": "http.response.start",
                        "status": 303,
                        "headers": [
                            (b"location", location.encode("latin-1")),
                            (
                                b"set-cookie",
                                f"{COOKIE}={query_token}; Path=/; HttpOnly; SameSite=Lax".encode("latin-1"),
                            ),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return
            await self.app(scope, receive, send)
            return
        if any(t is not None and self._ok(t) for t in (bearer, cookie_token, query_token)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 4401})
            return
        body = json.dumps(
            {
                "message": "this studio requires an access token: send 'Authorization: Bearer <token>', or open "
                "the URL `ernie-studio up` printed (it ends in ?token=...) once in the browser",
                "details": None,
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b'Bearer realm="ernie-studio"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _ok(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self.token.encode())
