"""SQLAlchemy 2 base, engine and session plumbing.

Conventions (STYLE.md §8): a constraint naming convention so Alembic migrations are deterministic on
SQLite and PostgreSQL alike; timezone-aware ``*_at`` columns (:class:`UTCDateTime`: SQLite has no time
zone type and returns naive values, so every value is stored as UTC and read back as aware UTC);
nothing is created at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, MetaData, create_engine, event
from sqlalchemy import exc as sa_exc
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


#: Whether transactions begun in this context may write (SQLite only: ``BEGIN IMMEDIATE`` then).
#: The API sets it per request from the method (GET/HEAD/OPTIONS read); scripts keep the default.
write_intent: ContextVar[bool] = ContextVar("layercast_write_intent", default=True)


def make_engine(url: str, *, pool_size: int = 40) -> Engine:
    """Engine for ``url`` with ``pool_size`` connections (size it to the worker threads: every sync
    route holds one for its duration, and a smaller pool turns load into pool-timeout errors).

    SQLite: foreign keys on, WAL journal, a 30 s busy timeout, and writes serialised with
    ``BEGIN IMMEDIATE`` (the pysqlite event hooks of SQLAlchemy's SQLite dialect documentation,
    "Serializable isolation / Savepoints / Transactional DDL"): a transaction that may write takes
    the write lock when it begins, waiting up to the busy timeout, instead of upgrading a read
    lock mid-transaction, which SQLite refuses at once with "database is locked" whatever the timeout
    when another writer committed in between. Read-only transactions (:data:`write_intent` false)
    begin deferred, so reads never wait for writers under WAL.
    """
    if url.startswith("sqlite"):
        in_memory = url in ("sqlite://", "sqlite+pysqlite://") or ":memory:" in url
        pool: dict[str, Any] = {} if in_memory else {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": 60}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            # pysqlite's own transaction handling breaks SAVEPOINTs (releasing one commits the outer
            # transaction); hand transaction control to SQLAlchemy, as its SQLite dialect docs advise.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):  # pragma: no cover - trivial
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write_intent.get() else "BEGIN")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=0, pool_timeout=60)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory bound to ``engine`` (objects stay usable after commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """Yield a session that commits on success and rolls back on any error (STYLE.md §3)."""
    session = factory()
    try:
        yield session
    except BaseException:
        end_session(session, commit=False)
        raise
    end_session(session, commit=True)


def end_session(session: Session, *, commit: bool) -> None:
    """Commit ``session`` (``commit``; rolled back, and the error re-raised, when the commit fails) or roll it
    back, then close it: the end of :func:`session_scope` and of the API's per-request session."""
    try:
        if not commit:
            session.rollback()
            return
        try:
            session.commit()
        except BaseException:
            session.rollback()
            raise
    finally:
        session.close()


#: Database errors that may mean "the database cannot serve now"; :func:`database_is_down` decides per error.
DATABASE_DOWN: tuple[type[Exception], ...] = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)

#: SQLite messages of a database that is busy or unreachable (``sqlite3.OperationalError`` has no code):
#: a write lock held past the busy timeout, a file or folder that is gone or unreadable.
_SQLITE_DOWN = ("database is locked", "unable to open database file", "disk i/o error")
#: PostgreSQL SQLSTATE classes of a server that cannot serve now (PostgreSQL manual, appendix A):
#: 08 connection exception, 53 insufficient resources (too many connections), 57P01-57P03 shutdown /
#: cannot connect now. Other OperationalErrors (57014 statement timeout aside) are bugs, not outages.
_PG_DOWN_CLASSES = ("08", "53")
_PG_DOWN_STATES = ("57P01", "57P02", "57P03")


def database_is_down(exc: BaseException) -> bool:
    """Whether database error ``exc`` is a connection-level failure worth a retry (503): a pool timeout,
    an interface error, a connection SQLAlchemy invalidated, SQLite locked or unable to open its file, or a
    psycopg connection/shutdown error. Anything else (an unmigrated table, a bad statement) is a bug: 500."""
    if isinstance(exc, sa_exc.InterfaceError | sa_exc.TimeoutError):
        return True
    if not isinstance(exc, sa_exc.DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    if type(orig).__module__.startswith("sqlite3"):
        return str(orig).lower().startswith(_SQLITE_DOWN)
    sqlstate = getattr(orig, "sqlstate", "")
    if type(orig).__module__.startswith("psycopg"):
        # no SQLSTATE: psycopg could not reach the server at all (refused, DNS, closed connection)
        return not sqlstate or sqlstate[:2] in _PG_DOWN_CLASSES or sqlstate in _PG_DOWN_STATES
    return False
