"""``ernie-studio serve`` (OpenAI-compatible server) and ``ernie-studio chat`` (terminal chat client)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

import uvicorn

from engine.models.paths import tokenizer_dir
from engine.serve.fastdeploy import BLOCK_SIZE, VL_LIMITS

log = logging.getLogger(__name__)

# ERNIEKit's run_chat.yaml, key by key. `serve` and `chat` read flags, not a YAML file: each value goes to the
# flag named in the first table, and the second says why a key has none. tests/engine/test_erniekit_keys.py
# holds both to every key of ERNIEKit's example run_chat.yaml files; docs/training.md shows them.
ERNIEKIT_CHAT_FLAGS: dict[str, str] = {
    "model_name_or_path": "serve --model",
    "tensor_parallel_degree": "serve --tensor-parallel-size",
    "port": "serve --port",
    "max_model_len": "serve --max-model-len",
    "max_num_seqs": "serve --max-num-seqs",
    "quantization": "serve --quantization",
    "max_new_tokens": "chat --max-tokens",
    "temperature": "chat --temperature",
    "top_p": "chat --top-p",
}
ERNIEKIT_CHAT_REASONS: dict[str, str] = {
    "output_dir": "ERNIEKit's LoRA checkpoint to add to the model (None in its examples); serve --model "
    "takes a LoRA run directory as it is",
    "device": "serve --backend chooses the engine (auto: FastDeploy on a GPU node, else llama.cpp or Paddle)",
    "fuse_rms_norm": "a fused-kernel switch of ERNIEKit's predictor; the served model computes the same result",
    "load_choices": "FastDeploy's weight-loader choice; serve starts FastDeploy with its default loader",
    "reasoning_parser": "FastDeploy's reasoning parser would send the text before `</think>` as "
    "reasoning_content, which the studio's chats (reading content) do not show; serve passes none",
    "tool_call_parser": "FastDeploy's tool-call parser; serve starts FastDeploy without one",
    "enable_thinking": "a chat request's chat_template_kwargs decides thinking (a VL model answers without "
    "thinking unless the request turns it on)",
    "enable_mm": "FastDeploy recognises a VL model from its config.json (its --enable-mm is deprecated)",
    "limit_mm_per_prompt": "serve gives FastDeploy a fixed limit for VL models: "
    f"{VL_LIMITS['image']} images and {VL_LIMITS['video']} videos a prompt",
    "max_num_batched_tokens": "FastDeploy's prefill token budget; serve leaves FastDeploy's default",
    "block_size": f"serve gives FastDeploy its KV-cache block size, {BLOCK_SIZE}",
}


def erniekit_chat_table() -> str:
    """ERNIEKit's run_chat.yaml keys and where their values go here, for the docs."""
    rows = ["| run_chat.yaml key | here |", "|---|---|"]
    rows += [f"| `{k}` | `ernie-studio {v}` |" for k, v in ERNIEKIT_CHAT_FLAGS.items()]
    rows += [f"| `{k}` | not taken: {v} |" for k, v in ERNIEKIT_CHAT_REASONS.items()]
    return "\n".join(rows)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument(
        "--model",
        required=True,
        help="model directory (config.json, weights, tokenizer); llamacpp also takes a .gguf file or a GGUF export",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8188)
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "paddle", "fastdeploy", "llamacpp"],
        help="auto: FastDeploy on a GPU node where installed, llama.cpp on a CPU node where installed, "
        "else the built-in Paddle server",
    )
    p.add_argument(
        "--gguf-type",
        default=None,
        help="llamacpp only: which GGUF of an export to serve, or the type a checkpoint is written as "
        "(default q8_0)",
    )
    p.add_argument(
        "--gguf-dir",
        default=None,
        help="llamacpp only: where a checkpoint's GGUF is written and reused while newer than the model's "
        "files (default: the log dir)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="llamacpp only: CPU threads (0: llama.cpp's choice)"
    )
    p.add_argument("--served-model-name", default="default", help="the name clients pass as `model`")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together in one batch")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion token limit")
    p.add_argument("--max-concurrent-requests", type=int, default=64, help="more in flight answer 429")
    p.add_argument(
        "--quantization", default=None, choices=["wint4", "wint8", "block_wise_fp8"], help="FastDeploy only"
    )
    p.add_argument("--dtype", default="float32", help="weights dtype for the Paddle backend")
    p.add_argument(
        "--media-dir",
        default=None,
        help="VL: a folder whose pictures chat requests may name by path (image_url 'file://...' or a "
        "path inside it); without it only data: URLs are read",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="FastDeploy / llama.cpp logs and their serving export (default: <model>/fastdeploy-logs, "
        "<model>/llamacpp-logs)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="FastDeploy only: the share of the GPU's memory it may take (default 0.9; divide it among "
        "deployments sharing a GPU)",
    )
    p.add_argument(
        "--devices", default=None, help="FastDeploy only: GPU indices it runs on (CUDA_VISIBLE_DEVICES)"
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="FastDeploy only: GPUs per model")
    p.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="chat with a served model in the terminal")
    c.add_argument("--url", default="http://127.0.0.1:8188/v1", help="the server's /v1 base URL")
    c.add_argument("--model", default="default", help="served model name")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("--top-p", type=float, default=None)
    c.add_argument("--max-tokens", type=int, default=None)
    c.set_defaults(func=cmd_chat)


