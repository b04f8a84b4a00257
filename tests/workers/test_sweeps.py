"""Sweeps on real workers (PostgreSQL, Redis, a training and a serving worker): three tiny trials run as
ordinary runs and the sweep ends with a best trial to promote; a trial whose evaluations stay above the
median is pruned through the runs' cancel path with its checkpoint kept; the driver's worker SIGKILLed
mid-sweep is replaced and no trial is lost or run twice. The crash window between asking Optuna for a trial
and creating its run is shown on the store directly (no worker needed: the trial's run is only queued)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import optuna
from fastapi.testclient import TestClient
from trainer_hold import hold_after_steps, pid_alive
from worker_helpers import DEMO_SFT, wait_for

from engine.sweep import ask
from studio.app import create_app
from studio.config import Settings
from studio.db import dispose_engines, session_factory
from studio.migrate import upgrade
from studio.models import Run, Sweep
from studio.services import sweeps as sweeps_svc
from studio.sweep_storage import dispose_storages, optuna_storage

# 9 steps with an evaluation every 3; no scheduled checkpoint, so a pruned trial's one is the cancel's.
HYPER = {
    "max_steps": 9,
    "eval_steps": 3,
    "logging_steps": 3,
    "save_steps": 1000,
    "warmup_steps": 0,
    "max_seq_len": 128,
    "batch_size": 4,
    "report_to": "none",
}
LOW_LR = 1e-9  # learns nothing: its eval loss stays above the median of the trial(s) before it


def _sweep_body(api, tmp_path: Path, **extra) -> dict:
    with open(DEMO_SFT, "rb") as f:
        train = api.post("/datasets", files={"file": ("sft_demo.jsonl", f)}).json()["id"]
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(DEMO_SFT.read_text().splitlines(keepends=True)[:16]))
    with open(held_out, "rb") as f:
        ev = api.post("/datasets", files={"file": ("eval.jsonl", f)}).json()["id"]
    run = {"dataset_ids": [train], "eval_dataset_ids": [ev], "fine_tuning": "Full", "hyperparameters": HYPER}
    return {
        "run": run,
        "parameters": {"learning_rate": {"type": "float", "low": 2e-3, "high": 8e-3, "log": True}},
        "n_trials": 3,
        "pruner": "median",
        "prune_after_trials": 1,
        "enqueue": [{"learning_rate": 5e-3}, {"learning_rate": LOW_LR}],
        **extra,
    }


def test_sweep_prunes_survives_its_driver_and_promotes_the_best(
    studio_factory, pg_url, shared_redis_url, tmp_path
):
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.env["ERNIE_STUDIO_SWEEP_POLL_S"] = "0.2"
    studio.start_workers()
    factory = session_factory(studio.settings)
    with TestClient(create_app(studio.settings, with_ui=False), base_url="http://127.0.0.1") as client:
        api = _Api(client)
        r = client.post("/api/v1/sweeps", json=_sweep_body(api, tmp_path))
        assert r.status_code == 201, r.text
        sid = r.json()["id"]

        def trial_run(n: int) -> dict | None:
            return next(
                (t for t in api.get(f"/sweeps/{sid}")["trials"] if t["number"] == n and t["run_id"]), None
            )

        # Kill the driver while trial 0 trains; a new serving worker takes the sweep over.
        wait_for(lambda: (t := trial_run(0)) and t["run_status"] == "running", 120, "trial 0 to train")
        studio.stop("serve@testnode", signal.SIGKILL)
        studio.start_worker("serve2@testnode", serve=True)
        # Trial 1 (the low learning rate) is held right after its first evaluation until its worker has
        # sent the cancel the pruner asked for: however fast the machine, the cancel lands mid-run.
        low = wait_for(lambda: (t := trial_run(1)) and t["run_status"] == "running" and t, 120, "trial 1")
        with factory() as s:
            pid, out = wait_for(lambda: _pid(s, low["run_id"]), 30, "trial 1's trainer")
        hold_after_steps(pid, Path(out) / "metrics.jsonl", 1)
        wait_for(lambda: api.get(f"/runs/{low['run_id']}")["cancel_requested"], 60, "the pruner's cancel")
        # the worker's stop (the runs' cancel path) continues the held trainer, which ends by its SIGTERM
        try:
            wait_for(lambda: not pid_alive(pid), 30, "trial 1's trainer to end by the cancel", interval=0.02)
        finally:
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)

        sweep = wait_for(
            lambda: (w := api.get(f"/sweeps/{sid}"))["status"] in ("succeeded", "failed") and w,
            600,  # a hang guard: under the whole suite's load on a slow host the sweep took 100 s (37 s alone)
            "the sweep",
        )
        assert sweep["status"] == "succeeded", sweep
        assert sweep["worker"] == "serve2@testnode" and sweep["stop_reason"] == "n_trials"
        trials = sweep["trials"]
        # three trials, each with exactly one run, numbered as Optuna numbered them
        assert [t["number"] for t in trials] == [0, 1, 2]
        runs = [r for r in api.get("/runs") if r["sweep_id"] == sid]
        assert sorted(r["sweep_trial"] for r in runs) == [0, 1, 2]
        assert sorted(r["id"] for r in runs) == sorted(t["run_id"] for t in trials)
        pruned = trials[1]
        assert pruned["params"] == {"learning_rate": LOW_LR}
        assert (pruned["state"], pruned["run_status"], pruned["stopped"]) == ("pruned", "cancelled", "pruned")
        # stopped mid-run (9 steps) with the checkpoint the cancel wrote where it stopped
        assert 3 <= pruned["last_step"] < 9
        checkpoints = [c["step"] for c in api.get(f"/runs/{pruned['run_id']}/checkpoints")]
        assert len(checkpoints) == 1 and pruned["last_step"] <= checkpoints[0] < 9, checkpoints
        out_dir = next(r["output_dir"] for r in runs if r["id"] == pruned["run_id"])
        assert (Path(out_dir) / f"checkpoint-{checkpoints[0]}").is_dir()
        assert trials[0]["state"] == "complete"
        assert (
            trials[2]["state"] in ("complete", "pruned")
            and 2e-3 <= trials[2]["params"]["learning_rate"] <= 8e-3
        )
        # the completed ones told Optuna their last evaluation, which the store holds
        for t in [t for t in trials if t["state"] == "complete"]:
            last = [m for m in api.get(f"/runs/{t['run_id']}/metrics") if "eval_loss" in m["values"]][-1]
            assert (last["step"], t["value"]) == (9, last["values"]["eval_loss"])
        best = client.post(f"/api/v1/sweeps/{sid}/promote").json()
        assert best["run_id"] == sweep["leaderboard"][0]["run_id"] and best["objective"] == "eval_loss"
        assert best["value"] == min(t["value"] for t in trials if t["state"] == "complete")
        assert best["model_dir"] and (Path(best["model_dir"]) / "config.json").exists()
        kinds = [e["kind"] for e in api.get(f"/runs/{pruned['run_id']}/events")]
        assert "run.cancel_requested" in kinds and kinds[-1] == "run.cancelled"


def test_a_sweep_spreads_over_two_workers_and_survives_a_kill_of_the_whole_service(
    studio_factory, pg_url, shared_redis_url, tmp_path
):
    """Two training workers take a parallelism-2 sweep's trials side by side. kill -9 of every process of the
    studio (the API, the three workers and both trainers) while they train; after a restart the sweep goes
    on to its 3 trials (the third asked after the restart): each trial has exactly one run, the two
    interrupted runs resume as their second attempt, and Optuna's study holds exactly 3 trials."""
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.env["ERNIE_STUDIO_SWEEP_POLL_S"] = "0.2"
    workers = {"train@testnode": False, "train2@testnode": False, "serve@testnode": True}

    def start_service() -> httpx.Client:
        studio.start_api()
        for name, serve in workers.items():
            studio.start_worker(name, serve=serve, wait=False)
        for name in workers:
            studio.wait_ready(name)
        return studio.client()

    api = start_service()
    body = _sweep_body(api, tmp_path, n_trials=3, parallelism=2, pruner="none", enqueue=[])
    r = api.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    factory = session_factory(studio.settings)

    def running() -> list[dict]:
        trials = api.get(f"/sweeps/{sid}").json()["trials"]
        return [t for t in trials if t["run_id"] and t["run_status"] == "running"]

    # both first trials train, one on each worker; each trainer is held after its first step
    first = wait_for(lambda: (t := running()) and len(t) == 2 and t, 120, "two trials training at once")
    held = {}
    with factory() as s:
        for t in first:
            pid, out = wait_for(lambda t=t: _pid(s, t["run_id"]), 30, f"trial {t['number']}'s trainer")
            hold_after_steps(pid, Path(out) / "metrics.jsonl", 1)
            held[t["run_id"]] = pid
    on = {api.get(f"/runs/{rid}").json()["worker"] for rid in held}
    assert on == {"train@testnode", "train2@testnode"}, on

    for name in [*workers, "api"]:
        studio.stop(name, signal.SIGKILL)
    for pid in held.values():
        os.kill(pid, signal.SIGKILL)
    api.close()

    api = start_service()
    sweep = wait_for(
        lambda: (w := api.get(f"/sweeps/{sid}").json())["status"] in ("succeeded", "failed") and w,
        600,  # a hang guard: the whole test took 177 s under the suite's load on a slow host (37 s alone)
        "the sweep after the restart",
    )
    assert sweep["status"] == "succeeded" and sweep["stop_reason"] == "n_trials", sweep
    trials = sweep["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2] and all(t["state"] == "complete" for t in trials)
    runs = [r for r in api.get("/runs").json() if r["sweep_id"] == sid]
    assert sorted(r["sweep_trial"] for r in runs) == [0, 1, 2]
    assert sorted(r["id"] for r in runs) == sorted(t["run_id"] for t in trials)
    attempts = {r["id"]: r["attempt"] for r in runs}
    assert all(attempts[rid] == 2 for rid in held) and list(attempts.values()).count(1) == 1, attempts
    with factory() as s:
        name = s.get(Sweep, sid).study_name
    assert len(optuna.load_study(study_name=name, storage=optuna_storage(studio.settings)).trials) == 3
    api.close()


class _Api:
    def __init__(self, client: TestClient) -> None:
        self.client = client

    def get(self, path: str):
        r = self.client.get(f"/api/v1{path}")
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, path: str, **kw):
        r = self.client.post(f"/api/v1{path}", **kw)
        assert r.status_code in (200, 201), r.text
        return r


