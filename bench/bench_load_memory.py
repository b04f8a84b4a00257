"""Memory of loading the ERNIE-4.5-0.3B shape for a run, before and after loading straight into the run's
storage precision, in one run of this script.

"Before" is the engine at another git revision (default: where this branch left main), unpacked with
``git archive`` into a temporary directory; "after" is this checkout. Each variant loads in its own fresh
process through the trainer's ``build_model`` (and, for the DPO row, ``build_dpo_loss``): a LoRA run for
fp32 / bf16 / wint8 / wint4/8, and a Full DPO run in bf16 (its policy plus its frozen reference). The
child reports its resident memory after importing Paddle and the engine (the baseline), the peak
(VmHWM) once the model is built, and the bytes the built model(s) hold. The table gives the peak above
the baseline and its ratio to the held bytes (the issue's bound: 1.15).

    .venv/bin/python bench/bench_load_memory.py [--before REV] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.train.stages import DPO, SFT, stage_info

ROOT = Path(__file__).resolve().parents[1]
PRESET = "ernie-4.5-0.3b"
# (row name, compute_type, fine_tuning, stage)
VARIANTS = [
    ("LoRA fp32", "fp32", "LoRA", SFT.name),
    ("LoRA bf16", "bf16", "LoRA", SFT.name),
    ("LoRA wint8", "wint8", "LoRA", SFT.name),
    ("LoRA wint4/8", "wint4/8", "LoRA", SFT.name),
    ("Full DPO bf16 (policy + reference)", "bf16", "Full", DPO.name),
]

CHILD = r"""
import json, re, sys, time
from pathlib import Path

def mib(key):
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024

import paddle
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.build import build_dpo_loss, build_model

model_dir, compute_type, fine_tuning, stage, with_reference, out = sys.argv[1:7]
cfg = config_from_dict(TrainConfig, dict(
    model_name_or_path=model_dir, output_dir=out, fine_tuning=fine_tuning, compute_type=compute_type,
    stage=stage, train_dataset_path="unused.jsonl"))
baseline = mib("VmRSS")
t0 = time.time()
models = [build_model(cfg)[0]]
if with_reference == "1":
    models.append(build_dpo_loss(cfg).reference)
seconds = time.time() - t0
size = {paddle.float32: 4, paddle.bfloat16: 2, paddle.float16: 2, paddle.int8: 1}
held = sum(int(t.numel()) * size[t.dtype] for m in models for t in m.state_dict().values())
print("RESULT " + json.dumps({"baseline": baseline, "peak": mib("VmHWM"), "held": held / 2**20,
                              "seconds": seconds}), flush=True)
"""


CHILD_EXPORT = r"""
import json, re, sys, time
from pathlib import Path

def mib(key):
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024

import paddle
from engine.train import run_export
from engine.train.config_load import config_from_dict
from engine.train.export_config import ExportConfig

