"""The ``layercast`` command line (no server started: ``serve`` is exercised by the app tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, inspect, pool

from app.cli import format_table, main
from tests.helpers import REPO


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.startswith("layercast ")


def test_migrate_and_downgrade(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    monkeypatch.setenv("LAYERCAST_DATABASE_URL", sqlite_url)
    assert main(["migrate"]) == 0
    engine = create_engine(sqlite_url, poolclass=pool.NullPool)
    assert "measurements" in inspect(engine).get_table_names()
    assert main(["downgrade", "base"]) == 0
    assert "measurements" not in inspect(engine).get_table_names()
    engine.dispose()


def test_unknown_command_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_format_table() -> None:
    table = format_table([("a100", 19.5e0), ("cpu", None)], ("id", "tflops"))
    assert table.splitlines() == ["id    tflops", "----  ------", "a100  19.5", "cpu"]


def test_hardware_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hardware", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["id", "name", "kind"]
    assert any(line.startswith("p100 ") for line in out)


@pytest.mark.parametrize("name", ["", "   ", "ci\x00pipeline", "ci\npipeline", "k" * 201])
def test_keys_create_refuses_a_name_no_one_can_read_or_store(name: str, sqlite_url: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An empty or blank name (a key `keys list` cannot tell apart), control characters (NUL: PostgreSQL's
    text refuses it, a traceback) or more than the column's 200 characters are exit 2, nothing stored."""
    assert main(["keys", "--database-url", sqlite_url, "create", name, "--scope", "read"]) == 2
    assert "layercast keys create:" in capsys.readouterr().err
    engine = create_engine(sqlite_url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM api_keys").scalar() == 0
    assert main(["keys", "--database-url", sqlite_url, "create", "ci-pipeline", "--scope", "read"]) == 0
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM api_keys").scalar() == 1
    engine.dispose()


@pytest.mark.parametrize("command", [["hardware", "list"], ["version"]])
def test_output_into_a_closed_pipe_is_a_quiet_exit_141(command: list[str]) -> None:
    """``layercast hardware list | head -1``: the reader is gone before the output is written. Python's
    BrokenPipeError used to end it with a traceback (or an 'Exception ignored' notice at exit, status 120);
    now it exits as a SIGPIPE'd command does, 128 + 13, saying nothing."""
    read, write = os.pipe()
    os.close(read)  # no reader from the start: every write fails, whatever the timing
    try:
        done = subprocess.run([sys.executable, "-m", "app.cli", *command], stdout=write, stderr=subprocess.PIPE,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr.decode()) == (141, "")