def _pid(session, run_id: int) -> tuple[int, str] | None:
    session.expire_all()
    run = session.get(Run, run_id)
    return (run.pid, run.output_dir) if run.pid else None


def test_a_trial_asked_before_a_crash_gets_one_run(tmp_path):
    """The driver dies after Optuna handed out a trial and before its run was made: the next step makes the
    run for that trial (the same values), and steps after it make no second one."""
    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:
            body = _sweep_body(_Api(client), tmp_path, n_trials=3, parallelism=2, enqueue=[])
            sid = client.post("/api/v1/sweeps", json=body).json()["id"]
        with session_factory(settings)() as s:
            sweep = sweeps_svc.get_sweep(s, sid)
            study = sweeps_svc._study(settings, sweep)
            asked = ask(study, sweeps_svc.parse_space(sweep.parameters))  # ... and the driver died here
            for _ in range(3):
                assert sweeps_svc.advance(s, settings, sid) is False
            runs = s.query(Run).filter(Run.sweep_id == sid).order_by(Run.sweep_trial).all()
            # parallelism 2: the asked trial got its run, one more was asked; no trial has two runs
            assert [r.sweep_trial for r in runs] == [0, 1]
            assert runs[0].config["learning_rate"] == asked.params["learning_rate"]
            assert [t.number for t in study.get_trials()] == [0, 1]
    finally:
        dispose_storages()
        dispose_engines()


