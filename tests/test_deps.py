"""The request session of :mod:`app.deps`: an ``async def`` route that runs its work with :func:`in_worker`
commits, rolls back and closes its session in that one worker-thread call, and the dependency does not end it
a second time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

import app.deps as deps
from app.db import make_engine, make_sessionmaker
from app.deps import SessionDep, in_worker


class Boom(Exception):
    pass


@pytest.fixture
def made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, Any, list[tuple[Session, bool]]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'd.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (v INTEGER)"))
    ended: list[tuple[Session, bool]] = []
    real = deps.end_session

    def counted(session: Session, *, commit: bool) -> None:
        ended.append((session, commit))
        real(session, commit=commit)

    monkeypatch.setattr(deps, "end_session", counted)
    api = FastAPI()
    api.state.sessionmaker = make_sessionmaker(engine)

    @api.post("/write/{v}")
    async def write(v: int, session: SessionDep) -> dict[str, int]:
        def work() -> dict[str, int]:
            session.execute(text("INSERT INTO t VALUES (:v)"), {"v": v})
            if v < 0:
                raise Boom
            return {"v": v}

        return await in_worker(session, work)

    @api.post("/write-twice/{v}")
    async def write_twice(v: int, session: SessionDep) -> dict[str, int]:
        out = await in_worker(session, lambda: {"v": v})
        session.execute(text("INSERT INTO t VALUES (:v)"), {"v": v})  # after in_worker: a new transaction
        return out

    @api.exception_handler(Boom)
    async def boom(request: Any, exc: Boom) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": "boom"}, status_code=422)

    return TestClient(api), engine, ended


def _rows(engine: Any) -> list[int]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(text("SELECT v FROM t ORDER BY v"))]


def test_work_is_committed_once_in_its_worker_call(made: tuple[TestClient, Any, list[tuple[Session, bool]]]) -> None:
    client, engine, ended = made
    assert client.post("/write/3").json() == {"v": 3}
    assert _rows(engine) == [3]
    assert [commit for _, commit in ended] == [True]  # by in_worker; the dependency did not end it again


def test_failed_work_is_rolled_back_once(made: tuple[TestClient, Any, list[tuple[Session, bool]]]) -> None:
    client, engine, ended = made
    r = client.post("/write/-1")
    assert r.status_code == 422
    assert _rows(engine) == []
    assert [commit for _, commit in ended] == [False]


def test_a_commit_that_fails_is_not_answered_200(made: tuple[TestClient, Any, list[tuple[Session, bool]]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    client, engine, _ = made

    def refuse(self: Session) -> None:
        raise Boom

    monkeypatch.setattr(Session, "commit", refuse)
    assert client.post("/write/4").status_code == 422
    monkeypatch.undo()
    assert _rows(engine) == []


def test_a_session_used_after_in_worker_is_ended_by_the_dependency(
        made: tuple[TestClient, Any, list[tuple[Session, bool]]]) -> None:
    client, engine, ended = made
    assert client.post("/write-twice/5").status_code == 200
    assert _rows(engine) == [5]  # committed, not left open
    assert [commit for _, commit in ended] == [True, True]
