"""Alembic environment: the target metadata is studio.models; the URL comes from the studio settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from studio.config import Settings
from studio.models import Base
from studio.sweep_storage import OPTUNA_TABLES

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    # `ernie-studio db upgrade` passes the URL in; the alembic CLI falls back to the environment.
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not url:
        settings = Settings()
        settings.home.mkdir(parents=True, exist_ok=True)
        url = settings.database_url
    return url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = engine_from_config({"sqlalchemy.url": _url()}, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)


def _studio_table(name, type_, parent_names) -> bool:
    # Optuna keeps a sweep's study in its own tables of the same database (engine.sweep, RDBStorage); they
    # are Optuna's to evolve, so the studio's autogenerate neither drops nor compares them.
    return type_ != "table" or name in target_metadata.tables or name not in OPTUNA_TABLES


def _run(connection) -> None:
    # Batch mode lets later migrations alter SQLite tables (it has no ALTER COLUMN).
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_name=_studio_table,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