run_dir, export_format, out = sys.argv[1:4]
values = dict(output_dir=run_dir, lora=True, export_dir=out, copy_tokenizer=False)
values |= dict(dtype="bfloat16") if export_format == "safetensors" else dict(export_format="gguf", gguf_types="q8_0")
cfg = config_from_dict(ExportConfig, values)
baseline = mib("VmRSS")
t0 = time.time()
run_export(cfg)
print("RESULT " + json.dumps({"baseline": baseline, "peak": mib("VmHWM"), "seconds": time.time() - t0}), flush=True)
"""
EXPORTS = [("LoRA run merged -> bf16 safetensors", "safetensors"), ("LoRA run merged -> GGUF q8_0", "gguf")]


def make_lora_run(model_dir: Path, work: Path, rank: int = 8) -> Path:
    """A LoRA run directory on ``model_dir`` (adapter on the four decoder linears, random A and B)."""
    import numpy as np

    from engine.models.config import ErnieConfig
    from engine.models.safetensors_io import save_file

    d = work / "lora-run"
    if (d / "adapter_config.json").exists():
        return d
    c = ErnieConfig.from_file(model_dir)
    q = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    shapes = {
        "self_attn.qkv_proj": (c.hidden_size, q),
        "self_attn.o_proj": (c.num_attention_heads * c.head_dim, c.hidden_size),
        "mlp.up_gate_proj": (c.hidden_size, 2 * c.intermediate_size),
        "mlp.down_proj": (c.intermediate_size, c.hidden_size),
    }
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(c.num_hidden_layers):
        for name, (fin, fout) in shapes.items():
            tensors[f"ernie.layers.{i}.{name}.lora_A"] = rng.normal(0, 0.02, (fin, rank)).astype(np.float32)
            tensors[f"ernie.layers.{i}.{name}.lora_B"] = rng.normal(0, 0.02, (rank, fout)).astype(np.float32)
    d.mkdir(parents=True)
    save_file(tensors, d / "adapter_model.safetensors")
    config = dict(base_model=str(model_dir), r=rank, lora_alpha=2 * rank, rslora=False, compute_type="bf16",
                  target_modules=["qkv_proj", "o_proj", "up_gate_proj", "down_proj"], stage=SFT.name)  # fmt: skip
    (d / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


def make_model_dir(work: Path) -> Path:
    """The official 0.3B shape with random weights stored bf16 and the tiny tokenizer
    (``ernie-studio init-model --preset ernie-4.5-0.3b``)."""
    d = work / "ernie-0.3b-random-bf16"
    if (d / "config.json").exists() and (d / "tokenizer.model").exists():
        return d
    from engine.models.initialize import init_model

    shutil.rmtree(d, ignore_errors=True)
    return init_model(PRESET, d, dtype="bfloat16")


def unpack(rev: str, into: Path) -> Path:
    """The engine at ``rev`` (``git archive``) in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(tree: Path, model_dir: Path, variant: tuple, work: Path) -> dict:
    _, compute_type, fine_tuning, stage = variant
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = tempfile.mkdtemp(prefix="bench_load_", dir=work)
    # the child runs the "before" revision's engine too, which may have no stage registry: the parent asks it
    with_reference = "1" if stage_info(stage).needs_reference else "0"
    cmd = [sys.executable, "-c", CHILD, str(model_dir), compute_type, fine_tuning, stage, with_reference, out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"{variant[0]} in {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def measure_export(tree: Path, run_dir: Path, export_format: str, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = tempfile.mkdtemp(prefix="bench_export_", dir=work)
    cmd = [sys.executable, "-c", CHILD_EXPORT, str(run_dir), export_format, out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"export {export_format} in {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(line[len("RESULT ") :])


def cell(r: dict) -> str:
    grown = r["peak"] - r["baseline"]
    return f"{grown:,.0f} MiB ({grown / r['held']:.2f}x)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--before", default="", help="git revision of the 'before' column (default: merge-base with main)"
    )
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ernie_bench_load_memory")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rev = (
        args.before
        or subprocess.run(
            ["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    model_dir = make_model_dir(args.work)
    before = unpack(rev, Path(tempfile.mkdtemp(prefix="before_", dir=args.work)))
    load = os.getloadavg()
    print(f"{PRESET} shape, random weights stored bf16; before = {rev[:10]}, after = this checkout")
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rows = []
    for variant in VARIANTS:
        b = measure(before, model_dir, variant, args.work)
        a = measure(ROOT, model_dir, variant, args.work)
        rows.append((variant[0], b, a))
        print(f"  {variant[0]}: before {cell(b)}, after {cell(a)}", flush=True)
    print()
    print("Peak resident memory while building the model(s), above the baseline after importing Paddle and")
    print("the engine (VmHWM - VmRSS then); the ratio is to the bytes the built model(s) hold.")
    print()
    print("| run | held before | held after | peak before | peak after | load s before | load s after |")
    print("|---|---|---|---|---|---|---|")
    for name, b, a in rows:
        print(
            f"| {name} | {b['held']:,.0f} MiB | {a['held']:,.0f} MiB | {cell(b)} | {cell(a)} | "
            f"{b['seconds']:.1f} | {a['seconds']:.1f} |"
        )
    print(
        f"\nbaseline after import: before {rows[0][1]['baseline']:,.0f} MiB, after {rows[0][2]['baseline']:,.0f} MiB"
    )
    run_dir = make_lora_run(model_dir, args.work)
    fp32_mib = rows[0][2]["held"]  # the fp32 LoRA row: the whole model in fp32 (plus its adapters)
    print()
    print(
        f"Export of a LoRA run (r8 on the four decoder linears), peak above the baseline; fp32 model {fp32_mib:,.0f} MiB."
    )
    print()
    print("| export | peak before | peak after | s before | s after |")
    print("|---|---|---|---|---|")
    for name, fmt in EXPORTS:
        b, a = measure_export(before, run_dir, fmt, args.work), measure_export(ROOT, run_dir, fmt, args.work)
        print(
            f"| {name} | {b['peak'] - b['baseline']:,.0f} MiB | {a['peak'] - a['baseline']:,.0f} MiB | "
            f"{b['seconds']:.1f} | {a['seconds']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
