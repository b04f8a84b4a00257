"""`ernie-studio serve` as a real subprocess on a loopback port, driven by the official `openai` client and
raw HTTP: greedy answers equal the no-cache argmax loop, concurrency, OpenAI-shaped errors, metrics,
client disconnects, the 429 limit and a clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from serve_support import free_port, running_server, sharp_model

import engine
from engine.serve.generate import GenerationEngine, generate_without_cache
from engine.serve.server import create_app
from studio.services.deployments import ChatStream

QUESTIONS = [
    "Hello there, how are you?",
    "What is the capital of France?",
    "Write a poem about the moon",
    "2 + 2 = ?",
    "Tell me a story",
    "翻译成英文：今天天气很好",
    "List three colours",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def sharp_dir(tiny_model_dir, tmp_path_factory):
    return sharp_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "sharp-tiny")


@pytest.fixture(scope="module")
def server(sharp_dir):
    with running_server(sharp_dir, "--max-num-seqs", "8", "--max-model-len", "512") as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def reference(sharp_dir):
    model, tok = engine.load_model(str(sharp_dir)), engine.load_tokenizer(str(sharp_dir))

    def greedy(messages, n):
        prompt = tok.encode(tok.apply_chat_template(messages))
        ids = generate_without_cache(model, prompt, n, set(tok.stop_token_ids))
        stopped = ids[-1] in tok.stop_token_ids
        return tok.decode(ids), len(ids), len(prompt), "stop" if stopped else "length"

    return greedy


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0)


def _msgs(q):
    return [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": q}]


def test_models_health_and_served_name(server, client):
    base, _ = server
    assert [m.id for m in client.models.list().data] == ["default"]
    assert httpx.get(base.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_openai_client_greedy_equals_argmax_loop(client, reference):
    for q in QUESTIONS[:2]:
        text, n_out, n_prompt, finish = reference(_msgs(q), 20)
        r = client.chat.completions.create(model="default", messages=_msgs(q), max_tokens=20, temperature=0)
        assert r.object == "chat.completion" and r.model == "default"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == text
        assert r.choices[0].finish_reason == finish
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
        assert r.usage.total_tokens == n_prompt + n_out


def test_openai_client_streaming_equals_non_streaming(client, reference):
    text, n_out, n_prompt, finish = reference(_msgs(QUESTIONS[2]), 20)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=_msgs(QUESTIONS[2]),
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_out
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_text_completions(client, sharp_dir):
    model, tok = engine.load_model(str(sharp_dir)), engine.load_tokenizer(str(sharp_dir))
    prompt = "Once upon a time"
    ids = generate_without_cache(model, tok.encode(prompt), 12, set(tok.stop_token_ids))
    r = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == tok.decode(ids)
    s = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in s) == tok.decode(ids)


def test_stream_usage_when_asked_in_openais_shape(client, sharp_dir):
    """`stream_options: {"include_usage": true}`: every chunk carries `usage: null` and one last chunk has no
    choices and the usage of all of them (chat with n=2, and text completions); without it, no usage."""
    chat = list(
        client.chat.completions.create(
            model="default", messages=_msgs(QUESTIONS[0]), max_tokens=6, temperature=0, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *body, last = chat
    assert last.choices == [] and all(c.choices and c.usage is None for c in body)
    completed = sum(1 for c in body if c.choices[0].delta.content) >= 1
    assert completed and last.usage.completion_tokens == 12  # two choices of 6 tokens (greedy, no stop)
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12 and last.usage.prompt_tokens > 0
    prompt = "Once upon a time"
    n_prompt = len(engine.load_tokenizer(str(sharp_dir)).encode(prompt))
    text = list(
        client.completions.create(
            model="default", prompt=prompt, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert text[-1].choices == [] and all(c.usage is None for c in text[:-1])
    assert (text[-1].usage.prompt_tokens, text[-1].usage.completion_tokens) == (n_prompt, 5)
    plain = list(
        client.chat.completions.create(
            model="default", messages=_msgs(QUESTIONS[0]), max_tokens=4, temperature=0, stream=True
        )
    )
    assert all(c.choices and c.usage is None for c in plain)


def test_langchain_chat_openai(server, client):
    """LangChain's ChatOpenAI (invoke and stream) gets the same answer as the openai client."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server[0], api_key="unused", model="default", temperature=0, max_tokens=12, max_retries=0
    )
    expected = (
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0
        )
        .choices[0]
        .message.content
    )
    reply = llm.invoke("Hello")
    assert reply.content == expected
    assert reply.usage_metadata["output_tokens"] >= 1
    assert "".join(chunk.content for chunk in llm.stream("Hello")) == expected


