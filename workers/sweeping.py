"""The driver of a sweep: claim it like a job, then step it (studio.services.sweeps.advance) every
sweep_poll_s with a heartbeat until it ends. A driver that dies is replaced through the jobs' reconcile
(stale heartbeat: the sweep is requeued and another serving worker claims it); one stopped gracefully
requeues the sweep at once. Every step is idempotent, so the new driver just goes on."""

from __future__ import annotations

import logging

from studio.config import Settings
from studio.db import session_factory
from studio.models import Sweep
from studio.services import jobs as jobs_svc
from studio.services import sweeps as sweeps_svc
from workers.training import SHUTTING_DOWN

log = logging.getLogger(__name__)
KIND = jobs_svc.SWEEPS


def execute_sweep(settings: Settings, sweep_id: int, worker: str) -> str | None:
    """Drive one sweep to its end; returns its final status (None when it was not queued or was taken over)."""
    with session_factory(settings)() as session:
        if jobs_svc.claim(session, KIND, sweep_id, worker) is None:
            return None
        KIND.event(session, session.get(Sweep, sweep_id), "running", f"driven by {worker}")
        session.commit()
        while True:
            if SHUTTING_DOWN.is_set():
                jobs_svc.requeue(session, settings, KIND, sweep_id, f"worker {worker} stopped")
                return "requeued"
            try:
                if sweeps_svc.advance(session, settings, sweep_id):
                    return session.get(Sweep, sweep_id).status
            except Exception:  # the database or broker may be briefly away: the next step tries again
                session.rollback()
                log.exception("sweep %s: a driver step failed", sweep_id)
            if not jobs_svc.heartbeat(session, KIND, sweep_id, worker):
                return None  # cancelled while queued, or another driver holds it now
            session.expire_all()
            SHUTTING_DOWN.wait(settings.sweep_poll_s)
