"""The work of a deployment task: merge a LoRA run when the engine needs it, start `ernie-studio serve`
on a free port, wait for /health, hold the server until a stop is requested, then free the port."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from sqlalchemy.orm import Session

from engine.models.paths import is_lora_dir
from engine.serve import llamacpp
from engine.serve.fastdeploy import PIDS_FILE, gpu_share, installed_check, model_unsupported
from engine.serve.fastdeploy_env import fastdeploy_importable
from engine.serve.ports import free_port
from engine.serve.process_records import kill_recorded
from studio.config import Settings
from studio.db import session_factory
from studio.models import Deployment, DeploymentStatus, Run, utcnow
from studio.services import deployments as dep_svc
from studio.services.models import BUILDABLE_PRESETS, build_preset
from workers.process import SupervisedJob, engine_command, spawn, stop_group, supervise, tail

log = logging.getLogger(__name__)

POLL_S = 0.25


def resolve_backend(backend: str) -> str:
    """FastDeploy's part of the choice: `auto` is FastDeploy where it is installed (GPU nodes) and its
    --help takes every flag the launcher passes, the Paddle server otherwise; an explicit `fastdeploy` that
    fails the check is refused."""
    return choose_backend(backend, None)[0]


def choose_backend(backend: str, model_dir: Path | None, cpu_serving: str | None = None) -> tuple[str, str]:
    """(backend, why) for a deployment: an explicit backend is checked and refused with the reason;
    `auto` takes FastDeploy where installed, then llama.cpp on a CPU node where installed (and the model
    fits it) unless the node's ``cpu_serving`` is paddle, else the built-in Paddle server."""
    if model_dir is not None and llamacpp.is_gguf(model_dir):
        return _gguf_backend(backend, model_dir)
    if backend == "paddle":
        return backend, "requested"
    if backend == "llamacpp":
        try:
            return llamacpp.choose("llamacpp", model_dir or "")
        except ValueError as e:
            raise RuntimeError(f"llama.cpp refused: {e}") from e
    chosen, why = _fastdeploy_choice(backend, model_dir)
    if chosen:
        return chosen, why
    if model_dir is not None:
        chosen, why_not = llamacpp.choose("auto", model_dir, prefer=cpu_serving)
        if chosen:
            return chosen, f"{why}; {why_not}"
        why = f"{why}; {why_not}"
    return "paddle", f"{why}; the built-in Paddle server serves it"


def _fastdeploy_choice(backend: str, model_dir: Path | None) -> tuple[str | None, str]:
    """("fastdeploy", why) when FastDeploy serves the deployment, else (None, why not); an explicit
    `fastdeploy` that cannot is refused."""
    unsupported = model_unsupported(model_dir)
    if unsupported:
        if backend == "fastdeploy":
            raise RuntimeError(f"FastDeploy refused: {model_dir} is {unsupported}")
        return None, f"not FastDeploy: {unsupported}"
    if backend == "auto" and not fastdeploy_importable():
        return None, "FastDeploy is not installed"
    check = installed_check()
    if check.ok:
        return "fastdeploy", "FastDeploy is installed and takes every flag the launcher passes"
    if backend == "fastdeploy":
        raise RuntimeError(f"FastDeploy refused: {check.message}")
    log.warning("not serving with FastDeploy: %s", check.message)
    return None, check.message


def _gguf_backend(backend: str, model: Path) -> tuple[str, str]:
    """A GGUF has one engine: `auto` takes it as a request for llama.cpp, other engines are refused."""
    if backend not in ("auto", "llamacpp"):
        raise RuntimeError(f"{model} is a GGUF, which only llama.cpp serves; deploy it with backend llamacpp")
    try:
        return "llamacpp", llamacpp.choose("llamacpp", model)[1] + " (a GGUF: only llama.cpp serves it)"
    except ValueError as e:
        raise RuntimeError(f"llama.cpp refused: {e}") from e


