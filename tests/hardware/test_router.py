"""HTTP routes of the hardware catalog on a tiny app (the router alone, SQLite via create_all)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.auth import Principal, Scope, authorize
from app.errors import LayercastError
from app.hardware import service
from app.hardware.catalog import load_catalog
from app.hardware.router import router

from .test_service import CUSTOM


@pytest.fixture
def client(hw_sessionmaker: sessionmaker[Session]) -> Iterator[TestClient]:
    app = FastAPI()
    app.state.sessionmaker = hw_sessionmaker
    app.include_router(router)
    app.dependency_overrides[authorize] = lambda: Principal(None, frozenset({Scope.READ, Scope.HARDWARE}))

    @app.exception_handler(LayercastError)
    async def _problem(_request: Request, exc: LayercastError) -> JSONResponse:
        return JSONResponse(exc.to_problem(), status_code=exc.status_code)

    with hw_sessionmaker.begin() as session:
        service.seed_builtin(session, include_local=False)
    with TestClient(app) as test_client:
        yield test_client


def test_list(client: TestClient) -> None:
    body = client.get("/v1/hardware").json()
    assert body["count"] == len(body["items"]) == len(load_catalog())
    assert {"v100-sxm2-16gb", "h100-sxm", "k80"} <= {item["id"] for item in body["items"]}
    assert client.get("/v1/hardware", params={"kind": "cpu"}).json() == {"items": [], "count": 0}
    assert client.get("/v1/hardware", params={"kind": "tpu"}).status_code == 422


def test_get(client: TestClient) -> None:
    response = client.get("/v1/hardware/a100-sxm4-40gb")
    assert response.status_code == 200
    body = response.json()
    assert body["builtin"] is True
    assert body["memory_bandwidth_bytes_per_s"] == 1555e9
    assert body["sources"]["memory_bandwidth_bytes_per_s"]


def test_post_then_duplicate(client: TestClient) -> None:
    created = client.post("/v1/hardware", json=CUSTOM)
    assert created.status_code == 201, created.text
    assert created.json()["builtin"] is False
    assert client.get("/v1/hardware/my-gpu").json()["peak_flops_per_s"]["fp16"] == 200e12
    duplicate = client.post("/v1/hardware", json={**CUSTOM, "name": "Other"})
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["code"] == "hardware_exists"
    assert client.get("/v1/hardware/my-gpu").json()["name"] == "My GPU"
    builtin = client.post("/v1/hardware", json={**CUSTOM, "id": "t4"})
    assert builtin.status_code == 409


def test_unknown_is_404_with_code(client: TestClient) -> None:
    response = client.get("/v1/hardware/nope")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "code": "hardware_not_found",
        "message": "unknown hardware id 'nope'",
        "detail": {"hardware_id": "nope"},
    }


@pytest.mark.parametrize(
    "change",
    [
        {"peak_flops_per_s": {"fp16": 1e12}},
        {"peak_flops_per_s": {"fp32": 1e12, "fp4": 1e12}},
        {"memory_bytes": -1},
        {"id": "Has Spaces"},
        {"kind": "tpu"},
        {"colour": "green"},
        {"base_clock_mhz": 2000, "boost_clock_mhz": 1000},
    ],
)
def test_post_rejects_invalid_payloads(client: TestClient, change: dict) -> None:
    assert client.post("/v1/hardware", json={**CUSTOM, **change}).status_code == 422
