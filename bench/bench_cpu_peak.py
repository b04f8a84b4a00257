"""One core's peak rate of fp32 FMAs against bf16 dot products (``VDPBF16PS``), in one run.

Whether oneDNN's bf16 GEMM can beat its sgemm on a CPU is decided by the instructions underneath: an fp32 FMA
does 2 flops per lane, a bf16 dot product 4 (two bf16 pairs into one fp32 lane), so the bf16 GEMM gains only
where the dot product issues at least half as often as the FMA. This compiles a loop of 12 independent
accumulators per instruction with the machine's gcc and prints GFLOP/s for each (``kernels.bf16_gemm_refusal``
cites these figures; docs/benchmarks.md has them per CPU).

    .venv/bin/python bench/bench_cpu_peak.py [--iterations 100000000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.cpuinfo import this_cpu

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
  long n = atol(argv[1]);
  __m512 acc[12];
  __m512 x = _mm512_set1_ps(1e-9f), y = _mm512_set1_ps(1.0f);
  for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
  double t = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) acc[j] = _mm512_fmadd_ps(x, y, acc[j]);
  }
  double fma = now() - t;
  float sink = 0;
  for (int j = 0; j < 12; j++) sink += _mm512_reduce_add_ps(acc[j]);
#ifdef WITH_BF16
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x0001);
  for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
  t = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  double dot = now() - t;
  for (int j = 0; j < 12; j++) sink += _mm512_reduce_add_ps(acc[j]);
  printf("%.6f %.6f %g\n", fma, dot, sink);
#else
  printf("%.6f 0 %g\n", fma, sink);
#endif
  return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=100_000_000)
    args = ap.parse_args()
    flags = this_cpu()[1]
    if "avx512f" not in flags:
        sys.exit("this CPU has no AVX-512: the bf16 dot product (AVX512_BF16) does not exist here")
    bf16 = "avx512_bf16" in flags
    gcc = shutil.which("gcc") or sys.exit("gcc is needed to build the loop")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        cmd = [gcc, "-O2", "-mavx512f", str(src), "-o", str(exe)]
        cmd += ["-mavx512bf16", "-DWITH_BF16"] if bf16 else []
        subprocess.run(cmd, check=True)
        out = subprocess.run([str(exe), str(args.iterations)], check=True, capture_output=True, text=True)
    fma_s, dot_s, _ = (float(v) for v in out.stdout.split())
    ops = args.iterations * 12
    fma = ops * 16 * 2 / fma_s / 1e9
    print(
        f"one core; {'avx512_bf16' if bf16 else 'no avx512_bf16'}; {args.iterations:,} x 12 instructions each\n"
    )
    print("| instruction (zmm) | flops each | GFLOP/s | vs fp32 FMA |")
    print("|---|---:|---:|---:|")
    print(f"| VFMADD231PS (fp32 FMA) | 32 | {fma:.1f} | 1.00x |")
    if bf16:
        dot = ops * 16 * 4 / dot_s / 1e9
        print(f"| VDPBF16PS (bf16 dot, fp32 sums) | 64 | {dot:.1f} | {dot / fma:.2f}x |")


if __name__ == "__main__":
    main()
