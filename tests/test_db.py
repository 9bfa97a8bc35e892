"""Database plumbing: SAVEPOINTs on SQLite must not commit the outer transaction."""

from __future__ import annotations

from sqlalchemy import func, select

from app.db import make_engine, make_sessionmaker
from app.graphs.models import StoredGraph
from app.migrate import upgrade


def _graph(gid: str) -> StoredGraph:
    return StoredGraph(id=gid, name=gid, source_format="json", size_bytes=1, content=b"{}", summary={})


def test_rollback_after_a_released_savepoint_undoes_everything(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    factory = make_sessionmaker(make_engine(sqlite_url))
    with factory() as session:
        with session.begin_nested():
            session.add(_graph("a" * 64))
        session.add(_graph("b" * 64))
        session.flush()
        session.rollback()
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(StoredGraph)) == 0