# ---- serve ------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from engine.serve import llamacpp
    from engine.serve.fastdeploy import choose_backend

    model_dir = Path(args.model).expanduser()
    if llamacpp.is_gguf(model_dir) and args.backend in ("auto", "llamacpp"):
        llamacpp.choose("llamacpp", model_dir)  # a GGUF has one engine: refuse clearly when it is missing
        return _serve_llamacpp(args, model_dir)
    if not (model_dir / "config.json").exists() and not (model_dir / "adapter_config.json").exists():
        raise FileNotFoundError(
            f"{model_dir}: neither config.json (a model) nor adapter_config.json (a LoRA run); "
            "--model must be a model directory, a LoRA run directory, or (--backend llamacpp) a GGUF"
        )
    if args.backend == "llamacpp":
        llamacpp.choose("llamacpp", model_dir)
        return _serve_llamacpp(args, model_dir)
    backend, reason = choose_backend(args.backend, model_dir)
    if args.backend == "auto" and backend == "paddle":
        chosen, why = llamacpp.choose("auto", model_dir)
        backend, reason = (chosen, f"{reason}; {why}") if chosen else (backend, f"{reason}; {why}")
    print(f"backend {backend}: {reason}", flush=True)
    if backend == "fastdeploy":
        return _serve_fastdeploy(args, model_dir)
    if backend == "llamacpp":
        return _serve_llamacpp(args, model_dir)
    return _serve_paddle(args, model_dir)


