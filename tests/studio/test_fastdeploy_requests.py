"""What the studio sends to a FastDeploy deployment: the chat body as a recording server receives it (VL
thinking off unless asked, ignore_eos as min_tokens), and min_tokens capped at the edge of max_model_len."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.serve.fastdeploy import DEFAULT_MAX_MODEL_LEN, fit_chat_request, prompt_tokens
from studio.models import Deployment
from studio.services import deployments


@pytest.fixture
def recording_server():
    """An OpenAI-style endpoint that keeps every request body it receives."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", bodies
    server.shutdown()
    server.server_close()


def _running(session, model_dir, url, backend="fastdeploy") -> int:
    dep = Deployment(name="d", model_dir=str(model_dir), status="running", url=url, backend=backend)
    session.add(dep)
    session.commit()
    return dep.id


def test_vl_deployment_gets_thinking_off_unless_asked(session, recording_server, tiny_vl_model_dir):
    url, bodies = recording_server
    dep = _running(session, tiny_vl_model_dir, url)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]
    deployments.chat(session, dep, {"messages": messages, "max_tokens": 16, "ignore_eos": True})
    sent = bodies[-1]
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["min_tokens"] == 16 and sent["messages"] == messages
    # the user's choice (Deploy & Chat's thinking box) goes through as it is, other kwargs kept
    asked = {"messages": messages, "chat_template_kwargs": {"enable_thinking": True, "x": 1}}
    deployments.chat(session, dep, asked)
    assert bodies[-1]["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}


def test_text_and_paddle_deployments_get_no_thinking_kwargs(session, recording_server, tiny_model_dir):
    url, bodies = recording_server
    fd = _running(session, tiny_model_dir, url)
    deployments.chat(session, fd, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                                   "ignore_eos": True})  # fmt: skip
    assert "chat_template_kwargs" not in bodies[-1] and bodies[-1]["min_tokens"] == 9
    paddle = _running(session, tiny_model_dir, url, backend="paddle")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "ignore_eos": True}
    deployments.chat(session, paddle, body)
    assert "min_tokens" not in bodies[-1] and bodies[-1]["ignore_eos"] is True


def test_messages_the_template_cannot_render_are_refused_before_fastdeploy(
    session, recording_server, tmp_path, tiny_model_dir
):
    import shutil

    from studio.services.errors import InvalidInput

    url, bodies = recording_server
    model = tmp_path / "strict"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}", encoding="utf-8")
    dep = _running(session, model, url)
    with pytest.raises(InvalidInput, match="messages: the model's chat template cannot render them"):
        deployments.chat(session, dep, {"messages": [{"role": "user", "content": "hi"}]})
    assert bodies == []


def test_min_tokens_capped_at_the_edge_of_max_model_len(tiny_model_dir):
    """FastDeploy refuses prompt + min_tokens >= max_model_len: the cap leaves min_tokens one short of it."""
    messages = [{"role": "user", "content": "hello there"}]
    n = prompt_tokens(tiny_model_dir, messages)
    assert n > 3
    body = {"messages": messages, "max_tokens": 100, "ignore_eos": True}
    for limit, want in ((n + 101, 100), (n + 100, 99), (n + 2, 1)):
        fitted = fit_chat_request(body, prompt_tokens=n, max_model_len=limit)
        assert fitted["min_tokens"] == want and n + fitted["min_tokens"] < limit
    assert "min_tokens" not in fit_chat_request(body, prompt_tokens=n, max_model_len=n + 1)
    explicit = {"messages": messages, "min_tokens": 10**6}
    assert fit_chat_request(explicit, prompt_tokens=n)["min_tokens"] == DEFAULT_MAX_MODEL_LEN - n - 1
    mapped = {"messages": messages, "max_completion_tokens": 40, "ignore_eos": True}
    assert fit_chat_request(mapped, prompt_tokens=n)["min_tokens"] == 40


def test_prompt_count_holds_images_at_their_largest_grid(tiny_vl_model_dir):
    text = [{"role": "user", "content": "what is it?"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]
    grid = prompt_tokens(tiny_vl_model_dir, with_image) - prompt_tokens(tiny_vl_model_dir, text)
    from engine.data.vl_processor import ProcessorSettings

    s = ProcessorSettings.from_model_dir(tiny_vl_model_dir)
    assert grid >= s.max_pixels // s.factor**2
