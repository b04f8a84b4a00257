"""Two reconcilers find the same dead claim. The first requeues it and a worker claims it again before the
second's UPDATE lands: the second must leave the new claim alone. Before the fix it requeued it, and two
drivers drove one sweep (CI, stop 40: a sweep of 3 trials asked Optuna for 4).

The race is made exact on PostgreSQL: connection C locks the row and makes the fresh claim; reconciler B reads
the old, stale row (a plain SELECT does not wait for the lock), then its UPDATE waits for C; C commits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import select, text, update

from studio.config import Settings
from studio.db import session_factory
from studio.migrate import upgrade
from studio.models import ModelDownload, Run, RunStatus, utcnow
from studio.services import jobs
from workers.reconcile import requeue_orphaned_runs

STALE_S = 30.0


@pytest.fixture
def pg_settings(tmp_path, pg_url) -> Settings:
    s = Settings(home=tmp_path / "home", database_url=pg_url, stale_after_s=STALE_S)
    upgrade(s)
    return s


def _race(settings: Settings, model: type, row_id: int, fresh_claim: dict, reconcile: Callable) -> int:
    """Run `reconcile(session)` while connection C holds the row and claims it afresh; C commits once the
    reconciler's UPDATE waits for its lock. Returns what the reconciler returned."""
    factory = session_factory(settings)
    result: dict[str, int] = {}
    with factory() as c:
        c.execute(select(model).where(model.id == row_id).with_for_update())
        c.execute(update(model).where(model.id == row_id).values(**fresh_claim))

        def b() -> None:
            with factory() as s:
                result["n"] = reconcile(s)

        thread = threading.Thread(target=b)
        thread.start()
        deadline = time.monotonic() + 30
        while c.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar() == 0:
            assert thread.is_alive(), "the reconciler ended without waiting for the row"
            assert time.monotonic() < deadline, "the reconciler never waited for the locked row"
            time.sleep(0.02)
        c.commit()
        thread.join(30)
    return result["n"]


def test_a_stale_job_claimed_again_meanwhile_is_not_requeued_a_second_time(pg_settings):
    old = utcnow() - timedelta(seconds=10 * STALE_S)
    with session_factory(pg_settings)() as s:
        job = ModelDownload(
            name="ernie-4.5-0.3b", repo_id="x/y", model_dir="/m", status=RunStatus.RUNNING,
            worker="serve@a", started_at=old, heartbeat_at=old,
        )  # fmt: skip
        s.add(job)
        s.commit()
        jid = job.id
    fresh = {"worker": "serve@a", "started_at": utcnow(), "heartbeat_at": utcnow()}
    n = _race(
        pg_settings,
        ModelDownload,
        jid,
        fresh,
        lambda s: jobs.requeue_stale(s, pg_settings, jobs.DOWNLOADS, STALE_S),
    )
    with session_factory(pg_settings)() as s:
        job = s.get(ModelDownload, jid)
        assert (n, job.status, job.worker) == (0, RunStatus.RUNNING, "serve@a")
        # and a claim that really is stale is still requeued
        s.execute(update(ModelDownload).where(ModelDownload.id == jid).values(heartbeat_at=old))
        s.commit()
        assert jobs.requeue_stale(s, pg_settings, jobs.DOWNLOADS, STALE_S) == 1
        s.refresh(job)
        assert job.status == RunStatus.QUEUED


def test_a_stale_run_claimed_again_meanwhile_keeps_its_new_attempt(pg_settings):
    old = utcnow() - timedelta(seconds=10 * STALE_S)
    with session_factory(pg_settings)() as s:
        run = Run(
            name="r", stage="SFT", fine_tuning="LoRA", base_model="tiny", queue="train", output_dir="/x",
            status=RunStatus.RUNNING, attempt=1, worker="train@b", node="b", heartbeat_at=old, started_at=old,
        )  # fmt: skip
        s.add(run)
        s.commit()
        rid = run.id
    fresh = {"attempt": 2, "worker": "train@c", "node": "c", "heartbeat_at": utcnow()}
    n = _race(pg_settings, Run, rid, fresh, lambda s: requeue_orphaned_runs(s, pg_settings, None))
    with session_factory(pg_settings)() as s:
        run = s.get(Run, rid)
        assert (n, run.status, run.attempt, run.worker) == (0, RunStatus.RUNNING, 2, "train@c")


def test_a_restarted_worker_requeues_its_dead_incarnations_run_not_the_one_it_just_claimed(pg_settings):
    """At start-up a worker's reconciler takes the runs under its name as leftovers of its dead incarnation.
    Its doctor may pass and its queue open before that pass reads: a run it claimed since is its own. Before,
    the pass requeued it while its trainer started, and a second worker could train the same run."""
    started = utcnow()
    old = started - timedelta(seconds=5)  # within stale_after_s: only the name says it is a leftover
    with session_factory(pg_settings)() as s:
        common = dict(
            stage="SFT", fine_tuning="LoRA", base_model="tiny", queue="train", output_dir="/x",
            status=RunStatus.RUNNING, attempt=1, worker="train@a", node="b",
        )  # fmt: skip
        beats = {"leftover": old, "claimed-since": started + timedelta(seconds=1)}
        rows = [Run(name=name, heartbeat_at=beat, started_at=beat, **common) for name, beat in beats.items()]
        s.add_all(rows)
        s.commit()
        leftover, claimed = rows[0].id, rows[1].id
        assert requeue_orphaned_runs(s, pg_settings, "train@a", started) == 1
        assert s.get(Run, leftover).status == RunStatus.QUEUED
        assert (s.get(Run, claimed).status, s.get(Run, claimed).worker) == (RunStatus.RUNNING, "train@a")
