"""exports

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 09:25:26.992330
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "exports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layout", sa.String(length=16), nullable=False),
        sa.Column("quantization", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("export_dir", sa.String(length=1024), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("perplexity", sa.JSON(), nullable=True),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("ended_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("exports", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_exports_run_id"), ["run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_exports_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("exports", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_exports_status"))
        batch_op.drop_index(batch_op.f("ix_exports_run_id"))

    op.drop_table("exports")
