"""One node's part of a run over several nodes: claim a part in the store, prepare the run directory, wait at
the barrier until every node's part is claimed and ready (or, after gang_timeout_s, release the claims and
requeue), launch `paddle.distributed.launch --master --nnodes --rank`, and follow it. Node rank 0 stores the
metrics and checkpoints (rank 0 alone writes metrics.jsonl) and records how the run ended; a part that loses
its rank requeues the attempt, and every other part stops its launcher. Testable without Celery."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from pathlib import Path

import yaml
from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.serve.ports import free_port
from studio.config import Settings
from studio.db import session_factory
from studio.models import Run, RunStatus
from studio.services import runs as runs_svc
from studio.services.models import BUILDABLE_PRESETS, build_preset
from studio.services.run_lifecycle import lost_streak, requeue_run
from studio.services.run_parts import (
    ENDED,
    FAILED,
    LAUNCHED,
    READY,
    Gang,
    PartClaim,
    beat_part,
    claim_part,
    gang,
    killed,
    set_part,
)
from workers.process import Stop, engine_command, log_line, spawn, stop_group, supervise, tail
from workers.training import (
    DIST_LOGS,
    POLL_S,
    Heartbeat,
    Training,
    _finish,
    _rank_tails,
    execute_run,
    launcher_devices,
    visible_gpus,
)

log = logging.getLogger(__name__)

# A rank that died of a Python error says so in its log; one that did not was lost (a kill, a dead node).
TRACEBACK = "Traceback (most recent call last)"
# ...except when its last traceback is Paddle's collective store failing to start: the launcher on node rank 0
# probes a free port (paddle/distributed/launch/controllers/collective.py, the `candidate` it makes
# PADDLE_MASTER) and rank 0 binds it seconds later, after importing Paddle, so another connection on the
# machine can take it between the two. Rank 0 then aborts in C++ (`TCPServer::create`, a libuv assertion in
# `LibUVMasterDaemon`'s destructor, SIGABRT). Nothing of the run is wrong: the rank is lost, and the attempt
# is requeued on new ports like any lost rank's. Seen once in ~20 full suites (2026-11-29).
STORE_START = ("TCPStore::TCPStore", "TCPServer::create")


class PartBeat(Heartbeat):
    """Beats for this part (node rank 0 also for the run) and learns of cancel and of the attempt's end."""

    def __init__(self, settings: Settings, claim: PartClaim) -> None:
        super().__init__(settings, claim.attempt)
        self.claim = claim

    def beat(self, session: Session) -> str:
        return beat_part(session, self.claim, pid=self.pid)


def rendezvous_address(settings: Settings) -> str:
    """This node's address as the other nodes reach it: ERNIE_STUDIO_NODE_ADDRESS, else what the launcher
    itself would take (the address the host name resolves to)."""
    return settings.node_address or socket.gethostbyname(socket.getfqdn(socket.gethostname()))


def execute_training(settings: Settings, run_id: int, worker: str) -> str | None:
    """One attempt of `run_id` on this worker: its node's part when the run spans several nodes, else the
    whole run (`training.execute_run`). Decided here, above both, so the one-node code never imports this."""
    with session_factory(settings)() as session:
        nodes = session.scalar(select(Run.num_nodes).where(Run.id == run_id))
    if nodes and nodes > 1:
        return execute_part(settings, run_id, worker)
    return execute_run(settings, run_id, worker)


def execute_part(settings: Settings, run_id: int, worker: str) -> str | None:
    """Take and run one node's part of `run_id`; returns the run's final status when this part recorded
    it (node rank 0), else None."""
    master = f"{rendezvous_address(settings)}:{free_port('')}"
    with session_factory(settings)() as session:
        claim = claim_part(session, run_id, worker, settings.node_name, master)
    if claim is None:
        log.debug("run %s has no part left to take; dropping this message", run_id)
        return None
    log.info(
        "run %s attempt %d: node rank %d of %d (ranks %s) on %s",
        run_id, claim.attempt.number, claim.node_rank, claim.nnodes, claim.ranks, worker,
    )  # fmt: skip
    beat = PartBeat(settings, claim)
    beat.start()
    try:
        with session_factory(settings)() as session:
            return _part(session, settings, claim, beat)
    finally:
        beat.done.set()