def _ready(name: str, host: str, port: int) -> None:
    print(f"serving {name} on http://{host}:{port}/v1", flush=True)


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown (exit status -15); a stop we asked for should
    exit 0, so the signals only set ``should_exit``."""

    @contextlib.contextmanager
    def capture_signals(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle_exit)
        yield


def _serve_paddle(args: argparse.Namespace, model_dir: Path) -> int:
    import engine
    from engine.serve.generate import GenerationEngine
    from engine.serve.server import create_app

    # the tokenizer first: a chat template the sandbox refuses stops the server before the model loads
    tokenizer = engine.load_tokenizer(str(tokenizer_dir(model_dir)))
    model = engine.load_model(str(model_dir), dtype=args.dtype)
    gen = GenerationEngine(model, tokenizer, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    app = create_app(gen, args.served_model_name, args.max_concurrent_requests, model_dir, args.media_dir)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = GracefulServer(config)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            _ready(args.served_model_name, args.host, args.port)

    threading.Thread(target=announce, daemon=True).start()
    server.run()  # uvicorn turns SIGTERM / SIGINT into a graceful shutdown (lifespan stops the engine)
    if not server.started:
        print(f"error: could not serve on {args.host}:{args.port} (is the port in use?)", file=sys.stderr)
        return 1
    return 0


def _serve_fastdeploy(args: argparse.Namespace, model_dir: Path) -> int:
    import engine
    from engine.serve.fastdeploy import (
        DEFAULT_MAX_MODEL_LEN,
        GPU_MEMORY_UTILIZATION,
        FastDeployServer,
        plan_launch,
    )
    from engine.train.serving_export import export_for_serving

    # FastDeploy renders the model's chat template itself: the template is loaded here first, in the sandbox,
    # so a template that tries to leave it stops the launch (as on the other backends) before any export.
    engine.load_tokenizer(str(tokenizer_dir(model_dir)))
    log_dir = Path(args.log_dir) if args.log_dir else model_dir / "fastdeploy-logs"
    # FastDeploy loads bf16 / fp16 Paddle-layout weights with its own config keys: a model in another form
    # (fp32 runs, HF layout, PTQ exports) is written in that form under the log dir first.
    served = export_for_serving(model_dir, log_dir / "model")
    if served != model_dir:
        print(f"serving export of {model_dir} written to {served}", flush=True)
    plan = plan_launch(
        served,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
        max_num_seqs=args.max_num_seqs,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization or GPU_MEMORY_UTILIZATION,
        devices=args.devices,
        log_dir=log_dir,
    )
    return run_until_signalled(FastDeployServer(plan), args.served_model_name, args.host, args.port)


def _serve_llamacpp(args: argparse.Namespace, model: Path) -> int:
    from engine.llamacpp import require_tool
    from engine.serve import llamacpp

    base = model.parent if model.is_file() else model
    log_dir = Path(args.log_dir) if args.log_dir else base / "llamacpp-logs"
    gguf_dir = Path(args.gguf_dir) if args.gguf_dir else log_dir
    gguf = llamacpp.gguf_for_serving(model, gguf_dir, args.gguf_type or llamacpp.SERVE_GGUF_TYPE)
    print(f"llama.cpp serves {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB)", flush=True)
    plan = llamacpp.LlamaCppArgs(
        gguf=gguf,
        port=args.port,
        host=args.host,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len or llamacpp.DEFAULT_CTX,
        parallel=args.max_num_seqs,
        threads=args.threads,
    )
    argv = llamacpp.build_argv(require_tool("llama-server"), plan)
    server = llamacpp.LlamaCppServer(argv, args.host, args.port, log_dir / "llama-server.log")
    return run_until_signalled(server, args.served_model_name, args.host, args.port)


class ExternalServer(Protocol):
    """A server process we launch (FastDeploy's api_server, llama-server)."""

    def start(self) -> object: ...
    def wait(self) -> int: ...
    def terminate(self) -> None: ...
    def stop(self) -> None: ...


def run_until_signalled(server: ExternalServer, name: str, host: str, port: int) -> int:
    """Start `server`, announce it, and wait for it to exit; SIGTERM / SIGINT stop it and exit 0, a failed
    start prints its error and exits 1.

    The handler only asks the server to stop (SIGTERM to its group, no wait): it runs in the main thread
    while that thread is inside the server's `Popen.wait()`, whose lock a second wait (or a poll loop that
    never sees the exit) would block on forever. The main thread's wait returns once the server has exited
    and `stop()` then reaps it and whatever it left.
    """
    stopping = threading.Event()

    def on_signal(signum, frame):
        stopping.set()
        server.terminate()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            server.start()
        except (RuntimeError, TimeoutError, ValueError) as e:
            if stopping.is_set():
                return 0
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        _ready(name, host, port)
        code = server.wait()
    finally:
        server.stop()
    return 0 if stopping.is_set() else code


# ---- chat -------------------------------------------------------------------------------------------
HELP = "commands: /clear forgets the conversation, /exit (or Ctrl-D) quits"


def stream_reply(client, url: str, body: dict, out=sys.stdout) -> str:
    """POST a streaming chat completion and print the deltas as they arrive; return the whole reply."""
    parts: list[str] = []
    with client.stream("POST", f"{url}/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise RuntimeError(f"server answered {r.status_code}: {message}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"].get("message", "generation failed"))
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    parts.append(text)
                    out.write(text)
                    out.flush()
    out.write("\n")
    out.flush()
    return "".join(parts)


def cmd_chat(args: argparse.Namespace) -> int:
    import httpx

    # httpx's per-request INFO lines would interleave the reply
    logging.getLogger("httpx").setLevel(logging.WARNING)
    url = args.url.rstrip("/")
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        if not _reachable(client, url):
            return 1
        print(f"chatting with {args.model} at {url}; {HELP}", flush=True)
        while (line := _next_line(interactive)) is not None:
            text = line.rstrip("\n")
            action = chat_command(text, history)
            if action == "exit":
                break
            if action == "message":
                send_turn(client, url, args, history, text)
    return 0


def _reachable(client, url: str) -> bool:
    import httpx

    try:
        client.get(f"{url}/models").raise_for_status()
    except httpx.HTTPError as e:
        print(
            f"error: cannot reach {url} ({e}); start a server with `ernie-studio serve --model DIR`",
            file=sys.stderr,
        )
        return False
    return True


def _next_line(interactive: bool) -> str | None:
    """The next line typed (with its newline), or None at end of input."""
    if interactive:
        print("> ", end="", flush=True)
    return sys.stdin.readline() or None


def chat_command(text: str, history: list[dict]) -> str:
    """What a typed line is: ``"exit"``, ``"skip"`` (blank, or a command already carried out) or ``"message"``."""
    if not text.strip():
        return "skip"
    if text.strip() == "/exit":
        return "exit"
    if text.strip() == "/clear":
        history.clear()
        print("(conversation cleared)", flush=True)
        return "skip"
    if text.startswith("/"):
        print(f"unknown command {text.split()[0]}; {HELP}", flush=True)
        return "skip"
    return "message"


def send_turn(client, url: str, args: argparse.Namespace, history: list[dict], text: str) -> None:
    """Send the user's message with the conversation so far and print the reply as it streams.

    A failed turn is forgotten, so the next message is not sent after an unanswered one.
    """
    import httpx

    system = [{"role": "system", "content": args.system}] if args.system else []
    history.append({"role": "user", "content": text})
    body = {"model": args.model, "messages": system + history, "stream": True}
    for key in ("temperature", "top_p", "max_tokens"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    print("assistant: ", end="", flush=True)
    try:
        reply = stream_reply(client, url, body)
    except (RuntimeError, httpx.HTTPError) as e:
        history.pop()
        print(f"\nerror: {e}", file=sys.stderr, flush=True)
        return
    history.append({"role": "assistant", "content": reply})
