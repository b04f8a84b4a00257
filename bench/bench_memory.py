"""Peak resident memory of a LoRA run on an ERNIE-4.5-0.3B-sized model: fp32, bf16, wint8 and wint4/8.

Every variant runs in its own process through the trainer's own ``setup_run`` and ``train_loop`` (a few
steps at a short sequence length, random weights of the official 0.3B shape). The child reports the peak
while loading and setting up (VmHWM, which is ru_maxrss; the model loads in fp32 before it is cast or
quantized), its resident memory once set up (model, adapters, optimizer), and the peak while training
(VmHWM again, after resetting it through /proc/self/clear_refs). The parent prints them as a table
against fp32 measured in the same run.

    .venv/bin/python bench/bench_memory.py [--steps 3] [--seq 128] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
PRESET = "ernie-4.5-0.3b"
VARIANTS = ["fp32", "bf16", "wint8", "wint4/8"]


def status_mib(key: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) / 1024


def make_model_dir(work: Path) -> Path:
    """The official 0.3B shape with random weights (stored bf16 to halve the file) and the tiny tokenizer."""
    d = work / "ernie-0.3b-random"
    if (d / "config.json").exists():
        return d
    from engine.models import ErnieForCausalLM, save_model
    from engine.models.initialize import init_model, init_weights
    from engine.models.presets import preset_config
    from engine.tokenizer import copy_tokenizer_files

    tiny = init_model("tiny", work / "tiny")
    model = ErnieForCausalLM(preset_config(PRESET))
    init_weights(model, seed=0)
    save_model(model, d, dtype="bfloat16")
    copy_tokenizer_files(tiny, d)
    return d


def child(model_dir: Path, compute_type: str, steps: int, seq: int) -> dict:
    """One LoRA run in this process; returns its memory figures (MiB) and step times."""
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict
    from engine.train.parallel import DataParallel
    from engine.train.trainer import setup_run, train_loop

    logging.disable(logging.INFO)
    out = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(model_dir),
            output_dir=str(out),
            fine_tuning="LoRA",
            compute_type=compute_type,
            train_dataset_path=str(DATA / "sft_demo.jsonl"),
            max_seq_len=seq,
            batch_size=1,
            max_steps=steps,
            save_steps=10**6,
            logging_steps=1,
            disable_tqdm=True,
        ),
    )
    dp = DataParallel()
    run = setup_run(cfg, dp, out, lambda event: None)
    setup_peak, after_setup = status_mib("VmHWM"), status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the next peak is training's own
    train_loop(cfg, dp, out, run, lambda event: None, {"signal": None})
    elapsed = [json.loads(line)["elapsed_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)]
    return {
        "setup_peak": setup_peak,
        "after_setup": after_setup,
        "training_peak": status_mib("VmHWM"),
        "step_s": statistics.median(times[1:] or times),
        "precision": run.precision.describe(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ernie_bench_memory")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.model, args.child, args.steps, args.seq)), flush=True)
        return

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(args.work)
    load = os.getloadavg()
    print(f"{PRESET} shape, random weights, LoRA r8, {args.steps} steps x 1 x {args.seq} tokens")
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--child", variant, "--model", str(model_dir)]
        cmd += ["--steps", str(args.steps), "--seq", str(args.seq)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(line[len("RESULT ") :])
        print(f"  {variant}: {results[variant]['precision']}", flush=True)
    base = results["fp32"]
    print()
    print("| compute_type | peak while loading | resident after setup | peak while training | s / step |")
    print("|---|---|---|---|---|")
    for variant, r in results.items():
        cells = [
            f"{r[k]:,.0f} MiB ({r[k] / base[k]:.2f}x)" for k in ("setup_peak", "after_setup", "training_peak")
        ]
        print(f"| {variant} | " + " | ".join(cells) + f" | {r['step_s']:.1f} |")


if __name__ == "__main__":
    main()
