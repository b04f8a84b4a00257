"""Node rank 0's worker following its launcher, without Celery: when another node's rank failed with a
Python error it stops its own ranks (which could wait in a collective until the backend's timeout) and
fails the run with that error; when another node's part went silent it requeues the attempt."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from studio.config import Settings
from studio.db import session_factory
from studio.migrate import upgrade
from studio.models import Run, RunPart, RunStatus, utcnow
from studio.services.run_parts import LAUNCHED, Gang, claim_part, killed, set_part
from studio.services.runs import resume_run
from workers.gang import PartBeat, _follow, _peers_lost, _rank_error, _requeue_lost, store_start_failed


@pytest.fixture
def settings(tmp_path) -> Settings:
    s = Settings(home=tmp_path / "home", stale_after_s=5, kill_grace_s=1)
    upgrade(s)
    return s


def _started(settings: Settings, tmp_path):
    """A run over two nodes whose two parts were claimed and launched; node rank 0's claim and a stand-in
    for its launcher (a process that would wait for ever)."""
    with session_factory(settings)() as s:
        run = Run(name="r", stage="SFT", fine_tuning="Full", base_model="tiny", queue="train", num_nodes=2,
                  output_dir=str(tmp_path / "out"))  # fmt: skip
        s.add(run)
        s.commit()
        first = claim_part(s, run.id, "train@a", "a", "127.0.0.1:6170")
        second = claim_part(s, run.id, "train@b", "b", "127.0.0.1:6170")
        set_part(s, first, LAUNCHED)
        set_part(s, second, LAUNCHED)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    return first, second, proc


def _follow_rank0(settings: Settings, first, proc, tmp_path) -> str | None:
    beat = PartBeat(settings, first)
    beat.start()
    try:
        with session_factory(settings)() as s:
            return _follow(s, settings, first, proc, beat, tmp_path / "train.log")
    finally:
        beat.done.set()


def test_a_python_error_on_another_node_stops_rank_0_and_fails_the_run(settings, tmp_path):
    first, second, proc = _started(settings, tmp_path)
    with session_factory(settings)() as s:
        set_part(
            s, second, "failed", exit_code=1, error="Traceback (most recent call last):\nValueError: bad"
        )
    assert _follow_rank0(settings, first, proc, tmp_path) == "failed"
    assert proc.poll() is not None  # node rank 0's launcher was stopped
    with session_factory(settings)() as s:
        run = s.get(Run, first.attempt.run_id)
        assert run.status == RunStatus.FAILED and run.error.startswith("node rank 1: Traceback")


def test_a_silent_node_requeues_the_attempt_and_stops_rank_0(settings, tmp_path):
    first, second, proc = _started(settings, tmp_path)
    with session_factory(settings)() as s:
        s.query(RunPart).filter_by(id=second.part_id).update(
            {"heartbeat_at": utcnow() - timedelta(seconds=60)}
        )
        s.commit()
    assert _follow_rank0(settings, first, proc, tmp_path) is None
    assert proc.poll() is not None
    with session_factory(settings)() as s:
        run = s.get(Run, first.attempt.run_id)
        assert run.status == RunStatus.QUEUED
        assert "node rank(s) 1 of attempt 1 lost their ranks" in (tmp_path / "train.log").read_text()


def test_a_killed_rank_is_named_lost_not_the_node_whose_ranks_its_loss_stopped(settings, tmp_path):
    """Node rank 1's rank is SIGKILLed; node rank 0's rank aborts on the broken collective (no Python error,
    launcher exit 250) and its launcher ends first. Rank 0 waits for the others' reports and names node rank 1,
    whose launcher ended with a kill's code (247), rather than itself."""
    first, second, proc = _started(settings, tmp_path)
    proc.kill()
    proc.wait()
    aborted = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(250)"])

    def killed_report() -> None:
        time.sleep(1.0)
        with session_factory(settings)() as s:
            set_part(s, second, "failed", exit_code=247)

    reporter = threading.Thread(target=killed_report)
    reporter.start()
    try:
        assert _follow_rank0(settings, first, aborted, tmp_path) is None
    finally:
        reporter.join()
    log = (tmp_path / "train.log").read_text()
    assert "node rank(s) 1 of attempt 1 lost their ranks" in log, log
    with session_factory(settings)() as s:
        assert s.get(Run, first.attempt.run_id).status == RunStatus.QUEUED


def test_ranks_stopped_without_a_kill_count_as_lost_only_when_nobody_else_is():
    killed_one = Gang([], None, lost=[1], stopped=[2])
    assert _peers_lost(killed_one, 0, None, 5.0)[0] == [1]
    stopped_only = Gang([], None, stopped=[2])
    lost, since = _peers_lost(stopped_only, 0, None, 5.0)
    assert lost == [] and since is not None
    assert _peers_lost(stopped_only, 0, since - 6.0, 5.0)[0] == [2]
    assert _peers_lost(Gang([], None, stopped=[0]), 0, None, 5.0) == ([], None)  # its own part is not a peer
    assert [killed(c) for c in (247, -9, 241, 250, 1, 0)] == [True, True, True, False, False, False]


