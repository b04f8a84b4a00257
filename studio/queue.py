"""The job queue both sides share: the Celery app factory, the queue names and the task names.

The API and the UI publish tasks by name through `send`; the workers (`workers.app`, `workers.tasks`) build
their app with the same factory and register their tasks under these names, so neither side imports the
other. Redis in production; with no broker configured, kombu's filesystem transport under
ERNIE_STUDIO_HOME, so `ernie-studio up` needs no server.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.config import Settings

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

# Queue names. Training goes to the shared `train` queue (any GPU worker) or to one GPU's own queue; a run
# on N > 1 devices to `train.devices.<N>`, which every worker owning at least N devices of one node serves;
# model servers to `serve`; exports to `export`, which the serving workers take (they hold threads to spare,
# so an export never waits behind a training run nor holds a training slot). `cpu` is where exports went
# before; serving workers still drain it.
TRAIN_QUEUE = "train"
CPU_QUEUE = "cpu"
SERVE_QUEUE = "serve"
EXPORT_QUEUE = "export"

# Task names. They are the names messages already in a broker carry, so they stay as they were when the
# tasks were named after their module.
RUN_TASK = "workers.tasks.run_training"
DEPLOYMENT_TASK = "workers.tasks.run_deployment"
EXPORT_TASK = "workers.tasks.run_export"
DOWNLOAD_TASK = "workers.tasks.run_download"
EVAL_TASK = "workers.tasks.run_eval"
MEDIA_TASK = "workers.tasks.run_media_fetch"
SWEEP_TASK = "workers.tasks.run_sweep"
TASK_NAMES = (RUN_TASK, DEPLOYMENT_TASK, EXPORT_TASK, DOWNLOAD_TASK, EVAL_TASK, MEDIA_TASK, SWEEP_TASK)

_apps: dict[tuple[str, str], Celery] = {}
_lock = threading.Lock()


def is_work_queue(name: str) -> bool:
    """Queues of runs and model servers (`train`, `train.devices.<N>`, `gpu.*`, `serve`): a worker consumes
    them only once its node passed its doctor. `export` (and `cpu`, where exports went before) it takes
    from the start."""
    return name in (TRAIN_QUEUE, SERVE_QUEUE) or name.startswith((f"{TRAIN_QUEUE}.devices.", "gpu."))


def gpu_queue(node: str, index: int) -> str:
    """The queue of one GPU of one node (`gpu.<node>.<index>`)."""
    return f"gpu.{node}.{index}"


def devices_queue(num_devices: int) -> str:
    """The queue of runs asking for `num_devices` devices of one node (`train` for one device)."""
    return TRAIN_QUEUE if num_devices <= 1 else f"{TRAIN_QUEUE}.devices.{num_devices}"


def devices_of(queue_name: str) -> int:
    """The devices a run on `queue_name` asked for: the queue is where that request is kept."""
    prefix = f"{TRAIN_QUEUE}.devices."
    if queue_name.startswith(prefix) and queue_name[len(prefix) :].isdigit():
        return int(queue_name[len(prefix) :])
    return 1


def training_queues(node: str, gpus: list[int], num_devices: int) -> list[str]:
    """What a training worker owning `num_devices` devices (`gpus` of `node`, none on a CPU node)
    consumes: `train`, each of its GPUs' own queues, and the multi-device queues up to its size."""
    return [
        TRAIN_QUEUE,
        *(gpu_queue(node, g) for g in gpus),
        *(devices_queue(n) for n in range(2, num_devices + 1)),
    ]


def _transport_options(settings: Settings) -> dict:
    if settings.uses_embedded_broker:
        folder = str(settings.broker_dir)
        return {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "processed_folder": str(settings.broker_dir / "processed"),
            # Without this kombu writes its exchange tables to the current directory.
            "control_folder": str(settings.broker_dir / "control"),
            "store_processed": False,
            "polling_interval": 0.2,
        }
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # Long runs hold their message unacked; the claim in the database makes a redelivery harmless.
        return {"visibility_timeout": 6 * 3600, "socket_connect_timeout": 3, "socket_timeout": 10}
    return {}


