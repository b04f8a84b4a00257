"""`ernie-studio chat` driven through a pipe against a real `ernie-studio serve`: streaming replies,
multi-turn history, the system prompt, /clear and /exit."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from serve_support import REPO, running_server, sharp_model


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    model_dir = sharp_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "sharp-tiny")
    with running_server(model_dir) as (base, _):
        yield base


def _chat(base: str, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "chat",
            "--url",
            base,
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            *args,
        ],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def _replies(stdout: str) -> list[str]:
    """Each reply is printed as `assistant: <streamed text>\n` (the text itself may hold newlines)."""
    replies = []
    for seg in stdout.split("assistant: ")[1:]:
        seg = seg.removesuffix("(conversation cleared)\n")
        replies.append(seg.removesuffix("\n"))
    return replies


def test_multi_turn_clear_and_exit(server):
    client = openai.OpenAI(base_url=server, api_key="unused", max_retries=0)

    def expected(messages):
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
        return r.choices[0].message.content

    sys_msg = [{"role": "system", "content": "Be brief."}]
    a1 = expected([*sys_msg, {"role": "user", "content": "Hello"}])
    a2 = expected([*sys_msg, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": a1},
                   {"role": "user", "content": "And then?"}])  # fmt: skip
    a3 = expected([*sys_msg, {"role": "user", "content": "And then?"}])
    assert a2 != a3, "history must change the answer for this test to mean anything"

    out = _chat(
        server, ["Hello", "And then?", "/clear", "And then?", "/exit", "never sent"], "--system", "Be brief."
    )
    assert out.returncode == 0, out.stderr
    assert _replies(out.stdout) == [a1, a2, a3]
    assert "(conversation cleared)" in out.stdout
    assert "never sent" not in out.stdout
    assert "HTTP Request" not in out.stdout + out.stderr  # no client logging mixed into the chat


def test_end_of_input_quits_and_unknown_commands_help(server):
    out = _chat(server, ["/help"])
    assert out.returncode == 0
    assert "unknown command /help" in out.stdout and "/clear" in out.stdout
    assert _replies(out.stdout) == []


def test_unreachable_server_is_a_clear_error():
    out = _chat("http://127.0.0.1:9/v1", ["hi"])
    assert out.returncode == 1
    assert "cannot reach http://127.0.0.1:9/v1" in out.stderr
