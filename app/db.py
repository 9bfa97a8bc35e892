"""SQLAlchemy 2 base, engine and session plumbing.

Conventions (STYLE.md §8): a constraint naming convention so Alembic migrations are deterministic on
SQLite and PostgreSQL alike; timezone-aware ``*_at`` columns (:class:`UTCDateTime`: SQLite has no time
zone type and returns naive values, so every value is stored as UTC and read back as aware UTC);
nothing is created at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, MetaData, create_engine, event
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that always round-trips as an aware UTC datetime.

    Writes: an aware value is converted to UTC; a naive one is taken to be UTC already (every timestamp
    this service writes is UTC: :func:`utcnow`, the profiler's ISO 8601 ``measured_at``). Reads: a
    naive value (SQLite stores the text without an offset) is UTC by construction and gets
    ``tzinfo=UTC``; an aware one (PostgreSQL ``timestamptz``) is converted to UTC. The DDL is
    the plain ``DateTime(timezone=True)`` column, so no migration is involved.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base of every ORM model; carries the naming convention. Every ``datetime`` column
    is a :class:`UTCDateTime`."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}


def utcnow() -> datetime:
    """Current time, timezone-aware UTC."""
    return datetime.now(UTC)


def make_engine(url: str) -> Engine:
    """Engine for ``url``; SQLite gets foreign keys switched on and a busy timeout."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            # pysqlite's own transaction handling breaks SAVEPOINTs (releasing one commits the outer
            # transaction); hand transaction control to SQLAlchemy, as its SQLite dialect docs advise.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):  # pragma: no cover - trivial
            conn.exec_driver_sql("BEGIN")

        return engine
    return create_engine(url, pool_pre_ping=True)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory bound to ``engine`` (objects stay usable after commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """Yield a session that commits on success and rolls back on any error (STYLE.md §3)."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
