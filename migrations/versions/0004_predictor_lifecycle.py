"""Predictor lifecycle: version status (candidate / production / retired), retrain runs, lease locks.

``predictor_versions.active`` becomes ``status`` (an active row is ``production``, the others
``candidate``), with ``schema_version``, ``watermark_measurement_id`` and ``promoted_at``; a partial unique
index allows one ``production`` row. New tables ``retrain_runs`` and ``lease_locks``. Reversible: the
downgrade maps ``production`` back to ``active = true``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:15:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PRODUCTION = sa.text("status = 'production'")


def upgrade() -> None:
    """``active`` -> ``status`` plus the new columns, the one-production index, the two new tables."""
    with op.batch_alter_table("predictor_versions") as batch:
        batch.add_column(sa.Column("status", sa.String(length=16), nullable=False, server_default="candidate"))
        batch.add_column(sa.Column("schema_version", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("watermark_measurement_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE predictor_versions SET status = 'production' WHERE active")
    with op.batch_alter_table("predictor_versions") as batch:
        batch.alter_column("status", server_default=None)
        batch.alter_column("schema_version", server_default=None)
        batch.drop_column("active")
    op.create_index("uq_predictor_versions_production", "predictor_versions", ["status"], unique=True,
                    sqlite_where=_PRODUCTION, postgresql_where=_PRODUCTION)  # fmt: skip
    op.create_table(
        "retrain_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("trigger", sa.String(length=32), nullable=False),
        sa.Column("candidate_version", sa.String(length=64), nullable=True),
        sa.Column("production_version", sa.String(length=64), nullable=True),
        sa.Column("watermark_measurement_id", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("gate", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retrain_runs")),
    )
    op.create_index(op.f("ix_retrain_runs_status"), "retrain_runs", ["status"], unique=False)
    op.create_table(
        "lease_locks",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_lease_locks")),
    )


def downgrade() -> None:
    """Drop the new tables and columns; ``status = 'production'`` becomes ``active = true``."""
    op.drop_table("lease_locks")
    op.drop_index(op.f("ix_retrain_runs_status"), table_name="retrain_runs")
    op.drop_table("retrain_runs")
    op.drop_index("uq_predictor_versions_production", table_name="predictor_versions")
    with op.batch_alter_table("predictor_versions") as batch:
        batch.add_column(sa.Column("active", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute("UPDATE predictor_versions SET active = (status = 'production')")
    with op.batch_alter_table("predictor_versions") as batch:
        batch.alter_column("active", server_default=None)
        batch.drop_column("promoted_at")
        batch.drop_column("watermark_measurement_id")
        batch.drop_column("schema_version")
        batch.drop_column("status")
