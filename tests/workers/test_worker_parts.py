"""The worker's parts without a running worker: the task names, following metrics.jsonl, the reconciler, a
deployment whose server cannot start, and stopping a deployment before it starts."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from engine.priority import autogroup_niceness
from studio.config import Settings, get_settings
from studio.db import session_factory
from studio.migrate import upgrade
from studio.models import Deployment, DeploymentStatus, Export, Run, RunStatus, utcnow
from studio.queue import DEPLOYMENT_TASK, SERVE_QUEUE, TASK_NAMES, held_jobs
from studio.services import deployments as dep_svc
from studio.services.run_lifecycle import RunAttempt
from workers.process import stop_group
from workers.reconcile import reconcile, stop_orphaned_deployments
from workers.serving import execute_deployment
from workers.training import MetricsTail, _finish


@pytest.fixture
def settings(tmp_path) -> Settings:
    s = Settings(home=tmp_path / "home", stale_after_s=5, serve_start_timeout_s=60)
    upgrade(s)
    return s


def test_the_worker_app_registers_every_task_the_studio_publishes(settings, monkeypatch):
    # `celery -A workers.app worker` builds the app from the environment and imports its task modules.
    monkeypatch.setenv("ERNIE_STUDIO_HOME", str(settings.home))
    get_settings.cache_clear()
    try:
        from workers import app as worker_app

        app = worker_app.app
        for module in app.conf.include:
            importlib.import_module(module)
        registered = {name for name in app.tasks if not name.startswith("celery.")}
    finally:
        get_settings.cache_clear()
    assert registered == set(TASK_NAMES)


def test_metrics_tail_reads_only_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert tail.read() == [{"step": 1, "loss": 2.0}]
    with open(path, "a") as f:
        f.write('ss": 1.5}\n')
    assert tail.read() == [{"step": 2, "loss": 1.5}]
    assert tail.read() == []
    # A resumed trainer rewrites the file (dropping a torn line): the tail starts over; the store's
    # (run, step) key makes the replay harmless.
    path.write_text('{"step": 1, "loss": 2.0}\n')
    assert tail.read() == [{"step": 1, "loss": 2.0}]


def _run(session, **values) -> Run:
    run = Run(
        name="r", stage="SFT", fine_tuning="LoRA", base_model="tiny", queue="train", output_dir="/x", **values
    )
    session.add(run)
    session.commit()
    return run


def test_reconciler_requeues_orphans_and_sends_undelivered_runs(settings):
    old = utcnow() - timedelta(seconds=60)
    with session_factory(settings)() as s:
        stale = _run(s, status=RunStatus.RUNNING, worker="gone@n", heartbeat_at=old, attempt=1)
        alive = _run(s, status=RunStatus.RUNNING, worker="other@n", heartbeat_at=utcnow(), attempt=1)
        mine = _run(s, status=RunStatus.RUNNING, worker="me@n", heartbeat_at=utcnow(), attempt=1)
        lost = _run(s, status=RunStatus.QUEUED, queued_at=old)
        dep = Deployment(
            name="d", model_dir="/m", status=DeploymentStatus.RUNNING, worker="gone@n", heartbeat_at=old
        )
        s.add(dep)
        done = _run(s, status=RunStatus.SUCCEEDED)
        export = Export(
            run_id=done.id, status=RunStatus.RUNNING, export_dir="/e", worker="gone@n", heartbeat_at=old
        )
        s.add(export)
        s.commit()
        ids = stale.id, alive.id, mine.id, lost.id

    assert reconcile(settings, None) == {
        "requeued": 1, "dispatched": 1, "deployments_stopped": 1, "resent": 0,
    }  # fmt: skip
    with session_factory(settings)() as s:
        runs = [s.get(Run, i) for i in ids]
        assert [r.status for r in runs] == ["queued", "running", "running", "queued"]
        assert runs[0].dispatched_at is not None and runs[3].dispatched_at is not None
        assert s.get(Deployment, dep.id).status == "stopped"
        requeued_export = s.get(Export, export.id)
        assert requeued_export.status == "queued" and requeued_export.dispatched_at is not None
    # At start-up a worker also takes back what it was running itself when it died.
    assert reconcile(settings, "me@n")["requeued"] == 1
    with session_factory(settings)() as s:
        assert s.get(Run, ids[2]).status == "queued" and s.get(Run, ids[1]).status == "running"
    broker_messages = list(settings.broker_dir.glob("*.msg"))
    assert len(broker_messages) == 4  # one per requeued or undelivered run, and the requeued export


def test_a_restarted_worker_fails_only_the_exports_it_left_not_those_it_took_since(settings):
    """A worker consumes the export queue from its start, so by its first reconcile pass it may already have
    claimed an export (even one that pass requeued from a stale heartbeat): only the exports it was running
    before it started are leftovers to fail."""
    started = utcnow()
    with session_factory(settings)() as s:
        done = _run(s, status=RunStatus.SUCCEEDED)
        before, since = (
            Export(run_id=done.id, status=RunStatus.RUNNING, export_dir="/e", worker="me@n", started_at=at,
                   heartbeat_at=started)
            for at in (started - timedelta(seconds=30), started + timedelta(seconds=1))
        )  # fmt: skip
        s.add_all([before, since])
        s.commit()
        ids = before.id, since.id
    reconcile(settings, "me@n", worker_started=started)
    with session_factory(settings)() as s:
        left, taken = (s.get(Export, i) for i in ids)
        assert (left.status, left.error) == ("failed", "its worker stopped; export again")
        assert (taken.status, taken.worker) == ("running", "me@n")


def test_orphaned_deployments_stay_stopped_when_a_later_step_rolls_back(settings):
    """The reconciler's steps share one session; a later one that loses a race (e.g. evaluate_after's
    duplicate evals) rolls it back, which must not undo the deployments already marked stopped."""
    old = utcnow() - timedelta(seconds=60)
    with session_factory(settings)() as s:
        dep = Deployment(
            name="d", model_dir="/m", status=DeploymentStatus.RUNNING, worker="gone@n", heartbeat_at=old
        )
        s.add(dep)
        s.commit()
        assert stop_orphaned_deployments(s, settings, None) == 1
        s.rollback()
    with session_factory(settings)() as s:
        assert s.get(Deployment, dep.id).status == "stopped"


def test_deployment_that_cannot_start_fails_with_the_server_output(settings):
    broken = settings.models_dir / "broken"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"model_type": "ernie4_5", "hidden_size": "wide"}))
    with session_factory(settings)() as s:
        dep = dep_svc.create_deployment(
            s, settings, dep_svc.DeploymentSpec(model="models/broken", backend="paddle")
        )
    assert execute_deployment(settings, dep.id, "test@n") == "failed"
    with session_factory(settings)() as s:
        dep = s.get(Deployment, dep.id)
        assert dep.status == "failed" and "exited with code" in dep.error and dep.pid is None
    # A second delivery of the same message does nothing.
    assert execute_deployment(settings, dep.id, "test@n") is None


def test_stop_before_start(settings):
    with session_factory(settings)() as s:
        dep = dep_svc.create_deployment(s, settings, dep_svc.DeploymentSpec(model="tiny"))
        stopped = dep_svc.stop_deployment(s, dep.id)
        assert stopped.status == "stopped" and stopped.stopped_at is not None
    assert execute_deployment(settings, dep.id, "test@n") is None  # the worker never starts it


@pytest.mark.parametrize(
    ("code", "summary_status", "cancelled", "expected"),
    [
        (0, "succeeded", True, RunStatus.SUCCEEDED),  # the cancel arrived after the last step
        (130, "cancelled", True, RunStatus.CANCELLED),
        (0, "succeeded", False, RunStatus.SUCCEEDED),
        (1, "failed", False, RunStatus.FAILED),
    ],
)
def test_finish_records_what_the_trainer_did(settings, tmp_path, code, summary_status, cancelled, expected):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_summary.json").write_text(json.dumps({"status": summary_status, "error": None}))
    log_file = tmp_path / "train.log"
    log_file.write_text("")
    with session_factory(settings)() as s:
        run = _run(s, status=RunStatus.RUNNING, worker="me@n", heartbeat_at=utcnow(), attempt=1)
        assert _finish(s, settings, RunAttempt.of(run), code, cancelled, out, log_file) == expected.value
        s.expire_all()
        assert s.get(Run, run.id).status == expected


def test_an_attempt_records_the_checkpoint_it_resumes_from(settings):
    with session_factory(settings)() as s:
        run = _run(s, status=RunStatus.RUNNING, worker="me@n", heartbeat_at=utcnow(), attempt=2)
        attempt = RunAttempt.of(run)
        attempt.resumed(s, "/x/checkpoint-20")
        s.expire_all()
        assert s.get(Run, run.id).resume_from == "/x/checkpoint-20"
        # A late call from an attempt whose run was requeued meanwhile changes nothing.
        s.get(Run, run.id).status = RunStatus.QUEUED
        s.commit()
        attempt.resumed(s, "/x/checkpoint-30")
        s.expire_all()
        assert s.get(Run, run.id).resume_from == "/x/checkpoint-20"


def test_batch_children_start_nicer_than_the_worker(tmp_path):
    """Training and exports yield the CPU to API reads and chat (ERNIE_STUDIO_BATCH_NICENESS)."""
    from workers.process import spawn

    code = "import os; print(os.nice(0))"
    for niceness in (0, 10):
        log = tmp_path / f"nice{niceness}.log"
        assert spawn([sys.executable, "-c", code], log, niceness=niceness).wait() == 0
        assert int(log.read_text().strip()) == os.nice(0) + niceness
    assert Settings.model_fields["batch_niceness"].default == 10  # the suite itself runs with 0 (conftest)


def test_a_batch_childs_session_is_as_nice_as_the_child(tmp_path):
    """Under autogroup scheduling the session's group, not the process, is what competes with the API: the
    child leads a new session, and that group gets the child's nice value. A rank of
    paddle.distributed.launch (a session leader of its own, nice by inheritance) does the same at start
    (`engine.cli.main`); a process that does not lead its session leaves the session's group alone. On a
    kernel without autogroups (no /proc/self/autogroup) nothing is written and nothing fails, and a process in
    the root group (init's session) reads None."""
    from workers.process import spawn

    # Whether a new session gets a group of its own is the kernel's switch, not this process's group: a suite
    # started in init's session (as CI's is) sits in the root group, whose /proc/self/autogroup is empty.
    switch = Path("/proc/sys/kernel/sched_autogroup_enabled")
    grouped = switch.exists() and switch.read_text().strip() == "1"
    base = os.nice(0)  # a suite started under `nice` shifts every child's value by as much

    def expect(niceness: int, spawned: bool) -> str:
        if not grouped:
            return "None False None"
        sets = niceness > 0  # a new session's group starts at 0 and takes the leader's value when above 0
        group = niceness if sets else 0
        return f"{group if spawned else 0} {sets} {group}"  # spawn gives the group its value before exec

    code = "from engine.priority import autogroup_niceness as a, nice_own_session as n; print(a(), n(), a())"
    for niceness in (0, 10):
        log = tmp_path / f"group{niceness}.log"
        assert spawn([sys.executable, "-c", code], log, niceness=niceness).wait() == 0
        assert log.read_text().strip() == expect(base + niceness, spawned=True)
    # A nice session leader whose new group is not nice yet (how a launcher's rank starts) makes it so.
    rank = "import os; os.setsid(); os.nice(7); " + code
    out = subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True, check=True)
    assert " ".join(out.stdout.split()) == expect(base + 7, spawned=False)
    # Not a session leader: the group is the caller's and stays as it is.
    ours = str(autogroup_niceness())
    plain = "import os; os.nice(5); " + code
    out = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [ours, "False", ours]


