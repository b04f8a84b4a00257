"""The pre-flight estimate (engine/estimate.py) against what a run really takes: LoRA and Full SFT of an
ERNIE-4.5-0.3B-sized model on this node.

Builds the official 0.3B shape with random weights (as ``bench_memory.py`` does: stored bf16, the tiny
preset's tokenizer), writes a synthetic erniekit SFT file whose samples average about 270 tokens, then
trains each variant through ``ernie-studio train`` in a child process, as a worker does, with this node's
doctor throughput probe (the estimate's calibration) measured just before and just after it: the box is
shared and its speed moves. Measured: the trainer's own peak RSS (VmHWM over the whole run, the saves
included, from run_summary.json), the mean seconds per step after the first, the final save's seconds
(the last checkpoint and the final model) and the bytes on disk. Printed against the estimate's point
value and its low / high range.

The variants (``--variants``, default all): LoRA fp32, LoRA bf16, LoRA wint8 and Full fp32 on one process,
and ``sharded``: Full fp32 with ``sharding: stage1`` on 2 gloo ranks (``python -m paddle.distributed.launch
--nproc_per_node 2``), whose per-rank peak (each rank's own VmHWM, written by the rank's runner after the
run) is held against the estimate's per-device peak for 2 devices. Expert parallelism needs a MoE model:
``MoE`` trains ``MOE_SHAPE`` (the ERNIE-4.5-21B-A3B layout made small, see there) Full fp32 on one process,
``ep2`` the same on 2 gloo ranks with ``expert_parallel_degree: 2`` (each rank holds half the routed experts);
``MoE-LoRA`` and ``ep2-LoRA`` the same with LoRA r8 (fp32).

    .venv/bin/python bench/bench_estimate.py [--lora-steps 8] [--full-steps 4] [--seq 1024] [--work DIR]
        [--variants LoRA,LoRA-bf16,LoRA-wint8,Full,sharded,MoE,ep2,MoE-LoRA,ep2-LoRA] [--shard-steps 2]
        [--moe-steps 3] [--no-probe]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PRESET = "ernie-4.5-0.3b"
TOLERANCE = 0.25  # the estimate's point values must be within 25% of the measurement


def make_model_dir(work: Path) -> Path:
    """The official 0.3B shape with random weights (stored bf16 to halve the file) and the tiny tokenizer."""
    d = work / "ernie-0.3b-random"
    if (d / "config.json").exists():
        return d
    from engine.models import ErnieForCausalLM, save_model
    from engine.models.initialize import init_model, init_weights
    from engine.models.presets import preset_config
    from engine.tokenizer import copy_tokenizer_files

    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        init_model("tiny", tiny)
    model = ErnieForCausalLM(preset_config(PRESET))
    init_weights(model, seed=0)
    save_model(model, d, dtype="bfloat16")
    copy_tokenizer_files(tiny, d)
    return d


# The ERNIE-4.5-21B-A3B layout (64 routed experts, top-6, 2 shared, layer 0 dense, the official vocabulary)
# made small enough for a 2-core, 24 GiB box: the 0.3B's attention (hidden 1024), 4 layers and experts of
# width 256. Its routed experts are 151M of its 289M weights, so splitting them shows in a Full run's memory.
MOE_SHAPE = dict(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=3072, moe_intermediate_size=256, moe_layer_end_index=3)  # fmt: skip


def make_moe_model_dir(work: Path) -> Path:
    """``MOE_SHAPE`` with random weights (stored bf16, written tensor by tensor) and the tiny tokenizer."""
    d = work / "ernie-moe-random"
    if (d / "config.json").exists():
        return d
    from engine.models.initialize import init_model, write_random_checkpoint
    from engine.models.presets import preset_config
    from engine.tokenizer import copy_tokenizer_files

    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        init_model("tiny", tiny)
    config = preset_config("ernie-4.5-21b-a3b", **MOE_SHAPE, dtype="bfloat16")
    write_random_checkpoint(config, d)
    config.save(d)
    copy_tokenizer_files(tiny, d)
    return d


def make_dataset(work: Path, records: int = 64, seed: int = 0) -> Path:
    """erniekit SFT records of varied length (about 150-350 tokens with the tiny tokenizer)."""
    path = work / "sft_bench.jsonl"
    lines = [ln for ln in (ROOT / "engine" / "assets" / "corpus.txt").read_text().splitlines() if ln.strip()]
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(records):
            question = " ".join(rng.choice(lines) for _ in range(rng.randint(1, 3)))
            answer = " ".join(rng.choice(lines) for _ in range(rng.randint(8, 18)))
            f.write(json.dumps({"src": [question], "tgt": [answer]}) + "\n")
    return path


def token_stats(model_dir: Path, data: Path, seq: int) -> dict:
    from engine import load_tokenizer
    from engine.data.stats import dataset_stats

    return dataset_stats(data, "erniekit", "sft", load_tokenizer(str(model_dir)), seq)


def probe_tokens_per_second(work: Path) -> float:
    """This node's doctor throughput probe (tokens/s of the tiny model), the median of three."""
    from engine.doctor.probes import throughput_probe
    from engine.doctor.report import DoctorFloors
    from engine.models.initialize import init_model

    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        init_model("tiny", tiny)
    runs = [
        throughput_probe(tiny, DoctorFloors(), timed_steps=4).values["tokens_per_second"] for _ in range(3)
    ]
    return statistics.median(runs)


