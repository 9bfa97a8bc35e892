"""Every query on the ``measurements`` table (STYLE.md §2). Flushes, never commits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, delete, func, insert, select
from sqlalchemy.orm import Session

from app.core.vocab import Granularity
from app.hardware.models import Hardware
from app.measurements.models import Measurement


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

    def job_actuals(self, *, hardware_ids: Sequence[str]) -> Sequence[Measurement]:
        """Recorded whole-job measurements (``granularity`` ``job``) on the given devices, by ascending id."""
        stmt = select(Measurement).where(
            Measurement.granularity == Granularity.JOB.value, Measurement.hardware_id.in_(list(hardware_ids))
        )
        return self.session.scalars(stmt.order_by(Measurement.id)).all()

    @staticmethod
    def _filtered(
        stmt: Select[Any], *, hardware_id: str | None, source: str | None, op_kind: str | None
    ) -> Select[Any]:
        if hardware_id is not None:
            stmt = stmt.where(Measurement.hardware_id == hardware_id)
        if source is not None:
            stmt = stmt.where(Measurement.source == source)
        if op_kind is not None:
            stmt = stmt.where(Measurement.op_kind == op_kind)
        return stmt

    def list(
        self,
        *,
        hardware_id: str | None = None,
        source: str | None = None,
        op_kind: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> Sequence[Measurement]:
        """One page of rows matching every given filter, by ascending id."""
        stmt = self._filtered(select(Measurement), hardware_id=hardware_id, source=source, op_kind=op_kind)
        return self.session.scalars(stmt.order_by(Measurement.id).limit(limit).offset(offset)).all()

    def count(self, *, hardware_id: str | None = None, source: str | None = None, op_kind: str | None = None) -> int:
        """Number of rows matching every given filter."""
        stmt = self._filtered(
            select(func.count()).select_from(Measurement), hardware_id=hardware_id, source=source, op_kind=op_kind
        )
        return int(self.session.scalar(stmt) or 0)

    def count_by_source(self) -> dict[str, int]:
        """Stored rows per ``source`` (``justus2018``, ``reported``...), for the ``/metrics`` gauge."""
        stmt = select(Measurement.source, func.count()).group_by(Measurement.source)
        return {str(source): int(n) for source, n in self.session.execute(stmt).all()}
