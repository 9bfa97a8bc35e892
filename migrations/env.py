"""Alembic environment of layercast.

The database URL comes from, in order: ``config.attributes["database_url"]`` (set by
:func:`app.migrate.alembic_config`), ``alembic -x url=...``, ``$LAYERCAST_DATABASE_URL``, then the default
of :class:`app.config.Settings`. The target metadata is ``app.db.Base.metadata`` with every model imported
through :mod:`app.models_registry`. ``render_as_batch=True`` so that ALTERs work on SQLite (STYLE.md §8).
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

import app.models_registry  # noqa: F401  (fills Base.metadata)
from app.config import Settings
from app.db import Base
from app.migrate import ensure_sqlite_dir

config = context.config

if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    """The URL to migrate (see the module docstring for the order of precedence)."""
    url = config.attributes.get("database_url")
    if url:
        return str(url)
    x_args = context.get_x_argument(as_dictionary=True)
    if x_args.get("url"):
        return x_args["url"]
    if os.environ.get("LAYERCAST_DATABASE_URL"):
        return os.environ["LAYERCAST_DATABASE_URL"]
    return Settings().database_url


def _configure_kwargs() -> dict[str, object]:
    return {
        "target_metadata": target_metadata,
        "render_as_batch": True,
        "compare_type": True,
        "compare_server_default": True,
    }


def run_migrations_offline() -> None:
    """Emit SQL to stdout (``alembic upgrade head --sql``) without a database connection."""
    context.configure(
        url=database_url(),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **_configure_kwargs(),  # type: ignore[arg-type]
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on a live connection (one transaction; DDL is transactional on both backends)."""
    connection = config.attributes.get("connection")
    if connection is not None:  # a caller (e.g. a test) lends its own connection
        context.configure(connection=connection, **_configure_kwargs())  # type: ignore[arg-type]
        with context.begin_transaction():
            context.run_migrations()
        return

    url = database_url()
    ensure_sqlite_dir(url)
    # A plain NullPool engine, not app.db.make_engine: on SQLite that one switches foreign keys on, and
    # batch mode's copy-and-move of a referenced table must run with them off (SQLite's own advice).
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context.configure(connection=conn, **_configure_kwargs())  # type: ignore[arg-type]
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
