"""A model's chat template renders in an immutable sandbox: a template that reaches for Python internals is
refused (naming the model directory and its template file) in preview, train, eval and serve, and the
command it names never runs (a sentinel file it would create stays absent)."""

from __future__ import annotations

import json
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import engine
from engine.cli import main as cli_main
from engine.eval import load_eval_config, run_eval
from engine.tokenizer import ChatTemplateRefused
from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
ESCAPE = "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}"
# the same escape by computed names: no attribute is named in the source, only the sandbox can stop it
COMPUTED = "{{ (cycler|attr('__in' ~ 'it__')|attr('__glo' ~ 'bals__'))['os'].popen('touch %s').read() }}"


# Process-starting audit events seen while a `watching()` block runs (an audit hook cannot be removed, so
# it records only when armed).
_STARTS = {"os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.spawn"}
_seen: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _seen is not None and event in _STARTS:
        _seen.append(event)


sys.addaudithook(_audit)


@contextmanager
def watching():
    global _seen
    _seen = []
    try:
        yield _seen
    finally:
        _seen = None


def evil_model(
    src: Path, dst: Path, template: str, sentinel: Path, where: str = "chat_template.jinja"
) -> Path:
    shutil.copytree(src, dst)
    text = "{{ messages[0]['content'] }}\n" + template % sentinel
    if where == "chat_template.jinja":
        (dst / where).write_text(text)
    else:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": text}))
    return dst


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_an_escaping_template_is_refused_at_load_naming_model_and_file(tiny_model_dir, tmp_path, where):
    sentinel = tmp_path / "SENTINEL"
    d = evil_model(tiny_model_dir, tmp_path / "evil", ESCAPE, sentinel, where)
    with pytest.raises(ChatTemplateRefused, match=rf"model {d}, {where}:2: .*'__globals__'"):
        engine.load_tokenizer(str(d))
    assert not sentinel.exists()


def test_a_computed_escape_is_stopped_by_the_sandbox_at_render(tiny_model_dir, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    tok = engine.load_tokenizer(str(evil_model(tiny_model_dir, tmp_path / "evil", COMPUTED, sentinel)))
    refused = pytest.raises(
        ChatTemplateRefused, match=r"chat_template.jinja: the chat template tried to leave"
    )
    with watching() as started, refused:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert started == [] and not sentinel.exists()


def test_the_sandbox_keeps_what_templates_use(tiny_model_dir, tmp_path):
    d = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{% if messages | length > 2 %}{{ raise_exception('too long') }}{% endif %}"
    )
    tok = engine.load_tokenizer(str(d))
    msgs = [{"role": "user", "content": "<b>é"}, {"role": "assistant", "content": "x"}]
    assert tok.apply_chat_template(msgs) == '{"role": "user", "content": "<b>é"}'  # transformers' tojson
    with pytest.raises(Exception, match="too long"):
        tok.apply_chat_template(msgs + msgs)


def test_train_is_refused_before_the_model_loads(tiny_model_dir, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    d = evil_model(tiny_model_dir, tmp_path / "evil", ESCAPE, sentinel)
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(d),
            output_dir=str(tmp_path / "out"),
            fine_tuning="Full",
            train_dataset_path=str(DATA / "sft_demo.jsonl"),
            max_seq_len=64,
            batch_size=1,
            max_steps=1,
            disable_tqdm=True,
        ),
    )
    with pytest.raises(ChatTemplateRefused, match=r"chat_template\.jinja"):
        run_training(cfg)
    assert not sentinel.exists()


def test_eval_is_refused_before_the_model_loads(tiny_model_dir, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    d = evil_model(tiny_model_dir, tmp_path / "evil", ESCAPE, sentinel)
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"src": ["1+1?"], "tgt": ["2"]}) + "\n")
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"model_name_or_path: {d}\noutput_dir: {tmp_path / 'out'}\neval_dataset_type: erniekit\n"
        f"eval_dataset_path: {data}\nmetrics: exact_match\nmax_new_tokens: 2\nmax_seq_len: 64\n"
    )
    with pytest.raises(ChatTemplateRefused, match=r"chat_template\.jinja"):
        run_eval(load_eval_config(config))
    assert not sentinel.exists()


def test_serve_is_refused_and_a_request_cannot_escape(tiny_model_dir, tmp_path, capsys):
    from engine.serve.generate import GenerationEngine
    from engine.serve.server import create_app

    sentinel = tmp_path / "SENTINEL"
    d = evil_model(tiny_model_dir, tmp_path / "evil", ESCAPE, sentinel)
    with socket.socket() as taken:  # were the server to start, it would fail on this port, not hang
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli_main(["serve", "--model", str(d), "--port", str(taken.getsockname()[1])]) == 2
    assert f"model {d}, chat_template.jinja:2" in capsys.readouterr().err

    d2 = evil_model(tiny_model_dir, tmp_path / "evil2", COMPUTED, sentinel)
    app = create_app(
        GenerationEngine(engine.load_model(str(d2)), engine.load_tokenizer(str(d2)), max_num_seqs=1)
    )
    with TestClient(app) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
    assert r.status_code == 400 and "tried to leave its sandbox" in r.text
    assert not sentinel.exists()


def test_the_fastdeploy_launch_is_refused_before_any_export(tiny_model_dir, tmp_path):
    """FastDeploy renders the template in its own process: the studio's launcher loads it in the sandbox
    first, so an escaping template stops the launch before the serving export is written or FastDeploy runs."""
    import argparse

    from engine.serve.cli import _serve_fastdeploy

    sentinel = tmp_path / "SENTINEL"
    d = evil_model(tiny_model_dir, tmp_path / "evil", ESCAPE, sentinel)
    args = argparse.Namespace(log_dir=str(tmp_path / "fd-logs"))
    with pytest.raises(ChatTemplateRefused, match=r"chat_template\.jinja"):
        _serve_fastdeploy(args, d)
    assert not (tmp_path / "fd-logs").exists() and not sentinel.exists()
