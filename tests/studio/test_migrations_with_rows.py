"""Rows written at every earlier revision survive the upgrade to head and read back through the REST API;
a downgrade of one step and the upgrade after it keep them too, and every downgrade to base keeps the rows of
the tables it keeps. On SQLite and PostgreSQL.

The database is walked up one revision at a time, and at each revision one more row goes into every table
there, written with plain SQL against the tables as they are then (reflected) with every column filled. So
each revision's rows take the path they would from a database built at that revision, and every migration
runs with rows present: one that cannot carry data (a NOT NULL column added without a server default, a
table rebuilt without its rows) fails here, while an empty database would upgrade fine.
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
    UniqueConstraint,
    create_engine,
    func,
    inspect,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.schema import Column

from studio.config import Settings
from studio.db import dispose_engines
from studio.migrate import MIGRATIONS_DIR, alembic_config
from studio.models import Base
from studio.services.runs import RunSpec

REVISIONS = [s.revision for s in reversed(list(ScriptDirectory(str(MIGRATIONS_DIR)).walk_revisions()))]
API = "/api/v1"
Rows = dict[str, list[dict[str, Any]]]
# Tables and the revision that made them (each gets one row per revision from there).
FIRST_REVISION = {"runs": "0001", "run_parts": "0012", "train_templates": "0013", "sweeps": "0014"}

# Values other code reads for their meaning: statuses, the gang-scheduled run's attempt and its parts, and
# every JSON column in the shape its API schema declares. A callable gets the rows written at this revision.
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
    # a saved Train form: the run spec as the API returns it (every field, so a lost or changed one shows)
    ("train_templates", "spec"): lambda rows: RunSpec(
        name="from-template",
        base_model="tiny",
        dataset_ids=[rows["datasets"][0]["id"]],
        stage="DPO",
        fine_tuning="LoRA",
        hyperparameters={"lora_rank": 16, "learning_rate": 0.0002},
    ).model_dump(mode="json"),
    # a sweep as POST /sweeps records it: the base run spec, the searched keys, engine.sweep.SweepSettings
    ("sweeps", "status"): "succeeded",
    ("sweeps", "spec"): lambda rows: RunSpec(
        base_model="tiny",
        dataset_ids=[rows["datasets"][0]["id"]],
        eval_dataset_ids=[rows["datasets"][0]["id"]],
    ).model_dump(mode="json"),
    ("sweeps", "parameters"): {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True}},
    ("sweeps", "settings"): {
        "objective": "eval_loss",
        "direction": "minimize",
        "n_trials": 4,
        "pruner": "median",
    },
    ("sweeps", "estimate"): {"n_trials": 4, "parallelism": 1, "steps": 40, "total_s": 12.5},
}


def _value(table: Table, column: Column, k: int, row: dict[str, Any], rows: Rows, i: int = 0) -> Any:
    """A value of the column's type (distinct per column, so swapped columns show), or its meaningful one;
    a unique text column's value is distinct per revision `i` too (each revision adds a row)."""
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
        unique = column.unique or any(
            isinstance(c, UniqueConstraint) and column.name in c.columns for c in table.constraints
        )
        return (f"{i}:" if unique else "") + f"{table.name}.{column.name}"[: t.length - 4]
    raise AssertionError(f"{table.name}.{column.name}: no sample value for type {t!r}")


def insert_rows(url: str, rows: Rows, i: int) -> None:
    """One more row (the `i`-th revision's) in every table as the database has it now, written with plain
    SQL (no model involved); appended to `rows` with the columns it was written with."""
    engine = create_engine(url)
    try:
        meta = MetaData()
        meta.reflect(engine)
        written: Rows = {}
        with engine.begin() as conn:
            for n, table in enumerate(meta.sorted_tables):
                if table.name == "alembic_version":
                    continue
                # Primary keys first: a self-reference (runs.parent_run_id) points at the row itself.
                row: dict[str, Any] = {}
                for c in table.primary_key.columns:
                    row[c.name] = (
                        1000 + 100 * i + n if isinstance(c.type, Integer) else f"train{i:02d}@node-{n}"
                    )
                for k, c in enumerate(table.columns):
                    if c.name not in row:
                        row[c.name] = _value(table, c, k, row, written, i)
                conn.execute(table.insert(), [row])
                written[table.name] = [row]
        for table, new in written.items():
            rows.setdefault(table, []).extend(new)
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


