"""The Celery app. Redis in production; with no broker configured, kombu's filesystem transport under
ERNIE_STUDIO_HOME, so `ernie-studio up` needs no server. Start a worker with
`celery -A workers.app worker -Q train,gpu.<node>.0 -c 1` (see docs/deploy.md)."""

from __future__ import annotations

import threading

from celery import Celery

from studio.config import CPU_QUEUE, Settings, get_settings

_apps: dict[tuple[str, str], Celery] = {}
_lock = threading.Lock()


def make_celery(settings: Settings) -> Celery:
    settings.ensure_dirs()
    app = Celery("ernie_studio", broker=settings.broker_url, backend=settings.result_backend)
    transport_options: dict = {}
    if settings.uses_embedded_broker:
        folder = str(settings.broker_dir)
        transport_options = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "processed_folder": str(settings.broker_dir / "processed"),
            # Without this kombu writes its exchange tables to the current directory.
            "control_folder": str(settings.broker_dir / "control"),
            "store_processed": False,
            "polling_interval": 0.2,
        }
    elif settings.broker_url.startswith(("redis://", "rediss://")):
        # Long runs hold their message unacked; the claim in the database makes a redelivery harmless.
        transport_options = {
            "visibility_timeout": 6 * 3600,
            "socket_connect_timeout": 3,
            "socket_timeout": 10,
        }
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=CPU_QUEUE,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        # The API must not hang when the broker is down: publish fails fast and the run stays undispatched.
        task_publish_retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 1,
        },
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
        include=["workers.tasks"],
    )
    app.conf.ernie_settings = settings
    return app


def celery_app_for(settings: Settings) -> Celery:
    """One app per (broker, home) per process."""
    key = (settings.broker_url, str(settings.home))
    with _lock:
        if key not in _apps:
            _apps[key] = make_celery(settings)
        return _apps[key]


def __getattr__(name: str) -> Celery:
    # `celery -A workers.app` looks up `app`; build it from the environment only then.
    if name in ("app", "celery"):
        return celery_app_for(get_settings())
    raise AttributeError(name)