def _part(session: Session, settings: Settings, claim: PartClaim, beat: PartBeat) -> str | None:
    attempt = claim.attempt
    directory = runs_svc.run_dir(settings, attempt.run_id)
    log_file = _node_log(settings, claim)
    try:
        config_file = _prepare(settings, claim, directory)
    except Exception as e:
        return _fail_part(session, claim, f"node rank {claim.node_rank} could not prepare the run: {e}")
    entry = engine_command("train", str(config_file))
    if entry[1:3] == ["-m", "engine"]:  # the launcher runs a program or a .py file, never `-m`
        return _fail_part(
            session, claim, "a run over several nodes needs the ernie-studio script (pip install)"
        )
    set_part(session, claim, READY)
    master = _barrier(session, settings, claim, beat)
    if master is None:
        return None
    from engine.train.parallel import NodeGroup, launch_command  # Paddle: only a multi-node launch needs it

    try:
        nodes = NodeGroup(master, claim.nnodes, claim.node_rank, settings.node_address or None)
    except ValueError as e:
        return _fail_part(session, claim, f"ERNIE_STUDIO_NODE_ADDRESS / rendezvous: {e}")
    import paddle

    devices = launcher_devices(visible_gpus(), claim.nproc, paddle.is_compiled_with_cuda())
    node_logs = directory / DIST_LOGS / f"node{claim.node_rank}"
    cmd = launch_command(entry, claim.nproc, str(node_logs), f"run{attempt.run_id}", devices, nodes=nodes)
    from engine.train.run_dir import latest_checkpoint

    resume = latest_checkpoint(attempt.output_dir)
    if claim.node_rank == 0 and resume is not None:
        attempt.resumed(session, str(resume))
    where = f", resuming from {resume.name}" if resume else ""
    log_line(
        log_file,
        f"attempt {attempt.number} on {attempt.worker}{where}: node rank {claim.node_rank} of {claim.nnodes}, "
        f"ranks {claim.ranks[0]}-{claim.ranks[-1]}, rendezvous {master}",
    )
    proc = spawn(cmd, log_file, cwd=directory, niceness=settings.batch_niceness)
    beat.pid = proc.pid
    set_part(session, claim, LAUNCHED, pid=proc.pid)
    status = _follow(session, settings, claim, proc, beat, log_file)
    if status != RunStatus.SUCCEEDED.value:
        _rank_tails(node_logs, claim.nproc, log_file)
    return status


def _node_log(settings: Settings, claim: PartClaim) -> Path:
    """Node rank 0 writes the run's train.log (what the API shows); the other nodes train.node<r>.log."""
    path = runs_svc.log_path(settings, claim.attempt.run_id)
    return path if claim.node_rank == 0 else path.with_name(f"train.node{claim.node_rank}.log")


def _prepare(settings: Settings, claim: PartClaim, directory: Path) -> Path:
    """The run directory, its config.yaml and the base model, on this node (the same on shared storage)."""
    directory.mkdir(parents=True, exist_ok=True)
    config_file = directory / "config.yaml"
    tmp = directory / f".config.node{claim.node_rank}.yaml"
    tmp.write_text(yaml.safe_dump(claim.attempt.config, sort_keys=False))
    tmp.replace(config_file)  # whole, also while another node's worker reads it
    if claim.attempt.base_model in BUILDABLE_PRESETS:
        build_preset(settings, claim.attempt.base_model)
    return config_file


def _fail_part(session: Session, claim: PartClaim, error: str) -> str | None:
    """This part cannot run: node rank 0 fails the run; another node's part reports it for rank 0 to."""
    set_part(session, claim, FAILED, error=error)
    if claim.node_rank == 0:
        claim.attempt.finish(session, RunStatus.FAILED, error=error)
        return RunStatus.FAILED.value
    return None


def _barrier(session: Session, settings: Settings, claim: PartClaim, beat: PartBeat) -> str | None:
    """Wait until every part of the attempt is claimed and ready: node rank 0 then gives the go (its part
    launched), the others start on it. The rendezvous address, or None when the attempt ended first
    (cancelled, failed, or requeued because not every node took its part in time)."""
    deadline = time.monotonic() + settings.gang_timeout_s
    while True:
        if beat.state == "lost":
            return None
        if beat.state == "cancel":
            if claim.node_rank == 0:
                claim.attempt.finish(session, RunStatus.CANCELLED)
            return None
        g = gang(session, claim, settings.stale_after_s)
        if g.errors and claim.node_rank == 0:
            rank, error = g.errors[0]
            claim.attempt.finish(session, RunStatus.FAILED, error=f"node rank {rank}: {error}")
            return None
        if claim.node_rank == 0 and g.ready:
            set_part(session, claim, LAUNCHED)  # the go the other parts wait for
            return g.master
        if claim.node_rank != 0 and g.go:
            return g.master
        # Node rank 0 gives up waiting; any part gives up on a part that was lost before the launch.
        if g.lost or (claim.node_rank == 0 and time.monotonic() > deadline):
            reason = (
                f"node ranks {g.lost} were lost before the launch"
                if g.lost
                else f"{g.claimed} of {claim.nnodes} nodes' workers took their part within "
                f"{settings.gang_timeout_s:g} s (ERNIE_STUDIO_GANG_TIMEOUT_S): the claims are released "
                "and the run waits for the nodes again"
            )
            requeue_run(session, settings, claim.attempt.run_id, reason, attempt=claim.attempt.number)
            return None
        beat.changed.wait(POLL_S)
        beat.changed.clear()


