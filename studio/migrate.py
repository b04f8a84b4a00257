"""Applying the Alembic migrations from code (`ernie-studio db upgrade`, `ernie-studio up`, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from studio.config import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = settings.database_url
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Bring the database at `settings.database_url` to `revision`."""
    settings.home.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(settings), revision)


def check(settings: Settings) -> None:
    """Raise if the models and the migrations disagree (alembic check)."""
    command.check(alembic_config(settings))
