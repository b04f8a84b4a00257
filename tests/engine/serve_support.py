"""Helpers for the generation / serving tests: a tiny model with sharper weights and a real server process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engine.llamacpp import TOOLS, find_tool
from engine.serve.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# llama.cpp's tools (llama-server, llama-quantize, llama-perplexity), built by `make llamacpp`; a skip here
# fails the run (tests/conftest.py): CI builds them.
needs_llamacpp = pytest.mark.skipif(
    any(find_tool(t) is None for t in TOOLS),
    reason="llama.cpp tools not built: run `make llamacpp` (make test builds them)",
)


def sharp_model(src: Path, dst: Path, std: float = 0.1, seed: int = 0) -> Path:
    """The tiny preset re-initialised with std 0.1: the 0.02 init makes greedy decoding repeat one token,
    which would let a broken cache or batch pass unnoticed; 0.1 gives varied, prompt-dependent output."""
    if (dst / "config.json").exists():
        return dst
    import engine
    from engine.models import save_model
    from engine.models.initialize import init_weights
    from engine.tokenizer import copy_tokenizer_files

    model = engine.load_model(str(src))
    init_weights(model, seed, std=std)
    tmp = dst.with_name(dst.name + ".tmp")
    save_model(model, tmp)
    copy_tokenizer_files(src, tmp)
    tmp.rename(dst)
    return dst


def start_llama(gguf_path: Path, log: Path, parallel: int = 2, threads: int = 2, max_model_len: int = 256):
    """The installed llama-server on ``gguf_path`` with the launcher's own command line, healthy (the
    started ``LlamaCppServer``; ``.port`` is its port, ``.stop()`` ends it)."""
    from engine.llamacpp import require_tool
    from engine.serve import llamacpp

    port = free_port()
    args = llamacpp.LlamaCppArgs(
        gguf=gguf_path, port=port, parallel=parallel, max_model_len=max_model_len, threads=threads
    )
    argv = llamacpp.build_argv(require_tool("llama-server"), args)
    return llamacpp.LlamaCppServer(argv, "127.0.0.1", port, log).start(120)


@contextmanager
def running_server(model_dir: Path, *extra: str, timeout: float = 90.0):
    """``ernie-studio serve`` as a subprocess on a free loopback port; yields (base_url, process)."""
    port = free_port()
    log = open(Path(model_dir).parent / f"serve-{port}.log", "w+")  # noqa: SIM115
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--port", str(port), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("serving "):
                break
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        else:
            raise TimeoutError(f"no 'serving ...' line within {timeout:.0f}s")
        assert line.strip().endswith(f" on http://127.0.0.1:{port}/v1"), line
        base = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def complete_in_process(model_dir: Path, prompt: str = "The capital", max_tokens: int = 4) -> dict:
    """One greedy ``/v1/completions`` answer from the engine's server app loaded in this process (what
    ``ernie-studio serve --backend paddle`` runs, without a process of its own)."""
    from fastapi.testclient import TestClient

    import engine
    from engine.serve.generate import GenerationEngine
    from engine.serve.server import create_app

    model, tok = engine.load_model(str(model_dir)), engine.load_tokenizer(str(model_dir))
    with TestClient(create_app(GenerationEngine(model, tok, max_num_seqs=1))) as client:
        r = client.post(
            "/v1/completions",
            json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    return r.json()


def fastdeploy_python_stand_in(
    directory: Path, help_text: str, pip_check_says: str, pip_check_code: int
) -> Path:
    """A `python` of another environment as the studio's worker meets FastDeploy's: it finds `fastdeploy`,
    reports fastdeploy-gpu 2.3.0, prints ``help_text`` for the api_server's --help and answers `pip check`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "help.txt").write_text(help_text)
    (directory / "pip-check.txt").write_text(pip_check_says)
    python = directory / "python3.10"
    python.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        f'  "-m fastdeploy.entrypoints.openai.api_server") cat {directory / "help.txt"} ;;\n'
        f'  "-m pip") cat {directory / "pip-check.txt"}; exit {pip_check_code} ;;\n'
        '  -c*) case "$2" in *packages_distributions*) echo 2.3.0 ;; esac ;;\n'
        "  *) exit 2 ;;\n"
        "esac\n"
    )
    python.chmod(0o755)
    return python