# bench variant: (fine_tuning, compute_type, extra config)
VARIANTS = {
    "LoRA": ("LoRA", "fp32", {}),
    "LoRA-bf16": ("LoRA", "bf16", {}),
    "LoRA-wint8": ("LoRA", "wint8", {}),
    "Full": ("Full", "fp32", {}),
    "sharded": ("Full", "fp32", {"sharding": "stage1"}),
    "MoE": ("Full", "fp32", {}),
    "ep2": ("Full", "fp32", {"expert_parallel_degree": 2}),
    "MoE-LoRA": ("LoRA", "fp32", {}),
    "ep2-LoRA": ("LoRA", "fp32", {"expert_parallel_degree": 2}),
}
MOE_VARIANTS = ("MoE", "ep2", "MoE-LoRA", "ep2-LoRA")  # trained on MOE_SHAPE, the others on the 0.3B
SHARD_RANKS = 2
# each rank's runner: run the trainer, then write this rank's own peak RSS (the trainer's metrics are rank 0's)
RANK_RUNNER = """import json, os, sys
from engine.cli import main
from engine.startup import end_rank
from engine.train.step import peak_rss_mib
code = main(sys.argv[2:])
rank = os.environ.get("PADDLE_TRAINER_ID", "0")
with open(os.path.join(sys.argv[1], "peak_rss_rank" + rank + ".json"), "w") as f:
    json.dump({"rank": int(rank), "peak_rss_mib": peak_rss_mib()}, f)
end_rank(code)
"""


def variant_config(name: str, model_dir: Path, data: Path, out: Path, seq: int, steps: int) -> dict:
    fine_tuning, compute_type, extra = VARIANTS[name]
    return {
        "model_name_or_path": str(model_dir),
        "train_dataset_type": "erniekit",
        "train_dataset_path": str(data),
        "output_dir": str(out),
        "fine_tuning": fine_tuning,
        "compute_type": compute_type,
        "max_seq_len": seq,
        "batch_size": 1,
        "max_steps": steps,
        "logging_steps": 1,
        "save_steps": 10**6,
        "disable_tqdm": True,
        **extra,
    }


def ranks_of(config: dict) -> int:
    """The processes a variant runs on: 2 gloo ranks for sharding and expert parallelism, else 1."""
    return SHARD_RANKS if config.get("sharding") or config.get("expert_parallel_degree", 1) > 1 else 1


