"""The embedded broker's files: a consumer sees a whole message or none (a serve worker once read a message
file kombu had created but not yet written, and died of the JSON error)."""

from __future__ import annotations

import queue

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
