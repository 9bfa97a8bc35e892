"""Measurement ingestion: ``measurement_batches`` (one row per ``Idempotency-Key``: the SHA-256 of the batch
and the ids it stored, so a retried batch is answered from it instead of stored twice) and an index on
``measurements.measured_at`` (the time-window filter of ``GET /v1/measurements``). Reversible.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``measurement_batches`` and ``ix_measurements_measured_at``."""
    op.create_table(
        "measurement_batches",
        sa.Column("idempotency_key", sa.String(length=255), nullable=False),
        sa.Column("request_sha256", sa.String(length=64), nullable=False),
        sa.Column("measurement_ids", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("idempotency_key", name=op.f("pk_measurement_batches")),
    )
    op.create_index(op.f("ix_measurements_measured_at"), "measurements", ["measured_at"], unique=False)


def downgrade() -> None:
    """Drop them (stored measurements are kept)."""
    op.drop_index(op.f("ix_measurements_measured_at"), table_name="measurements")
    op.drop_table("measurement_batches")
