"""POST /v1/predictions/batch: many items, one predictor call, the numbers of POST /v1/predictions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.deps import get_predictor
from app.estimates.schemas import MAX_BATCH_ITEMS

CNN = {"name": "small-cnn", "input_shape": [3, 32, 32],
       "layers": [{"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"},
                  {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"},
                  {"op": "flatten"}, {"op": "linear", "out_features": 10}]}


class CountingPredictor:
    """The app's predictor, counting its vectorised ``estimate_tables`` calls and the layer rows asked."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.version, self.calls, self.queries = inner, inner.version, 0, 0

    def estimate(self, queries: Sequence[Any]) -> Any:
        raise AssertionError("the batch path must not fall back to per-query estimates")

    def estimate_tables(self, items: Sequence[Any]) -> Any:
        self.calls += 1
        self.queries += sum(len(idx) for _, idx, _ in items)
        return self.inner.estimate_tables(items)


@pytest.fixture
def counting(client: TestClient) -> Iterator[CountingPredictor]:
    """The production predictor wrapped for counting, swapped in through ``dependency_overrides``."""
    wrapper = CountingPredictor(client.app.state.predictors.current())  # type: ignore[attr-defined]
    client.app.dependency_overrides[get_predictor] = lambda: wrapper  # type: ignore[attr-defined]
    yield wrapper
    client.app.dependency_overrides.pop(get_predictor, None)  # type: ignore[attr-defined]


def test_summaries_match_single_predictions_and_use_one_predictor_call(
        client: TestClient, resnet_id: str, counting: CountingPredictor) -> None:
    items = [
        {"graph_id": resnet_id, "hardware_id": "a100-sxm4-40gb", "batch_size": 32},
        {"graph_id": resnet_id, "hardware_id": "v100-sxm2-16gb", "batch_size": 64, "precision": "fp16"},
        {"graph_id": resnet_id, "hardware_id": "t4", "batch_size": 8, "mode": "inference"},
        {"graph": CNN, "hardware_id": "a100-sxm4-40gb", "batch_size": 128, "optimizer": "adam"},
    ]
    r = client.post("/v1/predictions/batch", json={"items": items})
    assert r.status_code == 200, r.text
    body = r.json()
    assert counting.calls == 1  # every layer of every item in one batched call
    assert body["failed"] == 0 and body["count"] == 4
    assert body["unique_layer_queries"] == counting.queries == body["layer_queries"] > 0
    again = client.post("/v1/predictions/batch", json={"items": items}).json()
    # the same scenarios again: recalled from the predictor's scenario cache, nothing predicted
    assert counting.calls == 1 and again["unique_layer_queries"] == 0
    assert again["layer_queries"] == body["layer_queries"] and again["items"] == body["items"]
    for item, answer in zip(items, body["items"], strict=True):
        assert answer["prediction"] is None  # summaries only by default
        single = client.post("/v1/predictions", json=item).json()
        s = answer["summary"]
        # the learned model runs in float32 and onnxruntime's GEMM kernels depend on how many rows one call
        # holds (the batch deduplicates repeated layers): equal up to float32 round-off, not bit for bit
        assert s["iteration_ms"] == pytest.approx(single["iteration"]["time_ms"], rel=1e-6)
        assert s["iteration_ms_p90"] == pytest.approx(single["iteration"]["time_ms_p90"], rel=1e-6)
        assert s["backward_ms"] == pytest.approx(single["iteration"]["backward_ms"], rel=1e-6)
        assert s["peak_memory_bytes"] == single["memory"]["total_bytes"]
        assert s["fits"] == single["memory"]["fits"]
        assert s["energy_j"] > 0
    assert body["items"][2]["summary"]["backward_ms"] == 0  # inference


def test_detail_layers_is_the_full_prediction(client: TestClient, resnet_id: str) -> None:
    item = {"graph_id": resnet_id, "hardware_id": "p100", "batch_size": 16}
    batch = client.post("/v1/predictions/batch", json={"items": [item], "detail": "layers"}).json()
    full = batch["items"][0]["prediction"]
    single = client.post("/v1/predictions", json=item).json()
    assert [row["total_ms"] for row in full["layers"]] == pytest.approx([row["total_ms"] for row in single["layers"]])
    assert full["memory"] == single["memory"]


