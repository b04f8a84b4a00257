"""media_fetches: a dataset's images named by URL are fetched by a worker job, not by the upload request

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 19:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "media_fetches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("urls_done", sa.Integer(), nullable=False),
        sa.Column("urls_total", sa.Integer(), nullable=False),
        sa.Column("bytes_done", sa.BigInteger(), nullable=False),
        sa.Column("failed", sa.JSON(), nullable=True),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("ended_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_media_fetches_dataset_id"), "media_fetches", ["dataset_id"], unique=False)
    op.create_index(op.f("ix_media_fetches_status"), "media_fetches", ["status"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_media_fetches_status"), table_name="media_fetches")
    op.drop_index(op.f("ix_media_fetches_dataset_id"), table_name="media_fetches")
    op.drop_table("media_fetches")
