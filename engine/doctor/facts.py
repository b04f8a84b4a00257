"""The node's facts: Paddle build and version, CUDA / cuDNN, GPUs with their memory, CPU cores, RAM and
FastDeploy. Every probe is guarded: a broken driver shows up as a fact (and fails the `devices` check),
never as a doctor that crashes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import platform
import socket
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.serve.fastdeploy_env import fastdeploy_importable, fastdeploy_python, fastdeploy_version

log = logging.getLogger(__name__)


def node_facts() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "paddle": paddle_build(),
        "devices": gpu_devices(),
        "cpu_count": cpu_count(),
        "memory": host_memory(),
        "fastdeploy": fastdeploy_facts(),
    }


def _version_string(value: Any) -> str | None:
    # A CPU build answers "False" to paddle.version.cuda() / cudnn().
    text = str(value) if value is not None else ""
    return None if text in ("", "False", "0") else text


def _version_file() -> ModuleType | None:
    """Paddle's generated `paddle/version/__init__.py`, loaded by itself: the build's facts without importing
    Paddle (1.5-2.5 s of CPU and several hundred MB a process; a worker reads them at every start)."""
    # PathFinder directly: importlib.util.find_spec would consult sys.meta_path, where the worker's import
    # guard (studio.processes) takes the first lookup of "paddle" for its import.
    spec = importlib.machinery.PathFinder.find_spec("paddle")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version" / "__init__.py"
    file_spec = importlib.util.spec_from_file_location("_ernie_paddle_version_file", path)
    if file_spec is None or file_spec.loader is None or not path.is_file():
        return None
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)
    except Exception:  # a layout this code does not know: the import below answers instead
        log.debug("paddle's version file did not load", exc_info=True)
        return None
    return module


def _cpu_only(v: ModuleType) -> bool:
    accelerators = (v.cuda_version, v.cudnn_version, v.hip_version, v.xpu_xre_version)
    return all(_version_string(a) is None for a in accelerators)


@cache
def cpu_only_build() -> bool:
    """True when the installed Paddle is a plain CPU build (no CUDA, ROCm or XPU), read without importing it.
    False also when the version file cannot be read: callers then import Paddle and ask it."""
    v = _version_file()
    return v is not None and _cpu_only(v)


def paddle_build() -> dict[str, Any]:
    # Read afresh (an upgrade in place shows in the next report). On a CPU build these are the facts
    # Paddle's API gives (a test compares them).
    v = _version_file()
    if v is not None and _cpu_only(v):
        return {
            "version": v.full_version,
            "commit": v.commit,
            "compiled_with_cuda": False,
            "cuda": None,
            "cudnn": None,
            "device": "cpu",
        }
    return imported_paddle_build()


def imported_paddle_build() -> dict[str, Any]:
    """The build's facts as the imported Paddle answers them."""
    import paddle

    version = paddle.version
    return {
        "version": paddle.__version__,
        "commit": getattr(version, "commit", None),
        "compiled_with_cuda": bool(paddle.device.is_compiled_with_cuda()),
        "cuda": _version_string(version.cuda()),
        "cudnn": _version_string(version.cudnn()),
        "device": paddle.device.get_device(),
    }


def gpu_devices() -> list[dict[str, Any]]:
    """Every visible GPU: name, compute capability, total and free memory (bytes)."""
    if cpu_only_build():
        return []
    import paddle

    if not paddle.device.is_compiled_with_cuda():
        return []
    try:
        count = paddle.device.cuda.device_count()
    except Exception as e:  # a driver that does not load: no devices, and the devices check says why
        log.warning("GPU count failed: %s", e)
        return []
    return [_gpu(i) for i in range(count)]


def _gpu(index: int) -> dict[str, Any]:
    import paddle

    device: dict[str, Any] = {"index": index}
    try:
        props = paddle.device.cuda.get_device_properties(index)
        device |= {
            "name": props.name,
            "compute_capability": f"{props.major}{props.minor}",
            "total_memory_bytes": int(props.total_memory),
        }
    except Exception as e:
        device["error"] = f"properties unreadable: {e}"
    # paddle.cuda.mem_get_info (Paddle >= 3.2): (free, total) bytes of the device asked for, not the current
    # one: its binding (paddle/fluid/pybind/cudart_py.cc, `cudaMemGetInfo`) switches to that device with a
    # CUDADeviceGuard around cudaMemGetInfo. It ignores cudaMemGetInfo's error code, returning (0, 0).
    mem_get_info = getattr(getattr(paddle, "cuda", None), "mem_get_info", None)
    if mem_get_info is not None:
        try:
            free, total = mem_get_info(f"gpu:{index}")
            if int(total) == 0:
                raise RuntimeError("cudaMemGetInfo reported 0 bytes in total")
            device["free_memory_bytes"] = int(free)
            device.setdefault("total_memory_bytes", int(total))
        except Exception as e:
            device["error"] = f"memory unreadable: {e}"
    return device


def cpu_count() -> int:
    """Cores this process may run on (a container's CPU set), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory() -> dict[str, int | None]:
    """Total and available RAM in bytes (MemAvailable of /proc/meminfo: what can be had without swapping)."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = values.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            total = None
    return {"total_bytes": total, "available_bytes": values.get("MemAvailable")}


def fastdeploy_facts() -> dict[str, Any]:
    """Importable or not, the version of the distribution that provides it (fastdeploy-gpu, ...), read from
    package metadata (importing FastDeploy would initialise CUDA), and the Python it is installed in."""
    try:
        python = fastdeploy_python()
    except ValueError as e:
        return {"available": False, "version": None, "python": None, "error": str(e)}
    available = fastdeploy_importable()
    return {"available": available, "version": fastdeploy_version() if available else None, "python": python}
