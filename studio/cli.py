"""`ernie-studio up`, `ernie-studio worker` and `ernie-studio db upgrade`, registered through the
`ernie_studio.commands` entry point so the engine's CLI never imports the studio."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time

from engine.startup import collection_paused
from studio.config import LOOPBACK_HOSTS, Settings, get_settings
from studio.queue import CPU_QUEUE, EXPORT_QUEUE, SERVE_QUEUE, training_queues

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="start the studio: migrations, API + UI, and local workers")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (anything but loopback needs a token)"
    )
    p.add_argument("--port", type=int, default=7860)
    p.add_argument(
        "--no-worker", action="store_true", help="serve the API and UI only (workers run elsewhere)"
    )
    p.add_argument("--no-ui", action="store_true", help="serve the REST API without the browser UI")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--workers", type=int, default=1, help="API server processes (the UI needs 1)")
    p.set_defaults(func=cmd_up)

    p = subparsers.add_parser("worker", help="run a Celery worker for training (one per GPU) or serving")
    p.add_argument(
        "--gpu", type=int, default=None, help="GPU index this worker owns (queue gpu.<node>.<index>)"
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="GPU indices this worker owns, e.g. 0,1,2,3: it also takes runs on up to that many devices "
        "(queues train.devices.<N>) and holds them all while one runs",
    )
    p.add_argument(
        "--serve", action="store_true", help="hold model servers (queue `serve`) instead of training"
    )
    p.add_argument("--name", default=None, help="worker name (default train@<node> / serve@<node>)")
    p.add_argument("--concurrency", type=int, default=None)
    p.set_defaults(func=cmd_worker)

    p = subparsers.add_parser("db", help="database maintenance")
    dsub = p.add_subparsers(dest="db_command", metavar="DB_COMMAND", required=True)
    d = dsub.add_parser("upgrade", help="apply the Alembic migrations to ERNIE_STUDIO_DATABASE_URL")
    d.add_argument("--revision", default="head")
    d.set_defaults(func=cmd_db_upgrade)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from studio.migrate import upgrade

    settings = get_settings()
    upgrade(settings, args.revision)
    print(f"database at {_safe_url(settings.database_url)} is at revision {args.revision}")
    return 0


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def worker_command(
    settings: Settings,
    *,
    gpu: int | None = None,
    gpus: list[int] | None = None,
    serve: bool = False,
    name: str | None = None,
    concurrency: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The `celery worker` command line (and extra environment) for a training or a serving worker.

    A training worker owns `gpus` (or the one `gpu`), or on a CPU node `settings.worker_devices` gloo
    processes; it runs one run at a time, so a run on several of its devices holds them all."""
    node = settings.node_name
    env: dict[str, str] = {}
    if gpu is not None:
        gpus = [gpu]
    if serve:
        # Exports are child processes the serving worker runs too, one thread each: they never wait behind a
        # long training run, and a run never waits behind an export (`cpu`: where exports went before).
        queues = [SERVE_QUEUE, EXPORT_QUEUE, CPU_QUEUE]
        name = name or f"serve@{node}"
        concurrency = concurrency or 8  # each held deployment occupies one thread
    else:
        size = len(gpus) if gpus else settings.worker_devices
        queues = training_queues(node, gpus or [], size)
        # The worker's runs read how many devices it owns from here (and see only its GPUs).
        env["ERNIE_STUDIO_WORKER_DEVICES"] = str(size)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            name = name or f"train{'-'.join(map(str, gpus))}@{node}"
        name = name or f"train@{node}"
        concurrency = concurrency or 1  # one run per device at a time
    cmd = [
        sys.executable, "-m", "celery", "-A", "workers.app", "worker",
        "-Q", ",".join(queues), "-c", str(concurrency), "-P", "threads", "-n", name,
        "--loglevel", "INFO", "--without-gossip", "--without-mingle",
    ]  # fmt: skip
    return cmd, env


def cmd_worker(args: argparse.Namespace) -> int:
    settings = get_settings()
    settings.ensure_dirs()
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()] if args.gpus else None
    cmd, env = worker_command(
        settings, gpu=args.gpu, gpus=gpus, serve=args.serve, name=args.name, concurrency=args.concurrency
    )
    os.environ.update(env)
    os.execv(sys.executable, cmd)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    # Gradio, FastAPI and the studio: ~2 s of imports whose objects live as long as the process; no
    # collection walks them while they arrive, nor after (engine.startup)
    with collection_paused():
        import uvicorn

        from studio.app import create_app
        from studio.migrate import upgrade
        from studio.processes import (
            die_with_parent,
            freeze_startup_heap,
            keep_signal_handlers_when_paddle_is_imported,
        )
        from studio.services.datasets import clean_incoming

    # The API imports engine helpers (and so Paddle) lazily, most requests none; whenever Paddle comes, its
    # abort-on-SIGTERM handler must not replace the graceful one below.
    keep_signal_handlers_when_paddle_is_imported()

    settings = get_settings()
    if args.workers > 1 and not args.no_ui:
        raise ValueError(
            "--workers N > 1 serves the API only; add --no-ui (Gradio keeps sessions in one process)"
        )
    if args.host not in LOOPBACK_HOSTS and not settings.token:
        # Like Jupyter: a non-loopback studio is never open to whoever can reach the port.
        settings.token = secrets.token_urlsafe(24)
    if settings.token:
        os.environ["ERNIE_STUDIO_TOKEN"] = settings.token
    os.environ["ERNIE_STUDIO_HOME"] = str(settings.home)
    settings.ensure_dirs()
    upgrade(settings)
    clean_incoming(settings)

    children: list[subprocess.Popen] = []
    if not args.no_worker:
        logs = settings.home / "logs"
        logs.mkdir(exist_ok=True)
        # One training worker per device group of this node (ERNIE_STUDIO_GPUS in groups of
        # ERNIE_STUDIO_WORKER_DEVICES), or one for the CPU; one serving worker.
        plan = [dict(gpus=group) for group in settings.device_groups] if settings.gpu_indices else [{}]
        for kwargs in [*plan, dict(serve=True)]:
            cmd, env = worker_command(settings, **kwargs)
            group = "-".join(map(str, kwargs.get("gpus", [])))
            name = "serve-worker" if kwargs.get("serve") else f"worker{group}"
            out = open(logs / f"{name}.log", "ab")  # noqa: SIM115
            children.append(
                subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=die_with_parent)
            )  # fmt: skip
        log.info("workers started (logs in %s)", logs)

    # uvicorn re-raises SIGTERM after its graceful shutdown; turning it into SystemExit lets `finally`
    # stop the workers instead of leaving them behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{shown}:{args.port}/"
    print(f"ERNIE Studio on {url}" + (f"?token={settings.token}" if settings.token else ""), flush=True)
    if settings.token:
        print("API clients send: Authorization: Bearer <token>", flush=True)
    try:
        if args.workers > 1:
            # Several processes need an import string; each builds the app from the environment set above.
            uvicorn.run("studio.app:app_from_env", factory=True, host=args.host, port=args.port,
                        workers=args.workers, log_level="info", access_log=args.access_log)  # fmt: skip
        else:
            app = create_app(settings, with_ui=not args.no_ui)
            freeze_startup_heap()
            uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                        access_log=args.access_log)  # fmt: skip
    finally:
        _stop(children)
    return 0


def _stop(children: list[subprocess.Popen]) -> None:
    """Stop the local workers; a run they were training is requeued by the next worker's reconciler."""
    for p in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in children:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
