"""The Alembic migrations: upgrade, downgrade and upgrade again on SQLite and PostgreSQL, and the ORM
metadata agrees with the migrated schema (STYLE.md §8)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, pool

import app.models_registry  # noqa: F401  (fills Base.metadata)
from app.db import Base
from app.migrate import current_heads, database_revisions, downgrade, script_heads, upgrade, upgrade_unless_current

TABLES = {"api_keys", "hardware", "graphs", "measurements", "measurement_batches", "predictor_versions", "retrain_runs",
          "lease_locks"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_single_head() -> None:
    assert current_heads() == ("0007",)


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    upgrade(database_url)
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        insp = inspect(engine)
        assert set(insp.get_table_names()) >= TABLES
        for table in TABLES:
            assert insp.get_pk_constraint(table)["name"] == f"pk_{table}"
        fks = insp.get_foreign_keys("measurements")
        assert [(fk["name"], fk["referred_table"]) for fk in fks] == [
            ("fk_measurements_hardware_id_hardware", "hardware")
        ]
        assert {ix["name"] for ix in insp.get_indexes("measurements")} == {
            "ix_measurements_hardware_id",
            "ix_measurements_measured_at",
            "ix_measurements_op_kind",
            "ix_measurements_source",
        }
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == "0007"
    finally:
        engine.dispose()

    downgrade(database_url, "base")
    assert _tables(database_url) & TABLES == set()

    upgrade(database_url)
    assert _tables(database_url) >= TABLES


def test_orm_matches_migration(database_url: str) -> None:
    upgrade(database_url)
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            diffs = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diffs == []


def test_migrate_is_idempotent(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    upgrade(sqlite_url)
    assert _tables(sqlite_url) >= TABLES


def test_sqlite_parent_folder_created(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'a' / 'b' / 'layercast.db'}"
    upgrade(url)
    assert (tmp_path / "a" / "b" / "layercast.db").is_file()


def test_script_heads_read_without_alembic_are_alembics_heads() -> None:
    assert script_heads() == frozenset(current_heads()) and len(script_heads()) == 1


def test_upgrade_unless_current_migrates_only_a_database_behind_head(sqlite_url: str) -> None:
    (head,) = current_heads()
    upgrade(sqlite_url, "0005")
    assert database_revisions(sqlite_url) == {"0005"}
    assert upgrade_unless_current(sqlite_url) is True and database_revisions(sqlite_url) == {head}
    assert upgrade_unless_current(sqlite_url) is False and _tables(sqlite_url) >= TABLES
