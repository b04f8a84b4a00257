"""How the studio answers with a file a user uploaded (a dataset's images, a zip's members) so that no
uploaded page runs in the studio's origin.

Only the image and video types the studio previews are served inline, with the type named here (never one
guessed from content); every other file goes out as ``application/octet-stream`` with
``Content-Disposition: attachment``. Every answer carries ``X-Content-Type-Options: nosniff`` and a CSP that
lets nothing run even when opened directly. ``.remote/`` (copies of the URLs records name,
``engine.data.remote``) is never served: its bodies came from servers the record chose. The same rule
covers ``/api/v1/datasets/{id}/files/...`` and Gradio's ``/gradio_api/file=...``.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from starlette.responses import FileResponse, JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.data.remote import CACHE_DIR

INLINE_MEDIA_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
    ".bmp": "image/bmp",
    ".tif": "image/tiff",
    ".tiff": "image/tiff",
    ".mp4": "video/mp4",
    ".m4v": "video/mp4",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
}
SERVED_FILE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; sandbox",
}
# Gradio serves files at /file={path} and at its alias /file/{path} (routes.py), each also under /gradio_api.
GRADIO_FILE_PREFIXES = ("/gradio_api/file=", "/gradio_api/file/", "/file=", "/file/")


def inline_media_type(name: str) -> str | None:
    """The type a file is served inline as, or None when it is served as an attachment."""
    return INLINE_MEDIA_TYPES.get(PurePosixPath(name).suffix.lower())


def in_remote_cache(path: str | Path) -> bool:
    """Whether a path names something inside a ``.remote/`` directory (as written, or once resolved)."""
    written = Path(os.path.normpath(str(path)))
    if CACHE_DIR in written.parts:
        return True
    try:
        return CACHE_DIR in written.resolve().parts
    except (OSError, RuntimeError):
        return True


def served_file_response(path: Path) -> FileResponse:
    """A dataset file as the REST API serves it: inline only as a previewable image or video."""
    media = inline_media_type(path.name)
    return FileResponse(
        path,
        media_type=media or "application/octet-stream",
        filename=path.name,
        content_disposition_type="inline" if media else "attachment",
        headers=SERVED_FILE_HEADERS,
    )


class GradioFileGuard:
    """ASGI middleware over Gradio's file route: ``.remote/`` and URLs are a 404, every answer gets the types,
    disposition and headers of ``served_file_response`` (Gradio serves any file under its allowed paths
    inline with a guessed type, ``text/html`` included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        prefix = next((p for p in GRADIO_FILE_PREFIXES if path.startswith(p)), None)
        if prefix is None:
            await self.app(scope, receive, send)
            return
        named = path[len(prefix) :]
        problem = None
        if "://" in named or named.lower().startswith(("http:", "https:")):
            # Gradio would fetch the URL and stream it back from the studio's origin; the studio shows only
            # files it holds
            problem = "the studio serves its own files only, not URLs"
        elif in_remote_cache(named):
            problem = f"{CACHE_DIR}/ holds copies of the URLs records name; it is not served"
        if problem:
            response = JSONResponse(
                {"message": problem, "details": None}, status_code=404, headers=SERVED_FILE_HEADERS
            )
            await response(scope, receive, send)
            return
        media = inline_media_type(named.split("?", 1)[0])

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = _file_headers(message.get("headers", []), message["status"], media)
            await send(message)

        await self.app(scope, receive, guarded)


def _file_headers(raw: list, status: int, media: str | None) -> list[tuple[bytes, bytes]]:
    replaced = {b"content-security-policy", b"x-content-type-options"}
    if status < 300:
        replaced |= {b"content-type", b"content-disposition"}
    headers = [(k, v) for k, v in raw if k.lower() not in replaced]
    headers += [(k.lower().encode(), v.encode()) for k, v in SERVED_FILE_HEADERS.items()]
    if status < 300:
        headers.append((b"content-type", (media or "application/octet-stream").encode()))
        headers.append((b"content-disposition", b"inline" if media else b"attachment"))
    return headers