class ApiReader:
    """GETs through the app, each path once per reading (many rows come from one list)."""

    def __init__(self, client: TestClient) -> None:
        self.client, self.seen = client, {}

    def get(self, path: str) -> Any:
        if path not in self.seen:
            r = self.client.get(API + path)
            assert r.status_code == 200, (path, r.status_code, r.text)
            self.seen[path] = r.json()
        return self.seen[path]

    def one(self, path: str, key: str, value: Any, items: str | None = None) -> dict[str, Any]:
        got = self.get(path)
        found = [i for i in (got[items] if items else got) if i[key] == value]
        assert len(found) == 1, f"GET {path}: no single item with {key}={value!r}"
        return found[0]

    def row(self, table: str, row: dict[str, Any]) -> dict[str, Any]:
        """The row as the REST API shows it (list endpoints: they show the same fields as the get ones)."""
        lists = {
            "datasets": "/datasets",
            "runs": "/runs",
            "deployments": "/deployments",
            "exports": "/exports",
            "model_downloads": "/models/downloads",
            "nodes": "/nodes",
            "evals": "/evals",
            "train_templates": "/templates",
            "sweeps": "/sweeps",
        }
        if table in lists:
            key = "name" if table == "nodes" else "id"
            return self.one(lists[table], key, row[key])
        if table == "media_fetches":
            return self.one("/datasets", "id", row["dataset_id"])["media_fetch"]
        if table == "run_parts":
            placement = self.one("/runs", "id", row["run_id"])["placement"]
            found = [p for p in placement if p["node_rank"] == row["node_rank"]]
            assert len(found) == 1, f"run {row['run_id']}: no part {row['node_rank']} in {placement}"
            return found[0]
        run = row.get("run_id")
        if table == "run_metrics":
            return self.one(f"/runs/{run}/metrics?after_step=-1", "step", row["step"])
        if table == "checkpoints":
            return self.one(f"/runs/{run}/checkpoints", "step", row["step"])
        if table == "events":
            return self.one(f"/runs/{run}/events", "id", row["id"])
        if table == "eval_samples":
            return self.one(f"/evals/{row['eval_id']}/samples", "sample_id", row["sample_id"], items="items")
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
            api = ApiReader(client)
            for table, table_rows in expected.items():
                for row in table_rows:
                    shown = api.row(table, row)
                    compared = [c for c in row if c in shown]
                    assert len(compared) >= 2, f"{table}: the API shows almost none of its columns: {shown}"
                    wrong = {c: (shown[c], row[c]) for c in compared if not _same(shown[c], row[c])}
                    assert not wrong, f"{table} row {row}: read back differently (shown, stored): {wrong}"
    finally:
        dispose_engines()


def _by_key(table: Table, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: tuple(r[c.name] for c in table.primary_key))


def assert_stored(url: str, expected: Rows) -> None:
    """Every table at head holds exactly the expected rows, every column equal (the API shows only some)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                got = [dict(r._mapping) for r in conn.execute(select(table))]
                got, want = _by_key(table, got), _by_key(table, expected.get(table.name, []))
                differ = [
                    {c: (g.get(c), w.get(c)) for c in {*g, *w} if g.get(c) != w.get(c)}
                    for g, w in zip(got, want, strict=False)
                ]
                assert got == want, (
                    f"{table.name}: {len(got)} rows stored, {len(want)} expected; "
                    f"(stored, expected) by column: {[d for d in differ if d]}"
                )
    finally:
        engine.dispose()


def _schema(url: str) -> dict[str, set[str]]:
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        return {t: {c["name"] for c in insp.get_columns(t)} for t in insp.get_table_names()}
    finally:
        engine.dispose()


def _counts(url: str) -> dict[str, int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            names = [t for t in inspect(conn).get_table_names() if t != "alembic_version"]
            return {
                t: conn.execute(select(func.count()).select_from(Table(t, MetaData()))).scalar_one()
                for t in names
            }
    finally:
        engine.dispose()


def upgrade_with_rows(settings: Settings, migrations: Path = MIGRATIONS_DIR) -> Rows:
    """Walk the database up from empty, writing a row into every table at every revision; at head read every
    row back with SQL (every column) and through the API. Then downgrade one step, upgrade again and check
    every row kept what that step does not drop; then downgrade step by step to base, each step keeping the
    rows of the tables it keeps."""
    cfg = alembic_config(settings)
    cfg.set_main_option("script_location", str(migrations))
    settings.home.mkdir(parents=True, exist_ok=True)
    url = settings.database_url
    rows: Rows = {}
    for i, revision in enumerate(REVISIONS):
        command.upgrade(cfg, revision)
        insert_rows(url, rows, i)
    expected = expected_at_head(rows)
    assert_stored(url, expected)
    assert_api_shows(settings, expected)
    # The schema is head's again after this, so the API reads the rows as it did: SQL shows what was kept.
    command.downgrade(cfg, "-1")
    kept = _schema(url)
    command.upgrade(cfg, "head")
    assert_stored(url, expected_at_head(rows, kept))
    for revision in [*reversed(REVISIONS[:-1]), "base"]:
        before = _counts(url)
        command.downgrade(cfg, revision)
        after = _counts(url)
        lost = {t: (before[t], n) for t, n in after.items() if n != before[t]}
        assert not lost, f"downgrade to {revision} lost rows (before, after): {lost}"
    return rows


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request, tmp_path) -> Settings:
    if request.param == "sqlite":
        return Settings(home=tmp_path / "home")
    return Settings(home=tmp_path / "home", database_url=request.getfixturevalue("pg_url"))


def test_rows_of_every_revision_survive_upgrade_and_downgrades(db_settings):
    rows = upgrade_with_rows(db_settings)
    # every table got a row at every revision that has it, and the API read them all
    assert set(rows) == set(Base.metadata.tables)
    since = {table: len(REVISIONS) - REVISIONS.index(rev) for table, rev in FIRST_REVISION.items()}
    assert {table: len(rows[table]) for table in since} == since


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
        upgrade_with_rows(db_settings, migrations=broken)