def test_per_item_errors_do_not_fail_the_batch(client: TestClient, resnet_id: str) -> None:
    items = [
        {"graph_id": resnet_id, "hardware_id": "k80", "batch_size": 8, "precision": "bf16"},
        {"graph_id": "0" * 64, "hardware_id": "p100", "batch_size": 8},
        {"graph_id": resnet_id, "hardware_id": "no-such-gpu", "batch_size": 8},
        {"graph_id": resnet_id, "hardware_id": "p100", "batch_size": 8, "dims": {"seq": 3}},
        {"graph_id": resnet_id, "hardware_id": "p100", "batch_size": 8},
    ]
    body = client.post("/v1/predictions/batch", json={"items": items}).json()
    codes = [(a["error"] or {}).get("code") for a in body["items"]]
    assert codes == ["precision_not_supported", "graph_not_found", "hardware_not_found", "unknown_dimension", None]
    assert body["failed"] == 4 and body["items"][4]["summary"]["iteration_ms"] > 0


def test_gpu_only_stack_on_a_cpu_fails_its_item_only(client: TestClient, resnet_id: str) -> None:
    items = [
        {"graph_id": resnet_id, "hardware_id": "local", "batch_size": 8, "software_stack": "pytorch-cuda-graph"},
        {"graph_id": resnet_id, "hardware_id": "p100", "batch_size": 8, "software_stack": "pytorch-cuda-graph"},
        {"graph_id": resnet_id, "hardware_id": "local", "batch_size": 8, "software_stack": "pytorch-compiled"},
    ]
    body = client.post("/v1/predictions/batch", json={"items": items, "detail": "layers"}).json()
    codes = [(a["error"] or {}).get("code") for a in body["items"]]
    assert codes == ["stack_not_supported", None, None]
    assert "pytorch-cuda-graph" in body["items"][0]["error"]["message"]


def test_items_carry_the_warnings_of_their_single_prediction(client: TestClient, resnet_id: str) -> None:
    items = [
        {"graph_id": resnet_id, "hardware_id": "t4", "batch_size": 4096},  # peak over the T4's 16 GB
        {"graph_id": resnet_id, "hardware_id": "local", "batch_size": 8},  # a CPU: outside the learned data
        {"graph_id": resnet_id, "hardware_id": "a100-sxm4-40gb", "batch_size": 32},
    ]
    body = client.post("/v1/predictions/batch", json={"items": items}).json()
    summaries = [item["summary"] for item in body["items"]]
    singles = [client.post("/v1/predictions", json=item).json() for item in items]
    assert [s["warnings"] for s in summaries] == [p["warnings"] for p in singles]
    assert any("exceeds" in w for w in summaries[0]["warnings"])


def test_detail_is_documented_and_read_as_a_body_field(client: TestClient, resnet_id: str) -> None:
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/v1/predictions/batch"]["post"]
    assert not [p for p in op.get("parameters", []) if p["name"] == "detail"]
    field = spec["components"]["schemas"]["BatchPredictionCreate"]["properties"]["detail"]
    assert "not a query parameter" in field["description"] and "body" in op["description"]
    item = {"graph_id": resnet_id, "hardware_id": "p100", "batch_size": 8}
    r = client.post("/v1/predictions/batch", json={"items": [item]}, params={"detail": "layers"})
    assert r.status_code == 422, r.text  # a query detail is refused, not silently ignored


def test_limits(client: TestClient) -> None:
    item = {"graph": CNN, "hardware_id": "p100", "batch_size": 1}
    r = client.post("/v1/predictions/batch", json={"items": [item] * (MAX_BATCH_ITEMS + 1)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_items"
    assert client.post("/v1/predictions/batch", json={"items": []}).status_code == 422
    bad = client.post("/v1/predictions/batch", json={"items": [{**item, "graph_id": "x"}]})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"


def test_a_repeated_scenario_is_recalled_with_the_same_numbers(
        client: TestClient, resnet_id: str, counting: CountingPredictor) -> None:
    items = [{"graph_id": resnet_id, "hardware_id": "a100-sxm4-40gb", "batch_size": 32}]
    first = client.post("/v1/predictions/batch", json={"items": items}).json()
    again = client.post("/v1/predictions/batch", json={"items": items + [{**items[0], "batch_size": 48}]}).json()
    assert again["items"][0]["summary"] == first["items"][0]["summary"]
    assert first["unique_layer_queries"] > 0 and counting.calls == 2
    # the second call predicted only the new binding (batch 48), not the recalled one
    assert 0 < again["unique_layer_queries"] <= first["unique_layer_queries"]
    assert again["layer_queries"] == 2 * first["layer_queries"]
