"""One full-fine-tuning step on the CPU, ours against PyTorch + transformers, in the same run.

The step of issue 20: the ERNIE-4.5-0.3B shape (hidden 1024, 18 layers, 16 / 2 heads of 128, FFN 3072,
vocab 103,424, tied head), batch 1 x 512 tokens, forward + cross-entropy + backward + gradient clipping +
AdamW, fp32 weights. Both sides start from the same random weights (ours saved in Paddle and in HF layout).

- ours: the trainer's own step (``build_model`` / ``build_optimizer`` / ``accumulate_gradients`` /
  ``optimizer_step``), also with ``compute_type: bf16``;
- theirs: transformers 5 ``Ernie4_5ForCausalLM`` (sdpa attention) + ``torch.optim.AdamW(fused=True)``
  (what ``Trainer`` picks on CPU); bf16 is ``torch.autocast("cpu", bfloat16)`` over fp32 weights (PyTorch's
  CPU mixed precision); in a separate virtualenv that is never a project dependency:

      python3.11 -m venv .venv-torch
      .venv-torch/bin/pip install torch==2.13.0 'transformers>=5,<6' safetensors

Every variant runs in a subprocess of its own (load, ``--warmup`` untimed steps, ``--steps`` timed steps;
a long run's steps are the steady state: torch's first step and our allocator's first two, while the heap
grows, are slower), and the
variants alternate round by round, so load from other processes on the machine hits them alike; the
median step over all rounds is reported with the load average seen around it. The last round also
profiles one step of each variant (Paddle's and torch's profilers) and splits it by op family.

    .venv/bin/python bench/bench_cpu_step.py [--layers 18] [--rounds 3] [--steps 2]
    .venv/bin/python bench/bench_cpu_step.py --layers 2 --rounds 2      # quick iteration

A variant can be added with environment settings, for before / after comparisons in one run:
``--variant 'ours, 1 thread=ours:fp32:ERNIE_STUDIO_CPU_THREADS=1'`` (name=kind:precision[:ENV=VALUE,...]; the
name holds no "="), or the engine of another checkout: ``--variant 'before=ours:fp32:PYTHONPATH=/tmp/old'``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"
PRESET = "ernie-4.5-0.3b"
FAMILIES = (
    "matmuls",
    "attention",
    "LM head + loss",
    "norms / RoPE / activation / other",
    "optimizer (clip + AdamW)",
    "framework overhead",
)
DEFAULT_VARIANTS = (
    "PyTorch fp32=torch:fp32",
    "ours fp32=ours:fp32",
    "ours bf16=ours:bf16",
)


# ---- the step, on each side (run inside the worker subprocess) --------------------------------------


def batch_ids(seq: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(seq)]]


class Marks:
    """Named instants and ranges in a profile, so that ops can be told apart by where they ran."""

    def __init__(self, begin, end):
        self._begin, self._end = begin, end
        self.active = False

    def begin(self, name: str):
        return self._begin(name) if self.active else None

    def end(self, handle) -> None:
        if handle is not None:
            self._end(handle)

    def instant(self, name: str) -> None:
        self.end(self.begin(name))


def ours_step(args):
    """(fwd_bwd, optimizer, marks, profile_fn) for our trainer's step."""
    import types

    import numpy as np
    import paddle.profiler as profiler

    from engine.models import layers
    from engine.train.build import build_model, build_optimizer
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict
    from engine.train.parallel import DataParallel
    from engine.train.precision import MasterWeights, PrecisionMode, resolve_precision
    from engine.train.step import accumulate_gradients, optimizer_step

    try:
        from engine.train.objectives import LanguageModel

        objective = LanguageModel()
    except ImportError:  # a checkout from before the objectives module (a variant with PYTHONPATH=<checkout>)
        from engine.train.run_state import Objective

        objective = Objective.LM
    values = dict(
        model_name_or_path=str(Path(args.model_dir) / "paddle"),
        train_dataset_path="bench.jsonl",
        fine_tuning="Full",
        learning_rate=1e-5,
        max_grad_norm=1.0,
        compute_type=args.precision,
    )
    cfg = config_from_dict(TrainConfig, values)
    precision = resolve_precision(cfg.compute_type)
    model, trainable = build_model(cfg, precision)
    masters = MasterWeights(trainable) if precision.mode is PrecisionMode.EMULATED else None
    if masters is not None and masters.low:
        trainable = masters.trainable(trainable)
    else:
        masters = None
    optimizer = build_optimizer(cfg, model, trainable)
    run = types.SimpleNamespace(
        model=model,
        params=list(trainable.values()),
        optimizer=optimizer,
        masters=masters,
        scaler=None,
        sharded=None,
    )
    dp = DataParallel()
    ids = np.array(batch_ids(args.seq, model.config.vocab_size), dtype=np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((1, 1), -100)], axis=1)
    batch = {"input_ids": ids, "labels": labels}

    marks = Marks(lambda n: _paddle_begin(profiler, n), lambda h: h.end())
    _mark_regions(marks, model.ernie, layers, "attention")
    _mark_onednn(marks)

    def fwd_bwd() -> float:
        sums, _, _ = accumulate_gradients(model, objective, [batch], dp, [])
        return sums["loss"]

    def opt() -> None:
        optimizer_step(cfg, run, dp)

    def profile(step) -> list[dict]:
        trace = Path(tempfile.mkdtemp(prefix="paddle-trace-"))
        prof = profiler.Profiler(
            targets=[profiler.ProfilerTarget.CPU], on_trace_ready=profiler.export_chrome_tracing(str(trace))
        )
        prof.start()
        step()
        prof.step()
        prof.stop()
        events = _paddle_events(next(trace.glob("*.json")))
        shutil.rmtree(trace)
        return events

    return fwd_bwd, opt, marks, profile