class FastDeploySlots:
    """How many FastDeploy servers this worker holds at once: `fastdeploy_per_gpu` per GPU it sees, each
    given 0.9 / `fastdeploy_per_gpu` of its GPU's memory (FastDeploy takes 0.9 by default) and pinned to the
    GPU with the fewest (CUDA_VISIBLE_DEVICES)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, str] = {}

    def take(self, settings: Settings, deployment_id: int) -> tuple[str, float]:
        gpus = [g.strip() for g in (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",") if g.strip()]
        per_gpu = max(1, settings.fastdeploy_per_gpu)
        with self._lock:
            load = {g: list(self._held.values()).count(g) for g in gpus}
            gpu = min(gpus, key=lambda g: load[g])
            if load[gpu] >= per_gpu:
                raise RuntimeError(
                    f"this serving worker already holds {len(self._held)} FastDeploy deployment(s), "
                    f"{per_gpu} per GPU on GPU(s) {','.join(gpus)} (ERNIE_STUDIO_FASTDEPLOY_PER_GPU); "
                    "stop one, or deploy with the paddle backend"
                )
            self._held[deployment_id] = gpu
        return gpu, gpu_share(per_gpu)

    def release(self, deployment_id: int) -> None:
        with self._lock:
            self._held.pop(deployment_id, None)


FASTDEPLOY_SLOTS = FastDeploySlots()
# FastDeploy's own shutdown (engine, cache managers, GPU workers) gets this long before SIGKILL.
FASTDEPLOY_STOP_GRACE_S = 30.0


def fastdeploy_pids_file(directory: Path) -> Path:
    """Where `ernie-studio serve --log-dir <deployment>/fastdeploy` records FastDeploy's processes."""
    return directory / "fastdeploy" / PIDS_FILE


def stop_server(settings: Settings, server: ModelServer) -> None:
    """Stop `ernie-studio serve`: for FastDeploy it stops the api_server (its own shutdown first); then its
    group, anything left below it, and every process FastDeploy was recorded starting."""
    if server.backend == "fastdeploy":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=FASTDEPLOY_STOP_GRACE_S + 10)
    stop_group(server.proc, settings.kill_grace_s)
    if server.backend == "fastdeploy":
        kill_recorded(fastdeploy_pids_file(server.log_file.parent))


def merge_lora(settings: Settings, run: Run, log_file: Path, beat: Callable[[], object]) -> Path:
    """`ernie-studio export <run config> lora=True`: the merged model FastDeploy can load."""
    export_dir = Path(run.output_dir) / "export"
    if (export_dir / "config.json").exists():
        return export_dir
    config_file = Path(run.output_dir).parent / "export.yaml"
    config_file.write_text(yaml.safe_dump({**run.config, "lora": True, "export_dir": str(export_dir)}))
    proc = spawn(engine_command("export", str(config_file)), log_file)
    while proc.poll() is None:
        beat()  # keep the deployment alive for the reconciler while a large merge runs
        time.sleep(POLL_S * 4)
    code = proc.returncode
    if code != 0 or not (export_dir / "config.json").exists():
        raise RuntimeError(f"merging the LoRA adapter failed (exit code {code}):\n{tail(log_file, 2000)}")
    return export_dir


def serving_gguf_dir(settings: Settings, model_dir: Path) -> Path:
    """Where a checkpoint served by llama.cpp is written as GGUF and found again by the next deployment of
    the same model (the file is rewritten when the model's files are newer): a model inside a run's folder
    under that run's `serving-gguf/<its path in the run>` (deleted with the run; the run's model and one of
    its checkpoints keep apart), any other model in a folder of the cache named after its path."""
    model = Path(model_dir).resolve()
    runs = settings.runs_dir.resolve()
    if model.is_relative_to(runs) and model != runs:
        run, *inside = model.relative_to(runs).parts
        return runs.joinpath(run, "serving-gguf", *inside)
    return settings.home / "cache" / "gguf" / hashlib.sha256(str(model).encode()).hexdigest()[:16]


