"""runs.num_nodes and run_parts: a run gang-scheduled over several nodes, one part per node and attempt

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 19:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("num_nodes", sa.Integer(), server_default="1", nullable=False))
    op.create_table(
        "run_parts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("nproc", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("master", sa.String(length=300), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("claimed_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "attempt", "node_rank", name="uq_run_parts_attempt_rank"),
    )
    op.create_index(op.f("ix_run_parts_run_id"), "run_parts", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_run_parts_run_id"), table_name="run_parts")
    op.drop_table("run_parts")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("num_nodes")
