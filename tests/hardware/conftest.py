"""A session on a fresh SQLite file built with ``Base.metadata.create_all`` (no app, no migrations)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

import app.models_registry  # noqa: F401  (registers every table on Base.metadata)
from app.db import Base, make_engine, make_sessionmaker


@pytest.fixture
def hw_sessionmaker(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'hardware.db'}")
    Base.metadata.create_all(engine)
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


@pytest.fixture
def db(hw_sessionmaker: sessionmaker[Session]) -> Iterator[Session]:
    session = hw_sessionmaker()
    try:
        yield session
    finally:
        session.rollback()
        session.close()
