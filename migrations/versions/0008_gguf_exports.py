"""exports: GGUF (export_format, gguf_types, and each GGUF file's size and perplexity)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Exports made before GGUF were all checkpoint directories.
    with op.batch_alter_table("exports") as batch:
        batch.add_column(
            sa.Column("export_format", sa.String(length=16), server_default="safetensors", nullable=False)
        )
        batch.add_column(sa.Column("gguf_types", sa.String(length=64), server_default="", nullable=False))
        batch.add_column(sa.Column("gguf_files", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_column("gguf_files")
        batch.drop_column("gguf_types")
        batch.drop_column("export_format")