def _paddle_begin(profiler, name):
    ev = profiler.RecordEvent(name)
    ev.begin()
    return ev


def _mark_regions(marks: Marks, body, module, attention_name: str) -> None:
    """Mark the decoder body (forward range; backward from its output's gradient on) and attention
    (forward range; backward from its output's gradient until all of q, k, v have theirs)."""
    state = {}

    def pre(layer, inputs):
        state["body"] = marks.begin("mark:body")

    def post(layer, inputs, output):
        marks.end(state.pop("body", None))
        h = output[0] if isinstance(output, tuple) else output
        if marks.active and not h.stop_gradient:
            h.register_hook(_instant(marks, "mark:body_backward"))

    if hasattr(body, "register_forward_pre_hook"):
        body.register_forward_pre_hook(pre)
        body.register_forward_post_hook(post)
    original = getattr(module, attention_name)

    def attention(q, k, v, *rest, **kw):
        if not marks.active:
            return original(q, k, v, *rest, **kw)
        handle = marks.begin("mark:attention")
        out = original(q, k, v, *rest, **kw)
        marks.end(handle)
        out.register_hook(_instant(marks, "mark:attention_backward_start"))
        for t in (q, k, v):
            t.register_hook(_instant(marks, "mark:attention_backward_input"))
        return out

    setattr(module, attention_name, attention)


def _time_as_op(marks: Marks, module, attr: str, op: str) -> None:
    """Replace ``module.attr`` by a call that marks its time as op ``op``."""
    original = getattr(module, attr)

    def timed(*a, **kw):
        handle = marks.begin(op)
        try:
            return original(*a, **kw)
        finally:
            marks.end(handle)

    setattr(module, attr, timed)


def _mark_onednn(marks: Marks) -> None:
    """Time oneDNN's GEMMs and reorders, and the native attention, as ops of their own: they are ctypes calls,
    which Paddle's profiler does not see, so without this they land in "framework overhead"."""
    try:
        from engine.models import native, onednn
    except ImportError:  # a checkout from before the oneDNN paths
        return
    _time_as_op(marks, onednn, "gemm", "op:onednn_gemm")
    _time_as_op(marks, onednn, "convert", "op:onednn_convert")
    if hasattr(native, "attention_forward"):  # not in a checkout from before the native attention
        _time_as_op(marks, native, "attention_forward", "op:native_attention")
        _time_as_op(marks, native, "attention_backward", "op:native_attention_grad")


def _instant(marks: Marks, name: str):
    def hook(grad):
        marks.instant(name)
        return grad

    return hook


