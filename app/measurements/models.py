"""ORM models of measured layer timings, ingested batches and predictor versions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class Measurement(Base):
    """One measured layer (or whole-iteration) time with its context.

    ``config`` holds the layer description (op type, shapes, attributes) as JSON; ``context`` holds the
    conditions of the measurement (framework and version, driver, threads, clocks, date, source file).
    ``software_stack`` and ``granularity`` (:mod:`app.core.vocab`) say which fixed overheads the time holds.
    """

    __tablename__ = "measurements"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hardware_id: Mapped[str] = mapped_column(ForeignKey("hardware.id", ondelete="RESTRICT"), index=True)
    source: Mapped[str] = mapped_column(String(64), index=True)  # e.g. "justus2018", "profiler"
    op_kind: Mapped[str] = mapped_column(String(32), index=True)
    pass_: Mapped[str] = mapped_column("pass", String(16))  # forward | backward | update | train_step
    optimizer: Mapped[str] = mapped_column(String(16), default="none")
    precision: Mapped[str] = mapped_column(String(16), default="fp32")
    # app.core.vocab.SoftwareStack / Granularity; NULL only for reported rows stored before revision 0002
    software_stack: Mapped[str | None] = mapped_column(String(32), nullable=True)
    granularity: Mapped[str | None] = mapped_column(String(16), nullable=True)
    batch_size: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    time_ms_median: Mapped[float] = mapped_column(Float)
    time_ms_std: Mapped[float | None] = mapped_column(Float, nullable=True)
    repetitions: Mapped[int | None] = mapped_column(Integer, nullable=True)
    context: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    measured_at: Mapped[datetime | None] = mapped_column(nullable=True, index=True)
    # the API key that reported it (app.auth); None for imports, anonymous reports and older rows
    submitter: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MeasurementBatch(Base):
    """One ingested batch of ``POST /v1/measurements`` or report of ``POST /v1/job-estimates/actuals`` sent
    with an ``Idempotency-Key``; ``idempotency_key`` holds :func:`app.measurements.service.stored_key` of it (the
    caller's key scoped to its API key id; one namespace for both routes).

    ``request_sha256`` is the SHA-256 of the body's canonical JSON (:func:`app.measurements.service.batch_sha256`)
    and ``measurement_ids`` the ids it stored, in batch order: a retry with the same key and body is answered
    from this row (nothing stored again), the same key with another body is refused. ``answer``: the whole
    answer of an actuals report (its items carry predictions and errors the ids alone do not give back); None
    for a measurement batch, answered from its ids.
    """

    __tablename__ = "measurement_batches"

    idempotency_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_sha256: Mapped[str] = mapped_column(String(64))
    measurement_ids: Mapped[list[int]] = mapped_column(JSON)
    answer: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class PredictorVersion(Base):
    """A registered predictor artifact (:mod:`app.predictors`).

    ``artifact_path`` is the ONNX file relative to the artifact store, ``sha256`` its checksum (verified on
    every load); ``metadata_`` is an :class:`app.predictor.metadata.ArtifactMetadata` as JSON. ``status``
    is ``candidate``, ``production`` or ``retired``; at most one row is ``production`` (a partial unique
    index). ``promoted_at`` is set each time the row becomes production (rollback picks the latest other).
    """

    __tablename__ = "predictor_versions"
    __table_args__ = (
        Index("uq_predictor_versions_production", "status", unique=True,
              sqlite_where=text("status = 'production'"), postgresql_where=text("status = 'production'")),
    )

    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    artifact_path: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str] = mapped_column(String(64))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    status: Mapped[str] = mapped_column(String(16), default="candidate")
    schema_version: Mapped[int] = mapped_column(Integer, default=1)
    watermark_measurement_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    promoted_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
