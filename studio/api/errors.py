"""Every error leaves the API as JSON `{"message": ..., "details": ...}` with a message a person can act on."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from studio.services.errors import ServiceError

log = logging.getLogger(__name__)


def _where(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)] or ["body"]
    return ".".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, e: ServiceError) -> JSONResponse:
        return JSONResponse({"message": e.message, "details": e.details}, status_code=e.status_code)

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
