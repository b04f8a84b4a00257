"""The embedded broker's files: a consumer sees a whole message or none (a serve worker once read a message
file kombu had created but not yet written, and died of the JSON error)."""

from __future__ import annotations

import queue
import threading

import pytest
from kombu import Connection

from studio.config import Settings
from studio.queue import embedded_transport, make_celery


def test_a_message_being_written_is_not_taken_and_a_written_one_is(tmp_path):
    settings = Settings(home=tmp_path / "home")
    app = make_celery(settings)
    assert app.conf.broker_transport is not None
    folder = settings.broker_dir
    with Connection(
        "filesystem://", transport=embedded_transport(), transport_options=app.conf.broker_transport_options
    ) as conn:
        channel = conn.default_channel
        # what a writer leaves while it writes: a hidden part file, which no consumer takes
        (folder / ".1_abc.serve.msg.part").write_bytes(b"")
        with pytest.raises(queue.Empty):
            channel._get("serve")
        channel._put("serve", {"body": "hello"})
        assert [p.name for p in folder.glob("*.serve.msg")], "the message is in place under its final name"
        assert not [p for p in folder.glob(".*.part") if p.name != ".1_abc.serve.msg.part"]
        assert channel._get("serve") == {"body": "hello"}


def _bind_at_once(channel_of, exchange: str, queues: list[str]) -> None:
    barrier = threading.Barrier(len(queues))

    def bind(q: str) -> None:
        channel = channel_of()
        barrier.wait()
        channel._queue_bind(exchange, "", "", q)

    threads = [threading.Thread(target=bind, args=(q,)) for q in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_workers_binding_to_one_exchange_at_once_all_stay_bound(tmp_path):
    """Every worker's remote-control queue binds to the `celery.pidbox` fanout exchange as it starts. kombu's
    own table lost a binding when two started at once (both emptied the new file before locking it), and the
    worker whose binding was lost never heard the request to open its work queues. With kombu 5.7's own
    `_queue_bind` this test failed in each of 10 tries by its 9th round: a binding lost, or a table left
    unreadable (`Extra data` after a shorter write over a longer one). Here none is lost in 40 rounds."""
    settings = Settings(home=tmp_path / "home")
    app = make_celery(settings)
    with Connection(
        "filesystem://", transport=embedded_transport(), transport_options=app.conf.broker_transport_options
    ) as conn:
        workers = [f"w{i}@node.celery.pidbox" for i in range(6)]
        for round_ in range(40):
            exchange = f"pidbox{round_}"
            _bind_at_once(lambda: conn.channel(), exchange, workers)
            table = conn.default_channel.get_table(exchange)
            assert sorted(b.queue for b in table) == sorted(workers), f"round {round_}: {table}"
        # a fanout reaches every bound queue, and a table being created (still empty) reads as no bindings
        conn.default_channel._put_fanout("pidbox0", {"body": "ping"}, "")
        assert all(conn.default_channel._get(q) == {"body": "ping"} for q in workers)
        (settings.broker_dir / "control" / "fresh.exchange").write_bytes(b"")
        assert conn.default_channel.get_table("fresh") == []
