"""Every query on the ``hardware`` table (STYLE.md §2). Flushes, never commits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from app.hardware.models import Hardware
from app.measurements.models import Measurement

#: Built once (its compiled cache key memoised on the object): the spec column alone, for every prediction. On
#: the table's columns, not the mapped attributes: a Core select, which the session runs without the ORM's compile
#: and loading stages (the same value; ~30 us less per read). No autoflush either: every change of a row here is
#: flushed at once (:meth:`HardwareRepository.add`, :meth:`HardwareRepository.flush`).
_HARDWARE = Hardware.__table__.c
_SPEC = select(_HARDWARE.spec).where(_HARDWARE.id == bindparam("hardware_id"))


class HardwareRepository:
    """Data access for :class:`app.hardware.models.Hardware` rows, bound to one session."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, hardware_id: str) -> Hardware | None:
        """The row with primary key ``hardware_id``, or ``None``."""
        return self.session.get(Hardware, hardware_id)

    def spec(self, hardware_id: str) -> dict[str, Any] | None:
        """The stored spec (the ``spec`` JSON column) of ``hardware_id``, or ``None``: one column by primary key,
        without loading the row as an ORM object (half the time of :meth:`get`; nothing is kept in the
        session)."""
        return self.session.scalar(_SPEC, {"hardware_id": hardware_id})

    def get_many(self, hardware_ids: set[str]) -> Sequence[Hardware]:
        """The rows with these ids, in one query (they stay in the session, so a later :meth:`get` of one
        of them is answered without SQL); unknown ids are absent."""
        return self.session.scalars(select(Hardware).where(Hardware.id.in_(sorted(hardware_ids)))).all()

    def list(self, *, kind: str | None = None) -> Sequence[Hardware]:
        """All rows (of ``kind`` when given): built-in entries first, then custom ones, each by id."""
        stmt = select(Hardware).order_by(Hardware.builtin.desc(), Hardware.id)
        if kind is not None:
            stmt = stmt.where(Hardware.kind == kind)
        return self.session.scalars(stmt).all()

    def ids(self) -> set[str]:
        """Ids of all stored rows."""
        return set(self.session.scalars(select(Hardware.id)).all())

    def measurement_count(self, hardware_id: str) -> int:
        """Measurements stored for ``hardware_id``."""
        stmt = select(func.count()).select_from(Measurement).where(Measurement.hardware_id == hardware_id)
        return int(self.session.scalar(stmt) or 0)

    def delete(self, row: Hardware) -> None:
        """Delete ``row`` and flush."""
        self.session.delete(row)
        self.session.flush()

    def add(self, row: Hardware) -> Hardware:
        """Insert ``row`` and flush (raises ``sqlalchemy.exc.IntegrityError`` on a duplicate id)."""
        self.session.add(row)
        self.session.flush()
        return row

    def flush(self) -> None:
        """Send pending changes (updated rows) to the database."""
        self.session.flush()
