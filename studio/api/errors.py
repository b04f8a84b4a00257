"""Every error leaves the API as JSON `{"message": ..., "details": ...}` with a message a person can act on."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.messages import Message
from studio.messages import accepted_language, localize, localize_all
from studio.services.errors import ServiceError

log = logging.getLogger(__name__)


def _where(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)] or ["body"]
    return ".".join(parts)


def service_error_body(e: ServiceError, accept_language: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """A refusal's JSON body in the language ``Accept-Language`` asks for (English by default), with the
    message's key and fields when it has them (a client may show it in its own words), and its headers."""
    lang = accepted_language(accept_language)
    body: dict[str, Any] = {"message": localize(e.message, lang), "details": localize_all(e.details, lang)}
    if isinstance(e.message, Message):
        body.update(e.message.to_json())
    return body, {"Content-Language": lang, "Vary": "Accept-Language"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, e: ServiceError) -> JSONResponse:
        body, headers = service_error_body(e, request.headers.get("accept-language"))
        return JSONResponse(body, status_code=e.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = [f"{_where(tuple(err.get('loc', ())))}: {err.get('msg')}" for err in e.errors()]
        return JSONResponse(
            {"message": "invalid request: " + "; ".join(problems), "details": problems}, status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}; see /docs for the API"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; see /docs for the API"
        return JSONResponse(
            {"message": message, "details": None}, status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {
                "message": f"internal error ({type(e).__name__}); the server log has the details",
                "details": None,
            },
            status_code=500,
        )
