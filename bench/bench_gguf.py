"""CPU serving: our built-in Paddle server against llama.cpp's llama-server on f16 / q8_0 / q4_K_M GGUF exports
of the same random ERNIE-4.5-0.3B-shaped weights (hidden 1024, 18 layers, vocab 103,424).

For each engine, one `ernie-studio serve` process (2 threads where the engine takes a count): time to first
token (a 1-token request's latency) and decode tokens/s of 1 stream, total tokens/s of 8 concurrent streams (greedy, `--new` tokens each,
end-of-sequence ignored, 512 tokens of KV cache per stream for both), and the peak RSS of the serving process (llama.cpp: llama-server's own), over
`--rounds` interleaved rounds (medians). "auto" is the checkpoint served as a CPU node's one-click deployment
is (llama.cpp, q8_0 GGUF written at its first start and reused after): its start time, first and later, shows
what the first deployment pays. Needs `make llamacpp`.

Run: `.venv/bin/python bench/bench_gguf.py` (`--quick`: hidden 512, 8 layers, 64 new tokens, 1 round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.serve.ports import free_port  # noqa: E402
from engine.serve.process_records import process_tree  # noqa: E402

# "auto": the checkpoint itself served as a CPU node's one-click deployment is (`--backend auto` with
# ERNIE_STUDIO_CPU_SERVING unset: llama.cpp from a q8_0 GGUF written at the first start into --gguf-dir, reused
# by the later rounds' starts).
ENGINES = [
    ("paddle", None),
    ("auto", None),
    ("llamacpp", "f16"),
    ("llamacpp", "q8_0"),
    ("llamacpp", "q4_K_M"),
]
PROMPT = "User: Write a short story about a lighthouse keeper and a storm.\nAssistant: "


def build_model(work: Path, quick: bool) -> Path:
    """The random model (Paddle checkpoint, fp32) and its GGUF exports."""
    import engine  # noqa: F401  (Paddle first)
    from engine.models import ErnieForCausalLM, save_model
    from engine.models.initialize import CORPUS, init_weights
    from engine.models.presets import preset_config, scaled_config
    from engine.tokenizer import train_tokenizer
    from engine.train import run_export
    from engine.train.config_load import load_export_config

    model_dir = work / "model"
    tok = train_tokenizer(CORPUS, model_dir)
    cfg = (
        scaled_config("bench-dense", 512, 8, vocab_size=16384, max_position_embeddings=4096)
        if quick
        else preset_config("ernie-4.5-0.3b", dtype="float32")
    )
    model = ErnieForCausalLM(cfg)
    init_weights(model, seed=0, std=0.02)
    save_model(model, model_dir)
    tok.save_pretrained(model_dir)
    del model
    gguf_dir = work / "gguf"
    keys = [f"model_name_or_path={model_dir}", f"export_dir={gguf_dir}", "export_format=gguf"]
    run_export(load_export_config(None, [*keys, "gguf_types=f16,q8_0,q4_K_M"]))
    return model_dir


def peak_rss_mib(root: int, backend: str) -> float:
    """VmHWM of the process serving: llama-server for llama.cpp (auto here), the serve process itself for
    Paddle."""
    pids = process_tree(root)
    best = 0.0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if backend in ("llamacpp", "auto") and not cmd.endswith("llama-server"):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                best = max(best, int(line.split()[1]) / 1024)
    return best


def stream_once(base: str, n: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s after the first token, tokens) of one greedy completion: TTFT is a 1-token
    request's latency, decode the other n - 1 tokens of an n-token request over its time past that. Counted
    from usage, not from streamed text: ids past the bench tokenizer's pieces decode as nothing, and the
    built-in server sends no chunk for a token without text, llama-server does."""

    def timed(tokens: int) -> tuple[float, int]:
        body = {"model": "default", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        start = time.perf_counter()
        r = httpx.post(f"{base}/completions", json=body, timeout=600).json()
        return time.perf_counter() - start, r["usage"]["completion_tokens"]

    ttft, _ = timed(1)
    total, count = timed(n)
    return ttft, (count - 1) / max(total - ttft, 1e-9), count


def concurrent(base: str, streams: int, n: int) -> float:
    """Total generated tokens/s of ``streams`` simultaneous completions (usage counts)."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    counts = [0] * streams

    def one(i: int) -> None:
        r = httpx.post(f"{base}/completions", json=body, timeout=1200).json()
        counts[i] = r["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def serve(
    model_dir: Path, backend: str, gguf_type: str | None, streams: int
) -> tuple[subprocess.Popen, str, float]:
    """The started server, its base URL, and the seconds from launch to its "serving" line."""
    port = free_port()
    model = model_dir.parent / "gguf" if backend == "llamacpp" else model_dir
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", str(port),
           "--backend", backend, "--max-num-seqs", str(streams), "--max-model-len", "512"]  # fmt: skip
    if gguf_type:
        cmd += ["--gguf-type", gguf_type, "--threads", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    if backend == "auto":
        env.pop("ERNIE_STUDIO_CPU_SERVING", None)
        cmd += ["--gguf-dir", str(model_dir.parent / "auto-gguf"), "--threads", "2"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    chosen = ""
    for line in proc.stdout:
        chosen = line.strip() if line.startswith("backend ") else chosen
        if line.startswith("serving "):
            if backend == "auto" and not chosen.startswith("backend llamacpp"):
                raise RuntimeError(f"auto did not choose llama.cpp: {chosen}")
            return proc, f"http://127.0.0.1:{port}/v1", time.perf_counter() - start
    raise RuntimeError(f"{backend} {gguf_type or ''} did not start (exit {proc.wait()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.new = 1, 64
    from engine.llamacpp import find_tool

    if find_tool("llama-server") is None or find_tool("llama-quantize") is None:
        print("llama.cpp tools not built: run `make llamacpp`", file=sys.stderr)
        return 1
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        model_dir = build_model(Path(tmp), args.quick)
        sizes = {t: (model_dir.parent / "gguf" / f"model-{t}.gguf").stat().st_size for _, t in ENGINES if t}
        sizes["paddle"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        for _ in range(args.rounds):
            for backend, gguf_type in ENGINES:
                name = gguf_type or backend
                proc, base, started = serve(model_dir, backend, gguf_type, args.streams)
                try:
                    stream_once(base, 8)  # warm-up
                    ttft, tps, _ = stream_once(base, args.new)
                    total = concurrent(base, args.streams, args.new)
                    rss = peak_rss_mib(proc.pid, backend)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                row = results.setdefault(name, {"ttft": [], "tps": [], "total": [], "rss": [], "start": []})
                for k, v in (
                    ("ttft", ttft),
                    ("tps", tps),
                    ("total", total),
                    ("rss", rss),
                    ("start", started),
                ):
                    row[k].append(v)
        auto_gguf = model_dir.parent / "auto-gguf" / "model-q8_0.gguf"
        sizes["auto"] = auto_gguf.stat().st_size
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    print(f"\n{'engine / format':<22}{'file MB':>9}{'peak RSS MiB':>14}{'TTFT ms':>9}{'1 stream tok/s':>16}"
          f"{f'{args.streams} streams tok/s':>18}{'start s (1st / later)':>24}")  # fmt: skip
    for name, m in med.items():
        starts = results[name]["start"]
        later = f"{statistics.median(starts[1:]):.1f}" if len(starts) > 1 else "-"
        print(f"{name:<22}{sizes[name] / 1e6:>9.0f}{m['rss']:>14.0f}{m['ttft'] * 1000:>9.0f}{m['tps']:>16.1f}"
              f"{m['total']:>18.1f}{f'{starts[0]:.1f} / {later}':>24}")  # fmt: skip
    base = med["paddle"]
    q8 = med["auto"]
    print(f"\nauto (llama.cpp q8_0 written on deploy) vs built-in: {q8['tps'] / base['tps']:.1f}x at 1 stream, {q8['total'] / base['total']:.1f}x at "
          f"{args.streams} streams, {q8['rss'] / base['rss']:.0%} of the memory")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
