"""HTTP routes of measurements on the full app (``create_app``: its routers, error handlers and catalog
seeding, predictor registry) on a migrated SQLite file and, when reachable, PostgreSQL database: batch
ingestion (all or nothing, bad rows named), idempotency keys, filters, cursor paging, the CSV export."""

from __future__ import annotations

import csv
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

import app.main
from app.config import REPO_ROOT, Settings
from app.measurements import service
from app.measurements.schemas import MAX_BATCH
from app.migrate import upgrade


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    """The app on a fresh migrated database of each backend (SQLite; PostgreSQL when reachable)."""
    upgrade(database_url)
    settings = Settings(database_url=database_url, models_dir=REPO_ROOT / "models")
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
    "config": {"model": "resnet50"},
    "time_ms_median": 210.5,
    "time_ms_std": 3.2,
    "repetitions": 20,
    "context": {"framework": "torch 2.5", "driver": "550.54", "threads": 8},
    "measured_at": "2026-11-20T10:00:00+01:00",
}


def _post(client: TestClient, *rows: dict[str, Any], key: str | None = None) -> Any:
    return client.post("/v1/measurements", json={"measurements": list(rows)},
                       headers={"Idempotency-Key": key} if key else {})  # fmt: skip


def test_post_201_and_read_back(client: TestClient) -> None:
    response = _post(client, BODY, {**BODY, "batch_size": 128})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["count"] == 2 and len(body["ids"]) == 2 and not body["replayed"]
    listing = client.get("/v1/measurements", params={"source": "scheduler"}).json()
    assert listing["total"] == listing["count"] == 2
    first = listing["items"][0]
    assert [i["id"] for i in listing["items"]] == body["ids"]
    assert first["pass"] == "train_step" and first["precision"] == "bf16"
    assert (first["software_stack"], first["granularity"]) == ("pytorch-eager", "iteration")
    assert first["context"] == BODY["context"] and first["created_at"]
    assert first["measured_at"].startswith("2026-11-20T09:00:00")  # stored in UTC