def test_eight_concurrent_streams_match_alone(server, client):
    alone = [
        client.chat.completions.create(model="default", messages=_msgs(q), max_tokens=16 + i, temperature=0)
        .choices[0]
        .message.content
        for i, q in enumerate(QUESTIONS)
    ]
    aclient = openai.AsyncOpenAI(base_url=server[0], api_key="unused", max_retries=0)

    async def one(i, q):
        stream = await aclient.chat.completions.create(
            model="default", messages=_msgs(q), max_tokens=16 + i, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i, q) for i, q in enumerate(QUESTIONS)))
        finally:
            await aclient.close()

    assert asyncio.run(all_of_them()) == alone


def test_fastdeploy_extra_fields_and_stop_strings(client, reference):
    text, *_ = reference(_msgs(QUESTIONS[3]), 20)
    # top_k=1 is greedy whatever the temperature; the other FastDeploy extras are accepted
    r = client.chat.completions.create(
        model="default",
        messages=_msgs(QUESTIONS[3]),
        max_tokens=20,
        temperature=1.3,
        extra_body={
            "top_k": 1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert r.choices[0].message.content == text
    stop = text[4:7]
    r = client.chat.completions.create(
        model="default", messages=_msgs(QUESTIONS[3]), max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].message.content == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    seeded = [
        client.chat.completions.create(
            model="default", messages=_msgs(QUESTIONS[4]), max_tokens=12, temperature=1.0, seed=7
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(
        model="default",
        messages=_msgs(QUESTIONS[5]),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy took the top token
    streamed = [
        lp
        for c in client.chat.completions.create(
            model="default",
            messages=_msgs(QUESTIONS[5]),
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content
    ]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    c = client.completions.create(
        model="default", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=1
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_n_choices(client):
    greedy = client.chat.completions.create(
        model="default", messages=_msgs("hi"), max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    kw = dict(model="default", messages=_msgs("hi"), max_tokens=8, temperature=1.0, seed=11, n=3)
    sampled = client.chat.completions.create(**kw)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1, "seed + i gives each choice its own sample"
    assert 3 <= sampled.usage.completion_tokens <= 3 * 8  # summed over the choices
    assert greedy.usage.completion_tokens == 2 * (greedy.usage.completion_tokens // 2)
    parts = {0: "", 1: "", 2: ""}
    for c in client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            parts[ch.index] += ch.delta.content or ""
    assert [parts[i] for i in range(3)] == texts


BAD_REQUESTS = [
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "'nope' does not exist", "model"),
    ({"model": "default", "messages": []}, 400, "messages", "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ({"model": "default", "messages": "hi"}, 400, "messages", "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", "temperature"),
    ({"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "model"),
    ({"model": "default", "messages": [{"role": "user", "content": "word " * 2000}]}, 400, "maximum context length is 512", "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "lower max_tokens", "max_tokens"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 50}, 400, "n=50", "n"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool calling", "tools"),
    ({"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "only text parts", "messages.0.content.0"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "fragment", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, body, status, fragment, param):
    r = httpx.post(server[0] + "/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"]
    assert err["param"] == param


def test_server_keeps_serving_after_errors(server, client):
    r = httpx.post(
        server[0] + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="prompt: must not be empty"):
        client.completions.create(model="default", prompt="")
    r = client.chat.completions.create(model="default", messages=_msgs("still there?"), max_tokens=4)
    assert r.usage.completion_tokens >= 1


def _metric(base: str, name: str) -> float:
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


def test_metrics_and_client_disconnect_stops_generation(server):
    base = server[0]
    # a request of its own first: the module's tests run in a random order, and drawn first this test found
    # the counters at 0 (no earlier test had asked anything)
    done = httpx.post(
        base + "/chat/completions",
        json={"model": "default", "messages": _msgs("count"), "max_tokens": 4, "stream": True},
        timeout=60,
    )
    assert done.status_code == 200, done.text
    assert _metric(base, "ernie_time_to_first_token_seconds_count") > 0
    assert _metric(base, "ernie_generation_tokens_total") > 0
    assert (
        _metric(base, "ernie_e2e_request_latency_seconds_count")
        >= _metric(base, "ernie_time_per_output_token_seconds_count")
        > 0
    )
    aborted = _metric(base, 'ernie_request_success_total{model_name="default",finished_reason="abort"}')
    body = {
        "model": "default",
        "messages": _msgs("go on forever"),
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/chat/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    generated_at_close = _metric(base, "ernie_generation_tokens_total")
    for _ in range(100):
        if (
            _metric(base, 'ernie_request_success_total{model_name="default",finished_reason="abort"}')
            > aborted
        ):
            break
        time.sleep(0.05)
    assert (
        _metric(base, 'ernie_request_success_total{model_name="default",finished_reason="abort"}')
        == aborted + 1
    )
    assert _metric(base, "ernie_num_requests_running") == 0
    # it stopped well short of the 400 tokens it asked for
    assert _metric(base, "ernie_generation_tokens_total") - generated_at_close < 200


ABORTED = 'ernie_request_success_total{model_name="default",finished_reason="abort"}'


def _aborted_once_more(base: str, before: float) -> bool:
    for _ in range(200):
        if _metric(base, ABORTED) > before:
            break
        time.sleep(0.05)
    return _metric(base, ABORTED) == before + 1


@pytest.mark.parametrize("reader", ["suspended", "reading"])
def test_a_chat_stream_closed_from_another_thread_stops_the_generation(server, reader):
    """The studio's Stop: ChatStream.close() from another thread ends the request to the model server whether
    the reply's handler is suspended between deltas (Gradio never resumes a cancelled one) or reading."""
    base = server[0]
    aborted = _metric(base, ABORTED)
    body = {"model": "default", "messages": _msgs("go on forever"), "max_tokens": 400, "ignore_eos": True}
    stream = ChatStream(1, base + "/chat/completions", {**body, "stream": True}, timeout=30)
    deltas = iter(stream)
    got = [next(deltas) for _ in range(3)]
    if reader == "reading":
        ended = threading.Event()
        threading.Thread(target=lambda: (got.extend(deltas), ended.set()), daemon=True).start()
    threading.Thread(target=stream.close).start()
    assert _aborted_once_more(base, aborted)
    if reader == "reading":
        assert ended.wait(10), "the reading thread ended quietly once the stream was closed"
    assert len(got) < 200, len(got)
    assert _metric(base, "ernie_num_requests_running") == 0


def check_sse_wire_format(url: str) -> None:
    """Raw SSE: `data: {json}` events, blank-line separated, ending with `data: [DONE]`; served name used."""
    body = {"model": "ernie-tiny", "messages": _msgs("hi"), "max_tokens": 3, "stream": True}
    raw = httpx.post(url, json=body, timeout=30).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {p["model"] for p in payloads} == {"ernie-tiny"}
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    models = httpx.get(url.replace("/chat/completions", "/models")).json()
    assert [m["id"] for m in models["data"]] == ["ernie-tiny"]


def test_concurrency_limit_answers_429_and_custom_name(sharp_dir):
    model, tok = engine.load_model(str(sharp_dir)), engine.load_tokenizer(str(sharp_dir))
    app = create_app(GenerationEngine(model, tok, max_num_seqs=2), "ernie-tiny", max_concurrent_requests=1)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        check_sse_wire_format(url)
        long = {
            "model": "ernie-tiny",
            "messages": _msgs("x"),
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url, json=long, timeout=30) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)
            busy = httpx.post(url, json={"model": "ernie-tiny", "messages": _msgs("y"), "max_tokens": 2})
            assert busy.status_code == 429
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
            assert "limit of 1 concurrent" in busy.json()["error"]["message"]
        for _ in range(100):  # the closed stream frees its slot
            ok = httpx.post(url, json={"model": "ernie-tiny", "messages": _msgs("y"), "max_tokens": 2})
            if ok.status_code != 429:
                break
            time.sleep(0.05)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        # a non-streaming client that gives up cancels its generation as well
        stats = app.state.serving.engine.stats
        aborted = stats.requests_finished.get("abort", 0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={**long, "stream": False}, timeout=0.5)
        for _ in range(100):
            if stats.requests_finished.get("abort", 0) > aborted:
                break
            time.sleep(0.05)
        assert stats.requests_finished.get("abort", 0) == aborted + 1
        assert stats.generation_tokens_total < 3000 + 300 + 2
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_sigterm_shuts_down_cleanly(sharp_dir):
    # a server of its own: the module's serves the other tests in whatever order they run
    with running_server(sharp_dir, "--max-model-len", "512") as (base, proc):
        assert openai.OpenAI(base_url=base, api_key="unused").models.list().data
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_vl_model_answers_about_an_inline_image(tiny_vl_model_dir, tmp_path):
    """A base64 image part becomes "Picture 1:" <|IMAGE_START|> + placeholders + <|IMAGE_END|>, its patches
    reach the vision encoder at prefill, and decoding continues from the prompt's largest 3-D position: the
    answer equals a no-cache argmax loop that passes the image (and recomputes every position) each step."""
    import base64
    import io

    import numpy as np
    import paddle
    from PIL import Image

    from engine.data.vl_processor import ProcessorSettings, preprocess_image
    from engine.tokenizer import IMAGE_END, IMAGE_PLACEHOLDER, IMAGE_START

    model, tok = engine.load_model(str(tiny_vl_model_dir)), engine.load_tokenizer(str(tiny_vl_model_dir))
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    item = preprocess_image(buf.getvalue(), ProcessorSettings.from_vision_config(model.config.vision_config))
    assert item.grid_thw == (1, 4, 6) and item.num_tokens == 6
    run = "Picture 1:" + IMAGE_START + IMAGE_PLACEHOLDER * 6 + IMAGE_END
    text = tok.apply_chat_template([{"role": "user", "content": "What is in " + run + "?"}])
    ids = tok.encode(text)
    expected = []
    with paddle.no_grad():
        for _ in range(8):
            vision = {"pixel_values": paddle.to_tensor(item.pixel_values), "grid_thw": [item.grid_thw]}
            logits = model(paddle.to_tensor([ids + expected]), **vision).logits
            expected.append(int(paddle.argmax(logits[0, -1]).item()))
            if expected[-1] in tok.stop_token_ids:
                break

    app = create_app(GenerationEngine(model, tok, max_num_seqs=2))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        vl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        content = [
            {"type": "text", "text": "What is in "},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "?"},
        ]
        r = vl.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
        )
        assert r.usage.prompt_tokens == len(ids)
        stops = set(tok.stop_token_ids)
        assert r.choices[0].message.content == tok.decode([t for t in expected if t not in stops])
        with pytest.raises(openai.BadRequestError, match="data:image"):
            vl.chat.completions.create(
                model="default",
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                    }
                ],
            )
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_vl_pictures_by_path_are_read_only_inside_the_media_dir(tiny_vl_model_dir, tmp_path):
    """image_url parts may name a file (``file://`` or a plain path) inside ``--media-dir``; the same
    picture as a data: URL gives the same prompt and patches; paths outside it, or without it, are refused."""
    import base64

    import numpy as np
    from PIL import Image

    from engine.serve.protocol import APIError, ChatCompletionRequest
    from engine.serve.state import ServingState

    media, outside = tmp_path / "media", tmp_path / "secret.png"
    media.mkdir()
    Image.fromarray(np.full((56, 84, 3), 90, np.uint8)).save(media / "grey.png")
    Image.fromarray(np.full((56, 84, 3), 90, np.uint8)).save(outside)
    model, tok = engine.load_model(str(tiny_vl_model_dir)), engine.load_tokenizer(str(tiny_vl_model_dir))
    gen = GenerationEngine(model, tok, max_num_seqs=1)

    def ask(url: str) -> dict:
        part = {"type": "image_url", "image_url": {"url": url}}
        return {
            "model": "m",
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
        }

    state = ServingState(gen, "m", 4, tiny_vl_model_dir, media_dir=media)
    data_url = "data:image/png;base64," + base64.b64encode((media / "grey.png").read_bytes()).decode()
    by_data = state.chat_prompt(ChatCompletionRequest(**ask(data_url)))
    for url in (f"file://{media / 'grey.png'}", "grey.png"):
        ids, items = state.chat_prompt(ChatCompletionRequest(**ask(url)))
        assert ids == by_data[0] and np.array_equal(items[0].pixel_values, by_data[1][0].pixel_values)
    for url in (f"file://{outside}", "../secret.png", "/etc/passwd"):
        with pytest.raises(APIError, match="is outside the server's --media-dir"):
            state.chat_prompt(ChatCompletionRequest(**ask(url)))
    without = ServingState(gen, "m", 4, tiny_vl_model_dir)
    with pytest.raises(APIError, match="reads files only from a --media-dir, which it was not given"):
        without.chat_prompt(ChatCompletionRequest(**ask("grey.png")))
