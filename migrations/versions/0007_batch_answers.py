"""Idempotent job actuals: ``measurement_batches.answer`` holds the whole answer of a
``POST /v1/job-estimates/actuals`` report sent with an ``Idempotency-Key`` (per-item predictions, ratios,
errors and calibration, which the stored ids alone cannot give back), so a retried report is answered from
it instead of stored twice. NULL for a ``POST /v1/measurements`` batch, answered from its
``measurement_ids``. Reversible.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``measurement_batches.answer``."""
    with op.batch_alter_table("measurement_batches") as batch:
        batch.add_column(sa.Column("answer", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop it (the batches' keys, digests and ids are kept)."""
    with op.batch_alter_table("measurement_batches") as batch:
        batch.drop_column("answer")