def test_bad_rows_are_named_and_nothing_is_stored(client: TestClient) -> None:
    response = _post(client, BODY, {**BODY, "hardware_id": "no-such-gpu"}, BODY, {**BODY, "source": "justus2018"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_measurements"
    assert [(e["index"], e["code"]) for e in error["detail"]["errors"]] == [
        (1, "hardware_not_found"), (3, "reserved_source")]
    assert client.get("/v1/measurements").json()["total"] == 0


def test_a_job_row_naming_a_graph_that_is_not_stored_is_refused(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json={"input_shape": [8], "layers": [{"op": "linear", "out_features": 4}]})
    assert graph.status_code == 201, graph.text
    job = {**BODY, "source": "cluster", "op_kind": "job", "granularity": "job", "time_ms_median": 3.6e6}
    rows = [{**job, "config": {"graph_id": graph.json()["id"]}}, {**job, "config": {"graph_id": "0" * 64}},
            {**job, "config": {"graph_id": 12}}, {**job, "config": {"model": "resnet50"}}]
    response = _post(client, *rows)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_measurements"
    assert [(e["index"], e["code"], e["field"]) for e in error["detail"]["errors"]] == [
        (1, "graph_not_found", "config.graph_id"), (2, "graph_not_found", "config.graph_id")]
    assert client.get("/v1/measurements").json()["total"] == 0
    assert _post(client, rows[0], rows[3]).status_code == 201  # a stored graph, or none named


def test_an_iteration_row_naming_a_graph_that_is_not_stored_is_refused(client: TestClient) -> None:
    """An iteration row's ``config.graph_id`` names the model that ran as surely as a job row's: an id no
    stored graph has (or one that is no string) is refused with the code of a missing graph elsewhere in
    the API, the row index named, and nothing of the batch stored."""
    graph = client.post("/v1/graphs", json={"input_shape": [8], "layers": [{"op": "linear", "out_features": 4}]})
    assert graph.status_code == 201, graph.text
    rows = [{**BODY, "config": {"graph_id": graph.json()["id"]}}, BODY,
            {**BODY, "config": {"model": "resnet50", "graph_id": "f" * 64}}, {**BODY, "config": {"graph_id": 12}}]
    response = _post(client, *rows)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_measurements"
    assert [(e["index"], e["code"], e["field"]) for e in error["detail"]["errors"]] == [
        (2, "graph_not_found", "config.graph_id"), (3, "graph_not_found", "config.graph_id")]
    assert client.get("/v1/measurements").json()["total"] == 0
    assert _post(client, rows[0], rows[1]).status_code == 201


def test_a_row_the_device_cannot_have_run_is_refused(client: TestClient) -> None:
    """A precision the device has no arithmetic for (bf16 on a K80) or a GPU-only stack on a CPU is refused
    with the code a prediction of it answers: such a time was not measured as labelled, and stored it would
    train the predictor on a configuration that cannot exist."""
    rows = [{**BODY, "hardware_id": "k80"},                                            # bf16 on Kepler
            {**BODY, "hardware_id": "local", "precision": "fp32", "software_stack": "cuda-library"},
            {**BODY, "hardware_id": "local", "precision": "fp32"},                       # fine
            {**BODY, "hardware_id": "k80", "precision": "fp32"}]                          # fine
    response = _post(client, *rows)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_measurements"
    assert [(e["index"], e["code"], e["field"]) for e in error["detail"]["errors"]] == [
        (0, "precision_not_supported", "precision"), (1, "stack_not_supported", "software_stack")]
    assert client.get("/v1/measurements").json()["total"] == 0
    assert _post(client, rows[2], rows[3]).status_code == 201


def test_schema_errors_name_the_row_index(client: TestClient) -> None:
    for bad in ({"time_ms_median": 0}, {"time_ms_median": -3.0}, {"batch_size": 0}, {"pass": "sideways"},
                {"software_stack": "tf2-keras"}, {"granularity": "epoch"}, {"software_stack": None},
                {"unknown_field": 1}, {"measured_at": "2026-11-20T10:00:00"}):
        response = _post(client, BODY, BODY, {**BODY, **bad})
        assert response.status_code == 422, bad
        error = response.json()["error"]
        assert error["code"] == "validation_error"
        assert {tuple(e["loc"][:3]) for e in error["detail"]["errors"]} == {("body", "measurements", 2)}, bad
    for empty in ({"measurements": []}, {}, [BODY]):
        assert client.post("/v1/measurements", json=empty).status_code == 422
    assert client.get("/v1/measurements").json()["total"] == 0


def test_idempotency_key(client: TestClient) -> None:
    first = _post(client, BODY, {**BODY, "batch_size": 2}, key="sched-7f3a")
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    # the same batch with the keys in another order and other whitespace is the same body
    reordered = {"measurements": [dict(reversed(BODY.items())), {**BODY, "batch_size": 2}]}
    same = client.post("/v1/measurements", content=json.dumps(reordered, indent=2),
                       headers={"Idempotency-Key": "sched-7f3a", "content-type": "application/json"})
    assert same.status_code == 201 and same.json() == {**first.json(), "replayed": True}
    assert same.headers["Idempotent-Replayed"] == "true"
    assert client.get("/v1/measurements").json()["total"] == 2
    other = _post(client, {**BODY, "batch_size": 3}, key="sched-7f3a")
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert _post(client, BODY, key="x" * 256).json()["error"]["code"] == "invalid_idempotency_key"
    assert client.get("/v1/measurements").json()["total"] == 2


def test_concurrent_retries_with_one_key_store_once(client: TestClient) -> None:
    answers: list[Any] = []
    barrier = threading.Barrier(4)

    def send() -> None:
        barrier.wait()
        answers.append(_post(client, *[{**BODY, "batch_size": b} for b in range(1, 40)], key="burst"))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [201] * 4, [a.text for a in answers]
    assert len({tuple(a.json()["ids"]) for a in answers}) == 1
    assert sum(not a.json()["replayed"] for a in answers) == 1
    assert client.get("/v1/measurements").json()["total"] == 39


def test_list_filters_and_paging(client: TestClient) -> None:
    rows = [{**BODY, "hardware_id": hw, "op_kind": kind, "granularity": "layer", "precision": prec, "pass": pass_,
             "measured_at": at}
            for hw, kind, prec, pass_, at in (
                ("a100-sxm4-40gb", "conv", "bf16", "train_step", "2026-11-01T00:00:00Z"),
                ("a100-sxm4-40gb", "gemm", "fp32", "forward", "2026-11-10T00:00:00Z"),
                ("h100-sxm", "conv", "fp32", "forward", "2026-11-20T00:00:00Z"))]  # fmt: skip
    assert _post(client, *rows).status_code == 201

    def total(**params: Any) -> int:
        r = client.get("/v1/measurements", params=params)
        assert r.status_code == 200, r.text
        return int(r.json()["total"])

    assert total() == 3
    assert total(hardware_id="a100-sxm4-40gb") == 2
    assert total(op_kind="conv") == 2 and total(precision="fp32") == 2 and total(**{"pass": "forward"}) == 2
    assert total(source="scheduler", granularity="layer") == 3 and total(source="ci") == 0
    assert total(measured_from="2026-11-05T00:00:00Z") == 2
    assert total(measured_from="2026-11-05T00:00:00Z", measured_to="2026-11-20T00:00:00Z") == 1
    page = client.get("/v1/measurements", params={"limit": 1, "offset": 1}).json()
    assert page["count"] == 1 and page["total"] == 3 and page["offset"] == 1
    ids, cursor = [], None
    while True:
        body = client.get("/v1/measurements", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        ids += [i["id"] for i in body["items"]]
        if (cursor := body["next_cursor"]) is None:
            break
    assert len(ids) == 3 == len(set(ids))
    for bad in ({"limit": 0}, {"limit": 5000}, {"cursor": -1}, {"pass": "sideways"},
                {"measured_from": "2026-11-05"}, {"measured_from": "yesterday"}):  # fmt: skip
        assert client.get("/v1/measurements", params=bad).status_code == 422, bad
    for bad in ({"cursor": 1, "offset": 1},
                {"measured_from": "2026-11-20T00:00:00Z", "measured_to": "2026-11-01T00:00:00Z"}):
        r = client.get("/v1/measurements", params=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", bad


def test_csv_export_streams_every_matching_row(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "CSV_CHUNK", 7)  # several keyset chunks
    assert _post(client, *[{**BODY, "batch_size": b, "config": {"model": "m, \"quoted\"", "b": b}}
                           for b in range(1, 24)], {**BODY, "hardware_id": "h100-sxm"}).status_code == 201  # fmt: skip
    r = client.get("/v1/measurements.csv", params={"hardware_id": "a100-sxm4-40gb"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert list(rows[0]) == list(service.CSV_COLUMNS)
    assert [int(row["batch_size"]) for row in rows] == list(range(1, 24))
    assert json.loads(rows[4]["config"]) == {"model": 'm, "quoted"', "b": 5}
    assert float(rows[0]["time_ms_median"]) == BODY["time_ms_median"] and rows[0]["pass"] == "train_step"
    assert len(list(csv.DictReader(io.StringIO(client.get("/v1/measurements.csv").text)))) == 24
    empty = client.get("/v1/measurements.csv", params={"source": "nobody"})
    assert empty.status_code == 200 and empty.text.strip() == ",".join(service.CSV_COLUMNS)
    assert client.get("/v1/measurements.csv", params={"pass": "sideways"}).status_code == 422


def test_openapi_lists_errors(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    post = paths["/v1/measurements"]["post"]
    assert {"201", "409", "422"} <= set(post["responses"])
    assert "/v1/measurements.csv" in paths


@pytest.mark.parametrize("path", ["/v1/measurements", "/v1/measurements.csv"])
def test_a_precision_filter_no_row_can_have_is_422_not_an_empty_page(client: TestClient, path: str) -> None:
    """``pass`` and ``granularity`` filters were checked, ``precision`` was not: a typo (``fp23``, ``float32``)
    answered an empty listing, indistinguishable from "no such measurements"."""
    assert _post(client, BODY).status_code == 201
    response = client.get(path, params={"precision": "float32"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "validation_error"
    for precision, rows in (("bf16", 1), ("fp32-strict", 0), ("int8", 0)):
        listed = client.get("/v1/measurements", params={"precision": precision})
        assert listed.status_code == 200 and listed.json()["total"] == rows


def test_a_batch_over_the_row_limit_is_413_too_many_items_like_the_other_batch_endpoints(
        client: TestClient) -> None:
    """Batch predictions and job estimates answer a call over their item limit 413 ``too_many_items``;
    measurements answered 422 ``validation_error`` for the same mistake."""
    response = _post(client, *[BODY] * (MAX_BATCH + 1))
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "too_many_items"
    assert error["detail"] == {"count": MAX_BATCH + 1, "limit": MAX_BATCH}
    assert client.get("/v1/measurements").json()["total"] == 0
