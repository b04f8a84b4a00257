"""Fixtures for the process-level worker tests: PostgreSQL databases, Redis servers, a studio harness."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from worker_helpers import RedisServer, Studio, redis_reachable, unique_name


@pytest.fixture
def pg_url() -> Iterator[str]:
    import psycopg

    try:
        admin = psycopg.connect(
            "host=127.0.0.1 user=postgres dbname=test", autocommit=True, connect_timeout=3
        )
    except Exception as e:
        pytest.skip(f"PostgreSQL on 127.0.0.1:5432 is unreachable: {e}")
    name = unique_name("ernie_w")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of this test's own on a free port (the shared one on 6379 is never stopped)."""
    reason = redis_reachable()
    if reason and not __import__("shutil").which("redis-server"):
        pytest.skip(f"no redis-server binary and {reason}")
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def volatile_redis(tmp_path) -> Iterator[RedisServer]:
    """A private redis-server that keeps nothing on disk: a restart comes back empty."""
    if not __import__("shutil").which("redis-server"):
        pytest.skip("no redis-server binary")
    server = RedisServer(tmp_path / "volatile-redis", persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def shared_redis_url(worker_id: str) -> str:
    """A database of the shared Redis on 6379 (11, or 11 + n for pytest-xdist's worker gw<n>, so parallel
    test processes never read each other's messages), emptied first so no message of an earlier run is left.
    A second suite on the same machine sets ERNIE_STUDIO_TEST_REDIS_DB to another first database."""
    reason = redis_reachable()
    if reason:
        pytest.skip(reason)
    import redis

    db = int(os.environ.get("ERNIE_STUDIO_TEST_REDIS_DB", "11")) + (
        int(worker_id[2:]) if worker_id.startswith("gw") else 0
    )
    client = redis.Redis(host="127.0.0.1", port=6379, db=db)
    client.flushdb()
    client.close()
    return f"redis://127.0.0.1:6379/{db}"


@pytest.fixture
def studio_factory(tmp_path, tiny_model_dir) -> Iterator:
    made: list[Studio] = []

    def make(**kwargs) -> Studio:
        s = Studio(tmp_path / f"studio{len(made)}", **kwargs)
        # The tiny preset as its first use would build it (`init-model --preset tiny`, seed 0), copied from the
        # session's: the API's build is a process importing Paddle (~1.5 s of CPU) on each test's first run.
        # The browser tests' studio builds it on first use, as a person's does.
        shutil.copytree(tiny_model_dir, s.settings.models_dir / "tiny")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