def _follow(
    session: Session,
    settings: Settings,
    claim: PartClaim,
    proc: subprocess.Popen,
    beat: PartBeat,
    log_file: Path,
) -> str | None:
    """Follow this node's launcher under the shared supervisor (workers.process.supervise)."""
    return supervise(session, settings, proc, _Part(settings, claim, beat, log_file))


class _Part(Training):
    """One node's part under the supervisor: node rank 0 collects what a one-node run does; every part also
    watches the other nodes' parts, and a stopping worker requeues the whole attempt."""

    def __init__(self, settings: Settings, claim: PartClaim, beat: PartBeat, log_file: Path) -> None:
        super().__init__(settings, claim.attempt, beat, log_file)
        self.claim = claim
        self.stopped_since: float | None = None

    def __repr__(self) -> str:
        return f"{super().__repr__()} node rank {self.claim.node_rank}"

    def collect(self, session: Session) -> None:
        if self.claim.node_rank == 0:  # rank 0 alone writes metrics.jsonl
            super().collect(session)

    def release(self, session: Session, proc: subprocess.Popen) -> None:
        log_line(self.log_file, "requeued: worker stopped")
        set_part(session, self.claim, FAILED, exit_code=proc.returncode)
        reason = f"worker {self.attempt.worker} stopped; resumes from the checkpoint the nodes share"
        requeue_run(session, self.settings, self.attempt.run_id, reason, attempt=self.attempt.number)

    def finish(self, session: Session, code: int, cancelled: bool) -> str | None:
        return _ended(session, self.settings, self.claim, code, cancelled, self.log_file)

    def watch(self, session: Session, proc: subprocess.Popen, cancelled: bool) -> Stop | None:
        """Stop this node's launcher when another node lost its ranks (the attempt is requeued) or, on node
        rank 0, when another node's rank failed with a Python error (the run fails with it)."""
        settings, claim = self.settings, self.claim
        g = gang(session, claim, settings.stale_after_s)
        lost, self.stopped_since = _peers_lost(g, claim.node_rank, self.stopped_since, _settle_s(settings))
        if cancelled:
            return None
        if lost:
            _requeue_lost(session, settings, claim, lost, self.log_file)
            stop_group(proc, settings.kill_grace_s)
            return Stop(None)
        errors = [(r, e) for r, e in g.errors if r != claim.node_rank]
        if claim.node_rank == 0 and errors:
            # This node's ranks may wait for the failed one in a collective until gloo's or NCCL's timeout.
            stop_group(proc, settings.kill_grace_s)
            set_part(session, claim, ENDED, exit_code=proc.returncode)
            self.attempt.finish(session, RunStatus.FAILED, error=f"node rank {errors[0][0]}: {errors[0][1]}")
            log_line(self.log_file, f"failed: node rank {errors[0][0]} failed with a Python error")
            return Stop(RunStatus.FAILED.value)
        return None


def _requeue_lost(
    session: Session, settings: Settings, claim: PartClaim, lost: list[int], log_file: Path
) -> None:
    """Requeue the attempt whose node ranks `lost` lost their ranks; or, when the attempts before it lost
    ranks `settings.lost_rank_retries` times in a row without a new checkpoint, fail the run: a rank killed
    every time (a node out of memory) would otherwise start again for ever."""
    from engine.train.run_dir import latest_checkpoint

    attempt, ranks = claim.attempt, ", ".join(map(str, lost))
    run = session.get(Run, attempt.run_id)
    if run is None:
        return
    session.refresh(run)
    if run.status != RunStatus.RUNNING or run.attempt != attempt.number:
        return  # another node's worker requeued or ended this attempt first
    newest = latest_checkpoint(attempt.output_dir)
    checkpoint = newest.name if newest else None
    streak = lost_streak(session, attempt.run_id, checkpoint)
    if streak >= settings.lost_rank_retries:
        error = (
            f"node rank(s) {ranks} lost their ranks in {streak + 1} attempts in a row with no new checkpoint "
            f"({checkpoint or 'none yet'}), so the run stops instead of starting again. A rank killed each "
            f"time is often a node out of memory: see the nodes' logs ({DIST_LOGS}/node<rank>/workerlog.*) "
            "and the kernel's, then resume the run."
        )
        log_line(log_file, f"failed: {error}")
        attempt.finish(session, RunStatus.FAILED, error=error)
        return
    reason = (
        f"node rank(s) {ranks} of attempt {attempt.number} lost their ranks; "
        "every node stops and the run resumes from the checkpoint they share"
    )
    log_line(log_file, f"requeued: {reason}")
    data = {"lost": lost, "checkpoint": checkpoint}
    requeue_run(session, settings, attempt.run_id, reason, attempt=attempt.number, data=data)