def _paddle_events(path: Path) -> list[dict]:
    """Kernel runs (name, start, duration in us) and our marks from a Paddle chrome trace."""
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        name = e["name"].split("[")[0]
        if e.get("cat") == "DygraphKernelLaunch":
            out.append({"op": name.replace(" kernel launch", ""), "ts": e["ts"], "dur": e["dur"]})
        elif e.get("cat") == "PythonUserDefined" and name.startswith("mark:"):
            out.append({"mark": name, "ts": e["ts"], "dur": e["dur"]})
        elif e.get("cat") == "PythonUserDefined" and name.startswith("op:"):
            out.append({"op": name[len("op:") :], "ts": e["ts"], "dur": e["dur"]})
    return out


def torch_step(args):
    """(fwd_bwd, optimizer, marks, profile_fn) for transformers + torch."""
    import torch
    from transformers import Ernie4_5ForCausalLM
    from transformers.integrations import sdpa_attention

    model = Ernie4_5ForCausalLM.from_pretrained(
        str(Path(args.model_dir) / "hf"), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    ids = torch.tensor(batch_ids(args.seq, model.config.vocab_size), dtype=torch.long)

    marks = Marks(_torch_begin, lambda h: h.__exit__(None, None, None))
    model.model.register_forward_pre_hook(lambda m, i: _torch_pre(marks, m))
    model.model.register_forward_hook(lambda m, i, o: _torch_post(marks, m, o))
    _mark_torch_attention(marks, sdpa_attention)

    # bf16: PyTorch's CPU mixed precision (fp32 weights and optimizer, autocast's bf16 GEMMs through oneDNN)
    bf16 = args.precision == "bf16"

    def fwd_bwd() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, labels=ids)  # transformers shifts the labels itself
        out.loss.backward()
        return float(out.loss)

    def opt() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def profile(step) -> list[dict]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        out = []
        for e in prof.events():
            start, dur = e.time_range.start, e.time_range.elapsed_us()
            if e.name.startswith("mark:"):
                out.append({"mark": e.name, "ts": start, "dur": dur})
            elif e.name.startswith("aten::"):
                out.append({"op": e.name, "ts": start, "dur": e.self_cpu_time_total})
        return out

    return fwd_bwd, opt, marks, profile


def _torch_begin(name):
    import torch

    h = torch.autograd.profiler.record_function(name)
    h.__enter__()
    return h


def _torch_pre(marks, module):
    module._mark = marks.begin("mark:body")


def _torch_post(marks, module, output):
    marks.end(getattr(module, "_mark", None))
    module._mark = None
    h = output.last_hidden_state
    if marks.active and h.requires_grad:
        h.register_hook(_instant(marks, "mark:body_backward"))


def _mark_torch_attention(marks, sdpa_attention) -> None:
    from transformers import modeling_utils

    original = sdpa_attention.sdpa_attention_forward

    def attention(module, q, k, v, *rest, **kw):
        if not marks.active:
            return original(module, q, k, v, *rest, **kw)
        handle = marks.begin("mark:attention")
        out, w = original(module, q, k, v, *rest, **kw)
        marks.end(handle)
        out.register_hook(_instant(marks, "mark:attention_backward_start"))
        for t in (q, k, v):
            t.register_hook(_instant(marks, "mark:attention_backward_input"))
        return out, w

    modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"] = attention


# ---- sorting a profiled step into op families ----------------------------------------------------------

MATMUL_OPS = (
    "matmul",
    "onednn_gemm",
    "linear",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
)


