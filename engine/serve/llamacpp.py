"""Serving through llama.cpp's ``llama-server`` (OpenAI-compatible, parallel slots, continuous batching):
the CPU serving engine where it is installed.

``ernie-studio serve --backend llamacpp`` takes a GGUF file, a GGUF export directory, or any model the
Paddle backend takes (written to GGUF under the log dir first), checks that the installed ``llama-server
--help`` lists every flag the launcher passes, starts it in its own session on the deployment's port with
its output in the log file, waits for /health and stops it: SIGTERM to its group, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.llamacpp import BUILD_HINT, CPU_SERVING_ENV, cpu_serving, find_tool, repack_args, tool_version
from engine.serve.fastdeploy import FlagCheck, help_flags, plan_flags
from engine.serve.ports import PortReservation, port_is_free

log = logging.getLogger(__name__)

SERVE_GGUF_TYPE = "q8_0"  # a checkpoint served with llama.cpp is written as this type unless told otherwise
DEFAULT_CTX = 4096


def gguf_files(directory: Path) -> dict[str, Path]:
    """The GGUF files of an export directory by type (``model-<type>.gguf``, else any ``*.gguf`` by stem)."""
    found = {}
    for p in sorted(Path(directory).glob("*.gguf")):
        t = p.stem.removeprefix("model-")
        found[t] = p
    return found


def is_gguf(model: str | Path) -> bool:
    """Whether ``model`` is a GGUF file or a GGUF export directory, which only llama.cpp serves."""
    p = Path(model)
    return (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and bool(gguf_files(p)))


def gguf_for_serving(model: str | Path, out_dir: str | Path, gguf_type: str = SERVE_GGUF_TYPE) -> Path:
    """The GGUF file llama-server loads for ``model``: the file itself, the export directory's file of
    ``gguf_type`` (else its only / first one), or ``model`` (a checkpoint or LoRA run) written as
    ``out_dir/model-<gguf_type>.gguf`` (reused while newer than the model's files)."""
    model = Path(model)
    if model.is_file():
        return model
    files = gguf_files(model)
    if files:
        return files.get(gguf_type) or next(iter(files.values()))
    from engine.train.options import GGUF_TYPES

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf type must be one of {', '.join(GGUF_TYPES)}, not {gguf_type!r}")
    out = Path(out_dir) / f"model-{gguf_type}.gguf"
    newest = max((p.stat().st_mtime for p in model.iterdir() if p.is_file()), default=0.0)
    if out.exists() and out.stat().st_mtime >= newest:
        return out
    return _write_gguf(model, out, gguf_type)


def _write_gguf(model_dir: Path, out: Path, gguf_type: str) -> Path:
    """Write ``model_dir`` as ``out`` through a private folder beside it, moved into place when whole: a
    deployment killed while writing leaves no half file for the next one to serve (its folder is removed by
    the next write), and two deployments of the same model writing at once each move a whole file."""
    import engine
    from engine.models.paths import tokenizer_dir
    from engine.train import gguf_export

    tokenizer = engine.load_tokenizer(str(tokenizer_dir(model_dir)))  # a refused chat template stops here
    loaded = _tensor_source(model_dir) or engine.load_model(str(model_dir), dtype="float32")  # LoRA merged
    problems = gguf_export.gguf_problems(loaded.config)
    if problems:
        raise ValueError(f"llama.cpp cannot serve {model_dir}: " + "; ".join(problems))
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_writes(out.parent)
    with writing_folder(out.parent) as work:
        written = work / out.name
        if gguf_type in gguf_export.QUANTIZE_NAMES:
            f16 = gguf_export.write_gguf(loaded, tokenizer, work / "model-f16.gguf", "f16")
            gguf_export.quantize_gguf(f16, written, gguf_type)
        else:
            gguf_export.write_gguf(loaded, tokenizer, written, gguf_type)
        os.replace(written, out)
    return out


WRITING_PREFIX = ".writing-"
WRITING_LOCK = ".lock"


@contextlib.contextmanager
def writing_folder(parent: Path) -> Iterator[Path]:
    """A private folder in ``parent`` for one write, deleted after. Its writer holds a lock in it for as long
    as it lives (the kernel drops the lock when the process dies, SIGKILL included), so a folder whose lock
    can be taken was abandoned. It takes its `.writing-` name only once locked: a cleaner never finds it
    unlocked while its writer lives."""
    made = Path(tempfile.mkdtemp(prefix=".new-", dir=parent))
    held = os.open(made / WRITING_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        work = made.with_name(WRITING_PREFIX + made.name.removeprefix(".new-"))
        os.rename(made, work)
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        os.close(held)
        shutil.rmtree(made, ignore_errors=True)  # only when the rename did not happen


def remove_abandoned_writes(directory: Path) -> list[Path]:
    """Delete the private folders of GGUF writes whose writer died (a deployment killed mid-write): their lock
    is free. A folder another live writer holds is left alone. Returns the folders removed."""
    removed = []
    for work in Path(directory).glob(f"{WRITING_PREFIX}*"):
        try:
            fd = os.open(work / WRITING_LOCK, os.O_RDWR)
        except OSError:  # no lock file: being removed by another cleaner, or not ours; leave it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live writer
        finally:
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
        log.info("removed %s, left by a GGUF write whose process died", work)
        removed.append(work)
    return removed


def _tensor_source(model_dir: Path):
    """The checkpoint read tensor by tensor (``loading.TensorSource``, a LoRA run's adapters folded in), so
    writing the GGUF holds one tensor at a time, not the model in fp32 (84 GB for ERNIE-4.5-21B-A3B); None
    where only the loaded model serves: a source the export would not stream either
    (``engine.train.export.source_streams``), or a quantized checkpoint."""
    from engine.models.loading import TensorSource
    from engine.train.export import source_streams

    try:
        source = TensorSource(model_dir)
    except ValueError:  # a quantized export: read as the loaded model computes it
        return None
    return source if source_streams(source) else None


def model_problem(model: str | Path) -> str:
    """Why llama.cpp could not serve ``model`` (a GGUF file, a GGUF export, a checkpoint or LoRA run
    directory); empty when it can. Reads config.json only."""
    from engine.models.config import ErnieConfig
    from engine.models.paths import architecture_dir
    from engine.train.gguf_export import gguf_problems

    p = Path(model)
    if p.is_file():
        return "" if p.suffix == ".gguf" else f"{p} is not a .gguf file"
    if gguf_files(p):
        return ""
    from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir

    if is_paddleocr_vl_dir(architecture_dir(p)):
        return "no PaddleOCR-VL architecture in this GGUF writer (the built-in Paddle server serves it)"
    config_file = architecture_dir(p) / "config.json"
    try:
        config = ErnieConfig.from_dict(json.loads(config_file.read_text()))
    except (OSError, ValueError) as e:
        return f"{config_file}: {e}"
    return "; ".join(gguf_problems(config))


def choose(
    requested: str, model: str | Path, gpu: bool | None = None, prefer: str | None = None
) -> tuple[str | None, str]:
    """llama.cpp's part of the backend choice: ("llamacpp", why) when it serves ``model``, else (None, why
    not). ``requested`` "llamacpp" raises instead of declining; "auto" takes it on a CPU node where
    llama-server is installed (ERNIE_STUDIO_LLAMACPP_BIN, the build cache of `make llamacpp`, or PATH) unless
    the node prefers the built-in server (``prefer``, else ERNIE_STUDIO_CPU_SERVING, is ``paddle``)."""
    explicit = requested == "llamacpp"
    if not explicit and cpu_serving(prefer) == "paddle":
        return None, f"{CPU_SERVING_ENV} is paddle: this node serves CPU deployments with the built-in server"
    server = find_tool("llama-server")
    if server is None:
        if explicit:
            raise ValueError(f"--backend llamacpp: llama.cpp's llama-server is not installed; {BUILD_HINT}")
        return None, f"llama.cpp is not installed on this node ({BUILD_HINT})"
    if not explicit:
        from engine.serve.fastdeploy_env import gpu_present

        if gpu_present() if gpu is None else gpu:
            return None, "a GPU node: llama.cpp serves CPU nodes"
    check = check_installed(server) if explicit else installed_check()
    problem = check.message if not check.ok else model_problem(model)
    if problem:
        if explicit:
            raise ValueError(f"--backend llamacpp: {problem}")
        return None, f"llama.cpp: {problem}"
    return (
        "llamacpp",
        "requested"
        if explicit
        else f"llama.cpp ({check.version}) is installed on this CPU node and serves this model "
        f"({SERVE_GGUF_TYPE} GGUF)",
    )


# ---- the launch plan and the --help check ---------------------------------------------------------------


@dataclass
class LlamaCppArgs:
    gguf: Path
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "default"
    max_model_len: int = DEFAULT_CTX
    parallel: int = 8
    threads: int = 0  # 0: llama.cpp's own choice


def build_argv(server: str | Path, args: LlamaCppArgs) -> list[str]:
    """The llama-server command line: every slot gets ``max_model_len`` tokens of the KV cache, continuous
    batching across slots, the GGUF's own chat template through Jinja, Prometheus /metrics, no web UI; on an
    AMX CPU no weight repacking (engine.llamacpp.repack_args: llama.cpp's AMX matmul crashes)."""
    argv = [
        str(server),
        "--model", str(args.gguf),
        "--host", args.host,
        "--port", str(args.port),
        "--alias", args.served_model_name,
        "--ctx-size", str(args.max_model_len * args.parallel),
        "--parallel", str(args.parallel),
        "--cont-batching",
        "--jinja",
        "--metrics",
        "--no-webui",
    ]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv + repack_args()


def launcher_flags() -> list[str]:
    return plan_flags(build_argv("llama-server", LlamaCppArgs(Path("m.gguf"), 0, threads=2)))


def check_flags(help_text: str, version: str) -> FlagCheck:
    missing = [f for f in launcher_flags() if f not in help_flags(help_text)]
    if not missing:
        return FlagCheck(True, version, [], f"llama-server {version} takes every flag")
    return FlagCheck(
        False,
        version,
        missing,
        f"llama-server {version or '(version unknown)'} does not accept {', '.join(missing)}, which the "
        f"launcher passes; {BUILD_HINT}",
    )


def check_installed(server: str | Path | None = None) -> FlagCheck:
    """Run the installed ``llama-server --help`` and hold the launcher's flags against it."""
    server = server or find_tool("llama-server")
    if server is None:
        return FlagCheck(False, None, [], f"llama.cpp's llama-server is not installed; {BUILD_HINT}")
    version = tool_version(server)
    try:
        out = subprocess.run(
            [str(server), "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return FlagCheck(False, version, [], f"`{server} --help` did not run: {e}")
    text = out.stdout + out.stderr
    if out.returncode != 0 or "--model" not in text:
        return FlagCheck(
            False, version, [], f"`{server} --help` failed (exit {out.returncode}): {text[-600:]}"
        )
    return check_flags(text, version)


@functools.cache
def installed_check() -> FlagCheck:
    """`check_installed` once per process."""
    return check_installed()


# ---- the server process ----------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: llama-server gets SIGTERM when `ernie-studio serve` dies, even by SIGKILL."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LlamaCppServer:
    """A running llama-server in its own session, logging to ``log_file``."""

    def __init__(self, argv: list[str], host: str, port: int, log_file: Path):
        self.argv, self.host, self.port, self.log_file = argv, host, port, Path(log_file)
        self.proc: subprocess.Popen | None = None
        self.reservation = PortReservation()
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 300.0) -> LlamaCppServer:
        """Start it and wait until /health answers 200; its exit or a timeout raise with llama.cpp's
        last log lines (a corrupt GGUF fails here with llama.cpp's own error)."""
        if not port_is_free(self.port, self.host) or not self.reservation.take(self.port):
            raise ValueError(f"port {self.port} on {self.host} is already in use; choose another --port")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_file, "ab")  # noqa: SIM115 (closed in stop)
        log.info("starting llama.cpp: %s (logs: %s)", " ".join(self.argv), self.log_file)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        local = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        health = f"http://{local}:{self.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(
                    f"llama-server exited with code {code}; last log lines:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(health, timeout=2) as r,
            ):
                if r.status == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"llama-server did not become healthy within {timeout:.0f}s; see {self.log_file}")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait(self) -> int:
        return self.proc.wait() if self.proc else 0

    def terminate(self) -> None:
        """SIGTERM to llama-server's process group without waiting (safe in a signal handler)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to its process group (llama-server finishes its slots' current step), SIGKILL after
        ``grace``."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reservation.release()
        if self._log:
            self._log.close()
            self._log = None
