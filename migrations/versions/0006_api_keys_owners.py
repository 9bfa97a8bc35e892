"""Access control: the ``api_keys`` table (hashed keys with scopes) and who created each graph, custom
hardware entry and reported measurement (``graphs.owner``, ``hardware.owner``, ``measurements.submitter``:
the id of the API key, ``admin`` for the bootstrap ``LAYERCAST_ADMIN_KEY``, NULL for anonymous or rows
stored before this revision). Reversible.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``api_keys``; add the owner/submitter columns."""
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("key_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    with op.batch_alter_table("graphs") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=32), nullable=True))
    with op.batch_alter_table("hardware") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=32), nullable=True))
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("submitter", sa.String(length=32), nullable=True))


def downgrade() -> None:
    """Drop the owner/submitter columns and ``api_keys``."""
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("submitter")
    with op.batch_alter_table("hardware") as batch:
        batch.drop_column("owner")
    with op.batch_alter_table("graphs") as batch:
        batch.drop_column("owner")
    op.drop_table("api_keys")
