"""evals and eval_samples: evaluation jobs and their per-sample rows; runs.evaluate (evaluate after training)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    when = studio.models.UTCDateTime(timezone=True)
    op.create_table(
        "evals",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=1024), nullable=False),
        sa.Column("model_dir", sa.String(length=1024), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("after_run_id", sa.Integer(), nullable=True),
        sa.Column("role", sa.String(length=16), nullable=True),
        sa.Column("dataset_ids", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("output_dir", sa.String(length=1024), nullable=False),
        sa.Column("samples_total", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("results", sa.JSON(), nullable=True),
        sa.Column("created_at", when, nullable=False),
        sa.Column("dispatched_at", when, nullable=True),
        sa.Column("started_at", when, nullable=True),
        sa.Column("ended_at", when, nullable=True),
        sa.Column("heartbeat_at", when, nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["after_run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("after_run_id", "role", name="uq_evals_after_run_role"),
    )
    op.create_index("ix_evals_status", "evals", ["status"])
    op.create_index("ix_evals_after_run_id", "evals", ["after_run_id"])
    op.create_table(
        "eval_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("eval_id", sa.Integer(), nullable=False),
        sa.Column("sample_id", sa.String(length=512), nullable=False),
        sa.Column("dataset", sa.String(length=255), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("reference", sa.Text(), nullable=False),
        sa.Column("prediction", sa.Text(), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["eval_id"], ["evals.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("eval_id", "sample_id", name="uq_eval_samples_eval_sample"),
    )
    op.create_index("ix_eval_samples_eval_id", "eval_samples", ["eval_id"])
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("evaluate", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("evaluate")
    op.drop_index("ix_eval_samples_eval_id", table_name="eval_samples")
    op.drop_table("eval_samples")
    op.drop_index("ix_evals_after_run_id", table_name="evals")
    op.drop_index("ix_evals_status", table_name="evals")
    op.drop_table("evals")
