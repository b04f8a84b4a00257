"""Fixtures for the studio's in-process tests: a fresh home, a migrated database, an API client."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from studio_helpers import TOKEN, postgres_available

from studio.config import Settings
from studio.db import dispose_engines, session_factory
from studio.migrate import upgrade


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A throw-away PostgreSQL database for one test."""
    reason = postgres_available()
    if reason:
        pytest.skip(reason)
    import psycopg

    name = f"ernie_t_{uuid.uuid4().hex[:10]}"
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    dispose_engines()
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory) -> Path:
    """An empty store at the migrations' head, made once per test process (Alembic's upgrade took 0.2-0.45 s,
    and ~250 tests start from it)."""
    s = Settings(home=tmp_path_factory.mktemp("migrated") / "home")
    upgrade(s)  # a NullPool engine of its own: nothing stays open
    return s.home / "studio.db"


@pytest.fixture
def settings(tmp_path, migrated_database) -> Settings:
    # A filesystem broker under home: dispatching works, nothing consumes (no worker in these tests).
    s = Settings(home=tmp_path / "home", max_upload_mb=2)
    s.home.mkdir(parents=True)
    # SQLite's backup: a consistent copy of the migrated store, whatever its WAL holds
    src, dst = sqlite3.connect(migrated_database), sqlite3.connect(s.home / "studio.db")
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return s


@pytest.fixture
def session(settings):
    with session_factory(settings)() as s:
        yield s


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    from studio.app import create_app

    # the studio answers loopback names only when it has no token (studio/api/security.py)
    app = create_app(settings, with_ui=False)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def locked(tmp_path) -> Iterator[TestClient]:
    """A studio that requires the access token TOKEN (as `up` on a non-loopback address)."""
    from studio.app import create_app

    s = Settings(home=tmp_path / "home", token=TOKEN)
    upgrade(s)
    with TestClient(create_app(s, with_ui=False), follow_redirects=False) as c:
        yield c
