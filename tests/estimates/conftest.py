"""Fixtures of the callers' endpoints: stored real graphs and a custom 8-GPU node with a link and a price."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.hardware.catalog import load_catalog, spec_to_dict
from tests.estimates.models import mlp_onnx
from tests.helpers import light_model

NODE = "a100-node-test"
LONELY = "a100-no-link-test"


def upload(client: TestClient, content: bytes, name: str) -> str:
    r = client.post("/v1/graphs", files={"file": (f"{name}.onnx", content, "application/octet-stream")})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


@pytest.fixture
def resnet_id(client: TestClient) -> str:
    return upload(client, light_model("resnet50"), "resnet50")


@pytest.fixture
def mlp_id(client: TestClient) -> str:
    return upload(client, mlp_onnx(1024), "mlp")


@pytest.fixture
def node(client: TestClient) -> str:
    """The A100-SXM4-40GB datasheet as a custom device with NVLink 3 (300 GB/s per direction per GPU,
    NVIDIA A100 datasheet), a few-µs ring step and a list price, so data parallel and money are defined
    whatever the built-in catalog lists."""
    return _custom(client, id=NODE, name="A100 node (test)", interconnect="nvlink",
                   interconnect_bandwidth_bytes_per_s=300e9, interconnect_latency_s=5e-6, price_usd_per_hour=4.1,
                   idle_power_w=60.0)


@pytest.fixture
def lonely(client: TestClient) -> str:
    """An A100 that lists no interconnect and no price: data parallel and money are undefined on it."""
    return _custom(client, id=LONELY, name="A100 without link (test)", interconnect=None,
                   interconnect_bandwidth_bytes_per_s=None, interconnect_latency_s=None, price_usd_per_hour=None)


def _custom(client: TestClient, **changes: object) -> str:
    spec = {**spec_to_dict(load_catalog()["a100-sxm4-40gb"]), **changes}
    spec.pop("builtin", None)
    r = client.post("/v1/hardware", json={k: v for k, v in spec.items() if v is not None})
    assert r.status_code == 201, r.text
    return str(changes["id"])


@pytest.fixture
def custom_op_id(client: TestClient) -> str:
    """A graph whose only layer is a custom-domain op: nothing in it has a cost formula."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MyCustomOp", ["x"], ["y"], domain="custom")], "custom-only",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    return upload(client, model.SerializeToString(), "custom-only")
