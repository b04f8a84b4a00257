"""exports: deploy_on_success, deployed_at, deployment_id (export, then deploy, in one request)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 13:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import studio.models

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Exports made before these were never deployed by themselves.
    with op.batch_alter_table("exports") as batch:
        batch.add_column(
            sa.Column("deploy_on_success", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch.add_column(sa.Column("deployed_at", studio.models.UTCDateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("deployment_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            "fk_exports_deployment_id", "deployments", ["deployment_id"], ["id"], ondelete="SET NULL"
        )


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_constraint("fk_exports_deployment_id", type_="foreignkey")
        batch.drop_column("deployment_id")
        batch.drop_column("deployed_at")
        batch.drop_column("deploy_on_success")
