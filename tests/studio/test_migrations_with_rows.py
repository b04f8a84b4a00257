"""Rows written at every earlier revision survive the upgrade to head and read back through the REST API;
a downgrade of one step and the upgrade after it keep them too. On SQLite and PostgreSQL.

Rows are written with plain SQL against the tables as they exist at that revision (reflected), one row per
table with every column filled, so a migration that cannot carry data (a NOT NULL column added without a
server default, a table rebuilt without its rows) fails here, while an empty database would upgrade fine.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    inspect,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.schema import Column

from studio.config import Settings
from studio.db import dispose_engines
from studio.migrate import MIGRATIONS_DIR, alembic_config
from studio.models import Base

REVISIONS = [s.revision for s in reversed(list(ScriptDirectory(str(MIGRATIONS_DIR)).walk_revisions()))]
API = "/api/v1"
Rows = dict[str, list[dict[str, Any]]]

# Values other code reads for their meaning: statuses, the gang-scheduled run's attempt and its parts, and
# every JSON column in the shape its API schema declares. A callable gets the rows written so far.
MEANINGFUL: dict[tuple[str, str], Any] = {
    ("datasets", "problems"): ["train.jsonl:3: no 'src' key"],
    ("datasets", "stats"): {"records": 4, "tokens": {"mean": 12.5}},
    ("runs", "status"): "succeeded",
    ("runs", "attempt"): 3,
    ("runs", "num_nodes"): 2,
    ("runs", "dataset_ids"): lambda rows: [rows["datasets"][0]["id"]],
    ("runs", "config"): {"max_steps": 10, "learning_rate": 0.0003},
    ("runs", "final_metrics"): {"loss": 1.25},
    ("runs", "estimate"): {"memory_gib": 1.5, "steps": 10},
    ("runs", "evaluate"): lambda rows: {
        "holdout": 0.1,
        "dataset_ids": [rows["datasets"][0]["id"]],
        "options": {},
    },
    ("run_parts", "status"): "ended",
    ("run_parts", "attempt"): 3,
    ("run_parts", "node_rank"): 0,
    ("run_parts", "nproc"): 2,
    ("run_metrics", "values"): {"tokens_per_second": 1000.0, "elapsed_s": 2.0},
    ("deployments", "status"): "stopped",
    ("exports", "status"): "succeeded",
    ("exports", "perplexity"): {"before": 12.5, "after": 12.75},
    ("exports", "gguf_files"): [{"type": "f16", "path": "model-f16.gguf", "size_bytes": 1024}],
    ("events", "data"): {"why": "a test row"},
    ("nodes", "status"): "ready",
    ("nodes", "queues"): ["train"],
    ("nodes", "devices"): [{"index": 0, "name": "gpu", "memory_bytes": 1024}],
    ("nodes", "doctor"): {"passed": True, "checks": [{"name": "paddle", "passed": True, "detail": "3.3.1"}]},
    ("model_downloads", "status"): "succeeded",
    ("media_fetches", "status"): "succeeded",
    ("media_fetches", "failed"): {"http://example.invalid/a.png": "not an image"},
    ("evals", "status"): "succeeded",
    ("evals", "dataset_ids"): lambda rows: [rows["datasets"][0]["id"]],
    ("evals", "config"): {"max_new_tokens": 8},
    ("evals", "metrics"): {"demo/accuracy": 0.5},
    ("evals", "results"): {"demo": {"accuracy": {"value": 0.5, "n": 4, "interval": [0.1, 0.9]}}},
    ("eval_samples", "scores"): {"exact_match": 1.0},
    ("eval_samples", "values"): {"prediction": "yes"},
}


def _value(table: Table, column: Column, k: int, row: dict[str, Any], rows: Rows) -> Any:
    """A value of the column's type (distinct per column, so swapped columns show), or its meaningful one."""
    if (table.name, column.name) in MEANINGFUL:
        v = MEANINGFUL[table.name, column.name]
        return v(rows) if callable(v) else v
    if column.foreign_keys:
        target = next(iter(column.foreign_keys)).column
        parent = row if target.table.name == table.name else rows[target.table.name][0]
        return parent[target.name]
    t = column.type
    if isinstance(t, JSON):
        raise AssertionError(
            f"{table.name}.{column.name} is JSON: give it a value of its API shape in MEANINGFUL"
        )
    if isinstance(t, Boolean):
        return True  # every boolean column defaults to false: a lost value shows
    if isinstance(t, BigInteger):
        return 2**40 + k
    if isinstance(t, Integer):
        return 100 + k
    if isinstance(t, Float):
        return 0.5 + k
    if isinstance(t, DateTime):
        return datetime(2026, 1, 2, 3, 4, k % 60, 123456, tzinfo=UTC)
    if isinstance(t, Text):
        return f"{table.name}.{column.name}: text ✓"
    if isinstance(t, String):
        return f"{table.name}.{column.name}"[: t.length]
    raise AssertionError(f"{table.name}.{column.name}: no sample value for type {t!r}")


