"""Apply and revert the Alembic migrations programmatically (``layercast serve``/``migrate``, tests).

Where the migrations are found: ``alembic.ini`` (with ``script_location = %(here)s/migrations``) sits at
the repository root, next to ``app/``. We install with ``pip install -e .`` (see README), so the package
directory's parent *is* the repository root and this works from any working directory. For a
non-editable install (the Docker image) the lookup falls back to ``$LAYERCAST_ALEMBIC_INI`` and then to
``./alembic.ini`` in the working directory (the image's ``WORKDIR`` holds ``alembic.ini`` and
``migrations/``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from app.config import REPO_ROOT

if TYPE_CHECKING:
    from alembic.config import Config

# alembic is imported inside the functions that run migrations: the API process imports this module (for
# ensure_sqlite_dir) at start-up and never migrates itself, so it does not pay alembic's import (~0.3 s).

ALEMBIC_INI_ENV = "LAYERCAST_ALEMBIC_INI"


def find_alembic_ini() -> Path:
    """Path of ``alembic.ini``: ``$LAYERCAST_ALEMBIC_INI``, else the repository root, else the cwd.

    Raises :class:`FileNotFoundError` naming every place that was looked at.
    """
    candidates: list[Path] = []
    if env := os.environ.get(ALEMBIC_INI_ENV):
        candidates.append(Path(env))
    candidates += [REPO_ROOT / "alembic.ini", Path.cwd() / "alembic.ini"]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        "alembic.ini not found; looked at " + ", ".join(str(p) for p in candidates)
        + f" (set {ALEMBIC_INI_ENV} to its path)"
    )


def ensure_sqlite_dir(database_url: str) -> None:
    """Create the parent folder of an SQLite database file if it is missing (no-op for other URLs)."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def _escape(path: Path) -> str:
    """``path`` with ``%`` doubled, as ``configparser`` interpolation requires."""
    return str(path).replace("%", "%%")


def alembic_config(database_url: str) -> Config:
    """An Alembic :class:`Config` for ``database_url``.

    The URL travels in ``config.attributes["database_url"]`` (read first by ``migrations/env.py``), so a
    password never passes through ``configparser`` interpolation. ``configure_logging=False`` tells
    env.py to leave the process's logging configuration alone (``fileConfig`` would otherwise disable the
    loggers of uvicorn and of the test run).
    """
    ini = find_alembic_ini()
    from alembic.config import Config

    config = Config(str(ini))
    config.set_main_option("script_location", _escape(ini.parent / "migrations"))
    config.attributes["database_url"] = database_url
    config.attributes["configure_logging"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database at ``database_url`` up to ``revision`` (default the newest)."""
    ensure_sqlite_dir(database_url)
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


_REVISION_LINE = re.compile(r"^(down_)?revision\b[^=]*=(.*)$", re.MULTILINE)
_QUOTED = re.compile(r"[\"']([^\"']+)[\"']")


def script_heads() -> frozenset[str]:
    """Head revision ids of the migration scripts read from their ``revision`` / ``down_revision`` lines
    without importing alembic (~0.3 s): the revisions no script names as its ``down_revision``. A test pins
    them equal to alembic's own :func:`current_heads`."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for script in (find_alembic_ini().parent / "migrations" / "versions").glob("*.py"):
        for down, value in _REVISION_LINE.findall(script.read_text(encoding="utf-8")):
            (parents if down else revisions).update(_QUOTED.findall(value))
    return frozenset(revisions - parents)


def database_revisions(database_url: str) -> frozenset[str]:
    """The revisions stamped in the database's ``alembic_version`` table (empty when it has none)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return frozenset()
            return frozenset(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
    finally:
        engine.dispose()


def upgrade_unless_current(database_url: str) -> bool:
    """:func:`upgrade` to head unless the database is stamped at the scripts' heads already (a cheap check:
    one query, no alembic import; ``layercast serve`` starts in under 2 s, issue 12). Returns whether it
    migrated."""
    ensure_sqlite_dir(database_url)
    if database_revisions(database_url) == script_heads():
        return False
    upgrade(database_url)
    return True


def downgrade(database_url: str, revision: str) -> None:
    """Migrate the database at ``database_url`` down to ``revision`` (``"base"`` drops every table)."""
    ensure_sqlite_dir(database_url)
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def current_heads() -> tuple[str, ...]:
    """Head revision ids of the migration scripts (no database needed)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    ini = find_alembic_ini()
    config = Config(str(ini))
    config.set_main_option("script_location", _escape(ini.parent / "migrations"))
    return tuple(ScriptDirectory.from_config(config).get_heads())