def families(
    events: list[dict], phases: dict[str, tuple[float, float]], by_op: dict | None = None
) -> dict[str, float]:
    """Milliseconds per op family in one profiled step. ``phases``: (start, end) of fwd_bwd / optimizer
    on the profiler's clock, read from their marks; time not spent inside an op is framework overhead."""
    marks = sorted((e for e in events if "mark" in e), key=lambda e: e["ts"])
    ops = [e for e in events if "op" in e]

    def first(name, default):
        ts = [m["ts"] for m in marks if m["mark"] == name]
        return ts[0] if ts else default

    ranges = {
        name: [(m["ts"], m["ts"] + m["dur"]) for m in marks if m["mark"] == name]
        for name in ("mark:body", "mark:attention")
    }
    # Attention backward: from a gradient reaching an attention output to the last of its q / k / v.
    att_bwd, start, last = [], None, None
    for m in marks:
        if m["mark"] == "mark:attention_backward_start":
            if start is not None and last is not None:
                att_bwd.append((start, last))
            start, last = m["ts"], None
        elif m["mark"] == "mark:attention_backward_input" and start is not None:
            last = m["ts"]
    if start is not None and last is not None:
        att_bwd.append((start, last))
    fwd0, fwd1 = phases["fwd_bwd"]
    opt0, opt1 = phases["optimizer"]
    body = ranges["mark:body"]
    body_end = body[0][1] if body else fwd0
    body_bwd = first("mark:body_backward", fwd1)

    def inside(ts, spans):
        return any(a <= ts <= b for a, b in spans)

    out = dict.fromkeys(FAMILIES, 0.0)
    for e in ops:
        ts, ms = e["ts"], e["dur"] / 1000.0
        name = e["op"]
        if opt0 <= ts <= opt1:
            fam = "optimizer (clip + AdamW)"
        elif not (fwd0 <= ts <= fwd1):
            continue
        elif (body_end <= ts < body_bwd) or "cross_entropy" in name or "log_softmax" in name:
            fam = "LM head + loss"
        elif inside(ts, ranges["mark:attention"]) or inside(ts, att_bwd) or "scaled_dot_product" in name:
            fam = "attention"
        elif any(name == m or name.startswith(m + "_") or name == m + "_grad" for m in MATMUL_OPS):
            fam = "matmuls"
        elif "embedding" in name:
            fam = "LM head + loss"  # the tied embedding: its lookup and the gradient's scatter
        else:
            fam = "norms / RoPE / activation / other"
        out[fam] += ms
        if by_op is not None:
            key = f"{name} [{fam.split(' ')[0]}]"
            by_op[key] = by_op.get(key, 0.0) + ms
    in_ops = sum(out.values())
    out["framework overhead"] = max((fwd1 - fwd0 + opt1 - opt0) / 1000.0 - in_ops, 0.0)
    return out


# ---- the worker: one variant in its own process ------------------------------------------------------


