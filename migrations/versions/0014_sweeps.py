"""sweeps: hyperparameter searches (issue 33); runs.sweep_id / sweep_trial tag a run as a sweep's trial

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 12:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("parallelism", sa.Integer(), nullable=False),
        sa.Column("study_name", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("stop_reason", sa.String(length=64), nullable=True),
        sa.Column("estimate", sa.JSON(), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("ended_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("study_name"),
    )
    with op.batch_alter_table("sweeps") as batch:
        batch.create_index("ix_sweeps_status", ["status"], unique=False)
    # Runs made before are nobody's trials (both columns null).
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("sweep_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("sweep_trial", sa.Integer(), nullable=True))
        batch.create_index("ix_runs_sweep_id", ["sweep_id"], unique=False)
        batch.create_unique_constraint("uq_runs_sweep_trial", ["sweep_id", "sweep_trial"])
        batch.create_foreign_key("fk_runs_sweep_id", "sweeps", ["sweep_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("fk_runs_sweep_id", type_="foreignkey")
        batch.drop_constraint("uq_runs_sweep_trial", type_="unique")
        batch.drop_index("ix_runs_sweep_id")
        batch.drop_column("sweep_trial")
        batch.drop_column("sweep_id")
    with op.batch_alter_table("sweeps") as batch:
        batch.drop_index("ix_sweeps_status")
    op.drop_table("sweeps")