def measure(config: dict, work: Path, name: str) -> dict:
    """Train through `ernie-studio train` in a child; the trainer's own figures (metrics, run summary)."""
    out = Path(config["output_dir"])
    shutil.rmtree(out, ignore_errors=True)
    cfg_file = work / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = ranks_of(config)
    cmd = [sys.executable, "-m", "engine", "train", str(cfg_file)]
    if ranks > 1:
        from engine.train.parallel import launch_command

        runner = work / "rank_runner.py"
        runner.write_text(RANK_RUNNER)
        peaks_dir = work / f"{name}-peaks"
        shutil.rmtree(peaks_dir, ignore_errors=True)
        peaks_dir.mkdir()
        entry = [str(runner), str(peaks_dir), "train", str(cfg_file)]
        cmd = launch_command(entry, ranks, str(work / f"{name}-logs"), f"bench-{name}")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    output = proc.stdout.read()
    if proc.wait():
        sys.exit(f"{name} failed:\n{output[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = json.loads((out / "run_summary.json").read_text())["final_metrics"]
    steps = [r["step_s"] for r in rows]
    disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    per_rank = [final["peak_rss_mib"]]
    if ranks > 1:
        found = sorted(json.loads(p.read_text())["rank"] for p in peaks_dir.glob("*.json"))
        if found != list(range(ranks)):
            sys.exit(f"{name}: rank peaks found for ranks {found}, expected 0..{ranks - 1}")
        per_rank = [
            json.loads((peaks_dir / f"peak_rss_rank{r}.json").read_text())["peak_rss_mib"] for r in found
        ]
    return {
        "peak_rss_gib": max(per_rank) / 1024,
        "peak_rss_per_rank_gib": [v / 1024 for v in per_rank],
        "training_peak_gib": rows[-1]["peak_rss_mib"] / 1024,
        "step_s": statistics.mean(steps[1:] or steps),
        "first_step_s": steps[0],
        "tokens_per_step": statistics.mean(r["tokens_per_second"] * r["step_s"] for r in rows),
        "checkpoint_s": final.get("checkpoint_s", 0.0),
        # the last step's checkpoint, then the final model: what the estimate's final save counts
        "final_save_s": final.get("checkpoint_s", 0.0) + final.get("final_save_s", 0.0),
        "disk_gb": disk / 1e9,
    }


def estimate_for(config: dict, stats: dict, probe: float, devices: int = 1) -> dict:
    from engine.estimate import DatasetTokens, NodeFacts, estimate_run
    from engine.models.config import ErnieConfig
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict

    cfg = config_from_dict(TrainConfig, config)
    model = ErnieConfig.from_file(config["model_name_or_path"])
    node = NodeFacts(device="cpu", probe_tokens_per_second=probe)
    return estimate_run(
        model, cfg, [DatasetTokens.from_stats(stats)], node=node, num_devices=devices
    ).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora-steps", type=int, default=8)
    ap.add_argument("--full-steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ernie_bench_estimate")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--shard-steps", type=int, default=2, help="steps of the 2-rank sharded run")
    ap.add_argument("--moe-steps", type=int, default=3, help="steps of the MoE and ep2 runs")
    ap.add_argument(
        "--no-probe", action="store_true", help="skip the throughput probes (memory only; time uses 4,300)"
    )
    args = ap.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    dense = any(v not in MOE_VARIANTS for v in chosen)
    models = {
        "dense": make_model_dir(args.work) if dense else None,
        "moe": make_moe_model_dir(args.work) if set(chosen) & set(MOE_VARIANTS) else None,
    }
    data = make_dataset(args.work)
    # the same tiny tokenizer in both model directories: one set of token statistics
    stats = token_stats(models["dense"] or models["moe"], data, args.seq)
    load = os.getloadavg()
    if models["moe"]:
        print(f"MoE variants: ernie-4.5-21b-a3b layout with {MOE_SHAPE}, random weights")
    print(
        f"{PRESET} shape, random weights; {data.name}: {stats['num_valid']} samples, mean "
        f"{stats['mean_length']:.0f} / p95 {stats['p95_length']:.0f} / max {stats['max_length']} tokens"
    )
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    figures, failures = {}, []
    for name in chosen:
        steps = {"Full": args.full_steps, "sharded": args.shard_steps}.get(name, args.lora_steps)
        steps = args.moe_steps if name in MOE_VARIANTS else steps
        model_dir = models["moe" if name in MOE_VARIANTS else "dense"]
        config = variant_config(name, model_dir, data, args.work / f"run-{name}", args.seq, steps)
        devices = ranks_of(config)
        # the node's speed while this variant ran: its probe just before and just after (the box is shared)
        before = 4300.0 if args.no_probe else probe_tokens_per_second(args.work)
        got = measure(config, args.work, name)
        after = 4300.0 if args.no_probe else probe_tokens_per_second(args.work)
        probe = (before + after) / 2
        est = estimate_for(config, stats, probe, devices)
        load = os.getloadavg()
        got.update(probe_before=before, probe_after=after, load=load[0])
        figures[name] = {"estimate": est, "measured": got}
        print(
            f"\n{name} SFT, {config['compute_type']}, {devices} process(es), max_seq_len {args.seq}, batch 1, "
            f"{steps} steps; per-rank peak {', '.join(f'{v:.2f}' for v in got['peak_rss_per_rank_gib'])} GiB; "
            f"probe {before:,.0f} before, "
            f"{after:,.0f} after; load average {load[0]:.2f} at the end"
        )
        for line in est["assumptions"]:
            print(f"  assumed: {line}")
        rows = [
            ("peak RSS (GiB)", est["memory_gib"]["peak"], est["memory_gib"]["range"], got["peak_rss_gib"]),
            ("s / step", est["time"]["step_s"], est["time"]["step_s_range"], got["step_s"]),
            ("final save (s)", est["time"]["final_save_s"], None, got["final_save_s"]),
            ("on disk (GB)", est["disk"]["total_bytes"] / 1e9, None, got["disk_gb"]),
        ]
        print("| | estimate | range | measured | estimate / measured |")
        print("|---|---|---|---|---|")
        for label, value, rng, measured in rows:
            span = f"{rng[0]:.2f} - {rng[1]:.2f}" if rng else ""
            print(f"| {label} | {value:.2f} | {span} | {measured:.2f} | {value / max(measured, 1e-9):.2f} |")
        print(
            f"  (peak before the saves {got['training_peak_gib']:.2f} GiB; first step {got['first_step_s']:.1f} s; "
            f"checkpoint {got['checkpoint_s']:.1f} s)"
        )
        for label, value, _, measured in rows[:2]:
            if abs(value / measured - 1) > TOLERANCE:
                failures.append(f"{name} {label}: estimate {value:.2f} vs measured {measured:.2f}")
        lo, hi = est["memory_gib"]["range"]
        if not lo <= got["peak_rss_gib"] <= hi:
            failures.append(
                f"{name} peak RSS {got['peak_rss_gib']:.2f} GiB outside the range {lo:.2f}-{hi:.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    print(
        "\n" + ("all within 25% and inside the range" if not failures else "MISSED: " + "; ".join(failures))
    )


if __name__ == "__main__":
    main()
