"""Initial schema: hardware, graphs, measurements, predictor versions.

Generated with ``alembic revision --autogenerate`` against an empty SQLite database, then reviewed by
hand. Constraint and index names come from the naming convention of :data:`app.db.NAMING_CONVENTION`
(``op.f()`` marks them as final), so SQLite and PostgreSQL get the same names.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:56:50+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the four tables and their indexes."""
    op.create_table(
        "hardware",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("builtin", sa.Boolean(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("peak_fp32_flops_per_s", sa.Float(), nullable=False),
        sa.Column("memory_bandwidth_bytes_per_s", sa.Float(), nullable=False),
        sa.Column("compute_units", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hardware")),
    )
    op.create_table(
        "graphs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source_format", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_graphs")),
    )
    op.create_table(
        "predictor_versions",
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("artifact_path", sa.String(length=500), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_predictor_versions")),
    )
    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("hardware_id", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("op_kind", sa.String(length=32), nullable=False),
        sa.Column("pass", sa.String(length=16), nullable=False),
        sa.Column("optimizer", sa.String(length=16), nullable=False),
        sa.Column("precision", sa.String(length=8), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("time_ms_median", sa.Float(), nullable=False),
        sa.Column("time_ms_std", sa.Float(), nullable=True),
        sa.Column("repetitions", sa.Integer(), nullable=True),
        sa.Column("context", sa.JSON(), nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["hardware_id"],
            ["hardware.id"],
            name=op.f("fk_measurements_hardware_id_hardware"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_measurements")),
    )
    op.create_index(op.f("ix_measurements_hardware_id"), "measurements", ["hardware_id"], unique=False)
    op.create_index(op.f("ix_measurements_op_kind"), "measurements", ["op_kind"], unique=False)
    op.create_index(op.f("ix_measurements_source"), "measurements", ["source"], unique=False)


def downgrade() -> None:
    """Drop everything :func:`upgrade` created, dependents first."""
    op.drop_index(op.f("ix_measurements_source"), table_name="measurements")
    op.drop_index(op.f("ix_measurements_op_kind"), table_name="measurements")
    op.drop_index(op.f("ix_measurements_hardware_id"), table_name="measurements")
    op.drop_table("measurements")
    op.drop_table("predictor_versions")
    op.drop_table("graphs")
    op.drop_table("hardware")