def test_the_steps_budget_stops_the_sweep_and_its_running_trial(tmp_path):
    """Steps counted from the store reach max_total_steps: the running trial is cancelled through the runs'
    cancel path, Optuna is told it failed, and the sweep ends without asking for more."""
    from studio.services import jobs as jobs_svc
    from studio.services.run_lifecycle import record_metrics

    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:
            body = _sweep_body(_Api(client), tmp_path, max_total_steps=5, enqueue=[])
            sid = client.post("/api/v1/sweeps", json=body).json()["id"]
        with session_factory(settings)() as s:
            assert jobs_svc.claim(s, jobs_svc.SWEEPS, sid, "driver@test") is not None
            assert sweeps_svc.advance(s, settings, sid) is False
            (run,) = s.query(Run).filter(Run.sweep_id == sid).all()
            record_metrics(s, run.id, [{"step": 4, "loss": 5.0}])  # as a worker records them
            assert sweeps_svc.advance(s, settings, sid) is False  # 4 < 5: goes on, nothing new asked
            assert s.query(Run).filter(Run.sweep_id == sid).count() == 1
            record_metrics(s, run.id, [{"step": 5, "loss": 4.9}])
            assert sweeps_svc.advance(s, settings, sid) is False  # the trial's cancel is asked for
            s.refresh(run)
            assert run.status == "cancelled" and run.cancel_requested
            assert sweeps_svc.advance(s, settings, sid) is True
            sweep = sweeps_svc.get_sweep(s, sid)
            s.refresh(sweep)
            assert (sweep.status, sweep.stop_reason) == ("failed", "max_total_steps")
            (trial,) = sweeps_svc.trials(s, settings, sweep)
            assert (trial["state"], trial["stopped"], trial["run_id"]) == ("fail", "max_total_steps", run.id)
            assert sweeps_svc.total_steps(s, [run.id]) == 5
    finally:
        dispose_storages()
        dispose_engines()


def test_cancelling_a_driven_sweep_cancels_its_trials(tmp_path):
    """POST /sweeps/{id}/cancel on a sweep a driver holds: the driver cancels the trials' runs through their
    cancel path, tells Optuna, and ends the sweep cancelled."""
    from studio.services import jobs as jobs_svc

    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:
            body = _sweep_body(_Api(client), tmp_path, parallelism=2, enqueue=[])
            sid = client.post("/api/v1/sweeps", json=body).json()["id"]
            with session_factory(settings)() as s:
                assert jobs_svc.claim(s, jobs_svc.SWEEPS, sid, "driver@test") is not None
                assert sweeps_svc.advance(s, settings, sid) is False
            out = client.post(f"/api/v1/sweeps/{sid}/cancel").json()
            assert out["status"] == "running" and out["cancel_requested"]  # the driver ends it
            with session_factory(settings)() as s:
                assert sweeps_svc.advance(s, settings, sid) is False
                assert sweeps_svc.advance(s, settings, sid) is True
            sweep = client.get(f"/api/v1/sweeps/{sid}").json()
        assert (sweep["status"], sweep["stop_reason"]) == ("cancelled", "cancelled")
        assert [(t["state"], t["run_status"], t["stopped"]) for t in sweep["trials"]] == [
            ("fail", "cancelled", "cancelled")
        ] * 2
    finally:
        dispose_storages()
        dispose_engines()
