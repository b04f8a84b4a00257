"""FastDeploy's environment as the studio finds it without importing FastDeploy (which starts CUDA): the
Python it is installed in, whether it is importable there, its version, `pip check` of that environment, and
whether a GPU is present."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# The interpreter FastDeploy is installed in. The serving image keeps FastDeploy in the image's own Python 3.10
# with FastDeploy's pins (uvicorn==0.29.0, setuptools<80), and the studio's worker in its own Python 3.11
# environment (docker/Dockerfile.serve); the worker launches, probes and checks FastDeploy through this one.
FASTDEPLOY_PYTHON_ENV = "ERNIE_STUDIO_FASTDEPLOY_PYTHON"


def fastdeploy_python() -> str:
    """``ERNIE_STUDIO_FASTDEPLOY_PYTHON`` (an absolute path to an executable), else this process's Python."""
    value = os.environ.get(FASTDEPLOY_PYTHON_ENV, "").strip()
    if not value:
        return sys.executable
    path = Path(value)
    if not path.is_absolute() or not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(
            f"{FASTDEPLOY_PYTHON_ENV}={value!r}: give the absolute path of the Python interpreter FastDeploy "
            "is installed in (the serving image sets /usr/local/bin/fastdeploy-python), or unset it"
        )
    return str(path)


def _separate(python: str) -> bool:
    return Path(python).resolve() != Path(sys.executable).resolve()


def _ask(python: str, code: str, timeout: float = 60.0) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def fastdeploy_importable() -> bool:
    """FastDeploy is importable by FastDeploy's Python (found, not imported: importing starts CUDA)."""
    python = fastdeploy_python()
    if not _separate(python):
        return importlib.util.find_spec("fastdeploy") is not None
    out = _ask(python, "import importlib.util, sys; sys.exit(importlib.util.find_spec('fastdeploy') is None)")
    return out is not None and out.returncode == 0


_VERSION_CODE = """
import contextlib, importlib.metadata as m
for dist in m.packages_distributions().get("fastdeploy", []):
    with contextlib.suppress(m.PackageNotFoundError):
        print(m.version(dist))
        break
"""


def fastdeploy_version() -> str | None:
    """The installed distribution's version (fastdeploy-gpu, ...) from package metadata, without importing it."""
    python = fastdeploy_python()
    if _separate(python):
        out = _ask(python, _VERSION_CODE)
        return (out.stdout.strip() or None) if out is not None and out.returncode == 0 else None
    import importlib.metadata

    for dist in importlib.metadata.packages_distributions().get("fastdeploy", []):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def pip_check(python: str | None = None, timeout: float = 120.0) -> tuple[bool, str]:
    """``pip check`` of FastDeploy's environment: (consistent, pip's words). Anything installed over FastDeploy's
    pins (a newer uvicorn or setuptools) shows here."""
    python = python or fastdeploy_python()
    try:
        out = subprocess.run(
            [python, "-m", "pip", "check"],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`{python} -m pip check` did not run: {e}"
    said = (out.stdout.strip() or out.stderr.strip())[-1200:]
    return out.returncode == 0, said


def gpu_present() -> bool:
    """A CUDA GPU is visible: Paddle compiled with CUDA and seeing a device, or nvidia-smi listing one."""
    try:
        import paddle

        if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            return True
    except Exception as e:  # an unusable GPU build counts as no GPU
        log.debug("paddle GPU probe failed: %s", e)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout
