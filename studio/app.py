"""The studio's ASGI app: REST API under /api/v1 (OpenAPI at /openapi.json) and the Gradio UI at "/"."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from studio.api.auth import TokenAuthMiddleware
from studio.api.body_limits import GradioUploadLimit, JSONBodyGuard
from studio.api.errors import install_error_handlers
from studio.api.page_script import HeadScript
from studio.api.routes import (
    compare,
    datasets,
    deployments,
    evals,
    exports,
    models,
    nodes,
    recipes,
    runs,
    sweeps,
    templates,
)
from studio.api.security import RequestOriginMiddleware
from studio.api.served_files import GradioFileGuard
from studio.api.uploads import MULTIPART_OVERHEAD
from studio.config import Settings, get_settings
from studio.processes import freeze_startup_heap

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
        evals.router,
        compare.router,
        deployments.router,
        models.router,
        nodes.router,
        templates.router,
        recipes.router,
        sweeps.router,
    ):
        app.include_router(r, prefix=API_PREFIX)
    if with_ui:
        _mount_ui(app, settings)
    # Added first of the three, so it runs after the origin and token checks: a refused request's body is
    # never read.
    app.add_middleware(JSONBodyGuard)
    # Gradio's file and upload routes under the REST API's rules: uploaded files are served inline only as
    # previewable images and videos (studio/api/served_files.py), uploads obey ERNIE_STUDIO_MAX_UPLOAD_MB.
    app.add_middleware(GradioFileGuard)
    app.add_middleware(GradioUploadLimit, max_bytes=settings.max_upload_bytes, overhead=MULTIPART_OVERHEAD)
    app.add_middleware(TokenAuthMiddleware, token=settings.token)
    # Added last, so it runs first: a cross-site or rebound request is refused before anything else.
    app.add_middleware(
        RequestOriginMiddleware,
        loopback_only=not settings.token,
        allowed_hosts=settings.allowed_host_names,
        allowed_origins=settings.allowed_origin_urls,
    )
    return app


def app_from_env() -> FastAPI:
    """Factory for multi-process API serving (`ernie-studio up --no-ui --workers N`): settings from the
    environment."""
    app = create_app(get_settings(), with_ui=False)
    freeze_startup_heap()
    return app


def _mount_ui(app: FastAPI, settings: Settings) -> None:
    try:
        import gradio as gr

        from studio.ui import STATUS_TIMER_JS, build_ui
    except ImportError as e:
        log.warning("UI not available (%s); serving the API only", e)
        return
    blocks = build_ui(settings)
    # Record images are shown from the datasets folder; nothing else of the server's files is Gradio's.
    gr.mount_gradio_app(
        app,
        blocks,
        path="/",
        allowed_paths=[str(settings.datasets_dir)],
        max_file_size=settings.max_upload_bytes,  # each file, as the REST API counts it
    )
    # First in the page's <head>, before Gradio's scripts: see studio.ui.STATUS_TIMER_JS.
    app.add_middleware(HeadScript, script=STATUS_TIMER_JS)
    # Gradio checks that a file named in a request was uploaded through it (and that files it returns lie in
    # allowed paths) only for Blocks marked launched; `launch()` and Gradio's reload set this flag,
    # `mount_gradio_app` does not. Without it, `{"path": "/any/file", "meta": {"_type": "gradio.FileData"}}`
    # in a request is read from the server's disk.
    blocks.has_launched = True
