"""Celery tasks: thin wrappers that hand a run, a deployment, an export, a download, an eval or a sweep to the functions doing the work.
They are registered under the names `studio.queue` publishes."""

from __future__ import annotations

import logging
from datetime import datetime

from celery import shared_task
from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown, worker_shutting_down

from studio.config import Settings, get_settings
from studio.models import utcnow
from studio.processes import keep_signal_handlers_when_paddle_is_imported
from studio.queue import (
    DEPLOYMENT_TASK,
    DOWNLOAD_TASK,
    EVAL_TASK,
    EXPORT_TASK,
    MEDIA_TASK,
    RUN_TASK,
    SWEEP_TASK,
)
from workers.downloading import execute_download
from workers.evaluating import execute_eval
from workers.exporting import execute_export
from workers.gang import execute_training
from workers.media import execute_media_fetch
from workers.nodes import NodeAgent, hold_work_queues
from workers.process import SHUTTING_DOWN
from workers.reconcile import Reconciler
from workers.serving import execute_deployment
from workers.sweeping import execute_sweep

log = logging.getLogger(__name__)
_reconcilers: list[Reconciler] = []
_agents: list[NodeAgent] = []
# The queues each worker of this process was started for (`-Q`), its work queues held until its doctor passed.
_started_queues: dict[str, list[str]] = {}
# When each worker of this process was set up, before its consumer took a message: the jobs it claimed
# since are not the leftovers its first reconcile pass recovers.
_set_up_at: dict[str, datetime] = {}

# A worker imports Paddle only if a task needs it in-process (a multi-device launch asks for the build's
# devices); whenever that happens, Paddle's import leaves Celery's signal handlers as they were. Importing it
# at start cost every worker 1.5-2.5 s of CPU and several hundred MB.
keep_signal_handlers_when_paddle_is_imported()


def _settings(app) -> Settings:
    return getattr(app.conf, "ernie_settings", None) or get_settings()


@shared_task(name=RUN_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_training(self, run_id: int) -> str | None:
    """One attempt of a training run (resumes from the newest checkpoint when there is one)."""
    return execute_training(_settings(self.app), int(run_id), self.request.hostname or "worker")


@shared_task(name=DEPLOYMENT_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_deployment(self, deployment_id: int) -> str | None:
    """Start a model server and hold it until the deployment is stopped."""
    return execute_deployment(_settings(self.app), int(deployment_id), self.request.hostname or "worker")


@shared_task(name=EXPORT_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_export(self, export_id: int) -> str | None:
    """`ernie-studio export` of a finished run (LoRA merge, layout, PTQ)."""
    return execute_export(_settings(self.app), int(export_id), self.request.hostname or "worker")


@shared_task(name=DOWNLOAD_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_download(self, download_id: int) -> str | None:
    """`ernie-studio download` of an official checkpoint into home/models."""
    return execute_download(_settings(self.app), int(download_id), self.request.hostname or "worker")


@shared_task(name=MEDIA_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_media_fetch(self, fetch_id: int) -> str | None:
    """Fetch the images a dataset's records name by URL into its folder (never done by a request)."""
    return execute_media_fetch(_settings(self.app), int(fetch_id), self.request.hostname or "worker")


@shared_task(name=EVAL_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_eval(self, eval_id: int) -> str | None:
    """`ernie-studio eval` of one model on its datasets (continues a killed attempt's samples)."""
    return execute_eval(_settings(self.app), int(eval_id), self.request.hostname or "worker")


@shared_task(name=SWEEP_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_sweep(self, sweep_id: int) -> str | None:
    """Drive a hyperparameter sweep: ask Optuna for trials, queue them as runs, prune, tell results."""
    return execute_sweep(_settings(self.app), int(sweep_id), self.request.hostname or "worker")


@celeryd_after_setup.connect
def _hold_work_queues(sender=None, instance=None, **_) -> None:
    # Before the consumer starts: no run or deployment is taken until this node's doctor has passed.
    _set_up_at[sender] = utcnow()
    _started_queues[sender] = hold_work_queues(instance.app)


@worker_ready.connect
def _start_reconciler(sender=None, **_) -> None:
    settings = _settings(sender.app)
    reconciler = Reconciler(settings, sender.hostname, _set_up_at.get(sender.hostname))
    reconciler.start()
    _reconcilers.append(reconciler)
    agent = NodeAgent(settings, sender.app, sender.hostname, _started_queues.get(sender.hostname, []))
    agent.start()
    _agents.append(agent)
    log.info("worker %s ready; reconciler started, node doctor running", sender.hostname)


@worker_shutting_down.connect
def _checkpoint_and_requeue(**_) -> None:
    # Warm shutdown waits for running tasks: tell them to checkpoint and requeue instead of training on.
    SHUTTING_DOWN.set()


@worker_shutdown.connect
def _stop_reconciler(**_) -> None:
    for r in _reconcilers:
        r.stopped.set()
    for a in _agents:
        a.stop()
