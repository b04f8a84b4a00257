"""The work of a deployment task: merge a LoRA run when the engine needs it, start `ernie-studio serve`
on a free port, wait for /health, hold the server until a stop is requested, then free the port."""

from __future__ import annotations

import importlib.util
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from studio.config import Settings
from studio.db import session_factory
from studio.models import DeploymentStatus, Run, utcnow
from studio.services import deployments as dep_svc
from studio.services.models import BUILDABLE_PRESETS, build_preset
from workers.process import engine_command, spawn, stop_group, tail
from workers.training import SHUTTING_DOWN

log = logging.getLogger(__name__)

POLL_S = 0.25


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(backend: str) -> str:
    """`auto` is FastDeploy where it is installed (GPU nodes), the Paddle server otherwise."""
    if backend != "auto":
        return backend
    return "fastdeploy" if importlib.util.find_spec("fastdeploy") is not None else "paddle"


def _is_lora_dir(model_dir: Path) -> bool:
    from engine.train.lora import is_lora_dir

    return is_lora_dir(model_dir)


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


def execute_deployment(settings: Settings, deployment_id: int, worker: str) -> str | None:
    """Start and hold one deployment; returns its final status (None when another worker has it)."""
    factory = session_factory(settings)
    directory = settings.deployments_dir / str(deployment_id)
    directory.mkdir(parents=True, exist_ok=True)
    log_file = directory / "server.log"
    with factory() as session:
        dep = dep_svc.claim_deployment(session, deployment_id, worker, settings.node_name)
        if dep is None:
            return None
        run = session.get(Run, dep.run_id) if dep.run_id else None
        model_dir = Path(dep.model_dir)
        backend = resolve_backend(dep.backend)
        try:
            if model_dir.parent == settings.models_dir and model_dir.name in BUILDABLE_PRESETS:
                build_preset(settings, model_dir.name)  # a tiny preset deployed before anything trained on it
            if run is not None and backend == "fastdeploy" and _is_lora_dir(model_dir):
                model_dir = merge_lora(
                    settings, run, log_file, lambda: dep_svc.deployment_heartbeat(session, deployment_id)
                )
        except Exception as e:
            dep_svc.mark_deployment(session, deployment_id, status=DeploymentStatus.FAILED, error=str(e))
            return DeploymentStatus.FAILED.value

        port = free_port(settings.serve_host)
        host = settings.serve_advertise_host or settings.serve_host
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
        proc = spawn(cmd, log_file, cwd=directory)

        def server_exited() -> str:
            error = f"the model server exited with code {proc.returncode}:\n{tail(log_file, 2000)}"
            dep_svc.mark_deployment(
                session,
                deployment_id,
                status=DeploymentStatus.FAILED,
                error=error,
                pid=None,
                stopped_at=utcnow(),
            )
            return DeploymentStatus.FAILED.value

        dep_svc.mark_deployment(session, deployment_id, pid=proc.pid, port=port, backend=backend)
        url = f"http://{host}:{port}/v1"
        health = f"http://{'127.0.0.1' if settings.serve_host in ('0.0.0.0', '') else settings.serve_host}:{port}/health"
        deadline = time.monotonic() + settings.serve_start_timeout_s
        healthy = False
        while not healthy:
            if proc.poll() is not None:
                return server_exited()
            if dep_svc.deployment_heartbeat(session, deployment_id) or time.monotonic() > deadline:
                timed_out = time.monotonic() > deadline
                stop_group(proc, settings.kill_grace_s)
                status = DeploymentStatus.FAILED if timed_out else DeploymentStatus.STOPPED
                error = (
                    f"no answer on {health} after {settings.serve_start_timeout_s:.0f} s"
                    if timed_out
                    else None
                )
                dep_svc.mark_deployment(
                    session, deployment_id, status=status, error=error, pid=None, stopped_at=utcnow()
                )
                return status.value
            try:
                healthy = httpx.get(health, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                time.sleep(POLL_S)
        dep_svc.mark_deployment(
            session, deployment_id, status=DeploymentStatus.RUNNING, url=url, started_at=utcnow()
        )
        log.info("deployment %s serving %s at %s", deployment_id, model_dir, url)
        while True:
            if proc.poll() is not None:
                return server_exited()
            if dep_svc.deployment_heartbeat(session, deployment_id) or SHUTTING_DOWN.is_set():
                stop_group(proc, settings.kill_grace_s)
                error = "its worker stopped; deploy again" if SHUTTING_DOWN.is_set() else None
                dep_svc.mark_deployment(
                    session,
                    deployment_id,
                    status=DeploymentStatus.STOPPED,
                    pid=None,
                    stopped_at=utcnow(),
                    error=error,
                )
                log.info("deployment %s stopped; port %d is free", deployment_id, port)
                return DeploymentStatus.STOPPED.value
            time.sleep(POLL_S * 2)