def worker(args) -> None:
    load0 = os.getloadavg()[0]
    step_fns = torch_step if args.kind == "torch" else ours_step
    fwd_bwd, opt, marks, profile = step_fns(args)
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(fwd_bwd())
        opt()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    result = {"times": times, "losses": losses, "load": [load0, os.getloadavg()[0]]}
    if args.profile:
        marks.active = True

        def step():
            h = marks.begin("mark:fwd_bwd")
            fwd_bwd()
            marks.end(h)
            h = marks.begin("mark:optimizer")
            opt()
            marks.end(h)

        t0 = time.perf_counter()
        events = profile(step)
        result["profiled_step_s"] = time.perf_counter() - t0
        phases = {
            name: next((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("mark") == f"mark:{name}")
            for name in ("fwd_bwd", "optimizer")
        }
        by_op: dict[str, float] = {}
        result["families"] = families(events, phases, by_op)
        result["top_ops"] = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    print("RESULT " + json.dumps(result), flush=True)


def make_model_dir(out: str | Path, layers: int) -> None:
    """The preset's shape with random weights, written in both layouts (runs in our environment)."""
    from engine.models import ErnieForCausalLM, save_model
    from engine.models.initialize import init_weights
    from engine.models.presets import preset_config

    out = Path(out)
    model = ErnieForCausalLM(preset_config(PRESET, num_hidden_layers=layers))
    init_weights(model, seed=0)
    save_model(model, out / "paddle")
    save_model(model, out / "hf", layout="hf")


# ---- the driver ------------------------------------------------------------------------------------------


def parse_variant(spec: str) -> dict:
    name, _, rest = spec.partition("=")
    kind, _, rest = rest.partition(":")
    precision, _, env = rest.partition(":")
    if kind not in ("ours", "torch") or precision not in ("fp32", "bf16"):
        raise SystemExit(f"--variant {spec!r}: expected NAME=ours|torch:fp32|bf16[:ENV=VALUE,...]")
    settings = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return {"name": name, "kind": kind, "precision": precision, "env": settings, "runs": []}


def run_variant(v: dict, args, model_dir: Path, profile: bool) -> dict:
    python = str(args.torch_python) if v["kind"] == "torch" else sys.executable
    cmd = [
        python,
        __file__,
        "--worker",
        v["kind"],
        "--precision",
        v["precision"],
        "--model-dir",
        str(model_dir),
    ]
    cmd += ["--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--profile"] if profile else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), **v["env"]}  # a variant may run another checkout
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{v['name']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=18, help="decoder layers (18 = ERNIE-4.5-0.3B)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--variant", action="append", help="NAME=ours|torch:fp32|bf16[:ENV=VALUE,...]")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--torch-python", type=Path, default=TORCH_PYTHON)
    ap.add_argument("--worker", choices=("ours", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.kind = args.worker
        return worker(args)

    variants = [parse_variant(s) for s in (args.variant or DEFAULT_VARIANTS)]
    if any(v["kind"] == "torch" for v in variants) and not args.torch_python.exists():
        # `make bench` runs every bench; without the torch venv this one still times ours, and says so.
        print(
            f"NOTE: {args.torch_python} not found, so the PyTorch variants are left out; make it with "
            "`python3.11 -m venv .venv-torch && .venv-torch/bin/pip install torch==2.13.0 "
            "'transformers>=5,<6' safetensors`",
            flush=True,
        )
        variants = [v for v in variants if v["kind"] != "torch"]
    with tempfile.TemporaryDirectory(prefix="bench-cpu-step-") as tmp:
        model_dir = Path(tmp)
        code = f"from bench.bench_cpu_step import make_model_dir; make_model_dir({str(model_dir)!r}, {args.layers})"
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                res = run_variant(v, args, model_dir, profile=not args.no_profile and r == args.rounds - 1)
                v["runs"].append(res)
                print(
                    f"round {r + 1} {v['name']}: "
                    + ", ".join(f"{t:.2f}s" for t in res["times"])
                    + f" (load {res['load'][0]:.1f}-{res['load'][1]:.1f}, loss {res['losses'][0]:.4f})",
                    flush=True,
                )
    report(variants, args)


def report(variants: list[dict], args) -> None:
    tokens = args.seq
    base = next((v for v in variants if v["kind"] == "torch"), variants[0])
    base_s = statistics.median(t for r in base["runs"] for t in r["times"])
    print(
        f"\nOne step (fwd + CE + bwd + clip + AdamW), {PRESET} shape with {args.layers} layers, "
        f"batch 1 x {tokens}; median of {args.steps} steps (after {args.warmup} untimed) x {args.rounds} alternating rounds\n"
    )
    print(f"| variant | s / step | tokens/s | vs {base['name']} | load avg | first loss |")
    print("|---|---:|---:|---:|---|---:|")
    for v in variants:
        times = [t for r in v["runs"] for t in r["times"]]
        s = statistics.median(times)
        loads = [x for r in v["runs"] for x in r["load"]]
        print(
            f"| {v['name']} | {s:.2f} | {tokens / s:.0f} | {base_s / s:.2f}x | "
            f"{min(loads):.1f}-{max(loads):.1f} | {v['runs'][0]['losses'][0]:.4f} |"
        )
    profiled = [v for v in variants if "families" in v["runs"][-1]]
    if not profiled:
        return
    print("\nOne profiled step by op family, ms (share of the step; the profiler adds its own cost)\n")
    print("| op family | " + " | ".join(v["name"] for v in profiled) + " |")
    print("|---|" + "---:|" * len(profiled))
    for fam in FAMILIES:
        cells = []
        for v in profiled:
            f = v["runs"][-1]["families"]
            total = sum(f.values())
            cells.append(f"{f[fam]:.0f} ({100 * f[fam] / total:.0f}%)")
        print(f"| {fam} | " + " | ".join(cells) + " |")
    totals = [sum(v["runs"][-1]["families"].values()) for v in profiled]
    print("| **total** | " + " | ".join(f"{t:.0f}" for t in totals) + " |")
    for v in profiled:
        ops = ", ".join(f"{name} {ms:.0f}" for name, ms in v["runs"][-1]["top_ops"])
        print(f"\n{v['name']}, largest ops (ms): {ops}")


if __name__ == "__main__":
    main()
