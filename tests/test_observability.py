"""Observability: /metrics series, request ids, JSON logs, /healthz and /readyz."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from app.observability import REGISTRY, JsonFormatter, get_engine, record_retrain

SMALL_CNN = {
    "name": "small-cnn", "input_shape": [3, 32, 32],
    "layers": [{"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"},
               {"op": "flatten"}, {"op": "linear", "out_features": 10}],
}
REPORTED = {
    "hardware_id": "p100", "source": "obs-test", "op_kind": "iteration", "pass": "train_step",
    "optimizer": "sgd", "precision": "fp32", "software_stack": "pytorch-eager", "granularity": "iteration",
    "batch_size": 8, "config": {"model": "small-cnn"}, "time_ms_median": 12.5, "repetitions": 5,
    "context": {}, "measured_at": "2026-11-20T10:00:00+00:00",
}


def _sample(text: str, name: str, **labels: str) -> float | None:
    """Value of the series ``name{labels}`` in a Prometheus text exposition (labels matched exactly)."""
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if found == labels:
            return float(match.group(3))
    return None


def test_metrics_after_a_prediction_and_a_measurement(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN)
    assert graph.status_code in (200, 201), graph.text
    version = client.get("/healthz").json()["predictor_version"]
    before = client.get("/metrics").text
    predicted = client.post("/v1/predictions", json={"graph_id": graph.json()["id"], "hardware_id": "p100",
                                                     "batch_size": 8, "mode": "training", "optimizer": "sgd"})
    assert predicted.status_code == 200, predicted.text
    methods = predicted.json()["methods"]
    assert client.post("/v1/measurements", json={"measurements": [REPORTED]}).status_code == 201
    after = client.get("/metrics")
    assert after.status_code == 200
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text

    def delta(name: str, **labels: str) -> float:
        return (_sample(text, name, **labels) or 0.0) - (_sample(before, name, **labels) or 0.0)

    assert delta("layercast_predictions_total", predictor_version=version) == 1
    for method, layers in methods.items():
        if layers:
            assert delta("layercast_predicted_layers_total", predictor_version=version, method=method) == layers
    assert delta("layercast_measurements_reported_total", source="obs-test") == 1
    assert _sample(text, "layercast_measurements_stored", source="obs-test") == 1
    # latency by route template, not by the raw path with the graph id in it
    assert delta("layercast_http_request_duration_seconds_count",
                 method="POST", route="/v1/predictions", status="200") == 1
    assert _sample(text, "layercast_http_request_duration_seconds_count",
                   method="POST", route="/v1/graphs", status=str(graph.status_code)) is not None
    client.get(f"/v1/graphs/{graph.json()['id']}/layers")
    templated = client.get("/metrics").text
    assert 'route="/v1/graphs/{graph_id}/layers"' in templated
    assert graph.json()["id"] not in templated


def test_unknown_paths_share_one_series(client: TestClient) -> None:
    client.get("/no/such/path/1")
    client.get("/no/such/path/2")
    text = client.get("/metrics").text
    assert _sample(text, "layercast_http_request_duration_seconds_count",
                   method="GET", route="unmatched", status="404") is not None
    assert "/no/such/path" not in text


def test_retrain_counter_is_exported(client: TestClient) -> None:
    before = REGISTRY.get_sample_value("layercast_retrain_runs_total", {"outcome": "rejected"}) or 0.0
    record_retrain("rejected")
    text = client.get("/metrics").text
    assert _sample(text, "layercast_retrain_runs_total", outcome="rejected") == before + 1


def test_request_id_echoed_or_made(client: TestClient) -> None:
    echoed = client.get("/healthz", headers={"X-Request-ID": "abc-123.x"})
    assert echoed.headers["x-request-id"] == "abc-123.x"
    made = client.get("/healthz")
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    hostile = client.get("/healthz", headers={"X-Request-ID": 'evil"\tinjected'})
    assert hostile.headers["x-request-id"] != 'evil"\tinjected'
    assert re.fullmatch(r"[0-9a-f]{32}", hostile.headers["x-request-id"])
    # errors carry it too
    missing = client.get("/v1/graphs/nope", headers={"X-Request-ID": "req-404"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "req-404"


def test_logs_are_json_with_the_request_id(client: TestClient) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    layercast = logging.getLogger("layercast")
    old_level = layercast.level
    layercast.addHandler(handler)
    layercast.setLevel(logging.INFO)
    client.app.dependency_overrides[get_engine] = lambda: create_engine("sqlite:////no/such/dir/x.db")  # type: ignore[attr-defined]
    try:
        client.get("/healthz", headers={"X-Request-ID": "log-me-1"})
        client.get("/readyz", headers={"X-Request-ID": "log-me-2"})  # logs the database failure
    finally:
        client.app.dependency_overrides.clear()  # type: ignore[attr-defined]
        layercast.removeHandler(handler)
        layercast.setLevel(old_level)
    lines = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    access = [entry for entry in lines if entry["logger"] == "layercast.access"]
    assert [entry["request_id"] for entry in access] == ["log-me-1", "log-me-2"]
    # a log line written inside the request (not by the middleware) carries the id from the context
    failure = [entry for entry in lines if entry["logger"] == "layercast"]
    assert failure and failure[0]["request_id"] == "log-me-2" and "exc_info" in failure[0]
    line = access[0]
    assert line["route"] == "/healthz" and line["status"] == 200 and line["method"] == "GET"
    assert line["duration_ms"] >= 0 and line["level"] == "info" and line["logger"] == "layercast.access"


def test_json_formatter_includes_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("t").makeRecord("t", logging.ERROR, __file__, 1, "failed %s", ("x",),
                                                   exc_info=__import__("sys").exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "failed x" and "ValueError: boom" in line["exc_info"]
    assert "request_id" not in line  # outside a request


def test_healthz_is_alive(client: TestClient) -> None:
    body = client.get("/healthz").json()
    assert body["status"] == "ok" and body["predictor_version"]


def test_readyz_ready(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["status"] == "ready" and response.json()["database"] == "ok"


def test_readyz_503_when_database_unreachable(client: TestClient, tmp_path: Path) -> None:
    unreachable = create_engine(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}")
    client.app.dependency_overrides[get_engine] = lambda: unreachable  # type: ignore[attr-defined]
    try:
        response = client.get("/readyz")
        health = client.get("/healthz")
        metrics = client.get("/metrics")
    finally:
        client.app.dependency_overrides.clear()  # type: ignore[attr-defined]
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "not_ready" and error["detail"]["database"] == "unreachable"
    assert health.status_code == 200  # liveness does not depend on the database
    assert metrics.status_code == 200 and "layercast_http_request_duration_seconds" in metrics.text


def test_readyz_503_without_predictor(client: TestClient) -> None:
    client.app.state.predictors = None  # type: ignore[attr-defined]
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["error"]["detail"] == {"database": "ok", "predictor": "missing"}


def test_callers_endpoints_count_their_predictions(client: TestClient) -> None:
    graph_id = client.post("/v1/graphs", json=SMALL_CNN).json()["id"]
    version = client.get("/healthz").json()["predictor_version"]

    def counted() -> float:
        return _sample(client.get("/metrics").text, "layercast_predictions_total", predictor_version=version) or 0.0

    start = counted()
    items = [{"graph_id": graph_id, "hardware_id": hw, "batch_size": 8} for hw in ("p100", "v100-sxm2-16gb")]
    items.append({"graph_id": graph_id, "hardware_id": "no-such-device", "batch_size": 8})
    batch = client.post("/v1/predictions/batch", json={"items": items})
    assert batch.status_code == 200 and batch.json()["failed"] == 1
    assert counted() == start + 2  # the failed item is not a prediction
    jobs = [{"graph_id": graph_id, "hardware_id": "p100", "batch_size": 8, "dataset_size": 800, "epochs": 1}] * 3
    assert client.post("/v1/job-estimates", json={"jobs": jobs}).status_code == 200
    assert counted() == start + 5
    compared = client.post("/v1/comparisons", json={"graph_id": graph_id, "batch_size": 8, "dataset_size": 800,
                                                    "epochs": 1, "hardware_ids": ["p100", "v100-sxm2-16gb"],
                                                    "sweep": {"hardware_id": "p100", "batch_sizes": [4, 8]}})
    assert compared.status_code == 200, compared.text
    assert counted() == start + 5 + len(compared.json()["rows"]) + 2