def test_the_trainers_notices_become_run_events_once(settings, tmp_path):
    """notices.json (config keys accepted without effect) -> `run.notice` events, once per run."""
    from studio.models import Event
    from workers.training import NoticesFile

    path = tmp_path / "notices.json"
    notices = NoticesFile(path)
    assert notices.read() == []  # not written yet
    first = {
        "key": "tensorwise_offload_optimizer",
        "message": "tensorwise_offload_optimizer: no effect on CPU",
    }
    path.write_text(json.dumps({"notices": [first]}))
    assert notices.read() == [first]
    assert notices.read() == []  # unchanged file: nothing new to look at
    second = {"key": "use_flash_attention", "message": "use_flash_attention: no fused kernels here"}
    path.write_text(json.dumps({"notices": [first, second]}))
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 1))
    read_again = notices.read()
    assert read_again == [first, second]
    with session_factory(settings)() as s:
        run = _run(s, status=RunStatus.RUNNING, worker="me@n", heartbeat_at=utcnow(), attempt=1)
        attempt = RunAttempt.of(run)
        assert attempt.announce(s, [first]) == 1
        assert attempt.announce(s, read_again) == 1  # only the second is new
        assert RunAttempt.of(run).announce(s, read_again) == 0  # a resumed attempt repeats nothing
        events = s.query(Event).filter(Event.run_id == run.id, Event.kind == "run.notice").all()
        assert sorted(e.message for e in events) == sorted([first["message"], second["message"]])
        assert {e.data["key"] for e in events} == {first["key"], second["key"]}