def insert_rows(url: str) -> Rows:
    """One row in every table as the database has it now, written with plain SQL (no model involved)."""
    engine = create_engine(url)
    try:
        meta = MetaData()
        meta.reflect(engine)
        rows: Rows = {}
        with engine.begin() as conn:
            for n, table in enumerate(meta.sorted_tables):
                if table.name == "alembic_version":
                    continue
                # Primary keys first: a self-reference (runs.parent_run_id) points at the row itself.
                row: dict[str, Any] = {}
                for c in table.primary_key.columns:
                    row[c.name] = 10 + n if isinstance(c.type, Integer) else f"w{n}@node-{table.name}"
                for k, c in enumerate(table.columns):
                    if c.name not in row:
                        row[c.name] = _value(table, c, k, row, rows)
                conn.execute(table.insert(), [row])
                rows[table.name] = [row]
        return rows
    finally:
        engine.dispose()


def _model_default(table: str, column: str) -> Any:
    """What a row made by the app has in a column it was not given: the model's scalar default, else None."""
    default = Base.metadata.tables[table].columns[column].default
    return default.arg if default is not None and default.is_scalar else None


def expected_at_head(rows: Rows, kept: dict[str, set[str]] | None = None) -> Rows:
    """`rows` as head should show them: columns added since read as the model's default; with `kept` (the
    schema a downgrade left), tables it dropped are gone and columns it dropped come back as defaults."""
    out: Rows = {}
    for table, table_rows in rows.items():
        if kept is not None and table not in kept:
            continue
        columns = Base.metadata.tables[table].columns.keys()
        out[table] = [
            {
                c: row[c] if c in row and (kept is None or c in kept[table]) else _model_default(table, c)
                for c in columns
            }
            for row in table_rows
        ]
    return out


def _get(client: TestClient, path: str) -> Any:
    r = client.get(API + path)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()


def _one(items: list[dict[str, Any]], key: str, value: Any, where: str) -> dict[str, Any]:
    found = [i for i in items if i[key] == value]
    assert len(found) == 1, f"{where}: no single item with {key}={value!r} in {items}"
    return found[0]


def _read(client: TestClient, table: str, row: dict[str, Any]) -> dict[str, Any]:
    """The row as the REST API shows it (list endpoints: they show the same fields as the get ones)."""
    if table == "datasets":
        return _one(_get(client, "/datasets"), "id", row["id"], "datasets")
    if table == "media_fetches":
        return _one(_get(client, "/datasets"), "id", row["dataset_id"], "datasets")["media_fetch"]
    if table == "runs":
        return _one(_get(client, "/runs"), "id", row["id"], "runs")
    if table == "run_parts":
        run = _one(_get(client, "/runs"), "id", row["run_id"], "runs")
        return _one(run["placement"], "node_rank", row["node_rank"], f"run {row['run_id']} placement")
    if table == "run_metrics":
        points = _get(client, f"/runs/{row['run_id']}/metrics?after_step=-1")
        return _one(points, "step", row["step"], f"run {row['run_id']} metrics")
    if table == "checkpoints":
        return _one(_get(client, f"/runs/{row['run_id']}/checkpoints"), "step", row["step"], "checkpoints")
    if table == "events":
        return _one(_get(client, f"/runs/{row['run_id']}/events"), "id", row["id"], "run events")
    if table == "deployments":
        return _one(_get(client, "/deployments"), "id", row["id"], "deployments")
    if table == "exports":
        return _one(_get(client, "/exports"), "id", row["id"], "exports")
    if table == "model_downloads":
        return _one(_get(client, "/models/downloads"), "id", row["id"], "model downloads")
    if table == "nodes":
        return _one(_get(client, "/nodes"), "name", row["name"], "nodes")
    if table == "evals":
        return _one(_get(client, "/evals"), "id", row["id"], "evals")
    if table == "eval_samples":
        page = _get(client, f"/evals/{row['eval_id']}/samples")
        return _one(page["items"], "sample_id", row["sample_id"], f"eval {row['eval_id']} samples")
    raise AssertionError(f"table {table} has no reader: say which REST endpoint shows its rows")


