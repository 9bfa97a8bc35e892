"""SQL for stored graphs (every select lives here)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from app.graphs.models import StoredGraph

#: Built once: a statement object memoises its cache key, so every prediction's existence check skips building,
#: coercing and keying the statement again (with :meth:`HardwareRepository.spec`, a prediction's two reads took
#: 0.40 ms instead of 0.69-0.83 ms in a loop of 1,000 on SQLite: benchmarks/README.md). On the table's columns,
#: not the mapped attributes: a Core select, which the session runs without the ORM's compile and loading
#: stages (the same value; ~30 us less per read). No autoflush either: this session never leaves a graph
#: row unflushed (:meth:`GraphRepository.add` flushes).
_GRAPHS = StoredGraph.__table__.c
_EXISTS = select(_GRAPHS.id).where(_GRAPHS.id == bindparam("graph_id"))


class GraphRepository:
    """Data access for :class:`StoredGraph` rows."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, graph_id: str) -> StoredGraph | None:
        return self.session.get(StoredGraph, graph_id)

    def exists(self, graph_id: str) -> bool:
        """Whether a row ``graph_id`` is stored: answered from the primary-key index alone. (Reading any other
        column costs a walk over the row's ``content`` overflow pages in SQLite, since the columns added by
        later migrations sit after it: ~0.7 ms for a stripped ResNet-50.)"""
        return self.session.scalar(_EXISTS, {"graph_id": graph_id}) is not None

    def list(self, *, limit: int = 100, offset: int = 0) -> Sequence[StoredGraph]:
        """Rows newest first; ties of ``created_at`` by id, so that an order is total and pages do not overlap."""
        stmt = (select(StoredGraph).order_by(StoredGraph.created_at.desc(), StoredGraph.id)
                .limit(limit).offset(offset))  # fmt: skip
        return self.session.scalars(stmt).all()

    def count(self) -> int:
        return int(self.session.scalar(select(func.count()).select_from(StoredGraph)) or 0)

    def delete(self, graph: StoredGraph) -> None:
        self.session.delete(graph)
        self.session.flush()

    def add(self, graph: StoredGraph) -> StoredGraph:
        self.session.add(graph)
        self.session.flush()
        return graph