@dataclass
class ModelServer:
    """A started `ernie-studio serve` child process and where it answers."""

    proc: subprocess.Popen
    port: int
    url: str  # the OpenAI base URL the API and other nodes reach
    health: str  # /health as this worker reaches it
    log_file: Path
    backend: str = "paddle"


def execute_deployment(settings: Settings, deployment_id: int, worker: str) -> str | None:
    """Start and hold one deployment; returns its final status (None when another worker has it)."""
    directory = settings.deployments_dir / str(deployment_id)
    directory.mkdir(parents=True, exist_ok=True)
    log_file = directory / "server.log"
    with session_factory(settings)() as session:
        dep = dep_svc.claim_deployment(session, deployment_id, worker, settings.node_name)
        if dep is None:
            return None
        try:
            model_dir = _servable_model(session, settings, dep, "", log_file)
            backend, why = choose_backend(dep.backend, model_dir, settings.cpu_serving)
            dep_svc.record_backend_choice(session, deployment_id, backend, why)
            model_dir = _servable_model(session, settings, dep, backend, log_file)
            gpu = FASTDEPLOY_SLOTS.take(settings, deployment_id) if backend == "fastdeploy" else None
        except Exception as e:
            dep_svc.mark_deployment(session, deployment_id, status=DeploymentStatus.FAILED, error=str(e))
            return DeploymentStatus.FAILED.value
        try:
            server = _start_server(
                session, settings, deployment_id, model_dir, backend, directory, log_file, gpu
            )
            not_ready = _wait_until_healthy(session, settings, deployment_id, server)
            if not_ready is not None:
                return not_ready
            dep_svc.mark_deployment(
                session, deployment_id, status=DeploymentStatus.RUNNING, url=server.url, started_at=utcnow()
            )
            log.info("deployment %s serving %s at %s", deployment_id, model_dir, server.url)
            return _hold(session, settings, deployment_id, server)
        finally:
            FASTDEPLOY_SLOTS.release(deployment_id)


def _servable_model(
    session: Session, settings: Settings, dep: Deployment, backend: str, log_file: Path
) -> Path:
    """The directory the server loads: a tiny preset is built first, a LoRA run merged for FastDeploy."""
    model_dir = Path(dep.model_dir)
    run = session.get(Run, dep.run_id) if dep.run_id else None
    if model_dir.parent == settings.models_dir and model_dir.name in BUILDABLE_PRESETS:
        build_preset(settings, model_dir.name)  # a tiny preset deployed before anything trained on it
    if run is not None and backend == "fastdeploy" and is_lora_dir(model_dir):
        model_dir = merge_lora(settings, run, log_file, lambda: dep_svc.deployment_heartbeat(session, dep.id))
    return model_dir


def _start_server(
    session: Session,
    settings: Settings,
    deployment_id: int,
    model_dir: Path,
    backend: str,
    directory: Path,
    log_file: Path,
    gpu: tuple[str, float] | None = None,
) -> ModelServer:
    """`ernie-studio serve` on a free port, recorded on the deployment; a FastDeploy one on its GPU with its
    share of the GPU's memory, logging (and recording its processes) under the deployment's directory."""
    port = free_port(settings.serve_host)
    cmd = engine_command(
        "serve",
        "--model",
        str(model_dir),
        "--host",
        settings.serve_host,
        "--port",
        str(port),
        "--backend",
        backend,
        "--served-model-name",
        "default",
    )
    if backend == "llamacpp":
        cmd += [
            "--log-dir",
            str(directory / "llamacpp"),
            "--gguf-dir",
            str(serving_gguf_dir(settings, model_dir)),
        ]
    if backend == "fastdeploy":
        cmd += ["--log-dir", str(directory / "fastdeploy")]
        if gpu is not None:
            cmd += ["--devices", gpu[0], "--gpu-memory-utilization", f"{gpu[1]:g}"]
    proc = spawn(cmd, log_file, cwd=directory)
    dep_svc.mark_deployment(session, deployment_id, pid=proc.pid, port=port, backend=backend)
    advertised = settings.serve_advertise_host or settings.serve_host
    local = "127.0.0.1" if settings.serve_host in ("0.0.0.0", "") else settings.serve_host
    return ModelServer(
        proc, port, f"http://{advertised}:{port}/v1", f"http://{local}:{port}/health", log_file, backend
    )


