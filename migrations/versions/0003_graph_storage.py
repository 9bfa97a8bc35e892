"""Graphs are stored without weight data: storage columns, 64-bit sizes.

``size_bytes`` becomes BIGINT (the default upload limit is 2 GiB, past a 32-bit INTEGER). New columns:
``stored_bytes``, ``weights_stored``, ``stripped_weight_bytes``, ``structure_sha256``. Rows stored
before this revision kept their weights: they get ``weights_stored = true``, ``stored_bytes =
size_bytes``, ``stripped_weight_bytes = 0`` and no structure hash. The server defaults used to fill
them are dropped afterwards (the ORM sets every value).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the storage columns (old rows: weights kept) and widen ``size_bytes``."""
    with op.batch_alter_table("graphs") as batch:
        batch.alter_column("size_bytes", existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)
        batch.add_column(sa.Column("stored_bytes", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("weights_stored", sa.Boolean(), nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("stripped_weight_bytes", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("structure_sha256", sa.String(length=64), nullable=True))
    op.execute("UPDATE graphs SET stored_bytes = size_bytes")
    with op.batch_alter_table("graphs") as batch:
        for column in ("stored_bytes", "weights_stored", "stripped_weight_bytes"):
            batch.alter_column(column, server_default=None)


def downgrade() -> None:
    """Drop the storage columns; ``size_bytes`` back to INTEGER (fails on PostgreSQL for a row > 2 GiB)."""
    with op.batch_alter_table("graphs") as batch:
        batch.drop_column("structure_sha256")
        batch.drop_column("stripped_weight_bytes")
        batch.drop_column("weights_stored")
        batch.drop_column("stored_bytes")
        batch.alter_column("size_bytes", existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