def test_the_reconciler_deploys_a_finished_export_once_when_its_worker_died_first(settings):
    """An export asked to deploy on success whose worker died between finishing it and deploying it: the
    reconciler makes the deployment once; a deleted deployment is not made again; an export whose model
    went away gets a failed deployment saying so."""
    written = settings.models_dir / "run-1-d2-e4-k1-paddle"
    written.mkdir(parents=True)
    (written / "config.json").write_text("{}")
    with session_factory(settings)() as s:
        done = _run(s, status=RunStatus.SUCCEEDED)
        rows = [
            Export(run_id=done.id, status=RunStatus.SUCCEEDED, export_dir=str(d), deploy_on_success=True)
            for d in (written, settings.models_dir / "gone")
        ]
        s.add_all(rows)
        s.commit()
        ids = [e.id for e in rows]
        assert [s.get(Export, i).deploy_state for i in ids] == ["deploying", "deploying"]

    reconcile(settings, None)
    reconcile(settings, None)
    with session_factory(settings)() as s:
        made, gone = (s.get(Export, i) for i in ids)
        assert s.query(Deployment).count() == 2
        assert (made.deploy_state, made.deployment.model_dir, made.deployment.run_id) == (
            "deploying", str(written), done.id,
        )  # fmt: skip
        assert gone.deploy_state == "failed"
        assert gone.deployment.error.startswith(f"export_id: export {gone.id}'s model directory")
        assert "is gone; export again" in gone.deployment.error
        dep_id = made.deployment_id
    assert (DEPLOYMENT_TASK, dep_id) in held_jobs(settings, [SERVE_QUEUE], 60)
    with session_factory(settings)() as s:
        dep_svc.stop_deployment(s, dep_id)
        dep_svc.delete_deployment(s, dep_id)
    reconcile(settings, None)
    with session_factory(settings)() as s:
        assert s.get(Export, ids[0]).deploy_state == "removed" and s.query(Deployment).count() == 1


