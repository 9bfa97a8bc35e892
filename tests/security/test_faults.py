"""Faults (issue 11 item 6): the database going away answers 503 ``database_unavailable`` with
``Retry-After`` (never a 500) while inline predictions keep working and ``/readyz`` says not ready; a
corrupt production predictor artifact at start-up falls back to the last good version, loudly, or the
API refuses to start when no version loads."""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import psycopg.errors
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import exc as sa_exc

from app.config import REPO_ROOT, Settings
from app.db import make_engine, make_sessionmaker
from app.hardware.catalog import load_catalog, spec_to_dict
from app.main import create_app, database_is_down
from app.migrate import upgrade
from app.predictors import service
from app.predictors.service import PredictorUnavailable
from tests.predictors.test_registry import SHIPPED, _register_copy
from tests.security.test_hostile_inputs import HARDWARE, MEASUREMENT, batch, json_graph

GPU_INLINE: dict[str, Any] = {**HARDWARE, "boost_clock_mhz": 1500, "l2_cache_bytes": 4 * 2**20}


def _settings(url: str, **kw: Any) -> Settings:
    return Settings(database_url=url, models_dir=REPO_ROOT / "models", **kw)


def test_database_down_is_503_with_retry_after_and_inline_predictions_keep_working(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    url = f"sqlite:///{folder / 'layercast.db'}"
    upgrade(url)
    with TestClient(create_app(_settings(url, predictor_poll_s=0, db_retry_after_s=7)),
                    raise_server_exceptions=False) as client:
        inline = {"graph": json_graph(), "hardware": GPU_INLINE, "batch_size": 2, "mode": "inference"}
        before = client.post("/v1/predictions", json=inline)
        assert before.status_code == 200, before.text
        gid = client.post("/v1/graphs", json=json_graph(name="stored")).json()["id"]

        folder.rename(tmp_path / "db-gone")  # the database disappears ...
        client.app.state.engine.dispose()  # ... and no pooled connection still holds it open

        for method, path, body in [("POST", "/v1/measurements", batch(MEASUREMENT)), ("GET", "/v1/hardware", None),
                                   ("POST", "/v1/graphs", json_graph(name="new")), ("GET", f"/v1/graphs/{gid}", None),
                                   ("GET", "/v1/measurements", None)]:  # fmt: skip
            r = client.request(method, path, json=body)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "database_unavailable" and r.headers["retry-after"] == "7"
            assert r.headers.get("connection") != "close"
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["error"]["detail"]["database"] == "unreachable"
        # predictor_poll_s=0: every request re-reads the registry and fails; the loaded version keeps serving
        during = client.post("/v1/predictions", json=inline)
        assert during.status_code == 200, during.text
        assert during.json()["totals"] == before.json()["totals"]
        # its id could not be checked against the stored devices: said, not silent
        assert not any("not checked" in w for w in before.json()["warnings"])
        assert any("'my-gpu' was not checked" in w for w in during.json()["warnings"]), during.json()["warnings"]
        # a catalog id is still checked, against the built-in catalog
        p100 = {k: v for k, v in spec_to_dict(load_catalog()["p100"]).items() if v is not None}
        clash = client.post("/v1/predictions", json={**inline, "hardware": {**p100, "memory_bytes": 1e9}})
        assert clash.status_code == 422 and clash.json()["error"]["detail"]["fields"] == ["memory_bytes"], clash.text

        (tmp_path / "db-gone").rename(folder)  # back: everything answers again, nothing was lost
        assert client.get("/readyz").status_code == 200
        assert client.get(f"/v1/graphs/{gid}").status_code == 200


def _two_versions(tmp_path: Path) -> tuple[str, Path, str, Path]:
    """A registry whose production version (a copy of the shipped one) was promoted after the shipped one:
    the URL, the store, the production version and its ONNX file."""
    url = f"sqlite:///{tmp_path / 'layercast.db'}"
    store = tmp_path / "store"
    upgrade(url)
    with TestClient(create_app(_settings(url, artifact_store=store))):
        pass  # first start: the shipped artifact is registered and copied into the store
    newer = _register_copy(url, store, "newer")
    engine = make_engine(url)
    with make_sessionmaker(engine).begin() as session:
        onnx = store / service.promote(session, newer).artifact_path
    engine.dispose()
    return url, store, newer, onnx


def test_corrupt_production_artifact_falls_back_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url, store, newer, onnx = _two_versions(tmp_path)
    onnx.write_bytes(onnx.read_bytes()[:-100] + b"\0" * 100)  # torn write: checksum mismatch
    with caplog.at_level(logging.ERROR, logger="layercast"), \
            TestClient(create_app(_settings(url, artifact_store=store))) as client:
        assert client.get("/healthz").json()["predictor_version"] == SHIPPED
        ready = client.get("/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "degraded" and body["predictor_version"] == SHIPPED
        assert newer in body["predictor_problem"] and "ChecksumMismatch" in body["predictor_problem"]
        r = client.post("/v1/predictions", json={"graph": json_graph(), "hardware_id": "p100", "batch_size": 2,
                                                 "mode": "inference"})
        assert r.status_code == 200 and r.json()["predictor_version"] == SHIPPED
    assert any("PREDICTOR FALLBACK" in rec.getMessage() and rec.levelno == logging.ERROR for rec in caplog.records)


def test_no_loadable_artifact_refuses_to_start(tmp_path: Path) -> None:
    url, store, newer, _ = _two_versions(tmp_path)
    for onnx in store.glob("*.onnx"):
        onnx.write_bytes(b"not an onnx file")
    with pytest.raises(PredictorUnavailable, match=f"refusing to start.*{newer}.*{SHIPPED}"), \
            TestClient(create_app(_settings(url, artifact_store=store))):
        pass


def test_missing_artifact_file_refuses_to_start(tmp_path: Path) -> None:
    url, store, _, _ = _two_versions(tmp_path)
    shutil.rmtree(store)
    with pytest.raises(PredictorUnavailable, match="FileNotFoundError"), \
            TestClient(create_app(_settings(url, artifact_store=store))):
        pass


def test_a_database_bug_is_a_logged_500_not_a_retry_forever_503(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'layercast.db'}"
    upgrade(url)
    with TestClient(create_app(_settings(url)), raise_server_exceptions=False) as client:
        engine = make_engine(url, pool_size=1)
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE measurements")  # a schema the code does not expect: a bug
        engine.dispose()
        with caplog.at_level(logging.ERROR, logger="layercast"):
            r = client.get("/v1/measurements")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert "retry-after" not in r.headers
        logged = [rec for rec in caplog.records if rec.exc_info]
        assert logged and "no such table" in str(logged[-1].exc_info[1])  # with its traceback


@pytest.mark.parametrize(("orig", "down"), [
    (sqlite3.OperationalError("database is locked"), True),
    (sqlite3.OperationalError("unable to open database file"), True),
    (sqlite3.OperationalError("no such table: graphs"), False),
    (psycopg.OperationalError("connection refused"), True),  # no SQLSTATE: never reached the server
    (psycopg.errors.AdminShutdown("terminating connection"), True),
    (psycopg.errors.ConnectionFailure("lost"), True),
    (psycopg.errors.QueryCanceled("statement timeout"), False),
])  # fmt: skip
def test_only_connection_level_database_errors_are_503(orig: Exception, down: bool) -> None:
    assert database_is_down(sa_exc.OperationalError("SELECT 1", {}, orig)) is down
    assert database_is_down(sa_exc.TimeoutError("pool exhausted"))
    invalidated = sa_exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("?"), connection_invalidated=True)
    assert database_is_down(invalidated)
