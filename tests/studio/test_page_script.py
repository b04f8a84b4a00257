"""studio.api.page_script.HeadScript: the studio's page carries STATUS_TIMER_JS first in its <head>."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.testclient import TestClient

from studio.api.page_script import HeadScript


def _app(page: str, **headers: str) -> TestClient:
    app = FastAPI()

    @app.get("/")
    def root() -> Response:
        return HTMLResponse(page, headers=headers)

    @app.get("/data")
    def data() -> Response:
        return JSONResponse({"html": "<head></head>"})

    app.add_middleware(HeadScript, script="window.__first = 1;")
    return TestClient(app)


def test_the_script_goes_first_in_the_head_and_the_length_follows():
    client = _app('<!doctype html><html><HEAD lang="en"><script src="/gradio.js"></script></HEAD></html>')
    r = client.get("/?tab=train")
    assert r.text.startswith('<!doctype html><html><HEAD lang="en"><script>window.__first = 1;</script>')
    assert r.text.endswith('<script src="/gradio.js"></script></HEAD></html>')
    assert int(r.headers["content-length"]) == len(r.content)


def test_other_paths_compressed_pages_and_pages_without_a_head_pass_untouched():
    assert _app("<html></html>").get("/data").json() == {"html": "<head></head>"}
    assert _app("<html><body>no head</body></html>").get("/").text == "<html><body>no head</body></html>"
    zipped = _app("<head></head>", **{"content-encoding": "identity"})
    assert zipped.get("/").text == "<head></head>"


def test_a_script_that_would_close_its_tag_is_refused():
    with pytest.raises(ValueError, match="</script>"):
        HeadScript(FastAPI(), script="x = '</SCRIPT><img src=x>'")


def test_the_studio_page_starts_with_the_status_timer_script(tmp_path):
    from studio.app import create_app
    from studio.config import Settings
    from studio.migrate import upgrade
    from studio.ui import STATUS_TIMER_JS

    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
        page = client.get("/").text
    head = page.index("<head")
    assert page.index(f"<script>{STATUS_TIMER_JS}</script>") == page.index(">", head) + 1
