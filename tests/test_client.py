"""The Python client (``app.client``) against the real app, no network: the sync client over the started
app's ``TestClient`` (an ``httpx.Client``), the async one over ``httpx.ASGITransport``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.client import AsyncClient, Client, LayercastAPIError, describe_module
from app.config import Settings
from app.graphs.schemas import GraphList, GraphRead
from app.hardware.schemas import HardwareCreate
from app.predictions.schemas import PredictionCreate, PredictionRead
from tests.hardware.test_service import CUSTOM
from tests.helpers import light_model
from tests.security.test_auth import _make_key

SMALL_CNN = {
    "name": "small-cnn", "input_shape": [3, 32, 32],
    "layers": [{"op": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1}, {"op": "relu"},
               {"op": "flatten"}, {"op": "linear", "out_features": 10}],
}
MEASUREMENT = {
    "hardware_id": "p100", "source": "client-test", "op_kind": "iteration", "pass": "train_step",
    "optimizer": "sgd", "precision": "fp32", "software_stack": "pytorch-eager", "granularity": "iteration",
    "batch_size": 8, "config": {"model": "small-cnn"}, "time_ms_median": 12.5, "repetitions": 5,
    "context": {}, "measured_at": "2026-11-20T10:00:00+00:00",
}


@pytest.fixture
def api(client: TestClient) -> Client:
    return Client(http=client)


def test_graphs_roundtrip(client: TestClient, settings: Settings, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # a key owns what it uploads and may delete it (anonymous uploads are deleted by admins only)
    api = Client(http=client, api_key=_make_key(settings.database_url, "client", "graphs", capsys=capsys))
    onnx_path = tmp_path / "resnet50.onnx"
    onnx_path.write_bytes(light_model("resnet50"))
    from_path = api.upload_onnx(onnx_path)
    assert isinstance(from_path, GraphRead)
    assert from_path.name == "resnet50.onnx" and from_path.source_format == "onnx"
    assert from_path.summary.op_counts["Conv"] == 53
    again = api.upload_onnx(onnx_path.read_bytes(), name="again")
    assert again.id == from_path.id  # same content hash
    js = api.upload_json(SMALL_CNN, batch_size=4)
    assert js.source_format == "json" and js.summary.batch_size == 4
    assert api.get_graph(js.id).id == js.id
    assert {g.id for g in api.list_graphs().items} >= {js.id, from_path.id}
    layers = api.graph_layers(js.id, batch_size=2)
    assert len(layers.layers) == js.summary.layer_count
    api.delete_graph(js.id)
    with pytest.raises(LayercastAPIError) as err:
        api.get_graph(js.id)
    assert err.value.status_code == 404 and err.value.code == "graph_not_found"
    assert err.value.detail


def test_hardware(api: Client) -> None:
    assert "p100" in {h.id for h in api.list_hardware(kind="gpu").items}
    assert api.get_hardware("p100").kind == "gpu"
    created = api.create_hardware(HardwareCreate.model_validate(CUSTOM))
    assert created.id == CUSTOM["id"] and created.builtin is False
    with pytest.raises(LayercastAPIError) as err:
        api.create_hardware(CUSTOM)
    assert err.value.status_code == 409 and err.value.code == "hardware_exists"
    with pytest.raises(LayercastAPIError) as missing:
        api.get_hardware("no-such-gpu")
    assert missing.value.code == "hardware_not_found"


def test_predictions_and_server_errors(api: Client) -> None:
    graph = api.upload_json(SMALL_CNN)
    prediction = api.predict(graph_id=graph.id, hardware_id="p100", batch_size=8)
    assert isinstance(prediction, PredictionRead)
    assert prediction.iteration.time_ms > 0 and len(prediction.layers) == graph.summary.layer_count
    same = api.predict(PredictionCreate(graph_id=graph.id, hardware_id="p100", batch_size=8))
    assert same.iteration.time_ms == prediction.iteration.time_ms
    with pytest.raises(LayercastAPIError) as err:
        api.predict(graph_id="0" * 64, hardware_id="p100", batch_size=8)
    assert err.value.code == "graph_not_found" and err.value.status_code == 404


def test_caller_endpoints(api: Client) -> None:
    graph = api.upload_json(SMALL_CNN)
    batch = api.predict_batch({"items": [{"graph_id": graph.id, "hardware_id": "p100", "batch_size": 8},
                                         {"graph_id": "0" * 64, "hardware_id": "p100", "batch_size": 8}]})
    assert batch.count == 2 and batch.failed == 1
    assert batch.items[0].summary is not None and batch.items[0].summary.iteration_ms > 0
    assert batch.items[1].error is not None and batch.items[1].error.code == "graph_not_found"
    jobs = api.estimate_jobs({"jobs": [{"graph_id": graph.id, "hardware_id": "p100", "batch_size": 8,
                                        "dataset_size": 800, "epochs": 2}]})
    assert jobs.estimates[0].p50_s is not None and jobs.estimates[0].p50_s > 0
    compared = api.compare({"graph_id": graph.id, "batch_size": 8, "dataset_size": 800, "epochs": 1,
                            "hardware_ids": ["p100", "v100-sxm2-16gb"]})
    assert {row.hardware_id for row in compared.rows} == {"p100", "v100-sxm2-16gb"}
    # keywords, as predict() takes them, and a dict overridden by keywords
    by_keywords = api.compare(graph_id=graph.id, batch_size=8, dataset_size=800, epochs=1, hardware_ids=["p100"])
    assert [row.hardware_id for row in by_keywords.rows] == ["p100"]
    overridden = api.compare({"graph_id": graph.id, "batch_size": 8, "dataset_size": 800, "epochs": 1,
                              "hardware_ids": ["p100"]}, hardware_ids=["v100-sxm2-16gb"])
    assert [row.hardware_id for row in overridden.rows] == ["v100-sxm2-16gb"]


def test_invalid_request_fails_before_sending(api: Client) -> None:
    with pytest.raises(ValidationError):
        api.predict(graph_id="x", hardware_id="p100", batch_size=0)


def test_measurements(api: Client) -> None:
    stored = api.report_measurements([MEASUREMENT, {**MEASUREMENT, "batch_size": 16}], idempotency_key="client-1")
    assert stored.count == 2 and not stored.replayed
    again = api.report_measurements([MEASUREMENT, {**MEASUREMENT, "batch_size": 16}], idempotency_key="client-1")
    assert again.replayed and again.ids == stored.ids
    listed = api.list_measurements(source="client-test", limit=1)
    assert listed.total == 2 and listed.items[0].id == stored.ids[0] and listed.items[0].pass_ == "train_step"
    second = api.list_measurements(source="client-test", limit=1, cursor=listed.next_cursor)
    assert [m.id for m in second.items] == stored.ids[1:]
    with pytest.raises(LayercastAPIError) as err:
        api.report_measurements([MEASUREMENT, {**MEASUREMENT, "source": "justus2018"}])
    assert err.value.status_code == 422 and err.value.code == "invalid_measurements"
    assert err.value.detail["errors"][0]["index"] == 1


def test_async_client_over_asgi_transport(client: TestClient) -> None:
    async def run() -> tuple[str, float, str, list[str]]:
        transport = httpx.ASGITransport(app=client.app)
        async with AsyncClient(http=httpx.AsyncClient(transport=transport, base_url="http://test")) as api:
            graph = await api.upload_json(SMALL_CNN)
            prediction = await api.predict(graph_id=graph.id, hardware_id="p100", batch_size=8)
            hardware = await api.get_hardware("p100")
            compared = await api.compare(graph_id=graph.id, batch_size=8, dataset_size=80, epochs=1,
                                         hardware_ids=["p100"])
            try:
                await api.get_graph("f" * 64)
            except LayercastAPIError as exc:
                code = exc.code
            return hardware.id, prediction.iteration.time_ms, code, [r.hardware_id for r in compared.rows]

    hardware_id, time_ms, code, compared = asyncio.run(run())
    assert hardware_id == "p100" and time_ms > 0 and code == "graph_not_found" and compared == ["p100"]


def test_a_newer_servers_added_fields_are_ignored_but_a_missing_one_fails(api: Client, client: TestClient) -> None:
    """A client older than the server reads answers that carry fields it does not know (top level and in nested
    items); an answer that lacks a field the client needs is still an error, not a silent default."""
    api.upload_json(SMALL_CNN)
    real = client.get("/v1/graphs").json()
    assert real["items"]

    def answer(body: dict[str, object]) -> Client:
        return Client(http=httpx.Client(base_url="http://x", transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=body))))

    newer = {**real, "added_later": 1, "items": [{**item, "added_later": {"x": 1}} for item in real["items"]]}
    assert answer(newer).list_graphs() == GraphList.model_validate(real)
    older = {**real, "items": [{k: v for k, v in item.items() if k != "summary"} for item in real["items"]]}
    with pytest.raises(ValidationError):
        answer(older).list_graphs()


def test_non_problem_error_body() -> None:
    error = LayercastAPIError.from_response(httpx.Response(502, text="<html>bad gateway</html>"))
    assert error.status_code == 502 and error.code == "http_502" and "bad gateway" in error.message


def test_describe_module_two_lines(api: Client) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.train()
    onnx_bytes = describe_module(model, torch.randn(2, 16))
    assert model.training  # mode restored
    graph = api.upload_onnx(onnx_bytes)
    assert graph.summary.op_counts.get("Gemm", 0) + graph.summary.op_counts.get("MatMul", 0) == 2
    assert graph.summary.params == 16 * 32 + 32 + 32 * 4 + 4
    cost = api.predict_module(model, (torch.randn(2, 16),), hardware_id="p100", batch_size=64)
    assert cost.batch_size == 64 and cost.iteration.time_ms > 0
    assert cost.graph_id == graph.id  # the same export, stored once


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_predict_module_exports_in_the_predictions_mode_and_leaves_the_module_as_it_was(api: Client,
                                                                                       mode: str) -> None:
    """The client exported every module in eval mode, so a training prediction of a network with BatchNorm
    carried the service's eval-mode export warning; a training-mode export must not move the running
    statistics (its forward runs once) nor the module's mode."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10), torch.nn.BatchNorm1d(10))
    bn = model[1]
    with torch.no_grad():  # statistics no single batch would produce, so any update shows
        bn.running_mean.fill_(0.25)
        bn.running_var.fill_(4.0)
    for training, batch in ((True, 2), (False, 2), (True, 1)):  # batch 1: BatchNorm cannot train on it
        model.train(training)
        before = {name: b.clone() for name, b in model.named_buffers()}
        cost = api.predict_module(model, (torch.randn(batch, 3, 8, 8) * 5 + 3,), hardware_id="p100",
                                  batch_size=16, mode=mode)
        assert cost.mode == mode and cost.iteration.time_ms > 0
        assert not any(w.startswith("eval-mode export") for w in cost.warnings), cost.warnings
        assert model.training is training  # the module's own mode, whatever the prediction's
        for name, b in model.named_buffers():
            assert torch.equal(b, before[name]), name
    graph = api.get_graph(cost.graph_id)
    assert graph.summary.op_counts.get("BatchNormalization") == 2


def test_client_import_does_not_import_torch() -> None:
    code = "import sys, app.client; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
