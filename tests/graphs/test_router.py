"""HTTP tests of graph upload and per-layer costs on a real migrated database."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.graphs.models import StoredGraph
from tests.helpers import light_model

JSON_GRAPH = {
    "name": "small-cnn",
    "input_shape": [3, 32, 32],
    "layers": [
        {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1},
        {"op": "relu"},
        {"op": "global_avgpool"},
        {"op": "flatten"},
        {"op": "linear", "out_features": 10},
    ],
}


def _upload(client: TestClient, name: str, **params):
    return client.post(
        "/v1/graphs", files={"file": (f"{name}.onnx", light_model(name), "application/octet-stream")}, params=params
    )


def test_upload_onnx_multipart_returns_id_and_summary(client: TestClient) -> None:
    r = _upload(client, "resnet50")
    assert r.status_code == 201, r.text
    body = r.json()
    assert len(body["id"]) == 64
    s = body["summary"]
    assert s["layer_count"] > 50
    assert s["op_counts"]["Conv"] == 53
    assert abs(s["params"] / 25.6e6 - 1) < 0.03
    assert abs(s["forward_macs"] / 4.1e9 - 1) < 0.03
    assert s["forward_flops"] >= 2 * s["forward_macs"]
    assert s["unsupported"] == []


def test_same_content_is_stored_once(client: TestClient, session: Session) -> None:
    first = _upload(client, "squeezenet")
    second = _upload(client, "squeezenet")
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert session.scalar(select(func.count()).select_from(StoredGraph)) == 1


def test_raw_octet_stream_upload(client: TestClient) -> None:
    r = client.post("/v1/graphs", content=light_model("vgg19"), headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert abs(r.json()["summary"]["params"] / 143.7e6 - 1) < 0.03


def test_json_layer_list_upload_and_get(client: TestClient) -> None:
    r = client.post("/v1/graphs", json=JSON_GRAPH)
    assert r.status_code == 201, r.text
    gid = r.json()["id"]
    assert r.json()["source_format"] == "json"
    got = client.get(f"/v1/graphs/{gid}")
    assert got.status_code == 200
    assert got.json()["summary"]["params"] == 16 * 27 + 16 + 16 * 10 + 10
    listing = client.get("/v1/graphs").json()
    assert listing["count"] == 1 and listing["items"][0]["id"] == gid


def test_listing_pages_count_the_page_and_total_every_graph(client: TestClient) -> None:
    """``count`` is the number of items in the page, ``total`` every stored graph; ``limit``/``offset`` page
    through them in one stable order (newest first, ties by id), as ``GET /v1/measurements`` does."""
    ids = set()
    for width in (8, 16, 24):
        r = client.post("/v1/graphs", json={"input_shape": [width], "layers": [{"op": "linear", "out_features": 4}]})
        assert r.status_code == 201, r.text
        ids.add(r.json()["id"])
    first = client.get("/v1/graphs", params={"limit": 2}).json()
    assert (first["count"], first["total"], first["limit"], first["offset"]) == (2, 3, 2, 0)
    rest = client.get("/v1/graphs", params={"limit": 2, "offset": 2}).json()
    assert (rest["count"], rest["total"], rest["limit"], rest["offset"]) == (1, 3, 2, 2)
    paged = [g["id"] for g in first["items"] + rest["items"]]
    assert set(paged) == ids and len(paged) == 3
    assert [g["id"] for g in client.get("/v1/graphs").json()["items"]] == paged
    beyond = client.get("/v1/graphs", params={"offset": 5}).json()
    assert (beyond["count"], beyond["total"], beyond["items"]) == (0, 3, [])
    assert client.get("/v1/graphs", params={"limit": 1000}).status_code == 200
    for bad in ({"limit": 0}, {"limit": 1001}, {"limit": -1}, {"offset": -1}, {"limit": "many"}):
        r = client.get("/v1/graphs", params=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", bad


def test_a_query_name_that_contradicts_the_body_name_is_422_and_stores_nothing(client: TestClient) -> None:
    r = client.post("/v1/graphs", json=JSON_GRAPH, params={"name": "other"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "conflicting_name"
    assert err["detail"] == {"query": "other", "body": "small-cnn", "field": "name"}
    r = client.post("/v1/graphs", files={"file": ("squeezenet.onnx", light_model("squeezenet"),
                                                  "application/octet-stream")},
                    data={"name": "form-name"}, params={"name": "query-name"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "conflicting_name", r.text
    assert r.json()["error"]["detail"]["field"] == "form.name"
    assert client.get("/v1/graphs").json()["items"] == []
    # one name, or the same name twice, is fine; a query name names a body that gives none
    r = client.post("/v1/graphs", json=JSON_GRAPH, params={"name": "small-cnn"})
    assert r.status_code == 201 and r.json()["name"] == "small-cnn", r.text
    unnamed = {k: v for k, v in JSON_GRAPH.items() if k != "name"} | {"input_shape": [3, 16, 16]}
    r = client.post("/v1/graphs", json=unnamed, params={"name": "from-query"})
    assert r.status_code == 201 and r.json()["name"] == "from-query", r.text
    r = client.post("/v1/graphs", files={"file": ("squeezenet.onnx", light_model("squeezenet"),
                                                  "application/octet-stream")},
                    data={"name": "same"}, params={"name": "same"})
    assert r.status_code == 201 and r.json()["name"] == "same", r.text


def test_a_multipart_upload_with_unknown_or_repeated_fields_is_422_and_stores_nothing(client: TestClient) -> None:
    """Form fields other than ``file`` and ``name``, or either given twice, were ignored (the first part won):
    a client that sent ``batch_size`` as a form field, or two files, got a graph it did not ask for."""
    part = ("squeezenet.onnx", light_model("squeezenet"), "application/octet-stream")
    cases = [
        ({"files": {"file": part}, "data": {"batch_size": "8", "dims": "seq=4"}},
         {"unknown": ["batch_size", "dims"], "repeated": []}),
        ({"files": [("file", part), ("file", ("b.onnx", light_model("shufflenet"), "application/octet-stream"))]},
         {"unknown": [], "repeated": ["file"]}),
        ({"files": [("file", part), ("name", (None, "a")), ("name", (None, "b")), ("extra", ("x.txt", b"x"))]},
         {"unknown": ["extra"], "repeated": ["name"]}),
    ]
    for kwargs, expected in cases:
        r = client.post("/v1/graphs", **kwargs)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_request", r.text
        assert error["detail"] == {**expected, "allowed": ["file", "name"]}, r.text
    # a name sent as a file part, or a file sent as text, is refused (the name was ignored, the graph named after
    # its file)
    for kwargs, field in (({"files": [("file", part), ("name", ("n.txt", b"my-graph"))]}, "name"),
                          ({"data": {"file": "not a file"}, "files": {"name": (None, "x")}}, "file")):
        r = client.post("/v1/graphs", **kwargs)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        assert r.json()["error"]["detail"]["field"] == field, r.text
    assert client.get("/v1/graphs").json()["total"] == 0
    assert client.post("/v1/graphs", files={"file": part}, data={"name": "sq"}).status_code == 201


def test_layers_endpoint_at_requested_batch(client: TestClient) -> None:
    gid = _upload(client, "resnet50").json()["id"]
    one = client.get(f"/v1/graphs/{gid}/layers", params={"batch_size": 1}).json()
    many = client.get(f"/v1/graphs/{gid}/layers", params={"batch_size": 32}).json()
    assert len(one["layers"]) == len(many["layers"]) > 50
    assert many["summary"]["forward_macs"] == 32 * one["summary"]["forward_macs"]
    conv = next(layer for layer in many["layers"] if layer["op_type"] == "Conv")
    assert conv["output_shapes"][0][0] == 32
    assert conv["operational_intensity_flops_per_byte"] > 0


def test_onnx_that_does_not_parse_is_422_and_stores_nothing(client: TestClient, session: Session) -> None:
    junk = ("x.onnx", b"this is not protobuf \x00\xff", "application/octet-stream")
    r = client.post("/v1/graphs", files={"file": junk})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_graph"
    assert session.scalar(select(func.count()).select_from(StoredGraph)) == 0


def test_invalid_json_graph_is_422_with_code(client: TestClient) -> None:
    bad = {**JSON_GRAPH, "layers": [{"op": "conv2d", "kernel_size": 3}]}
    r = client.post("/v1/graphs", json=bad)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_graph"
    assert "out_channels" in r.json()["error"]["message"]


def test_a_json_conv_without_kernel_size_is_422_naming_the_field(client: TestClient, session: Session) -> None:
    conv = {k: v for k, v in JSON_GRAPH["layers"][0].items() if k != "kernel_size"}  # type: ignore[union-attr]
    layers = [conv, *JSON_GRAPH["layers"][1:]]  # type: ignore[misc]
    r = client.post("/v1/graphs", json={**JSON_GRAPH, "layers": layers})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_graph"
    assert error["detail"] == {"layer_index": 0, "field": "kernel_size"}
    assert session.scalar(select(func.count()).select_from(StoredGraph)) == 0


def test_graphs_whose_shapes_do_not_chain_are_422_and_store_nothing(client: TestClient) -> None:
    """A linear layer declaring 100 inputs on a 784-wide input, a MatMul of x (N, 784) with W (100, 10), and a
    Reshape baked at seq 16 uploaded at ``dims=seq=64`` were all stored (201) and costed."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from tests.helpers import baked_seq_reshape_onnx

    linear = {"input_shape": [784], "layers": [{"op": "linear", "in_features": 100, "out_features": 10}]}
    r = client.post("/v1/graphs", json=linear)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_graph"
    assert error["detail"] == {"layer_index": 0, "field": "in_features", "declared": 100, "actual": 784}
    assert "'in_features' is 100" in error["message"] and "784" in error["message"]

    w = numpy_helper.from_array(np.zeros((100, 10), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 784])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], [w])
    matmul = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    r = client.post("/v1/graphs", files={"file": ("mm.onnx", matmul, "application/octet-stream")})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_graph"
    assert {k: error["detail"][k] for k in ("node", "node_index", "op_type", "field")} == {
        "node": "fc", "node_index": 0, "op_type": "MatMul", "field": "B"}

    baked = baked_seq_reshape_onnx(seq=16)
    r = client.post("/v1/graphs", files={"file": ("b.onnx", baked, "application/octet-stream")},
                    params={"dims": "seq=64"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_graph"
    assert r.json()["error"]["detail"]["node"] == "split_heads" and r.json()["error"]["detail"]["field"] == "shape"
    assert client.get("/v1/graphs").json()["total"] == 0
    # the equal declared size, and the baked graph at the sizes it was exported at, are stored
    ok = client.post("/v1/graphs", json={**linear, "layers": [{**linear["layers"][0], "in_features": 784}]})
    assert ok.status_code == 201 and ok.json()["summary"]["warnings"] == []
    ok = client.post("/v1/graphs", files={"file": ("b.onnx", baked, "application/octet-stream")},
                     params={"dims": "seq=16"})
    assert ok.status_code == 201, ok.text
    assert client.get("/v1/graphs").json()["total"] == 2
    # its layer table at another binding is the same 422, at the sizes it holds a table
    layers = client.get(f"/v1/graphs/{ok.json()['id']}/layers", params={"dims": "seq=64"})
    assert layers.status_code == 422 and layers.json()["error"]["code"] == "invalid_graph", layers.text
    assert layers.json()["error"]["detail"]["dims"] == {"batch": 1, "seq": 64}
    layers = client.get(f"/v1/graphs/{ok.json()['id']}/layers", params={"dims": "seq=16"})
    assert layers.status_code == 200, layers.text


def test_a_bad_json_graph_names_the_field_and_does_not_echo_the_document(client: TestClient) -> None:
    # no input_shape: pydantic's error carries the whole document as its input; the problem must not
    layers = [{"op": "linear", "out_features": 10, "name": f"fc{i}"} for i in range(2000)]
    r = client.post("/v1/graphs", json={"layers": layers})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["code"] == "invalid_graph"
    assert error["message"] == "JSON graph is not valid: input_shape: Field required"
    assert error["detail"]["errors"] == [{"type": "missing", "loc": ["input_shape"], "msg": "Field required"}]
    assert "fc1999" not in r.text
    r = client.post("/v1/graphs", content=b'{"input_shape": [3,', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_graph"
    assert r.json()["error"]["message"].startswith("JSON graph is not valid: Expecting value")


def test_unknown_graph_is_404(client: TestClient) -> None:
    r = client.get("/v1/graphs/" + "0" * 64)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "graph_not_found"


def test_non_positive_batch_is_422(client: TestClient) -> None:
    r = _upload(client, "squeezenet", batch_size=0)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "validation_error"
