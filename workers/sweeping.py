"""The driver of a sweep: claim it like a job, then step it (studio.services.sweeps.advance) every
sweep_poll_s until it ends, with a heartbeat of its own thread (a step that makes a run computes its estimate,
which may take longer than the heartbeat may be late). A driver that dies is replaced through the jobs'
reconcile (stale heartbeat: the sweep is requeued and another serving worker claims it); one stopped
gracefully requeues the sweep at once. Every step is idempotent, so the new driver just goes on."""

from __future__ import annotations

import logging
import threading

from studio.config import Settings
from studio.db import session_factory
from studio.models import Sweep
from studio.services import jobs as jobs_svc
from studio.services import sweeps as sweeps_svc
from workers.process import SHUTTING_DOWN

log = logging.getLogger(__name__)
KIND = jobs_svc.SWEEPS


def execute_sweep(settings: Settings, sweep_id: int, worker: str) -> str | None:
    """Drive one sweep to its end; returns its final status (None when it was not queued or was taken over)."""
    with session_factory(settings)() as session:
        if jobs_svc.claim(session, KIND, sweep_id, worker) is None:
            return None
        KIND.event(session, session.get(Sweep, sweep_id), "running", f"driven by {worker}")
        session.commit()
        beat = _Heartbeat(settings, sweep_id, worker)
        beat.start()
        try:
            return _drive(session, settings, sweep_id, worker, beat)
        finally:
            beat.done.set()
            beat.join()


def _drive(session, settings: Settings, sweep_id: int, worker: str, beat: _Heartbeat) -> str | None:
    while not beat.lost.is_set():
        if SHUTTING_DOWN.is_set():
            beat.done.set()
            beat.join()
            jobs_svc.release(session, settings, KIND, sweep_id, f"worker {worker} stopped", worker=worker)
            return "requeued"
        try:
            if sweeps_svc.advance(session, settings, sweep_id):
                return session.get(Sweep, sweep_id).status
        except Exception:  # the database or broker may be briefly away: the next step tries again
            session.rollback()
            log.exception("sweep %s: a driver step failed", sweep_id)
        session.expire_all()
        SHUTTING_DOWN.wait(settings.sweep_poll_s)
    return None  # cancelled while queued, or another driver holds it now


class _Heartbeat(threading.Thread):
    """Beats for the sweep while its driver works; `lost` once the sweep is no longer this driver's."""

    def __init__(self, settings: Settings, sweep_id: int, worker: str) -> None:
        super().__init__(name=f"sweep-{sweep_id}-heartbeat", daemon=True)
        self.settings, self.sweep_id, self.worker = settings, sweep_id, worker
        self.done, self.lost = threading.Event(), threading.Event()

    def run(self) -> None:
        every = min(self.settings.sweep_poll_s, self.settings.stale_after_s / 3)
        with session_factory(self.settings)() as session:
            while not self.done.wait(every):
                try:
                    if not jobs_svc.heartbeat(session, KIND, self.sweep_id, self.worker):
                        self.lost.set()
                        return
                except Exception:
                    session.rollback()
                    log.exception("sweep %s: heartbeat failed", self.sweep_id)
