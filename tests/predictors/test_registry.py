"""The predictor registry in the database: seeding, listing, admin-key protection, promote / rollback,
hot swap into a running app, checksum verification, and the 0004 migration's data mapping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, pool, text

from app.config import REPO_ROOT, Settings
from app.db import make_engine, make_sessionmaker
from app.main import create_app
from app.migrate import downgrade, upgrade
from app.predictor.metadata import ArtifactMetadata, ChecksumMismatch, sha256_file, write_atomic
from app.predictor.registry import load_from_store
from app.predictors import service
from tests.helpers import light_model

SHIPPED = (REPO_ROOT / "models" / "CURRENT").read_text().strip()
KEY = "s3cret-admin-key-of-at-least-32-characters"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _register_copy(database_url: str, store: Path, suffix: str) -> str:
    """Register a copy of the shipped artifact under version ``<name>-<suffix>`` as a candidate."""
    training = json.loads((REPO_ROOT / "models" / f"{SHIPPED}.json").read_text())
    training = {**training, "version": suffix, "onnx_file": f"{training['name']}-{suffix}.onnx"}
    write_atomic(store / training["onnx_file"], (REPO_ROOT / "models" / f"{SHIPPED}.onnx").read_bytes())
    meta = ArtifactMetadata.from_training(training, sha256=sha256_file(store / training["onnx_file"]))
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            service.register(session, meta)
    finally:
        engine.dispose()
    return meta.version


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def admin_client(sqlite_url: str, store: Path) -> TestClient:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, models_dir=REPO_ROOT / "models", artifact_store=store,
                        admin_key=KEY, predictor_poll_s=0)  # fmt: skip
    with TestClient(create_app(settings)) as c:
        yield c


def _served_version(client: TestClient, graph_id: str) -> str:
    r = client.post("/v1/predictions", json={"graph_id": graph_id, "hardware_id": "p100", "batch_size": 8,
                                             "mode": "inference"})  # fmt: skip
    assert r.status_code == 200, r.text
    return str(r.json()["predictor_version"])


def test_startup_seeds_the_shipped_artifact_as_production(admin_client: TestClient, store: Path) -> None:
    r = admin_client.get("/v1/predictors")
    assert r.status_code == 200
    body = r.json()
    assert body["production"] == SHIPPED
    [item] = body["items"]
    assert item["status"] == "production" and item["promoted_at"] is not None
    assert item["sha256"] == sha256_file(store / item["artifact_path"])  # copied into the store
    assert item["feature_names"] and item["metrics"]["train_test"]["by_source"]
    assert admin_client.get(f"/v1/predictors/{SHIPPED}").json()["version"] == SHIPPED
    r = admin_client.get("/v1/predictors/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "predictor_version_not_found"
    assert admin_client.get("/healthz").json()["predictor_version"] == SHIPPED


def test_admin_routes_are_closed_without_a_configured_key(client: TestClient) -> None:
    r = client.post(f"/v1/predictors/{SHIPPED}/promote", headers=AUTH)
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_invalid"


def test_admin_routes_reject_a_wrong_or_missing_key(admin_client: TestClient) -> None:
    for headers in ({}, {"Authorization": KEY}):  # no key; a key not sent as a bearer token
        r = admin_client.post(f"/v1/predictors/{SHIPPED}/rollback", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "auth_required"
    r = admin_client.post(f"/v1/predictors/{SHIPPED}/rollback", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_invalid"


def test_promotion_is_served_without_restart_and_rollback_restores(
    admin_client: TestClient, sqlite_url: str, store: Path
) -> None:
    upload = ("resnet50.onnx", light_model("resnet50"), "application/octet-stream")
    graph_id = admin_client.post("/v1/graphs", files={"file": upload}).json()["id"]
    assert _served_version(admin_client, graph_id) == SHIPPED
    new = _register_copy(sqlite_url, store, "swap-test")
    assert admin_client.get(f"/v1/predictors/{new}").json()["status"] == "candidate"
    assert _served_version(admin_client, graph_id) == SHIPPED  # a candidate is not served

    r = admin_client.post(f"/v1/predictors/{new}/promote", headers=AUTH)
    assert r.status_code == 200 and r.json()["status"] == "production"
    assert admin_client.get(f"/v1/predictors/{SHIPPED}").json()["status"] == "retired"
    assert _served_version(admin_client, graph_id) == new  # same process, no restart

    r = admin_client.post(f"/v1/predictors/{SHIPPED}/rollback", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_production"
    r = admin_client.post(f"/v1/predictors/{new}/rollback", headers=AUTH)
    assert r.status_code == 200 and r.json()["version"] == SHIPPED
    assert _served_version(admin_client, graph_id) == SHIPPED
    r = admin_client.post(f"/v1/predictors/{SHIPPED}/rollback", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_previous_version"


def test_a_torn_artifact_is_never_served(admin_client: TestClient, sqlite_url: str, store: Path) -> None:
    new = _register_copy(sqlite_url, store, "torn")
    path = store / admin_client.get(f"/v1/predictors/{new}").json()["artifact_path"]
    path.write_bytes(path.read_bytes()[:1000])  # a half-written file
    assert admin_client.post(f"/v1/predictors/{new}/promote", headers=AUTH).status_code == 200
    assert admin_client.get("/healthz").json()["predictor_version"] == SHIPPED
    holder = admin_client.app.state.predictors  # type: ignore[attr-defined]
    assert holder.current().version == SHIPPED  # refresh failed: the old version keeps serving
    engine = make_engine(sqlite_url)
    try:
        with make_sessionmaker(engine)() as session:
            meta = service.metadata_of(service.get_version(session, new))
    finally:
        engine.dispose()
    with pytest.raises(ChecksumMismatch):
        load_from_store(store, meta)


def test_polling_interval_bounds_the_swap(sqlite_url: str, store: Path) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    factory = make_sessionmaker(engine)
    try:
        with factory.begin() as session:
            service.seed_from_models_dir(session, REPO_ROOT / "models", store)
        now = [0.0]
        holder = service.PredictorHolder(factory, store, poll_s=5.0, clock=lambda: now[0])
        first = holder.current()
        new = _register_copy(sqlite_url, store, "poll")
        with factory.begin() as session:
            service.promote(session, new)
        now[0] = 4.9
        assert holder.current() is first  # within the interval: no database read, same reference
        now[0] = 5.0
        assert holder.current().version == new
    finally:
        engine.dispose()


def test_migration_maps_active_to_production_and_back(database_url: str) -> None:
    upgrade(database_url, "0003")
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO predictor_versions (version, artifact_path, sha256, metadata, active, created_at) "
                "VALUES ('a', 'a.onnx', :h, '{}', :t, CURRENT_TIMESTAMP), "
                "('b', 'b.onnx', :h, '{}', :f, CURRENT_TIMESTAMP)"), {"h": "0" * 64, "t": True, "f": False})
        upgrade(database_url)
        with engine.connect() as conn:
            rows = dict(conn.execute(text("SELECT version, status FROM predictor_versions")).all())
        assert rows == {"a": "production", "b": "candidate"}
        with pytest.raises(Exception, match="(?i)unique"), engine.begin() as conn:
            conn.execute(text("UPDATE predictor_versions SET status = 'production' WHERE version = 'b'"))
        downgrade(database_url, "0003")
        with engine.connect() as conn:
            rows = dict(conn.execute(text("SELECT version, active FROM predictor_versions")).all())
        assert {k: bool(v) for k, v in rows.items()} == {"a": True, "b": False}
    finally:
        engine.dispose()
