"""LLM as judge end to end: ``ernie-studio eval`` asks a real ``ernie-studio serve`` through the openai client;
pairwise judging asks every pair in both orders; a judge that does not answer stops the eval before any
model time, naming the config line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from serve_support import free_port, running_server

from engine.eval import JudgeError, load_eval_config, run_eval
from engine.eval.judge import Judge, JudgeSettings, combine

QA = [{"src": [f"What is {i} plus {i}?"], "tgt": [str(2 * i)]} for i in range(1, 4)]


@pytest.fixture(scope="module")
def judge_url(tiny_model_dir):
    with running_server(tiny_model_dir, "--max-num-seqs", "8", "--max-model-len", "1024") as (base, _):
        yield base


def write_config(tmp_path: Path, model: Path, **extra) -> Path:
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in QA))
    lines = [f"model_name_or_path: {model}", f"output_dir: {tmp_path / 'out'}", "eval_dataset_type: erniekit",
             f"eval_dataset_path: {data}", "max_new_tokens: 4", "max_seq_len: 128", "bootstrap_samples: 50"]  # fmt: skip
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / "eval.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def served_requests(base: str) -> float:
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    return sum(float(v) for v in re.findall(r"^ernie_request_success_total\{[^}]*\} (\S+)$", text, re.M))


def test_pairwise_judge_asks_both_orders_of_a_real_server(tiny_model_dir, judge_url, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, metrics="exact_match,judge", judge_url=judge_url,
                          judge_mode="pairwise", judge_max_tokens=8)  # fmt: skip
    before = served_requests(judge_url)
    summary = run_eval(load_eval_config(config))
    assert served_requests(judge_url) - before == 2 * len(QA)  # every pair asked twice
    rows = [json.loads(x) for x in (tmp_path / "out" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(QA)
    for row in rows:
        assert row["judge_orders"] == [["prediction", "baseline"], ["baseline", "prediction"]]
        assert len(row["judge_raw"]) == 2 and "judge" in row["scores"]
    assert summary.datasets["qa.jsonl"]["metrics"]["judge"]["unparsed"] + summary.datasets["qa.jsonl"][
        "metrics"
    ]["judge"]["n"] == len(QA)  # a random tiny model rarely writes a verdict: counted, not hidden


def test_score_judge_through_the_openai_client(tiny_model_dir, judge_url, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, metrics="judge", judge_url=judge_url, judge_max_tokens=4)
    before = served_requests(judge_url)
    run_eval(load_eval_config(config))
    assert served_requests(judge_url) - before == len(QA)
    rows = [json.loads(x) for x in (tmp_path / "out" / "eval_samples.jsonl").read_text().splitlines()]
    assert all(isinstance(r["judge_raw"], str) and "judge" in r["scores"] for r in rows)


def test_pairwise_prompts_swap_the_answers(monkeypatch):
    asked: list[str] = []
    replies = iter(["[[A]]", "[[B]]", "[[A]]", "[[A]]"])
    judge = Judge(JudgeSettings("http://127.0.0.1:9/v1", "default", "none", 5))
    monkeypatch.setattr(judge, "ask", lambda prompt: asked.append(prompt) or next(replies))
    monkeypatch.setattr("engine.eval.judge.THREADS", 1)
    cases = [{"question": "q", "reference": "r", "answer": "MINE", "baseline": "THEIRS"}] * 2
    out = judge.compare_all(cases)
    a_first = asked[0].index("MINE") < asked[0].index("THEIRS")
    b_first = asked[1].index("THEIRS") < asked[1].index("MINE")
    assert a_first and b_first
    assert [o["judge"] for o in out] == [
        1.0,
        0.5,
    ]  # agreeing orders win; A both times is position bias: a tie
    assert combine("C", "B") == 0.75 and combine(None, "A") is None


def test_a_judge_that_does_not_answer_is_a_located_error(tiny_model_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    config = write_config(tmp_path, tiny_model_dir, metrics="exact_match,judge", judge_url=url)
    with pytest.raises(
        JudgeError, match=rf"{re.escape(str(config))}:9: the judge at {re.escape(url)} does not answer"
    ):
        run_eval(load_eval_config(config))
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["status"] == "failed" and "does not answer" in results["error"]
    assert not (tmp_path / "out" / "eval_samples.jsonl").exists()


class KeyRecorder:
    """A stand-in judge endpoint that records the Authorization header of every request and refuses it."""

    def __init__(self):
        import http.server
        import threading

        self.seen: list[str] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(self.headers.get("Authorization", ""))
                body = b'{"error": {"message": "bad key"}}'
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    r = KeyRecorder()
    yield r
    r.close()


def test_a_judge_url_from_the_request_never_receives_the_workers_key(
    tiny_model_dir, tmp_path, recorder, monkeypatch
):
    monkeypatch.setenv("ERNIE_STUDIO_JUDGE_API_KEY", "operator-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "openai-secret")
    monkeypatch.setenv("ERNIE_STUDIO_JUDGE_URLS", "https://judge.internal.example/v1")
    config = write_config(tmp_path, tiny_model_dir, metrics="exact_match,judge", judge_url=recorder.url)
    with pytest.raises(JudgeError, match=r"ERNIE_STUDIO_JUDGE_API_KEY was not sent: .*give judge_api_key"):
        run_eval(load_eval_config(config))  # refused by the judge's check, before the model loads
    assert recorder.seen and not any("secret" in h for h in recorder.seen), recorder.seen
    assert not (tmp_path / "out" / "eval_samples.jsonl").exists()


def test_the_workers_key_goes_only_to_the_operators_judge_and_a_request_key_to_its_url(recorder, monkeypatch):
    from engine.eval.judge import api_key

    monkeypatch.setenv("OPENAI_API_KEY", "openai-secret")
    monkeypatch.setenv("ERNIE_STUDIO_JUDGE_URLS", f"https://other.example/v1, {recorder.url}/")
    for configured, expected in [("", "openai-secret"), ("request-key", "request-key")]:
        key, note = api_key(configured, recorder.url)
        with pytest.raises(JudgeError):
            Judge(JudgeSettings(recorder.url, "default", key, 5.0, key_note=note)).check()
        assert recorder.seen[-1] == f"Bearer {expected}"
    # the studio hands an eval's own key to the scorer in ERNIE_STUDIO_EVAL_JUDGE_API_KEY: it goes to any URL
    monkeypatch.setenv("ERNIE_STUDIO_EVAL_JUDGE_API_KEY", "eval-key")
    assert api_key("", "http://anywhere.example/v1") == ("eval-key", "")
    monkeypatch.delenv("ERNIE_STUDIO_EVAL_JUDGE_API_KEY")
    # a host that only starts like a listed one, or a listed host on another port, is not that endpoint
    for url in [recorder.url.replace("127.0.0.1", "127.0.0.1.evil.example"), "https://other.example:8443/v1",
                "https://other.example@evil.example/v1"]:  # fmt: skip
        assert api_key("", url)[0] == "none", url
    assert api_key("", "HTTPS://Other.Example:443/v1/")[0] == "openai-secret"