def _same(shown: Any, stored: Any) -> bool:
    if isinstance(stored, datetime):
        return shown is not None and datetime.fromisoformat(shown) == stored
    return shown == stored


def assert_api_shows(settings: Settings, expected: Rows) -> None:
    """Every expected row is found through the REST API, with every column the API shows equal to it."""
    from studio.app import create_app

    dispose_engines()  # the app's engine must see the schema as the migrations left it
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:
            for table, table_rows in expected.items():
                for row in table_rows:
                    shown = _read(client, table, row)
                    compared = [c for c in row if c in shown]
                    assert len(compared) >= 2, f"{table}: the API shows almost none of its columns: {shown}"
                    wrong = {c: (shown[c], row[c]) for c in compared if not _same(shown[c], row[c])}
                    assert not wrong, f"{table}: read back differently (shown, stored): {wrong}"
    finally:
        dispose_engines()


def assert_stored(url: str, expected: Rows) -> None:
    """Every table at head holds exactly the expected rows, every column equal (the API shows only some)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                got = [dict(r._mapping) for r in conn.execute(select(table).order_by(*table.primary_key))]
                assert got == expected.get(table.name, []), f"{table.name}: stored rows differ"
    finally:
        engine.dispose()


def _schema(url: str) -> dict[str, set[str]]:
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        return {t: {c["name"] for c in insp.get_columns(t)} for t in insp.get_table_names()}
    finally:
        engine.dispose()


def upgrade_with_rows(settings: Settings, start: str, migrations: Path = MIGRATIONS_DIR) -> Rows:
    """Build the database at `start`, fill every table, upgrade to head and read every row back, with SQL
    (every column) and through the API; then downgrade one step, upgrade again and check that every row
    kept what that step does not drop (SQL: the schema is head's again, so the API reads as it did)."""
    cfg = alembic_config(settings)
    cfg.set_main_option("script_location", str(migrations))
    settings.home.mkdir(parents=True, exist_ok=True)
    command.upgrade(cfg, start)
    rows = insert_rows(settings.database_url)
    command.upgrade(cfg, "head")
    expected = expected_at_head(rows)
    assert_stored(settings.database_url, expected)
    assert_api_shows(settings, expected)
    command.downgrade(cfg, "-1")
    kept = _schema(settings.database_url)
    command.upgrade(cfg, "head")
    assert_stored(settings.database_url, expected_at_head(rows, kept))
    return rows


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request, tmp_path) -> Settings:
    if request.param == "sqlite":
        return Settings(home=tmp_path / "home")
    return Settings(home=tmp_path / "home", database_url=request.getfixturevalue("pg_url"))


@pytest.mark.parametrize("start", REVISIONS)
def test_rows_of_every_revision_survive_upgrade_and_a_downgrade(db_settings, start):
    rows = upgrade_with_rows(db_settings, start)
    if start == REVISIONS[-1]:
        # the whole schema is covered: a new table gets a row (and needs a REST reader in _read)
        assert set(rows) == set(Base.metadata.tables)


def test_the_check_fails_on_a_not_null_column_added_without_a_default(db_settings, tmp_path):
    """0010 rewritten to add exports.deploy_on_success NOT NULL without its server default: an empty
    database still upgrades, one with an export at 0009 cannot, and the check fails naming the column."""
    broken = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, broken, ignore=shutil.ignore_patterns("__pycache__"))
    script = broken / "versions" / "0010_export_deploy_on_success.py"
    source = script.read_text()
    good = 'sa.Column("deploy_on_success", sa.Boolean(), server_default=sa.false(), nullable=False)'
    assert source.count(good) == 1
    script.write_text(source.replace(good, 'sa.Column("deploy_on_success", sa.Boolean(), nullable=False)'))

    cfg = alembic_config(db_settings)
    cfg.set_main_option("script_location", str(broken))
    db_settings.home.mkdir(parents=True)
    command.upgrade(cfg, "head")
    command.downgrade(cfg, "base")

    with pytest.raises(IntegrityError, match="deploy_on_success"):
        upgrade_with_rows(db_settings, "0009", migrations=broken)