def embedded_transport() -> type:
    """kombu's filesystem transport, with each message written under a hidden name and renamed into place.

    kombu's own `_put` opens `<ms>_<uuid>.<queue>.msg` and then writes it, while a consumer that lists the
    folder moves and reads any such file at once: a serve worker read one empty and died of the JSON error
    (an e2e run, 2026-11-28), leaving every later deployment to wait. A rename is atomic, so a consumer sees
    a whole message or none.

    kombu's `_queue_bind` loses bindings: two workers starting at once both find no exchange table, both
    open it with "wb" (which empties the file before the lock is taken), and the second one's write
    replaces the first one's or leaves the table unreadable. A serve worker whose remote-control queue lost
    its binding to `celery.pidbox` never hears a broadcast, so its work queues were never opened (a fresh
    clone's e2e run, 2026-11-29). Here the table is opened without truncation, then read, extended and
    rewritten under one exclusive lock, and a table read while it is being created (empty) counts as no
    bindings.
    """
    from kombu.transport import filesystem
    from kombu.utils.encoding import str_to_bytes
    from kombu.utils.json import dumps, loads

    def _bindings(raw: bytes) -> list:
        """An exchange table's bindings; a table still being created (empty) has none."""
        return [filesystem.exchange_queue_t(*q) for q in loads(raw)] if raw.strip() else []

    class Channel(filesystem.Channel):
        def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
            name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
            final = os.path.join(self.data_folder_out, name)
            hidden = os.path.join(self.data_folder_out, f".{name}.part")  # not `<x>.<queue>.msg`: never read
            try:
                with open(hidden, "wb") as f:
                    f.write(str_to_bytes(dumps(payload)))
                os.replace(hidden, final)
            except OSError as exc:
                raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from exc

        def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
            file = self._exchange_file(exchange)
            self.control_folder.mkdir(parents=True, exist_ok=True)
            binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
            try:
                with open(os.open(file, os.O_RDWR | os.O_CREAT, 0o644), "r+b", buffering=0) as f:
                    filesystem.lock(f, filesystem.LOCK_EX)
                    try:
                        table = _bindings(f.read())
                        if binding not in table:
                            f.seek(0)
                            f.write(str_to_bytes(dumps([binding, *table])))
                            f.truncate()
                    finally:
                        filesystem.unlock(f)
            except OSError as exc:
                raise filesystem.ChannelError(f"Cannot open {file}") from exc

        def get_table(self, exchange: str) -> list:
            file = self._exchange_file(exchange)
            try:
                with open(file, "rb") as f:
                    filesystem.lock(f, filesystem.LOCK_SH)
                    try:
                        raw = f.read()
                    finally:
                        filesystem.unlock(f)
            except FileNotFoundError:
                return []
            except OSError as exc:
                raise filesystem.ChannelError(f"Cannot open {file}") from exc
            return _bindings(raw)

    class Transport(filesystem.Transport):
        pass

    Transport.Channel = Channel
    return Transport


def make_celery(settings: Settings) -> Celery:
    """A Celery app on the settings' broker, configured for long, late-acknowledged tasks."""
    from celery import Celery

    settings.ensure_dirs()
    app = Celery("ernie_studio", broker=settings.broker_url, backend=settings.result_backend)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=CPU_QUEUE,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=_transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        # The API must not hang when the broker is down: publish fails fast and the run stays undispatched.
        task_publish_retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 1,
        },
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    if settings.uses_embedded_broker:
        app.conf.broker_transport = embedded_transport()
    app.conf.ernie_settings = settings
    return app


def celery_app_for(settings: Settings) -> Celery:
    """One app per (broker, home) per process."""
    key = (settings.broker_url, str(settings.home))
    with _lock:
        if key not in _apps:
            _apps[key] = make_celery(settings)
        return _apps[key]


def send(settings: Settings, task: str, args: list, queue: str) -> str | None:
    """Publish `task`; returns the task id, or None when the broker could not be reached.

    A broker outage never loses a run: it stays `queued` with no dispatch time and a worker's reconciler
    sends it again.
    """
    app = celery_app_for(settings)
    try:
        result = app.send_task(task, args=args, queue=queue)
    except Exception as e:  # kombu raises several connection error types; all mean "try later"
        log.warning("could not publish %s%s to %s: %s (the reconciler will retry)", task, args, queue, e)
        return None
    return result.id


def revoke(settings: Settings, task_id: str) -> None:
    """Ask the workers to drop a task that has not started."""
    try:
        celery_app_for(settings).control.revoke(task_id)
    except Exception as e:  # revocation is an optimisation: the task checks the run status anyway
        log.debug("could not revoke %s: %s", task_id, e)


# ---- what the broker holds ------------------------------------------------------------------------------
# A job is (task name, id of the run, export or deployment): any message carrying it does the same work, so
# a job is what the reconciler asks the broker about and what a cancel removes, whatever its task id.
Job = tuple[str, int]
# Message file name -> its job (a message file never changes once written), so a look at a long queue reads
# only the files it has not seen before.
_file_jobs: dict[str, Job] = {}
_file_jobs_lock = threading.Lock()