def _wait_until_healthy(
    session: Session, settings: Settings, deployment_id: int, server: ModelServer
) -> str | None:
    """None once /health answers 200; else the status the deployment ended with (the server exited, a stop
    was requested, or it took longer than serve_start_timeout_s)."""
    deadline = time.monotonic() + settings.serve_start_timeout_s
    healthy = False
    while not healthy:
        if server.proc.poll() is not None:
            return _server_exited(session, deployment_id, server)
        stop_requested = dep_svc.deployment_heartbeat(session, deployment_id)
        timed_out = time.monotonic() > deadline
        if stop_requested or timed_out:
            return _stop_before_ready(session, settings, deployment_id, server, timed_out=timed_out)
        try:
            healthy = httpx.get(server.health, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            time.sleep(POLL_S)
    return None


def _stop_before_ready(
    session: Session, settings: Settings, deployment_id: int, server: ModelServer, *, timed_out: bool
) -> str:
    """Stop a server that never became ready: failed when it timed out, stopped when asked to."""
    stop_server(settings, server)
    status = DeploymentStatus.FAILED if timed_out else DeploymentStatus.STOPPED
    error = (
        f"no answer on {server.health} after {settings.serve_start_timeout_s:.0f} s" if timed_out else None
    )
    dep_svc.mark_deployment(session, deployment_id, status=status, error=error, pid=None, stopped_at=utcnow())
    return status.value


def _hold(session: Session, settings: Settings, deployment_id: int, server: ModelServer) -> str | None:
    """Keep the deployment alive under the supervisor until the server exits, a stop is requested (the
    deployment's cancel) or the worker shuts down."""
    return supervise(session, settings, server.proc, _Serving(settings, deployment_id, server))


class _Serving(SupervisedJob):
    """A ready model server under the supervisor: no progress to collect; a stop request is its cancel, and
    done is stopped (asked to) or failed (the server exited by itself)."""

    def __init__(self, settings: Settings, deployment_id: int, server: ModelServer) -> None:
        self.settings, self.id, self.server, self.proc = settings, deployment_id, server, server.proc

    def __repr__(self) -> str:
        return f"deployment {self.id}"

    def state(self, session: Session) -> str:
        return "cancel" if dep_svc.deployment_heartbeat(session, self.id) else "ok"

    def stop(self, settings: Settings, proc: subprocess.Popen) -> None:
        stop_server(settings, self.server)

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        self._stopped(session, "its worker stopped; deploy again")

    def finish(self, session: Session, code: int, cancelled: bool) -> str:
        if not cancelled:
            return _server_exited(session, self.id, self.server)
        return self._stopped(session, None)

    def _stopped(self, session: Session, error: str | None) -> str:
        dep_svc.mark_deployment(
            session, self.id, status=DeploymentStatus.STOPPED, pid=None, stopped_at=utcnow(), error=error
        )
        log.info("deployment %s stopped; port %d is free", self.id, self.server.port)
        return DeploymentStatus.STOPPED.value

    def wait(self) -> None:
        time.sleep(POLL_S * 2)


def _server_exited(session: Session, deployment_id: int, server: ModelServer) -> str:
    if server.backend == "fastdeploy":  # its workers may outlive a crashed api_server
        kill_recorded(fastdeploy_pids_file(server.log_file.parent))
    error = f"the model server exited with code {server.proc.returncode}:\n{tail(server.log_file, 2000)}"
    dep_svc.mark_deployment(
        session, deployment_id, status=DeploymentStatus.FAILED, error=error, pid=None, stopped_at=utcnow()
    )
    return DeploymentStatus.FAILED.value