def test_gpu_uuids_in_cuda_visible_devices_are_device_slots(monkeypatch):
    # Container runtimes and device plugins name GPUs by UUID; the worker did int() on every entry.
    from paddle.distributed.launch.context.device import Device

    from engine.train.parallel import launch_command
    from workers.training import launcher_devices, visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc, GPU-def")
    visible = visible_gpus()
    assert visible == ["GPU-abc", "GPU-def"]
    devices = launcher_devices(visible, 2, cuda=True)
    assert devices == ["GPU-abc", "GPU-def"]
    cmd = launch_command(["/bin/ernie-studio", "train", "c.yaml"], 2, "/r/dist_logs", "run1", devices)
    assert cmd[cmd.index("--devices") + 1] == "GPU-abc,GPU-def"
    # Paddle's launcher finds those names among CUDA_VISIBLE_DEVICES' entries: ranks on devices 0 and 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,GPU-def")
    assert Device.parse_device().get_selected_devices("GPU-abc,GPU-def") == ["0", "1"]
    assert launcher_devices(["MIG-1", "MIG-2", "MIG-3"], 2, cuda=True) == ["MIG-1", "MIG-2"]
    assert launcher_devices([], 2, cuda=True) == ["0", "1"]
    assert launcher_devices(visible, 2, cuda=False) is None  # gloo on a CPU build


def test_stopping_a_stopped_child_ends_it_with_sigterm_not_after_the_grace():
    """A child held by SIGSTOP (Ctrl-Z, a debugger) is continued after the SIGTERM and ends by it at once.
    Before, the SIGTERM waited at the stopped child for the whole grace and SIGKILL ended it; meanwhile the
    job's heartbeat was silent, and another worker's reconciler requeued an export its worker was failing
    (a CI failure: test_export_faults saw `queued` where `failed` was due)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    os.kill(child.pid, signal.SIGSTOP)
    assert stop_group(child, grace_s=60) == -signal.SIGTERM  # without SIGCONT: -SIGKILL, 60 s later


def test_a_recent_passing_doctor_report_is_read_in_the_worker_without_a_child(
    settings, monkeypatch, tmp_path
):
    """On this CPU build of Paddle the worker looks the node's recent passing report up itself (no child
    importing Paddle again); without one, or with reuse off, the doctor runs as a child as before."""
    from engine.doctor import reuse
    from engine.doctor.facts import node_facts
    from engine.doctor.report import DoctorFloors
    from workers.nodes import DoctorProcess

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    key = reuse.report_key(node_facts(), DoctorFloors().model_dump(), False)
    check = {"name": "device", "passed": True, "detail": "cpu", "duration_s": 0.1}
    reuse.save(reuse.default_cache_dir(), key, {"passed": True, "checks": [check]})
    doctor = DoctorProcess(settings)
    assert doctor.proc is None and doctor.report()["reused_from"] and doctor.report()["passed"]
    assert [c["name"] for c in doctor.report()["checks"]] == ["device"]
    # a floor the saved report did not vouch for: the key differs, and a child runs the checks
    monkeypatch.setenv("ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S", "1e12")
    doctor = DoctorProcess(settings)
    assert doctor.proc is not None
    doctor.proc.kill()
    doctor.proc.communicate()
