"""oneDNN's GEMMs and conversions (``engine.models.onednn``) against Paddle's own ops, in one run.

The ERNIE-4.5-0.3B shapes (hidden 1024, FFN 3072, vocab 103,424 with the tied [V, H] head) at decode and
training row counts: ``paddle.matmul`` (the baseline: MKL on a CPU) against oneDNN's sgemm, and for weights
held in bf16 Paddle's cast + ``paddle.matmul`` (the baseline) against the engine's upcast (oneDNN's reorder +
sgemm, ``upcast_matmul``) and oneDNN's bf16 GEMM (where the CPU has bf16 instructions, whether or not the
engine takes it here: ``kernels.bf16_gemm_refusal``); then Paddle's fp32 -> bf16 cast against oneDNN's
reorder. Best of ``--repeat`` calls each, on ``kernels.CPU_THREADS`` threads.

    .venv/bin/python bench/bench_onednn.py [--rows 1,8,64,256,512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import paddle

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import kernels, onednn
from engine.models.quantized import low_precision_matmul

SHAPES = (  # (name, K, N, weight transposed)
    ("up_gate 1024 -> 6144", 1024, 6144, False),
    ("down 3072 -> 1024", 3072, 1024, False),
    ("tied head 1024 -> 103424", 1024, 103424, True),
)


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def row(
    x: paddle.Tensor, w: paddle.Tensor, wb: paddle.Tensor, transposed: bool, bf16: bool, repeat: int
) -> list[str]:
    """One table row's cells: fp32 baseline, oneDNN sgemm, ratio; bf16 weights: Paddle's upcast, the engine's
    upcast and ratio, oneDNN bf16 and ratio."""
    base = best_ms(lambda: paddle.matmul(x, w, transpose_y=transposed), repeat)
    ours = best_ms(lambda: onednn.matmul(x, w, transposed), repeat)
    cells = [f"{base:.2f}", f"{ours:.2f}", f"{base / ours:.2f}x"]
    up = best_ms(lambda: paddle.matmul(x, wb.astype("float32"), transpose_y=transposed), repeat)
    with kernels.forced(onednn_bf16_matmul=False):
        engine_up = best_ms(lambda: low_precision_matmul(x, wb, transposed), repeat)
    cells += [f"{up:.2f}", f"{engine_up:.2f}", f"{up / engine_up:.2f}x"]
    if not bf16:
        return [*cells, "no bf16 instructions", ""]
    low = best_ms(lambda: onednn.matmul(x, wb, transposed, "bfloat16", kernels.cast), repeat)
    return [*cells, f"{low:.2f}", f"{up / low:.2f}x"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,256,512")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    bf16 = bool(kernels.cpu_bf16_features())
    print(f"threads {kernels.CPU_THREADS}; CPU bf16 instructions: {kernels.cpu_bf16_features() or 'none'}")
    refusal = kernels.bf16_gemm_refusal()
    print(f"bf16-held weights here: {'oneDNN bf16 GEMM' if refusal is None else 'upcast: ' + refusal}")
    print(
        "\n| shape | rows | paddle.matmul fp32 ms | oneDNN sgemm ms | x "
        "| bf16: Paddle cast + matmul ms | reorder + sgemm ms | x | oneDNN bf16 GEMM ms | x |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with paddle.no_grad():
        for name, k, n, transposed in SHAPES:
            w = paddle.randn([n, k] if transposed else [k, n])
            wb = w.astype("bfloat16")
            for rows in (int(r) for r in args.rows.split(",")):
                print(
                    f"| {name} | {rows} | "
                    + " | ".join(row(paddle.randn([rows, k]), w, wb, transposed, bf16, args.repeat))
                    + " |"
                )
    print("\n| fp32 -> bf16 of | Paddle cast ms | oneDNN reorder ms | x |")
    print("|---|---:|---:|---:|")
    for shape in ([512, 1024], [1024, 6144], [103424, 1024]):
        t = paddle.randn(shape)
        base = best_ms(functools.partial(t.astype, "bfloat16"), args.repeat)
        ours = best_ms(functools.partial(onednn.convert, t, "bfloat16"), args.repeat)
        print(f"| {shape} | {base:.2f} | {ours:.2f} | {base / ours:.2f}x |")


if __name__ == "__main__":
    main()
