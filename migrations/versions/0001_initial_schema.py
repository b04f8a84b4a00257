"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-21 08:41:57.025593
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_records", sa.Integer(), nullable=False),
        sa.Column("num_valid", sa.Integer(), nullable=False),
        sa.Column("problems", sa.JSON(), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=True),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("fine_tuning", sa.String(length=16), nullable=False),
        sa.Column("base_model", sa.String(length=1024), nullable=False),
        sa.Column("dataset_ids", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("queue", sa.String(length=128), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("task_id", sa.String(length=64), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("resume_from", sa.String(length=1024), nullable=True),
        sa.Column("parent_run_id", sa.Integer(), nullable=True),
        sa.Column("output_dir", sa.String(length=1024), nullable=False),
        sa.Column("model_dir", sa.String(length=1024), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("final_metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("queued_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("ended_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["parent_run_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)
        batch_op.create_index("ix_runs_status_queue", ["status", "queue"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_step"),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoints_run_id"), ["run_id"], unique=False)

    op.create_table(
        "deployments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("model_dir", sa.String(length=1024), nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("stop_requested", sa.Boolean(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("port", sa.Integer(), nullable=True),
        sa.Column("url", sa.String(length=512), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("started_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("stopped_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", studio.models.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_deployments_status"), ["status"], unique=False)

    op.create_table(
        "run_metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("learning_rate", sa.Float(), nullable=True),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("recorded_at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "step", name="uq_run_metrics_run_step"),
    )
    with op.batch_alter_table("run_metrics", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_metrics_run_id"), ["run_id"], unique=False)

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", studio.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("deployment_id", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_deployment_id"), ["deployment_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_run_id"))
        batch_op.drop_index(batch_op.f("ix_events_deployment_id"))
        batch_op.drop_index(batch_op.f("ix_events_at"))

    op.drop_table("events")
    with op.batch_alter_table("run_metrics", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_metrics_run_id"))

    op.drop_table("run_metrics")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_deployments_status"))

    op.drop_table("deployments")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_run_id"))

    op.drop_table("checkpoints")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_status_queue")
        batch_op.drop_index(batch_op.f("ix_runs_status"))

    op.drop_table("runs")
    op.drop_table("datasets")
