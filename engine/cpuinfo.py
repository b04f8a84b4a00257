"""What the kernel says about this CPU (/proc/cpuinfo): its vendor and feature flags, read once.

The fast paths (engine.models.kernels: which bf16 GEMM to take), the native ops' build key
(engine.models.native), llama.cpp's AMX work-around (engine.llamacpp) and bench/bench_cpu_peak.py read
them here.
"""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def read_cpuinfo(cpuinfo: str | Path = CPUINFO) -> tuple[str, frozenset[str]]:
    """(vendor_id, flags) of the first CPU listed in ``cpuinfo``; ("", {}) where it cannot be read."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:
        return "", frozenset()

    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(name)), "")

    return field("vendor_id"), frozenset(field("flags").split())


@functools.cache
def this_cpu() -> tuple[str, frozenset[str]]:
    """(vendor_id, flags) of this machine's CPU, read once per process."""
    return read_cpuinfo()
