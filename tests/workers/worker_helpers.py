"""A studio made of real processes for the worker tests: `ernie-studio up` (API), Celery workers started
with the same command line `ernie-studio worker` uses, Redis servers the tests own, a PostgreSQL database."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from trainer_hold import pid_alive

from engine.serve.ports import free_port
from studio.cli import worker_command
from studio.config import Settings
from studio.db import dispose_engines, session_factory
from studio.migrate import upgrade
from studio.models import Run

REPO = Path(__file__).resolve().parents[2]
DEMO_SFT = REPO / "examples" / "data" / "sft_demo.jsonl"
CLI = str(Path(sys.executable).parent / "ernie-studio")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def redis_reachable(port: int = 6379) -> str | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return None
    except OSError as e:
        return f"Redis on 127.0.0.1:{port} is unreachable: {e}"
    return f"Redis on 127.0.0.1:{port} did not answer PING"


class RedisServer:
    """A private redis-server: AOF on, so queued messages survive a restart like in production, or with
    `persist=False` none at all, so a restart comes back empty."""

    def __init__(self, directory: Path, *, persist: bool = True) -> None:
        self.port = free_port()
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        args += ["--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(args)
        wait_for(lambda: redis_reachable(self.port) is None, 10, f"redis-server on port {self.port}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: redis flushes the AOF (when it keeps one) and exits; SIGKILL: it just dies."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None


class Studio:
    """API, workers and state of one test; `close()` stops every process it started."""

    def __init__(
        self,
        tmp: Path,
        *,
        database_url: str | None = None,
        broker_url: str | None = None,
        cpu_serving: str | None = "paddle",
    ) -> None:
        """``cpu_serving``: the node's engine for an `auto` CPU deployment (tests/conftest.py: the built-in
        server unless a test asks; None leaves the studio's default)."""
        self.home = tmp / "home"
        values = {
            "ERNIE_STUDIO_HOME": str(self.home),
            "ERNIE_STUDIO_NODE_NAME": "testnode",
            "ERNIE_STUDIO_STALE_AFTER_S": "3",
            "ERNIE_STUDIO_RECONCILE_INTERVAL_S": "1",
            "ERNIE_STUDIO_KILL_GRACE_S": "3",
        }
        if cpu_serving:
            values["ERNIE_STUDIO_CPU_SERVING"] = cpu_serving
        if database_url:
            values["ERNIE_STUDIO_DATABASE_URL"] = database_url
        if broker_url:
            values["ERNIE_STUDIO_BROKER_URL"] = broker_url
            values["ERNIE_STUDIO_RESULT_BACKEND"] = broker_url
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ERNIE_STUDIO_")} | values
        self.settings = Settings(
            home=self.home,
            database_url=database_url or "",
            broker_url=broker_url or "",
            result_backend=broker_url or "",
            node_name="testnode",
            **({"cpu_serving": cpu_serving} if cpu_serving else {}),
        )
        upgrade(self.settings)
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # ---- processes ------------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(cmd, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_api(self, *extra: str, full: bool = False) -> None:
        """`ernie-studio up` serving the API only, or (`full`) with its UI and local workers."""
        flags = [] if full else ["--no-worker", "--no-ui"]
        self._spawn("api", [CLI, "up", *flags, "--port", str(self.port), *extra])
        wait_for(self._healthy, 90, "the API to answer /api/v1/health")

    def stop_api(self) -> None:
        self.stop("api")

    def _healthy(self) -> bool:
        if self.procs["api"].poll() is not None:
            raise AssertionError(f"the API exited:\n{self.log('api')[-3000:]}")
        try:
            return httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(
        self,
        name: str,
        *,
        serve: bool = False,
        gpu: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> subprocess.Popen:
        """A worker as `ernie-studio worker` starts it (`env` adds to its environment); `wait=False` returns
        at once (`wait_ready` later), so several workers start side by side."""
        cmd, worker_env = worker_command(self.settings, serve=serve, gpu=gpu, name=name)
        proc = self._spawn(name, cmd, {**worker_env, **(env or {})})
        if wait:
            self.wait_ready(name)
        return proc

    def start_workers(self) -> None:
        """A training worker and a serving worker, started side by side (`train@testnode`, `serve@testnode`)."""
        self.start_worker("train@testnode", wait=False)
        self.start_worker("serve@testnode", serve=True, wait=False)
        self.wait_ready("train@testnode")
        self.wait_ready("serve@testnode")

    def wait_ready(self, name: str) -> None:
        proc = self.procs[name]
        wait_for(
            lambda: "ready." in self.log(name) or proc.poll() is not None, 60, f"worker {name} to be ready"
        )
        assert proc.poll() is None, self.log(name)[-3000:]

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name, signal.SIGKILL if name != "api" else signal.SIGTERM)
        dispose_engines()

    # ---- API --------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=60)

    def upload_demo(self, api: httpx.Client) -> dict:
        with open(DEMO_SFT, "rb") as f:
            r = api.post("/datasets", files={"file": ("sft_demo.jsonl", f)}, data={"name": "demo"})
        assert r.status_code == 201, r.text
        return r.json()

    def create_run(self, api: httpx.Client, dataset_id: int, **hyper: Any) -> dict:
        body = {
            "dataset_ids": [dataset_id],
            "fine_tuning": "LoRA",
            "base_model": "tiny",
            "hyperparameters": hyper,
        }
        r = api.post("/runs", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def wait_status(self, api: httpx.Client, run_id: int, statuses: set[str], timeout: float) -> dict:
        def check() -> dict | None:
            run = api.get(f"/runs/{run_id}").json()
            return run if run["status"] in statuses else None

        return wait_for(check, timeout, f"run {run_id} to reach {statuses}", interval=0.2)


def start_deployment(api: httpx.Client, body: dict[str, Any], timeout: float = 120) -> dict:
    """POST /deployments and wait until it runs (or failed); returns the deployment as it was then."""
    dep = api.post("/deployments", json=body).json()
    assert dep["status"] == "starting", dep
    return wait_for(
        lambda: (d := api.get(f"/deployments/{dep['id']}").json())["status"] in ("running", "failed") and d,
        timeout,
        "the deployment to start",
        interval=0.2,
    )


def processes_naming(marker: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose command line names `marker` (a run's config, which
    a launcher and its ranks all name)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and pid_alive(int(entry)):
                found[int(entry)] = cmdline
    return found


def unique_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def trainer_pid(studio: Any, run_id: int) -> int | None:
    """The pid of run `run_id`'s trainer as the worker recorded it in `studio`'s store (None before it)."""
    with session_factory(studio.settings)() as s:
        return s.get(Run, run_id).pid
