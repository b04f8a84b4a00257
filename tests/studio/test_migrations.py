"""The Alembic history creates exactly the schema of studio.models, on SQLite and on PostgreSQL."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect

from studio.config import Settings
from studio.migrate import check, upgrade
from studio.models import Base

EXPECTED_TABLES = {
    "datasets", "runs", "run_metrics", "checkpoints", "deployments", "exports", "events", "nodes", "model_downloads",
    "evals", "eval_samples", "media_fetches", "run_parts", "train_templates", "sweeps",
    "alembic_version",
}  # fmt: skip


def _assert_clean(settings: Settings) -> None:
    upgrade(settings)
    check(settings)  # raises when autogenerate would emit any operation
    engine = create_engine(settings.database_url)
    try:
        insp = inspect(engine)
        assert set(insp.get_table_names()) == EXPECTED_TABLES
        uniques = {tuple(u["column_names"]) for u in insp.get_unique_constraints("run_metrics")}
        assert ("run_id", "step") in uniques
        for table in Base.metadata.sorted_tables:
            assert {c["name"] for c in insp.get_columns(table.name)} == set(table.columns.keys())
    finally:
        engine.dispose()


def test_migrations_match_models_on_sqlite(tmp_path):
    _assert_clean(Settings(home=tmp_path))


def test_migrations_match_models_on_postgresql(tmp_path, pg_url):
    _assert_clean(Settings(home=tmp_path, database_url=pg_url))


def test_upgrade_is_idempotent(tmp_path):
    s = Settings(home=tmp_path)
    upgrade(s)
    upgrade(s)
    check(s)


def test_db_upgrade_command(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).parent / "ernie-studio")
    env = {**os.environ, "ERNIE_STUDIO_HOME": str(tmp_path)}
    done = subprocess.run([cli, "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"sqlite:///{tmp_path}/studio.db" in done.stdout and "head" in done.stdout
    check(Settings(home=tmp_path))
