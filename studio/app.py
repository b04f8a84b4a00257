"""The studio's ASGI app: REST API under /api/v1 (OpenAPI at /openapi.json) and the Gradio UI at "/"."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from studio.api.auth import TokenAuthMiddleware
from studio.api.errors import install_error_handlers
from studio.api.routes import compare, datasets, deployments, exports, models, runs
from studio.config import Settings, get_settings

log = logging.getLogger(__name__)
API_PREFIX = "/api/v1"


def create_app(settings: Settings | None = None, *, with_ui: bool = True) -> FastAPI:
    """Build the app; the UI is mounted when `studio.ui` is importable (it is built by its own module)."""
    settings = settings or get_settings()
    settings.ensure_dirs()
    app = FastAPI(
        title="ERNIE Studio",
        version="0.1.0",
        description="Upload data, fine-tune, compare and deploy ERNIE 4.5 models.",
        openapi_url="/openapi.json",
    )
    app.state.settings = settings
    install_error_handlers(app)

    @app.get(f"{API_PREFIX}/health", tags=["system"])
    def health() -> dict:
        """Liveness probe (open even when a token is required)."""
        return {"status": "ok"}

    for r in (
        datasets.router,
        runs.router,
        exports.router,
        compare.router,
        deployments.router,
        models.router,
    ):
        app.include_router(r, prefix=API_PREFIX)
    if with_ui:
        _mount_ui(app, settings)
    app.add_middleware(TokenAuthMiddleware, token=settings.token)
    return app


def app_from_env() -> FastAPI:
    """Factory for multi-process API serving (`ernie-studio up --no-ui --workers N`): settings from the
    environment."""
    return create_app(get_settings(), with_ui=False)


def _mount_ui(app: FastAPI, settings: Settings) -> None:
    try:
        import gradio as gr

        from studio.ui import build_ui
    except ImportError as e:
        log.warning("UI not available (%s); serving the API only", e)
        return
    gr.mount_gradio_app(app, build_ui(settings), path="/")
