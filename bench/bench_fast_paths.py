"""What named fast paths are worth in our whole training step, measured in one process with the model built
once: steps alternate between the paths off (the baseline) and on, so that a host whose speed drifts (a
shared VM's neighbours) slows both arms alike. Prints each arm's median and fastest step and the median of
the paired per-step ratios.

    .venv/bin/python bench/bench_fast_paths.py cpu_rms_norm,cpu_rope --pairs 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_cpu_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", help="comma-separated fast paths (engine.models.kernels.FAST_PATHS)")
    ap.add_argument("--pairs", type=int, default=6, help="timed off/on pairs")
    ap.add_argument("--warmup", type=int, default=1, help="untimed pairs before them")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()

    from engine.models import kernels

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    off = [p for p in paths if not kernels.capabilities()[p].on]
    if off:
        raise SystemExit(f"{off[0]} is off on this machine: {kernels.capabilities()[off[0]].reason}")
    with tempfile.TemporaryDirectory() as tmp:
        bench_cpu_step.make_model_dir(tmp, args.layers)
        step_args = types.SimpleNamespace(model_dir=tmp, precision=args.precision, seq=args.seq)
        fwd_bwd, opt, _marks, _profile = bench_cpu_step.ours_step(step_args)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.warmup + args.pairs):
            for on in (False, True) if i % 2 == 0 else (True, False):  # alternate which arm goes first
                with kernels.forced(**dict.fromkeys(paths, on)):
                    t0 = time.perf_counter()
                    fwd_bwd()
                    opt()
                    took = time.perf_counter() - t0
                if i >= args.warmup:
                    times[on].append(took)
    ratios = [a / b for a, b in zip(times[False], times[True], strict=True)]
    print(
        f"\nOur {args.precision} step ({args.layers} layers, batch 1 x {args.seq}), {args.pairs} pairs, "
        f"paths {', '.join(paths)}\n"
    )
    print("| arm | median s / step | fastest s / step |")
    print("|---|---:|---:|")
    for on, name in ((False, "paths off (baseline)"), (True, "paths on")):
        print(f"| {name} | {statistics.median(times[on]):.3f} | {min(times[on]):.3f} |")
    print(f"\npaired speed-up (off / on, median of {len(ratios)}): {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
