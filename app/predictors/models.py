"""ORM models of the retraining loop: one row per retrain run, and named lease locks (the worker's one-run
guarantee on SQLite; PostgreSQL uses an advisory lock). Versions themselves are
:class:`app.measurements.models.PredictorVersion`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class RetrainRun(Base):
    """One retraining run (``layercast retrain``, the worker, or ``POST /v1/predictors/retrain``).

    ``status``: ``requested`` (waiting for a worker), ``running``, ``promoted``, ``rejected`` or ``failed``.
    ``metrics`` holds ``{"candidate": {split: ...}, "production": {split: ...}}`` on the same splits and
    ``gate`` each comparison that decided (``reason`` says it in words). ``error`` is the failure of a
    ``failed`` run (production untouched).
    """

    __tablename__ = "retrain_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    trigger: Mapped[str] = mapped_column(String(32))  # cli | api | schedule | new_measurements
    candidate_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    production_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    watermark_measurement_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    gate: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    requested_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class LeaseLock(Base):
    """A named lock held by ``holder`` until ``expires_at`` (a crashed holder's lease simply expires)."""

    __tablename__ = "lease_locks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column()
