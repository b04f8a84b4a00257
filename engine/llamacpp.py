"""Where llama.cpp's tools are on this node and which release they are (no Paddle, no subprocess at import).

The tools (``llama-server``, ``llama-quantize``, ``llama-perplexity``) are built by ``make llamacpp``
(tools/build_llamacpp.sh) from the llama.cpp source vendored in the pinned ``llama-cpp-python`` sdist, into
``~/.cache/ernie-studio/llama.cpp/llama-cpp-python-<version>/bin``. Looked up in this order:
``ERNIE_STUDIO_LLAMACPP_BIN`` (a directory), that cache, then ``PATH``. A node with llama-server in any of them
serves text models on CPU with it under ``--backend auto`` unless ``ERNIE_STUDIO_CPU_SERVING`` is ``paddle``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from engine.cpuinfo import read_cpuinfo, this_cpu

# The llama-cpp-python sdist whose vendored llama.cpp the Makefile builds (LLAMACPP_PY_VERSION there; a
# test holds the two equal).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity")
BUILD_HINT = "build it with `make llamacpp` (tools/build_llamacpp.sh), or set ERNIE_STUDIO_LLAMACPP_BIN"
# Which engine `--backend auto` gives a text model on a CPU node where llama.cpp is installed: llama.cpp
# (docs/benchmarks.md: 2.8x to 6x the built-in server's decode speed in a sixth of its memory) or the
# built-in Paddle server. The studio's Settings.cpu_serving is the same variable.
CPU_SERVING_ENV = "ERNIE_STUDIO_CPU_SERVING"
CPU_SERVING = ("llamacpp", "paddle")

# On a CPU with AMX-INT8 (Intel Sapphire Rapids and later) llama.cpp repacks quantized weights into its "AMX"
# buffer type, and its AMX matmul segfaults: ggml-org/llama.cpp#20824 (ggml_backend_amx_mul_mat, closed stale
# without a fix). Reproduced with the pinned build (0c1e570) on an Intel Xeon with AMX_INT8: llama-perplexity
# and llama-server die with SIGSEGV on q8_0 and q4_K_M files, f16 runs, and `--no-repack` (plain CPU buffers
# instead of the extra AMX / repack ones) runs all three. Every tool we start gets it on such a CPU.
AMX_FLAG = "amx_int8"
NO_REPACK = "--no-repack"


def cpu_flags(cpuinfo: str | Path | None = None) -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (empty where /proc/cpuinfo cannot be read);
    ``cpuinfo``: another machine's file."""
    return (this_cpu() if cpuinfo is None else read_cpuinfo(cpuinfo))[1]


def repack_args(flags: frozenset[str] | None = None) -> list[str]:
    """Extra arguments for llama-server / llama-perplexity on this CPU: `--no-repack` where AMX would crash."""
    return [NO_REPACK] if AMX_FLAG in (cpu_flags() if flags is None else flags) else []


def cache_bin_dir() -> Path:
    home = os.environ.get("ERNIE_STUDIO_LLAMACPP_HOME") or str(
        Path.home() / ".cache" / "ernie-studio" / "llama.cpp"
    )
    return Path(home) / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "bin"


def cpu_serving(value: str | None = None) -> str:
    """The node's choice for `auto` on a CPU (``value``, else ERNIE_STUDIO_CPU_SERVING, else llamacpp)."""
    chosen = (value if value is not None else os.environ.get(CPU_SERVING_ENV, "")).strip() or CPU_SERVING[0]
    if chosen not in CPU_SERVING:
        raise ValueError(f"{CPU_SERVING_ENV} must be one of {', '.join(CPU_SERVING)}, not {chosen!r}")
    return chosen


def find_tool(name: str) -> Path | None:
    """The path of llama.cpp tool ``name`` on this node, or None."""
    if name not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}; one of {', '.join(TOOLS)}")
    dirs = [os.environ.get("ERNIE_STUDIO_LLAMACPP_BIN"), str(cache_bin_dir())]
    for d in dirs:
        if d and (Path(d) / name).is_file() and os.access(Path(d) / name, os.X_OK):
            return Path(d) / name
    found = shutil.which(name)
    return Path(found) if found else None


def require_tool(name: str) -> Path:
    """Like ``find_tool`` but a clear error when the tool is not installed."""
    path = find_tool(name)
    if path is None:
        raise FileNotFoundError(f"llama.cpp's {name} is not installed on this node; {BUILD_HINT}")
    return path


def tool_version(path: str | Path) -> str:
    """``--version`` of a llama.cpp tool, e.g. ``version: 1 (0c1e570)`` (its first line; empty on error)."""
    try:
        p = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (p.stdout + p.stderr).strip().splitlines()
    version = [ln for ln in lines if ln.startswith("version")]
    return (version or lines or [""])[0].strip()
