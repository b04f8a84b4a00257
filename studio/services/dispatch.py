"""Putting jobs on the queue. A broker outage never loses a run: it stays `queued` with no dispatch time
and the worker's reconciler sends it again."""

from __future__ import annotations

import logging

from studio.config import Settings

log = logging.getLogger(__name__)

RUN_TASK = "workers.tasks.run_training"
START_DEPLOYMENT_TASK = "workers.tasks.run_deployment"


def send(settings: Settings, task: str, args: list, queue: str) -> str | None:
    """Publish `task`; returns the task id, or None when the broker could not be reached."""
    from workers.app import celery_app_for

    app = celery_app_for(settings)
    try:
        result = app.send_task(task, args=args, queue=queue)
    except Exception as e:  # kombu raises several connection error types; all mean "try later"
        log.warning("could not publish %s%s to %s: %s (the reconciler will retry)", task, args, queue, e)
        return None
    return result.id


def revoke(settings: Settings, task_id: str) -> None:
    from workers.app import celery_app_for

    try:
        celery_app_for(settings).control.revoke(task_id)
    except Exception as e:  # revocation is an optimisation: the task checks the run status anyway
        log.debug("could not revoke %s: %s", task_id, e)
