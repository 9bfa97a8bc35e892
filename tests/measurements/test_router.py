"""HTTP routes of measurements on the full app (``create_app``: its routers, error handlers and catalog
seeding, predictor registry) on a migrated SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

import app.main
from app.config import Settings
from app.migrate import upgrade


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    upgrade(settings.database_url)
    with TestClient(app.main.create_app(settings)) as test_client:
        yield test_client

BODY: dict[str, Any] = {
    "hardware_id": "a100-sxm4-40gb",
    "source": "scheduler",
    "op_kind": "iteration",
    "pass": "train_step",
    "optimizer": "adam",
    "precision": "bf16",
    "software_stack": "pytorch-eager",
    "granularity": "iteration",
    "batch_size": 64,
    "config": {"model": "resnet50", "graph_id": 12},
    "time_ms_median": 210.5,
    "time_ms_std": 3.2,
    "repetitions": 20,
    "context": {"framework": "torch 2.5", "driver": "550.54", "threads": 8},
    "measured_at": "2026-11-20T10:00:00+01:00",
}


def test_post_201_and_read_back(client: TestClient) -> None:
    response = client.post("/v1/measurements", json=BODY)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["id"] > 0 and body["pass"] == "train_step" and body["precision"] == "bf16"
    assert (body["software_stack"], body["granularity"]) == ("pytorch-eager", "iteration")
    assert body["context"] == BODY["context"] and body["created_at"]
    assert body["measured_at"].startswith("2026-11-20T09:00:00")  # stored in UTC

    listing = client.get("/v1/measurements", params={"source": "scheduler"}).json()
    assert listing["total"] == listing["count"] == 1
    assert listing["items"][0]["id"] == body["id"]


def test_post_unknown_hardware_404(client: TestClient) -> None:
    response = client.post("/v1/measurements", json={**BODY, "hardware_id": "no-such-gpu"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "hardware_not_found" and error["detail"] == {"hardware_id": "no-such-gpu"}


def test_post_invalid_422(client: TestClient) -> None:
    for bad in ({"time_ms_median": 0}, {"time_ms_median": -3.0}, {"batch_size": 0}, {"pass": "sideways"},
                {"software_stack": "tf2-keras"}, {"granularity": "epoch"}, {"software_stack": None},
                {"unknown_field": 1}, {"measured_at": "2026-11-20T10:00:00"}):
        response = client.post("/v1/measurements", json={**BODY, **bad})
        assert response.status_code == 422, bad
        assert response.json()["error"]["code"] == "validation_error"
    response = client.post("/v1/measurements", json={**BODY, "source": "justus2018"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"


def test_list_filters_and_paging(client: TestClient) -> None:
    for hw, kind in (("a100-sxm4-40gb", "conv"), ("a100-sxm4-40gb", "gemm"), ("h100-sxm", "conv")):
        assert client.post("/v1/measurements", json={**BODY, "hardware_id": hw, "op_kind": kind}).status_code == 201
    assert client.get("/v1/measurements").json()["total"] == 3
    assert client.get("/v1/measurements", params={"hardware_id": "a100-sxm4-40gb"}).json()["total"] == 2
    conv = client.get("/v1/measurements", params={"op_kind": "conv"}).json()
    assert conv["total"] == 2 and {i["hardware_id"] for i in conv["items"]} == {"a100-sxm4-40gb", "h100-sxm"}
    page = client.get("/v1/measurements", params={"limit": 1, "offset": 1}).json()
    assert page["count"] == 1 and page["total"] == 3 and page["offset"] == 1
    assert client.get("/v1/measurements", params={"limit": 0}).status_code == 422
    assert client.get("/v1/measurements", params={"limit": 5000}).status_code == 422


def test_openapi_lists_errors(client: TestClient) -> None:
    post = client.get("/openapi.json").json()["paths"]["/v1/measurements"]["post"]
    assert {"201", "404", "422"} <= set(post["responses"])
