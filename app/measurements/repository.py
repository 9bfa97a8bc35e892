"""Every query on the ``measurements`` and ``measurement_batches`` tables (STYLE.md §2). Flushes, never commits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.vocab import Granularity
from app.hardware.models import Hardware
from app.measurements.models import Measurement, MeasurementBatch


@dataclass(frozen=True, slots=True)
class MeasurementFilter:
    """Filters of a measurement listing; None matches everything. ``measured_from`` (inclusive) and
    ``measured_to`` (exclusive) bound ``measured_at`` (rows without one never match a window)."""

    hardware_id: str | None = None
    source: str | None = None
    op_kind: str | None = None
    precision: str | None = None
    pass_: str | None = None
    granularity: str | None = None
    measured_from: datetime | None = None
    measured_to: datetime | None = None


class MeasurementRepository:
    """Data access for :class:`app.measurements.models.Measurement` rows, bound to one session."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, row: Measurement) -> Measurement:
        """Insert ``row`` and flush (its ``id`` and defaults are set afterwards)."""
        self.session.add(row)
        self.session.flush()
        return row

    def bulk_insert(self, rows: Sequence[dict[str, Any]]) -> int:
        """Insert ``rows`` (dicts keyed by ORM attribute names, e.g. ``pass_``) in one executemany.

        Column defaults (``created_at``) are applied. Returns the number of rows sent.
        """
        if rows:
            self.session.execute(insert(Measurement), list(rows))
        return len(rows)

    def delete_source_file(self, *, source: str, source_file: str) -> int:
        """Delete the rows of ``source`` whose ``context["source_file"]`` is ``source_file``; returns how many.

        The JSON lookup is portable (SQLite ``json_extract``, PostgreSQL ``->>``); ``source`` is indexed.
        """
        stmt = delete(Measurement).where(
            Measurement.source == source,
            Measurement.context["source_file"].as_string() == source_file,
        )
        result = self.session.execute(stmt, execution_options={"synchronize_session": False})
        return int(getattr(result, "rowcount", 0) or 0)

    def hardware_ids(self) -> set[str]:
        """Ids of all stored hardware rows (measurements reference them)."""
        return set(self.session.scalars(select(Hardware.id)).all())

    def hardware_exists(self, hardware_id: str) -> bool:
        """Whether a hardware row with this id is stored."""
        return self.session.get(Hardware, hardware_id) is not None

    def job_actuals(self, *, hardware_ids: Sequence[str] | None = None, source: str | None = None,
                    after_id: int | None = None, up_to_id: int | None = None) -> Sequence[Measurement]:  # fmt: skip
        """Recorded whole-job measurements (``granularity`` ``job``), by ascending id: on the given devices, of
        ``source``, with ids in (``after_id``, ``up_to_id``] (None: no bound)."""
        stmt = select(Measurement).where(Measurement.granularity == Granularity.JOB.value)
        if hardware_ids is not None:
            stmt = stmt.where(Measurement.hardware_id.in_(list(hardware_ids)))
        if source is not None:
            stmt = stmt.where(Measurement.source == source)
        if after_id is not None:
            stmt = stmt.where(Measurement.id > after_id)
        if up_to_id is not None:
            stmt = stmt.where(Measurement.id <= up_to_id)
        return self.session.scalars(stmt.order_by(Measurement.id)).all()

    def insert_returning_ids(self, rows: Sequence[dict[str, Any]]) -> list[int]:
        """Insert ``rows`` (dicts keyed by ORM attribute names) in batched multi-row INSERTs and return their
        new ids in the order of ``rows`` (``RETURNING``, sorted by parameter order; column defaults applied)."""
        if not rows:
            return []
        stmt = insert(Measurement).returning(Measurement.id, sort_by_parameter_order=True)
        return [int(i) for i in self.session.scalars(stmt, list(rows)).all()]

    def batch(self, idempotency_key: str) -> MeasurementBatch | None:
        """The batch stored under ``idempotency_key``, or None."""
        return self.session.get(MeasurementBatch, idempotency_key)

    def add_batch(self, row: MeasurementBatch) -> bool:
        """Insert ``row`` in a savepoint; False (nothing inserted, the session still usable) when a batch with
        its key was committed meanwhile by another request (primary-key conflict)."""
        try:
            with self.session.begin_nested():
                self.session.add(row)
                self.session.flush()
        except IntegrityError:
            return False
        return True

    @staticmethod
    def _filtered(stmt: Select[Any], f: MeasurementFilter) -> Select[Any]:
        m = Measurement
        for column, value in ((m.hardware_id, f.hardware_id), (m.source, f.source), (m.op_kind, f.op_kind),
                              (m.precision, f.precision), (m.pass_, f.pass_), (m.granularity, f.granularity)):
            if value is not None:
                stmt = stmt.where(column == value)
        if f.measured_from is not None:
            stmt = stmt.where(m.measured_at >= f.measured_from)
        if f.measured_to is not None:
            stmt = stmt.where(m.measured_at < f.measured_to)
        return stmt

    def list(self, f: MeasurementFilter, *, limit: int = 100, offset: int = 0,
             after_id: int | None = None) -> Sequence[Measurement]:  # fmt: skip
        """One page of rows matching ``f``, by ascending id: ids above ``after_id`` (a cursor) or from
        ``offset``."""
        stmt = self._filtered(select(Measurement), f)
        if after_id is not None:
            stmt = stmt.where(Measurement.id > after_id)
        return self.session.scalars(stmt.order_by(Measurement.id).limit(limit).offset(offset)).all()

    def count(self, f: MeasurementFilter) -> int:
        """Number of rows matching ``f``."""
        return int(self.session.scalar(self._filtered(select(func.count()).select_from(Measurement), f)) or 0)

    def count_by_source(self) -> dict[str, int]:
        """Stored rows per ``source`` (``justus2018``, ``reported``...), for the ``/metrics`` gauge."""
        stmt = select(Measurement.source, func.count()).group_by(Measurement.source)
        return {str(source): int(n) for source, n in self.session.execute(stmt).all()}
