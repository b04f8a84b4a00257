"""exports: elastic_member and gpas_gates

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Exports made before these wrote the whole model; no model had GPAS gates then.
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("elastic_member", sa.String(length=32), server_default="", nullable=False))
        batch.add_column(sa.Column("gpas_gates", sa.String(length=16), server_default="keep", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_column("gpas_gates")
        batch.drop_column("elastic_member")