def _rank_error(node_logs: Path, nproc: int) -> str | None:
    """The end of the first local rank's log that shows a Python error; None when none does, or when a rank's
    collective store could not start (`STORE_START`: its peers' errors follow from it)."""
    if _store_failed(node_logs, nproc):
        return None
    for rank in range(nproc):
        text = tail(node_logs / f"workerlog.{rank}", 2000)
        if TRACEBACK in text:
            return text
    return None


def _store_failed(node_logs: Path, nproc: int) -> bool:
    return any(store_start_failed(tail(node_logs / f"workerlog.{rank}", 2000)) for rank in range(nproc))


def store_start_failed(text: str) -> bool:
    """Does a rank's log end with Paddle's collective store failing to start? Its last traceback is read, as
    the log of a rank holds its earlier attempts' too."""
    last = text.rfind(TRACEBACK)
    return last >= 0 and all(marker in text[last:] for marker in STORE_START)


def _peers_lost(
    g: Gang, own: int, stopped_since: float | None, settle_s: float
) -> tuple[list[int], float | None]:
    """The other nodes whose ranks are lost, and since when others' ranks have been seen stopped. A node
    whose ranks stopped without a kill (`Gang.stopped`) counts as lost once nobody else was named for
    `settle_s`: its ranks are gone and this node's would wait in a collective for them."""
    lost = [r for r in g.lost if r != own]
    stopped = [r for r in g.stopped if r != own]
    if not stopped:
        return lost, None
    since = stopped_since or time.monotonic()
    return (lost or (stopped if time.monotonic() - since > settle_s else [])), since


def _settle_s(settings: Settings) -> float:
    """How long the other nodes' launchers take to end after one ends (their ranks lose their peer)."""
    return settings.stale_after_s + settings.kill_grace_s


def _lost_ranks(
    session: Session, settings: Settings, claim: PartClaim, code: int, error: str | None
) -> list[int]:
    """The node ranks to name as lost after this node's launcher ended with `code`. A node whose rank was
    killed names itself at once. A node whose ranks ended otherwise (a peer's loss breaks gloo's collective
    with an abort or a timeout) first waits for the others' reports and names a node that was killed or went
    silent; with none, itself when its own ranks left no Python error, else nobody (the run fails with it)."""
    if error is None and killed(code):
        return [claim.node_rank]
    settle = time.monotonic() + _settle_s(settings)
    while time.monotonic() < settle:
        g = gang(session, claim, settings.stale_after_s)
        others = [r for r in g.lost if r != claim.node_rank]
        if others:
            return others
        if all(p.status in (ENDED, FAILED) for p in g.parts):
            break
        time.sleep(POLL_S)
    return [] if error else [claim.node_rank]


def _ended(
    session: Session, settings: Settings, claim: PartClaim, code: int, cancelled: bool, log_file: Path
) -> str | None:
    """This node's launcher exited. A part other than node rank 0 reports how; node rank 0 waits for the
    others' reports, then requeues when any rank was lost, or records the run's end."""
    attempt = claim.attempt
    node_logs = runs_svc.run_dir(settings, attempt.run_id) / DIST_LOGS / f"node{claim.node_rank}"
    error = None if code == 0 or cancelled else _rank_error(node_logs, claim.nproc)
    if code != 0 and not cancelled and error is None and _store_failed(node_logs, claim.nproc):
        log_line(log_file, f"node rank {claim.node_rank}: a rank could not start Paddle's collective store")
    if code == 0 or cancelled:
        set_part(session, claim, ENDED, exit_code=code)
    else:
        set_part(session, claim, FAILED, exit_code=code, error=error)
    log_line(log_file, f"node rank {claim.node_rank} ended (exit code {code})")
    if claim.node_rank != 0:
        if code != 0 and error is None and not cancelled:
            _requeue_lost(
                session, settings, claim, _lost_ranks(session, settings, claim, code, error), log_file
            )
        return None
    if code != 0 and not cancelled:
        lost = _lost_ranks(session, settings, claim, code, error)
        if lost:
            _requeue_lost(session, settings, claim, lost, log_file)
            return None
    return _finish(session, settings, attempt, code, cancelled, attempt.output_dir, log_file)
