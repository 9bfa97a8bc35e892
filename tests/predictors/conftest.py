"""Fixtures of the retrain tests: a small measurement database with the shipped version seeded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.config import REPO_ROOT
from app.db import make_engine, make_sessionmaker
from app.migrate import upgrade
from app.predictors import service
from tests.conftest import JUSTUS_ROWS_PER_FILE
from tests.helpers import import_measurements


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path, justus_db: str) -> str:
    """The first 300 rows of every Justus file, migrated, the shipped version seeded into ``tmp_path/store``:
    a private copy of the shared SQLite database, or a fresh PostgreSQL database (one per test) imported the
    same way."""
    if request.param == "sqlite":
        dst = tmp_path / "m.db"
        shutil.copy(Path(justus_db.removeprefix("sqlite:///")), dst)
        url = f"sqlite:///{dst}"
    else:
        url = str(request.getfixturevalue("postgres_url"))
        import_measurements(url, "justus", "--limit", str(JUSTUS_ROWS_PER_FILE))
    upgrade(url)
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            service.seed_from_models_dir(session, REPO_ROOT / "models", tmp_path / "store")
    finally:
        engine.dispose()
    return url
