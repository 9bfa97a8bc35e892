"""Shared fixtures: settings on a fresh SQLite file per test, a migrated app, a client, a session, and a
``database_url`` that also covers PostgreSQL for the migration tests (STYLE.md §9).

PostgreSQL: ``$LAYERCAST_TEST_POSTGRES_URL`` (a SQLAlchemy URL to any database on the server, e.g.
``postgresql+psycopg://postgres@127.0.0.1:5432/test``) or, when unset, the local server at
127.0.0.1:5432 (trust auth, database ``test``, user ``postgres`` then ``root``). Each test gets its own
uniquely named database, created and dropped around it, so concurrent runs do not clash. Without a
reachable server the PostgreSQL cases are skipped, except under ``CI=true`` where they fail: CI has one.

Access control: the suite runs with every scope but ``admin`` open to requests without a key, the
TestClient's ``testserver`` host allowed and no rate limit (``LAYERCAST_OPEN_SCOPES``,
``LAYERCAST_ALLOWED_HOSTS``, ``LAYERCAST_RATE_LIMIT`` set below unless the environment sets them), so
tests of other features need no key (and ``LAYERCAST_IMPORT_WORKER_AT_START=false``: an app spawns its ONNX
import process on its first large upload, not at every start); the access-control tests
(``tests/security/test_auth.py``) build their apps with the shipped defaults passed explicitly.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

from app.config import REPO_ROOT, Settings
from app.main import create_app
from app.migrate import upgrade

#: Settings the whole suite runs under (see the module doc).
TEST_ENV = {
    "LAYERCAST_OPEN_SCOPES": "read,graphs,measurements,hardware",
    "LAYERCAST_ALLOWED_HOSTS": "testserver,test,localhost,127.0.0.1",
    "LAYERCAST_RATE_LIMIT": "",
    "LAYERCAST_IMPORT_WORKER_AT_START": "false",
}
for _name, _value in TEST_ENV.items():
    os.environ.setdefault(_name, _value)

POSTGRES_ENV = "LAYERCAST_TEST_POSTGRES_URL"
LOCAL_POSTGRES = ("127.0.0.1", 5432)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _admin_url() -> tuple[URL | None, str]:
    """A working SQLAlchemy URL to an existing database on the test PostgreSQL server, or None and why."""
    try:
        import psycopg
    except ImportError:
        return None, "psycopg is not installed (pip install -e '.[dev]')"
    if os.environ.get(POSTGRES_ENV):
        candidates = [make_url(os.environ[POSTGRES_ENV])]
    elif _port_open(*LOCAL_POSTGRES):
        host, port = LOCAL_POSTGRES
        candidates = [
            URL.create("postgresql+psycopg", username=user, host=host, port=port, database="test")
            for user in ("postgres", "root")
        ]
    else:
        return None, f"no PostgreSQL at {LOCAL_POSTGRES[0]}:{LOCAL_POSTGRES[1]} and ${POSTGRES_ENV} unset"
    errors = []
    for url in candidates:
        try:
            with psycopg.connect(_libpq(url), connect_timeout=3):
                return url, ""
        except psycopg.Error as exc:
            errors.append(f"{url.render_as_string(hide_password=True)}: {exc}".strip())
    return None, "cannot connect to PostgreSQL: " + "; ".join(errors)


def _libpq(url: URL) -> str:
    """``url`` as a libpq URI for psycopg (no SQLAlchemy driver suffix)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_admin_url() -> URL:
    """URL of an existing database on the test PostgreSQL server (skips, or fails under CI, if none)."""
    url, why = _admin_url()
    if url is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but PostgreSQL is unavailable: {why}")
        pytest.skip(f"PostgreSQL tests skipped: {why}")
    return url