def job_of(message: dict[str, Any]) -> Job | None:
    """The job a Celery message (as kombu stores it) carries; None for any other message."""
    headers = message.get("headers") or {}
    task = headers.get("task")
    if task not in TASK_NAMES:
        return None
    try:
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return task, int(args[0])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class FolderMessages:
    """The embedded transport's messages: kombu's filesystem transport writes one `<ms>_<uuid>.<queue>.msg`
    file per message and a consumer moves the file away when it takes it, so a file in the folder is a
    message no worker has taken yet. A taken message lives only in that worker's memory until it ends."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def waiting(self, queues: Iterable[str]) -> Iterator[tuple[Path, Job]]:
        wanted = {f"{q}.msg" for q in queues}
        names = [n for n in os.listdir(self.folder) if n.partition(".")[2] in wanted]
        with _file_jobs_lock:
            known = dict(_file_jobs)
            _file_jobs.clear()
            for name in names:
                job = known.get(name) or self._read(name)
                if job is not None:  # an unreadable file (being written right now) is read again next time
                    _file_jobs[name] = job
            jobs = dict(_file_jobs)
        for name, job in jobs.items():
            yield self.folder / name, job

    def _read(self, name: str) -> Job | None:
        try:
            return job_of(json.loads((self.folder / name).read_bytes()))
        except (OSError, ValueError):  # taken by a worker meanwhile, or not a JSON message
            return None

    def delivered_since(self, since: float) -> Iterator[Job]:
        return iter(())  # the filesystem transport keeps no record of what it handed out

    def remove(self, ref: Path) -> bool:
        try:
            ref.unlink()
        except FileNotFoundError:  # a worker took it first; it drops the message itself
            return False
        return True


class RedisMessages:
    """Kombu's Redis transport: a queue is one list per priority step (named as kombu's `_q_for_pri` does);
    a message handed to a worker moves to the `unacked` hash, scored by delivery time in `unacked_index`,
    until the worker acknowledges it (or kombu restores it after the visibility timeout)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.client = channel.client

    def _keys(self, queue: str) -> list[str]:
        steps = sorted({p for p in self.channel.priority_steps if p})
        return [queue] + [f"{queue}{self.channel.sep}{p}" for p in steps]

    def waiting(self, queues: Iterable[str]) -> Iterator[tuple[tuple[str, bytes], Job]]:
        for key in (k for q in queues for k in self._keys(q)):
            for raw in self.client.lrange(key, 0, -1):
                job = _job_of_raw(raw)
                if job is not None:
                    yield (key, raw), job

    def delivered_since(self, since: float) -> Iterator[Job]:
        tags = self.client.zrangebyscore(self.channel.unacked_index_key, since, "+inf")
        for raw in self.client.hmget(self.channel.unacked_key, tags) if tags else []:
            try:
                job = job_of(json.loads(raw)[0]) if raw else None
            except (ValueError, IndexError, TypeError):
                job = None
            if job is not None:
                yield job

    def remove(self, ref: tuple[str, bytes]) -> bool:
        key, raw = ref
        return bool(self.client.lrem(key, 1, raw))


def _job_of_raw(raw: bytes) -> Job | None:
    try:
        return job_of(json.loads(raw))
    except ValueError:
        return None


@contextmanager
def broker_messages(settings: Settings) -> Iterator[FolderMessages | RedisMessages | None]:
    """The broker's messages through kombu's own channel (its key names, its folder); None for a transport
    the studio cannot read. Raises kombu's OperationalError when the broker is unreachable."""
    with celery_app_for(settings).connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        driver = conn.transport.driver_type
        if driver == "filesystem":
            yield FolderMessages(conn.default_channel.data_folder_in)
        elif driver == "redis":
            yield RedisMessages(conn.default_channel)
        else:
            yield None


def held_jobs(settings: Settings, queues: Iterable[str], delivered_within_s: float) -> set[Job] | None:
    """The jobs whose message the broker still holds: waiting on `queues`, or handed to a worker less than
    `delivered_within_s` ago and not yet acknowledged (Redis). None when that cannot be known (the broker
    is down or its transport cannot be read); then nothing should be treated as lost."""
    try:
        with broker_messages(settings) as messages:
            if messages is None:
                return None
            held = {job for _, job in messages.waiting(set(queues))}
            held.update(messages.delivered_since(time.time() - delivered_within_s))
            return held
    except Exception as e:  # kombu and redis raise several connection error types; all mean "not now"
        log.debug("could not read the broker's queues: %s", e)
        return None


def purge_job(settings: Settings, task: str, job_id: int, queue_name: str) -> int:
    """Remove the waiting messages of one job (a cancelled or deleted run) from its queue, so no worker
    has to take and drop them; returns how many were removed (0 when the broker cannot be read)."""
    removed = 0
    try:
        with broker_messages(settings) as messages:
            if messages is None:
                return 0
            for ref, job in list(messages.waiting([queue_name])):
                if job == (task, job_id):
                    removed += messages.remove(ref)
    except Exception as e:  # an optimisation: a message left behind is dropped by the worker's claim
        log.debug("could not purge %s %s from %s: %s", task, job_id, queue_name, e)
    return removed
