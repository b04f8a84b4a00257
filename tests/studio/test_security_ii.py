"""Issue 27 (Security II), studio side: no uploaded page runs in the studio's origin (both file routes serve
only previewable images and videos inline, with nosniff and a CSP), ``.remote/`` is never read back, Gradio's
uploads obey ERNIE_STUDIO_MAX_UPLOAD_MB, and a model whose chat template escapes is refused in the preview."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_datasets_zip import VL_DATA, VL_IMAGES, make_zip, post_zip

from studio.app import create_app
from studio.config import Settings
from studio.migrate import upgrade
from studio.services import datasets as datasets_svc

CSP = "default-src 'none'; sandbox"
ACTIVE = {
    "evil.html": b"<html><script>fetch('/api/v1/datasets')</script></html>",
    "evil.svg": b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(document.cookie)</script></svg>',
    "images/evil.js": b"alert(1)",
    "page.png.html": b"<script>alert(1)</script>",
}


@pytest.fixture(scope="module")
def studio_with_ui(tmp_path_factory):
    """The studio as `ernie-studio up` serves it (Gradio mounted), with a 1 MB upload limit."""
    settings = Settings(home=tmp_path_factory.mktemp("ui") / "home", max_upload_mb=1)
    upgrade(settings)
    with TestClient(create_app(settings, with_ui=True), base_url="http://127.0.0.1") as client:
        yield client


def upload_zip_with_pages(client) -> tuple[dict, Path]:
    """A valid VL zip that also carries HTML, SVG and JS members; returns the dataset and its folder."""
    image = sorted(VL_IMAGES.iterdir())[0]
    members = {"data.jsonl": VL_DATA.read_bytes(), **ACTIVE}
    members.update({f"images/{p.name}": p.read_bytes() for p in VL_IMAGES.iterdir()})
    r = post_zip(client, make_zip(members))
    assert r.status_code == 201, r.text
    ds = r.json()
    folder = next(client.app.state.settings.datasets_dir.rglob("evil.html")).parent
    assert (folder / "evil.html").is_file() and (folder / "images" / image.name).is_file()
    return ds, folder


def assert_attachment(r, body: bytes) -> None:
    assert r.status_code == 200, r.text
    assert r.content == body  # served, but as a download the browser never renders
    assert r.headers["content-type"].split(";")[0] == "application/octet-stream"
    assert r.headers["content-disposition"].startswith("attachment")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["content-security-policy"] == CSP


def assert_inline_image(r, body: bytes) -> None:
    assert r.status_code == 200 and r.content == body
    assert r.headers["content-type"] == "image/png"
    assert r.headers["content-disposition"].startswith("inline")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["content-security-policy"] == CSP


def test_rest_route_serves_pages_only_as_attachments_and_never_remote(client, settings):
    ds, folder = upload_zip_with_pages(client)
    for name, body in ACTIVE.items():
        assert_attachment(client.get(f"/api/v1/datasets/{ds['id']}/files/{name}"), body)
    image = sorted(VL_IMAGES.iterdir())[0]
    assert_inline_image(
        client.get(f"/api/v1/datasets/{ds['id']}/files/images/{image.name}"), image.read_bytes()
    )
    # the read-back path of issue 27: what a record's URL answered, kept in .remote/, is not served
    remote = folder / ".remote"
    remote.mkdir()
    (remote / "0123abcd").write_bytes(b"internal service answer")
    (remote / "0123abcd.png").write_bytes(image.read_bytes())
    for rel in (
        ".remote/0123abcd",
        ".remote/0123abcd.png",
        "images/../.remote/0123abcd",
        "./.remote/0123abcd",
    ):
        r = client.get(f"/api/v1/datasets/{ds['id']}/files/{rel}")
        assert r.status_code in (403, 404, 422), (rel, r.status_code)
        assert b"internal service answer" not in r.content
    with pytest.raises(datasets_svc.NotFound, match=r"\.remote/ of dataset"):
        from studio.db import session_factory

        with session_factory(settings)() as session:
            datasets_svc.dataset_file(session, settings, ds["id"], ".remote/0123abcd")


# Every spelling of Gradio's file route: /file={path} and its alias /file/{path}, at the root and under
# /gradio_api (an outside review found the alias served pages inline after the first spelling was guarded).
GRADIO_FILE_ROUTES = ("/gradio_api/file=", "/gradio_api/file/")


def test_gradio_file_route_serves_pages_only_as_attachments_and_never_remote(studio_with_ui):
    _, folder = upload_zip_with_pages(studio_with_ui)
    (folder / ".remote").mkdir()
    (folder / ".remote" / "0123abcd").write_bytes(b"internal service answer")
    for route in GRADIO_FILE_ROUTES:
        _gradio_route_guarded(studio_with_ui, route, folder)
    for route in ("/file=", "/file/"):  # mounted at /, Gradio 6 serves files under /gradio_api only
        r = studio_with_ui.get(f"{route}{folder / 'evil.html'}")
        assert r.status_code == 404 and b"<script>" not in r.content, route


def _gradio_route_guarded(studio_with_ui, route: str, folder: Path) -> None:
    for name, body in ACTIVE.items():
        assert_attachment(studio_with_ui.get(f"{route}{folder / name}"), body)
        head = studio_with_ui.head(f"{route}{folder / name}")
        assert head.headers.get("x-content-type-options") == "nosniff", (route, name, head.headers)
    image = sorted(VL_IMAGES.iterdir())[0]
    assert_inline_image(studio_with_ui.get(f"{route}{folder / 'images' / image.name}"), image.read_bytes())
    for named in (folder / ".remote" / "0123abcd", f"{folder}/images/../.remote/0123abcd"):
        r = studio_with_ui.get(f"{route}{named}")
        assert r.status_code in (403, 404) and b"internal service answer" not in r.content, (route, named)
    # Gradio's file route would fetch a URL and stream it back from the studio's origin
    for url in ("http://127.0.0.1:9/x.png", "https://example.com/a.html", "http:/example.com/a"):
        r = studio_with_ui.get(f"{route}{url}")
        assert r.status_code in (403, 404) and b"Example Domain" not in r.content, (route, url)
    # a refused file still carries the headers
    r = studio_with_ui.get(f"{route}/etc/passwd")
    assert r.status_code in (403, 404) and r.headers["x-content-type-options"] == "nosniff", route


def _multipart(files: list[tuple[str, bytes]], boundary: str = "studio-test-boundary") -> list[bytes]:
    parts = []
    for name, data in files:
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        )
        parts += [head.encode(), data, b"\r\n"]
    return [*parts, f"--{boundary}--\r\n".encode()]


def test_gradio_uploads_obey_the_upload_limit(studio_with_ui):
    upload_dir = Path(studio_with_ui.app.state.settings.home)
    ok = studio_with_ui.post("/gradio_api/upload", files={"files": ("small.jsonl", b"{}\n" * 100)})
    assert ok.status_code == 200, ok.text
    # a picture uploaded through the UI (the chat's image box) is shown back inline
    image = sorted(VL_IMAGES.iterdir())[0]
    shown = studio_with_ui.post("/gradio_api/upload", files={"files": (image.name, image.read_bytes())})
    assert_inline_image(studio_with_ui.get(f"/gradio_api/file={shown.json()[0]}"), image.read_bytes())
    # one file over the 1 MB limit, with its length declared
    big = studio_with_ui.post("/gradio_api/upload", files={"files": ("big.jsonl", b"x" * (3 * 2**20))})
    assert big.status_code == 413 and "ERNIE_STUDIO_MAX_UPLOAD_MB" in big.text
    # three files under the limit each, streamed without a declared length: the whole body is counted
    chunks = _multipart([(f"part{i}.bin", b"y" * (900 * 1024)) for i in range(3)])
    streamed = studio_with_ui.post(
        "/gradio_api/upload",
        content=iter(chunks),
        headers={"Content-Type": "multipart/form-data; boundary=studio-test-boundary"},
    )
    assert streamed.status_code == 413, streamed.text
    assert not list(upload_dir.rglob("part*.bin"))


def test_preview_refuses_a_model_whose_template_escapes(client, settings, tiny_model_dir, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    evil = settings.models_dir / "evil"
    shutil.copytree(tiny_model_dir, evil)
    (evil / "chat_template.jinja").write_text(
        f"{{{{ cycler.__init__.__globals__.os.popen('touch {sentinel}').read() }}}}"
    )
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"src": ["hi"], "tgt": ["there"]}) + "\n")
    with open(data, "rb") as f:
        ds = client.post("/api/v1/datasets", files={"file": ("d.jsonl", f)}).json()
    for route in ("preview", "stats"):
        param = "render_with" if route == "preview" else "model"
        r = client.get(f"/api/v1/datasets/{ds['id']}/{route}", params={param: "models/evil"})
        assert r.status_code == 422, r.text
        assert f"model {evil}, chat_template.jinja:1" in r.json()["message"]
    assert not sentinel.exists()


def test_a_download_name_cannot_leave_the_models_folder(client, settings):
    for name in ("x/..", "x/.", "x/a\\b"):
        r = client.post("/api/v1/models/downloads", json={"name": name})
        assert r.status_code == 422 and "is not a hub repo id" in r.json()["message"], (name, r.text)
    assert client.get("/api/v1/models/downloads").json() == []
