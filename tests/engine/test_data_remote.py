"""Images named by URL in VL records: fetched once into the dataset directory, public hosts only by default,
and clear errors when the worker is offline, the server refuses, or the file is too large."""

from __future__ import annotations

import json

import pytest
from image_standin import ImageHost, picture

from engine.data import remote
from engine.data.formats import parse_record


@pytest.fixture
def image_server():
    """A local HTTP server with one PNG at /red.png, a 404 elsewhere and a redirect at /moved.png."""
    png = picture((200, 20, 20))
    host = ImageHost({"/red.png": (png, "image/png")}, redirects={"/moved.png": "/red.png"})
    yield host.url, png, host.hits
    host.close()


def record(url: str) -> dict:
    return {
        "image_info": [{"matched_text_index": 0, "image_url": url}],
        "text_info": [{"text": "Colour?", "tag": "mask"}, {"text": "Red.", "tag": "no_mask"}],
    }


def test_a_url_image_is_fetched_once_into_the_dataset(image_server, tmp_path, monkeypatch):
    base, png, hits = image_server
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")  # the test server is on loopback
    ex = parse_record(record(f"{base}/red.png"), "erniekit_vl", "sft", tmp_path)
    (path,) = ex.turns[0].media
    assert path.parent == tmp_path / ".remote" and path.read_bytes() == png
    parse_record(record(f"{base}/red.png"), "erniekit_vl", "sft", tmp_path)
    assert hits == ["/red.png"]  # the second read used the copy
    assert [p.name for p in (tmp_path / ".remote").iterdir()] == [path.name]  # no partial file left


def test_url_problems_are_located_errors(image_server, tmp_path, monkeypatch):
    base, _, _ = image_server

    def problem(url: str) -> str:
        with pytest.raises(ValueError) as e:
            parse_record(record(url), "erniekit_vl", "sft", tmp_path)
        return str(e.value)

    # by default loopback / private hosts are not fetched: a dataset must not reach into the network
    assert "127.0.0.1 is a loopback address (127.0.0.1); record URLs are fetched from public hosts only" in (
        problem(f"{base}/red.png")
    )
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    assert "could not be fetched: the server answered 404 Not Found" in problem(f"{base}/nope.png")
    # a redirect is not followed (it could lead past the address check)
    assert "the server answered 302 Found" in problem(f"{base}/moved.png")
    monkeypatch.setattr(remote, "MAX_BYTES", 100)
    assert "larger than 100 bytes" in problem(f"{base}/red.png")
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "off")
    assert "fetching record URLs is turned off (ERNIE_STUDIO_MEDIA_URLS=off)" in problem(f"{base}/red.png")
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "public")
    offline = problem("https://no-such-host.invalid/cat.png")
    assert "cannot resolve 'no-such-host.invalid'" in offline and "is this worker offline?" in offline
    assert "or save it next to the data file" in offline
    assert not (tmp_path / ".remote").exists() or all(
        not p.name.endswith(".part") for p in (tmp_path / ".remote").iterdir()
    )
    json.dumps(offline)  # a plain message
