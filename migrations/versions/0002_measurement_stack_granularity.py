"""Measurements record their software stack and granularity; precision names up to 16 characters.

``software_stack`` (:class:`app.core.vocab.SoftwareStack`) and ``granularity``
(:class:`app.core.vocab.Granularity`) decide which fixed overheads a measured time contains (a TF1
session iteration, a PyTorch eager op between CUDA events, a bare cuDNN kernel). Rows stored before this
revision get the values their import source implies (``justus2018``: TF1 session layers; ``deepbench``:
library kernels; ``profiler``: PyTorch eager layers); reported rows of other sources keep NULL, which the
training loader refuses to guess. ``precision`` widens to 16 characters for ``fp32-strict``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:10:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: import source -> (software_stack, granularity) of the rows it stored before this revision
_BACKFILL = {
    "justus2018": ("tf1-session", "layer"),
    "deepbench": ("cuda-library", "kernel"),
    "profiler": ("pytorch-eager", "layer"),
}


def upgrade() -> None:
    """Add the two columns, backfill them for the import sources, widen ``precision``."""
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("software_stack", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("granularity", sa.String(length=16), nullable=True))
        batch.alter_column("precision", existing_type=sa.String(length=8), type_=sa.String(length=16),
                           existing_nullable=False)
    table = sa.table("measurements", sa.column("source", sa.String), sa.column("software_stack", sa.String),
                     sa.column("granularity", sa.String))
    for source, (stack, granularity) in _BACKFILL.items():
        op.execute(table.update().where(table.c.source == source)
                   .values(software_stack=stack, granularity=granularity))


def downgrade() -> None:
    """Drop the two columns and narrow ``precision`` back (values longer than 8 characters must be gone)."""
    with op.batch_alter_table("measurements") as batch:
        batch.alter_column("precision", existing_type=sa.String(length=16), type_=sa.String(length=8),
                           existing_nullable=False)
        batch.drop_column("granularity")
        batch.drop_column("software_stack")
