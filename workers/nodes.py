"""This worker in the node registry: it starts without its work queues (`train`, `gpu.*`, `serve`), runs
`ernie-studio doctor --json` in a child process, opens them only when every check passed, and heartbeats.
A worker whose node fails takes no runs or deployments; what was sent to its queues waits for another."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import threading
import time
from typing import Any

from celery import Celery

from studio.config import Settings
from studio.db import session_factory
from studio.processes import die_with_parent
from studio.queue import is_work_queue
from studio.services import nodes as nodes_svc
from workers.process import engine_command

log = logging.getLogger(__name__)


def hold_work_queues(app: Celery) -> list[str]:
    """Before the consumer starts: stop the work queues from being consumed; returns every queue the worker
    was started for (`-Q`), in order."""
    selected = app.amqp.queues.consume_from
    started = list(selected)
    held = [q for q in started if is_work_queue(q)]
    if held:
        app.amqp.queues.deselect(held)
    return started


def reused_in_process(settings: Settings) -> dict[str, Any] | None:
    """The node's recent passing report (`engine.doctor.reuse.reused_report`), looked up in this process
    when that is safe: on a CPU build of Paddle, reading the node's facts touches no device and imports no
    Paddle (the build is read from Paddle's version file). A GPU build always asks a child: reading a GPU's
    free memory makes a CUDA context, which would stay in the worker. Saves a child that imports Paddle at
    each restart, and keeps Paddle out of the worker."""
    from engine.doctor.facts import cpu_only_build

    if not cpu_only_build():
        return None
    from engine.doctor.report import DoctorFloors
    from engine.doctor.reuse import reused_report

    report = reused_report(DoctorFloors(), settings.doctor_reuse_s)
    return None if report is None else report.to_dict()


class DoctorProcess:
    """`ernie-studio doctor --json` as a child: the probe's GPU memory and any crash of a broken driver stay
    out of the worker. A doctor that cannot report counts as failed, with the reason. A recent passing
    report read in this process (`reused_in_process`) stands in for the child."""

    def __init__(self, settings: Settings) -> None:
        self.timeout = settings.doctor_timeout_s
        self.started = time.monotonic()
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        self.reused = reused_in_process(settings)
        if self.reused is not None:
            log.info(
                "node doctor: a passing report of %s stands (read in this process)",
                self.reused["reused_from"],
            )
            return
        try:
            self.proc = subprocess.Popen(
                engine_command("doctor", "--json", "--reuse-s", str(settings.doctor_reuse_s)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                preexec_fn=die_with_parent,
            )
        except OSError as e:
            self.error = f"could not start `ernie-studio doctor`: {e}"

    def report(self) -> dict[str, Any]:
        """Wait for it (up to ERNIE_STUDIO_DOCTOR_TIMEOUT_S from its start) and return its JSON report."""
        if self.reused is not None:
            return self.reused
        if self.proc is None:
            return {"passed": False, "error": self.error}
        try:
            out, err = self.proc.communicate(
                timeout=max(0.0, self.timeout - (time.monotonic() - self.started))
            )
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {
                "passed": False,
                "error": f"`ernie-studio doctor` did not finish within {self.timeout:g} s "
                "(ERNIE_STUDIO_DOCTOR_TIMEOUT_S)",
            }
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    break
        last = " | ".join(err.strip().splitlines()[-3:])
        return {
            "passed": False,
            "error": f"`ernie-studio doctor` exited with status {self.proc.returncode} without a report: {last}",
        }


class NodeAgent(threading.Thread):
    """Registers the worker, runs its doctor, opens its work queues when it passed, then heartbeats."""

    def __init__(self, settings: Settings, app: Celery, worker: str, queues: list[str]) -> None:
        super().__init__(name="ernie-node-agent", daemon=True)
        self.settings = settings
        self.app = app
        self.worker = worker
        self.queues = queues
        self.factory = session_factory(settings)
        self.stopped = threading.Event()
        self.report: dict[str, Any] = {}
        self.passed = False
        self.opened = False

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.check()
                break
            except Exception:  # the database may be briefly unreachable at start-up
                log.exception("node registration failed; trying again")
                self.stopped.wait(self.settings.node_heartbeat_s)
        while not self.stopped.wait(self.settings.node_heartbeat_s):
            try:
                self.beat()
            except Exception:
                log.exception("node heartbeat failed")

    def check(self) -> None:
        self.register()
        self.report = DoctorProcess(self.settings).report()
        reason = self.record()
        self.passed = bool(self.report.get("passed"))
        if self.passed:
            log.info("node doctor passed; taking work from %s", ", ".join(self.queues))
            self.open_work_queues()
        else:
            log.error("node doctor FAILED, this worker takes no runs or deployments: %s", reason)

    def register(self) -> None:
        with self.factory() as session:
            nodes_svc.register_node(
                session,
                name=self.worker,
                node=self.settings.node_name,
                hostname=socket.gethostname(),
                queues=self.queues,
            )

    def record(self) -> str | None:
        with self.factory() as session:
            return nodes_svc.record_doctor(session, self.worker, self.report, queues_open=self.opened).reason

    def beat(self) -> None:
        with self.factory() as session:
            alive = nodes_svc.beat(session, self.worker)
        if not alive:
            # The row went away (a reset database): report again with the doctor's verdict of this start.
            self.register()
            self.record()
        if self.passed and not self.opened:
            self.open_work_queues()

    def open_work_queues(self) -> None:
        """Ask this worker's consumer, through Celery's remote control, to consume the held queues (it runs
        the change in its own loop); the node is marked ready once it answered. When no reply came, the
        request is repeated at the next heartbeat; on the embedded broker the worker's remote-control queue
        is first declared again, which writes back a binding its exchange table lost (kombu's own table
        lost one to a race, `studio.queue.embedded_transport`)."""
        held = [q for q in self.queues if is_work_queue(q)]
        replies = [
            self.app.control.add_consumer(q, destination=[self.worker], reply=True, timeout=5) for q in held
        ]
        self.opened = all(any(self.worker in r for r in rs or []) for rs in replies)
        if self.opened:
            with self.factory() as session:
                nodes_svc.mark_open(session, self.worker)
            return
        log.warning("no reply from the consumer to opening %s; trying again", ", ".join(held))
        if not self.settings.uses_embedded_broker:
            return  # Redis delivers remote control by publish/subscribe: there is no binding to lose
        try:
            with self.app.connection_for_write() as conn:
                self.app.control.mailbox.get_queue(self.worker)(conn.default_channel).declare()
        except Exception:
            log.exception("could not declare the remote-control queue of %s", self.worker)

    def stop(self) -> None:
        self.stopped.set()
        try:
            with self.factory() as session:
                nodes_svc.mark_stopped(session, self.worker)
        except Exception:
            log.exception("could not mark node %s stopped", self.worker)