# The end of rank 0's log in a two-node run whose resumed attempt failed (2026-11-29, a fresh clone's suite):
# attempt 2's rank lost its peer (a Python error), then attempt 3's rank could not start Paddle's collective
# store on the port its launcher had probed (exit code 250).
EARLIER_ATTEMPT = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/paddle/distributed/communication/all_reduce.py", line 51, in _all_reduce_in_dygraph
    task = group.process_group.all_reduce(tensor, op_type, sync_op)
RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:576] Read error [127.0.0.1]:56706: Connection reset by peer
"""
STORE_ABORT = """I1129 20:16:04.592231  4796 tcp_store.cc:336] create libuv server at port: 58878
python: /paddle/third_party/libuv/src/unix/core.c:314: uv__finish_close: Assertion `handle->flags & UV_HANDLE_CLOSING' failed.


--------------------------------------
C++ Traceback (most recent call last):
--------------------------------------
0   phi::distributed::CreateOrGetGlobalTCPStore()
1   phi::distributed::TCPStore::TCPStore(std::string, unsigned short, bool, unsigned long, int)
2   phi::distributed::detail::TCPServer::create(unsigned short, int, int, bool)
3   phi::distributed::detail::LibUVMasterDaemon::~LibUVMasterDaemon()
4   phi::distributed::detail::LibUVMasterDaemon::~LibUVMasterDaemon()
5   uv_run

----------------------
Error Message Summary:
----------------------
FatalError: `Process abort signal` is detected by the operating system.
"""


def test_a_rank_whose_collective_store_could_not_start_is_lost_not_the_runs_error(tmp_path):
    """Such a rank is counted lost (the attempt is requeued on new ports) although its log holds tracebacks:
    the C++ one of the store and, above it, an earlier attempt's Python one. A Python error after an earlier
    store failure is the run's error again, and so is a C++ abort elsewhere."""
    logs = tmp_path / "node0"
    logs.mkdir()
    rank0 = logs / "workerlog.0"
    rank0.write_text(EARLIER_ATTEMPT + STORE_ABORT)
    assert store_start_failed(rank0.read_text())
    assert _rank_error(logs, 1) is None
    # a second local rank's error (it could not reach the store) follows from rank 0's
    (logs / "workerlog.1").write_text(EARLIER_ATTEMPT)
    assert _rank_error(logs, 2) is None

    rank0.write_text(STORE_ABORT + EARLIER_ATTEMPT)  # the next attempt failed in Python
    assert not store_start_failed(rank0.read_text())
    assert "Connection reset by peer" in _rank_error(logs, 1)
    other_abort = STORE_ABORT.replace("TCPServer::create", "MatmulKernel").replace(
        "TCPStore::TCPStore", "Run"
    )
    rank0.write_text(other_abort)
    assert "C++ Traceback" in _rank_error(logs, 1)


def test_ranks_lost_again_and_again_without_a_new_checkpoint_fail_the_run(settings, tmp_path):
    """Each lost rank requeues the attempt, but after `lost_rank_retries` (here 2) such requeues in a row with
    no new checkpoint between them the next loss fails the run with the reason (a rank OOM-killed every time
    would start again for ever). A new checkpoint, or a person's resume, starts the count again."""
    settings = settings.model_copy(update={"lost_rank_retries": 2})
    out = tmp_path / "out"
    with session_factory(settings)() as s:
        run = Run(name="r", stage="SFT", fine_tuning="Full", base_model="tiny", queue="train", num_nodes=2,
                  output_dir=str(out))  # fmt: skip
        s.add(run)
        s.commit()
        run_id = run.id

    def lose_rank_1() -> RunStatus:
        with session_factory(settings)() as s:
            first = claim_part(s, run_id, "train@a", "a", "127.0.0.1:6170")
            claim_part(s, run_id, "train@b", "b", "127.0.0.1:6170")
            _requeue_lost(s, settings, first, [1], tmp_path / "train.log")
            run = s.get(Run, run_id)
            s.refresh(run)
            return run.status

    def checkpoint(step: int) -> None:
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")

    assert [lose_rank_1() for _ in range(2)] == [RunStatus.QUEUED] * 2
    checkpoint(5)  # progress: the count starts again
    assert [lose_rank_1() for _ in range(3)] == [RunStatus.QUEUED, RunStatus.QUEUED, RunStatus.FAILED]
    with session_factory(settings)() as s:
        error = s.get(Run, run_id).error
        assert error.startswith(
            "node rank(s) 1 lost their ranks in 3 attempts in a row with no new checkpoint"
        )
        assert "(checkpoint-5)" in error and "out of memory" in error
        resume_run(s, settings, run_id)  # a person's resume: the count starts again
    assert lose_rank_1() == RunStatus.QUEUED
    assert "failed: node rank(s) 1 lost their ranks in 3 attempts" in (tmp_path / "train.log").read_text()