@contextmanager
def _scratch_database(admin: URL, prefix: str, *, template: str | None = None) -> Iterator[str]:
    """Name of a new PostgreSQL database ``<prefix>_<random>`` (a copy of ``template`` when given) on the
    server of ``admin``, dropped (connections forced off) when the block ends, however it ends."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    copy = f' TEMPLATE "{template}"' if template is not None else ""
    with psycopg.connect(_libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    try:
        yield name
    finally:
        with psycopg.connect(_libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database, dropped after the test."""
    admin: URL = request.getfixturevalue("postgres_admin_url")
    with _scratch_database(admin, "layercast_test") as name:
        yield admin.set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """URL of a fresh SQLite file (the parent folder exists, the file does not yet)."""
    return f"sqlite:///{tmp_path / 'layercast.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str:
    """An empty database on each backend: SQLite always, PostgreSQL when reachable."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(fixture))


#: ``LAYERCAST_TEST_BACKEND=postgresql`` runs every test that takes the ``settings``/``app``/``client``
#: fixtures on its own PostgreSQL database instead of its own SQLite file (``scripts/test.sh`` runs the API
#: test packages a second time so); the default is ``sqlite``.
TEST_BACKEND_ENV = "LAYERCAST_TEST_BACKEND"


def test_backend() -> str:
    """``sqlite`` or ``postgresql`` (``$LAYERCAST_TEST_BACKEND``); anything else is an error."""
    backend = os.environ.get(TEST_BACKEND_ENV, "sqlite")
    if backend not in ("sqlite", "postgresql"):
        raise pytest.UsageError(f"${TEST_BACKEND_ENV} must be sqlite or postgresql, not {backend!r}")
    return backend


@pytest.fixture(scope="session")
def postgres_template(postgres_admin_url: URL) -> Iterator[str]:
    """Name of a PostgreSQL database migrated to head once per session, the template of
    :func:`postgres_migrated_url` (``CREATE DATABASE ... TEMPLATE`` copies it in ~0.1 s)."""
    with _scratch_database(postgres_admin_url, "layercast_tmpl") as name:
        upgrade(postgres_admin_url.set(database=name).render_as_string(hide_password=False))
        yield name


@pytest.fixture
def postgres_migrated_url(request: pytest.FixtureRequest, postgres_template: str) -> Iterator[str]:
    """URL of a fresh PostgreSQL database already migrated to head, dropped after the test."""
    admin: URL = request.getfixturevalue("postgres_admin_url")
    with _scratch_database(admin, "layercast_test", template=postgres_template) as name:
        yield admin.set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated to head once per session (per xdist worker), the template of
    :func:`sqlite_migrated_url` (a file copy takes well under 1 ms; a fresh migration 0.1-0.3 s)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "layercast.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_migrated_url(tmp_path: Path, sqlite_template: Path) -> str:
    """URL of this test's own SQLite file (the path of :func:`sqlite_url`) already migrated to head: a copy
    of :func:`sqlite_template`."""
    dst = tmp_path / "layercast.db"
    shutil.copyfile(sqlite_template, dst)
    return f"sqlite:///{dst}"


@pytest.fixture
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of an empty database (no tables) on the backend of :func:`settings`: a new SQLite file
    (``empty.db``, beside the one of ``settings``) or a fresh PostgreSQL database."""
    if test_backend() == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def settings(request: pytest.FixtureRequest) -> Settings:
    """Settings on this test's own database, already migrated to head (an SQLite file, or a PostgreSQL
    database under ``LAYERCAST_TEST_BACKEND=postgresql``, each copied from a template migrated once per
    session), with the predictor shipped in ``models/``. A test of migrating an empty database takes
    ``sqlite_url``, ``postgres_url`` or ``database_url`` instead."""
    fixture = "sqlite_migrated_url" if test_backend() == "sqlite" else "postgres_migrated_url"
    return Settings(database_url=str(request.getfixturevalue(fixture)), models_dir=REPO_ROOT / "models")


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    """The app on this test's migrated database (not started: use ``client`` for that). ``upgrade`` runs
    anyway: on a database already at head it only reads the revision (~15 ms)."""
    upgrade(settings.database_url)
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """A started app (lifespan run: catalog seeded, predictor loaded)."""
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def session(client: TestClient) -> Iterator[Session]:
    """A session on the same database as ``client``; rolled back and closed after the test."""
    db: Session = client.app.state.sessionmaker()  # type: ignore[attr-defined]
    try:
        yield db
    finally:
        db.rollback()
        db.close()


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's folder shared by all its pytest-xdist workers (the parent of each worker's ``basetemp``),
    or this process's ``basetemp`` when it runs alone."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _real_models_exported_once_per_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Points :data:`tests.core.real_models.SHARED_DIR` at this run's folder: each real model is exported
    once per run, whichever workers need it (removed at the end of the run, :func:`pytest_sessionfinish`)."""
    from tests.core import real_models

    shared = _run_dir(tmp_path_factory) / REAL_MODELS_DIR
    shared.mkdir(exist_ok=True)
    real_models.SHARED_DIR = shared


#: Name of the folder of :func:`_real_models_exported_once_per_run` (several GB of pickled exports).
REAL_MODELS_DIR = "real-model-exports"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the pickled real-model exports once every worker is done (in the controlling process, or in the
    only one): pytest keeps the last three runs' temporary folders, which would keep them too."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    try:
        base = factory.getbasetemp()
    except (OSError, ValueError):
        return
    shutil.rmtree(base / REAL_MODELS_DIR, ignore_errors=True)


#: Justus rows per file stored by :func:`justus_db` (10 files: 3,000 rows).
JUSTUS_ROWS_PER_FILE = 300


@pytest.fixture(scope="session")
def justus_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SQLite URL of a database holding the first :data:`JUSTUS_ROWS_PER_FILE` rows of every Justus file
    (``layercast import justus --limit``), shared by the tests that train or featurise Justus rows."""
    from tests.helpers import import_measurements

    url = f"sqlite:///{tmp_path_factory.mktemp('justus-db') / 'measurements.db'}"
    import_measurements(url, "justus", "--limit", str(JUSTUS_ROWS_PER_FILE))
    return url
