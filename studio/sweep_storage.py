"""Optuna's storage of the studio's sweeps: its RDB storage on the studio's own database (SQLite or
PostgreSQL), so a study lives as long as the sweep's rows and survives any restart.

Optuna's tables sit beside the studio's. Two things keep them apart: the studio's Alembic environment leaves
OPTUNA_TABLES out of autogenerate (migrations/env.py), and Optuna's own schema check is skipped because it
reads the `alembic_version` table, which holds the studio's revision here. In its place `optuna_storage`
compares Optuna's recorded schema version (its `version_info` table) with the installed Optuna's and says
what to do when they differ.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from studio.config import Settings

if TYPE_CHECKING:
    from optuna.storages import RDBStorage

# Optuna 5's tables (optuna.storages._rdb.models); tests/studio/test_sweeps_storage.py holds them equal.
OPTUNA_TABLES = frozenset(
    {
        "studies",
        "study_directions",
        "study_system_attributes",
        "study_user_attributes",
        "trial_heartbeats",
        "trial_intermediate_values",
        "trial_params",
        "trial_system_attributes",
        "trial_user_attributes",
        "trial_values",
        "trials",
        "version_info",
    }
)

_storages: dict[str, RDBStorage] = {}
_lock = threading.Lock()


class OptunaSchemaMismatch(RuntimeError):
    pass


def optuna_storage(settings: Settings) -> RDBStorage:
    """One RDBStorage per database URL per process (its tables are created on first use)."""
    url = settings.database_url
    with _lock:
        storage = _storages.get(url)
        if storage is None:
            storage = _create(settings)
            _storages[url] = storage
        return storage


def _create(settings: Settings) -> RDBStorage:
    import optuna
    from optuna.storages._rdb import models

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = settings.database_url
    if url.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
        kwargs = {"connect_args": {"timeout": 30}}
    else:
        kwargs = {"pool_pre_ping": True}
    storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=True)
    with storage.engine.connect() as conn:
        recorded = conn.execute(models.VersionInfoModel.__table__.select()).first()
    if recorded is not None and recorded.schema_version != models.SCHEMA_VERSION:
        raise OptunaSchemaMismatch(
            f"the sweeps' Optuna tables have schema {recorded.schema_version} (written by Optuna "
            f"{recorded.library_version}); the installed Optuna {optuna.__version__} needs "
            f"{models.SCHEMA_VERSION}: install the Optuna version of uv.lock"
        )
    return storage


def dispose_storages() -> None:
    with _lock:
        for storage in _storages.values():
            storage.engine.dispose()
        _storages.clear()
