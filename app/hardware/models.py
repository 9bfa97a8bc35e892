"""ORM model of a hardware catalog entry (datasheet or custom)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class Hardware(Base):
    """One device. Built-in catalog entries are seeded from ``app/hardware/catalog.toml`` at startup
    (``builtin=True``); ``POST /v1/hardware`` adds custom ones. ``spec`` holds the full
    :class:`app.core.hardware.HardwareSpec` as JSON (units in the key names, sources included)."""

    __tablename__ = "hardware"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(16))
    builtin: Mapped[bool] = mapped_column(Boolean, default=False)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    peak_fp32_flops_per_s: Mapped[float] = mapped_column(Float)
    memory_bandwidth_bytes_per_s: Mapped[float] = mapped_column(Float)
    compute_units: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str | None] = mapped_column(String(32), nullable=True)  # API key id (app.auth), None: anonymous
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
