"""A corpus of hostile inputs: each case is sent to a started app and must answer its expected 4xx and
machine-readable code (or, for inputs that are merely large, succeed), within a time bound (a SIGALRM
timer interrupts the test) and a memory bound (Python allocations traced by ``tracemalloc``, and the
process's peak RSS from ``resource.getrusage``, which also sees onnx's C++ allocations).

Without the bounds of :mod:`app.core.limits`, the ONNX cases below took 17 GB (``Range`` to 10¹²) or
1-2 GB (``Expand`` to 16384²) per import; the JSON cases recursed past the interpreter's stack (500).
The app here runs with small body limits (``max_json_bytes`` 2 MiB, ``max_upload_bytes`` 8 MiB,
``max_nodes`` 2,000), so the size cases exercise the mechanism without allocating the issue's 100 MB
strings; the defaults are checked separately.
"""

from __future__ import annotations

import asyncio
import json
import math
import resource
import signal
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper

import app.main
from app.config import Settings
from app.migrate import upgrade

MiB = 2**20

# ------------------------------------------------------------------------------------------ builders


def _onnx(nodes: list[Any], inits: list[Any], inputs: list[Any], outputs: list[str], opset: int = 17) -> bytes:
    graph = helper.make_graph(
        nodes, "hostile", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])


def _i64(value: Any, name: str) -> Any:
    return numpy_helper.from_array(np.array(value, dtype=np.int64), name)


def onnx_range_1e12() -> bytes:
    """163 bytes that made ONNX data propagation allocate 17.5 GB."""
    return _onnx(
        [helper.make_node("Range", ["s", "l", "d"], ["r"]), helper.make_node("Cast", ["r"], ["rf"], to=1),
         helper.make_node("Relu", ["x"], ["y"])],
        [_i64(0, "s"), _i64(10**12, "l"), _i64(1, "d")], [X], ["y", "rf"],
    )


def onnx_expand_16384sq() -> bytes:
    """128 bytes whose constant folding materialised 1-2 GB."""
    return _onnx(
        [helper.make_node("Expand", ["one", "shp"], ["e"]), helper.make_node("Add", ["e", "e"], ["e2"]),
         helper.make_node("Relu", ["x"], ["y"])],
        [_i64([16384, 16384], "shp"), numpy_helper.from_array(np.ones(1, np.float32), "one")], [X], ["y", "e2"],
    )


def onnx_constant_of_shape() -> bytes:
    return _onnx(
        [helper.make_node("ConstantOfShape", ["shp"], ["c"]), helper.make_node("Mul", ["c", "c"], ["c2"]),
         helper.make_node("Relu", ["x"], ["y"])],
        [_i64([30000, 30000], "shp")], [X], ["y", "c2"],
    )


def onnx_many_nodes(n: int) -> bytes:
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"]) for i in range(n)]
    return _onnx(nodes, [], [X], [f"t{n - 1}"])


def onnx_conv_dim_2_31() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 2**31, 1])
    w = numpy_helper.from_array(np.ones((8, 3, 3, 1), np.float32), "w")
    return _onnx([helper.make_node("Conv", ["x", "w"], ["y"])], [w], [x], ["y"])


def onnx_opset(version: int) -> bytes:
    return _onnx([helper.make_node("Relu", ["x"], ["y"])], [], [X], ["y"], opset=version)


def onnx_negative_dim() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    x.type.tensor_type.shape.dim[1].dim_value = -4
    return _onnx([helper.make_node("Relu", ["x"], ["y"])], [], [x], ["y"])


def onnx_rank(rank: int) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *([1] * (rank - 1))])
    return _onnx([helper.make_node("Relu", ["x"], ["y"])], [], [x], ["y"])


def onnx_nested_if(depth: int) -> bytes:
    """``If`` nodes whose then-branch holds another ``If``, ``depth`` levels deep."""
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, None)
    body = helper.make_graph([helper.make_node("Relu", ["x"], ["o"])], "leaf", [], [out])
    for level in range(depth):
        node = helper.make_node("If", ["c"], ["o"], then_branch=body, else_branch=body)
        body = helper.make_graph([node], f"level{level}", [], [out])
    return _onnx([*body.node, helper.make_node("Relu", ["x"], ["y"])], [], [X, cond], ["y"])


def json_graph(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": "g", "input_shape": [3, 8, 8], "layers": [{"op": "relu"}]}
    doc.update(overrides)
    return doc


def nested_list(depth: int) -> str:
    return "[" * depth + "]" * depth


MEASUREMENT: dict[str, Any] = {
    "hardware_id": "a100-sxm4-40gb",
    "source": "scheduler",
    "op_kind": "iteration",
    "pass": "train_step",
    "optimizer": "adam",
    "software_stack": "pytorch-eager",
    "granularity": "iteration",
    "batch_size": 64,
    "config": {"model": "resnet50"},
    "time_ms_median": 210.5,
}

HARDWARE: dict[str, Any] = {
    "id": "my-gpu",
    "name": "My GPU",
    "vendor": "Acme",
    "peak_flops_per_s": {"fp32": 1e13},
    "memory_bytes": 16e9,
    "memory_bandwidth_bytes_per_s": 5e11,
    "compute_units": 40,
}


def prediction(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"graph": json_graph(), "hardware_id": "a100-sxm4-40gb", "batch_size": 2,
                            "mode": "inference"}
    body.update(overrides)
    return body


def inline_hardware(field: str, value: float) -> dict[str, Any]:
    """A prediction with inline hardware whose fp32 peak (``peak``) or bandwidth is ``value``."""
    spec = {**HARDWARE}
    if field == "peak":
        spec["peak_flops_per_s"] = {"fp32": value}
    else:
        spec["memory_bandwidth_bytes_per_s"] = value
    return prediction(hardware_id=None, hardware=spec)


def batch(measurement: dict[str, Any]) -> dict[str, Any]:
    """The body of ``POST /v1/measurements`` holding one measurement."""
    return {"measurements": [measurement]}


def raw_json(text: str) -> dict[str, Any]:
    return {"content": text.encode("utf-8", "surrogatepass"), "headers": {"content-type": "application/json"}}


def octet(content: bytes) -> dict[str, Any]:
    return {"content": content, "headers": {"content-type": "application/octet-stream"}}


# ------------------------------------------------------------------------------------------ the corpus


@dataclass(frozen=True)
class Case:
    """One hostile request: ``method path`` with httpx keyword arguments, the expected status and
    error code (None for a success), and ``limit``: the expected ``detail.limit`` when the code is a
    limit's."""

    id: str
    method: str
    path: str
    kwargs: Callable[[], dict[str, Any]]
    status: int
    code: str | None
    limit: str | None = None


CASES = [
    # -- bounded import (issue item 1)
    Case("onnx-range-1e12", "POST", "/v1/graphs", lambda: octet(onnx_range_1e12()), 422, "limit_exceeded",
         "dimension"),
    Case("onnx-expand-16384sq", "POST", "/v1/graphs", lambda: octet(onnx_expand_16384sq()), 201, None),
    Case("onnx-constant-of-shape-9e8", "POST", "/v1/graphs", lambda: octet(onnx_constant_of_shape()), 201, None),
    Case("onnx-2001-nodes", "POST", "/v1/graphs", lambda: octet(onnx_many_nodes(2001)), 413, "graph_too_large",
         "nodes"),
    Case("onnx-if-nested-12", "POST", "/v1/graphs", lambda: octet(onnx_nested_if(12)), 413, "graph_too_large",
         "subgraph_depth"),
    Case("onnx-rank-40", "POST", "/v1/graphs", lambda: octet(onnx_rank(40)), 422, "limit_exceeded", "tensor_rank"),
    Case("json-2001-layers", "POST", "/v1/graphs", lambda: {"json": json_graph(layers=[{"op": "relu"}] * 2001)},
         413, "graph_too_large", "layers"),
    Case("json-graph-depth-10000", "POST", "/v1/graphs",
         lambda: raw_json('{"input_shape":[3],"layers":' + nested_list(10_000) + "}"), 422, "limit_exceeded",
         "json_depth"),
    Case("json-layer-spec-depth-10000", "POST", "/v1/graphs",
         lambda: raw_json('{"input_shape":[3],"layers":[{"op":"relu","x":' + nested_list(10_000) + "}]}"),
         422, "limit_exceeded", "json_depth"),
    Case("json-layer-junk-field-3mib", "POST", "/v1/graphs",
         lambda: {"json": json_graph(layers=[{"op": "relu", "junk": "j" * (3 * MiB)}])}, 413, "payload_too_large",
         "json_bytes"),
    Case("json-conv-out-channels-2^31", "POST", "/v1/graphs",
         lambda: {"json": json_graph(layers=[{"op": "conv2d", "out_channels": 2**31, "kernel_size": 1}])},
         422, "limit_exceeded", "dimension"),
    # -- no 5xx for anything a user sends (item 4)
    Case("graphs-offset-2^63", "GET", "/v1/graphs", lambda: {"params": {"offset": 2**63}}, 422, "validation_error"),
    Case("measurements-offset-2^64", "GET", "/v1/measurements", lambda: {"params": {"offset": 2**64}}, 422,
         "validation_error"),
    Case("upload-dims-seq-1e30", "POST", "/v1/graphs",
         lambda: {**octet(onnx_many_nodes(2)), "params": {"dims": "seq=" + "1" + "0" * 30}}, 422, "limit_exceeded",
         "dimension"),
    Case("measurement-config-depth-300", "POST", "/v1/measurements",
         lambda: raw_json('{"measurements":[' + json.dumps({**MEASUREMENT, "config": {"a": 1}})[:-1]
                          + ',"context":{"x":' + nested_list(300) + "}}]}"), 422, "limit_exceeded", "json_depth"),
    Case("measurement-config-string-3mib", "POST", "/v1/measurements",
         lambda: {"json": batch({**MEASUREMENT, "config": {"s": "x" * (3 * MiB)}})}, 413, "payload_too_large",
         "json_bytes"),
    Case("measurement-batch-2^31", "POST", "/v1/measurements",
         lambda: {"json": batch({**MEASUREMENT, "batch_size": 2**31})}, 422, "validation_error"),
    Case("measurement-batch-true", "POST", "/v1/measurements",
         lambda: {"json": batch({**MEASUREMENT, "batch_size": True})}, 422, "validation_error"),
    Case("measurement-config-nul", "POST", "/v1/measurements",
         lambda: {"json": batch({**MEASUREMENT, "config": {"model": "res\x00net"}})}, 422, "validation_error"),
    Case("measurement-context-nan", "POST", "/v1/measurements",
         lambda: raw_json(json.dumps(batch({**MEASUREMENT, "context": {"clock": math.nan}}))), 422, "validation_error"),
    Case("hardware-name-lone-surrogate", "POST", "/v1/hardware",
         lambda: raw_json(json.dumps({**HARDWARE, "name": "\ud800"})), 422, "validation_error"),
    Case("hardware-name-nul", "POST", "/v1/hardware", lambda: {"json": {**HARDWARE, "name": "a\x00b"}}, 422,
         "validation_error"),
    Case("hardware-surrogate-field-name", "POST", "/v1/hardware",
         lambda: raw_json(json.dumps({**HARDWARE, "\ud800": 1})), 422, "validation_error"),
    Case("hardware-compute-units-2^31", "POST", "/v1/hardware",
         lambda: {"json": {**HARDWARE, "compute_units": 2**31}}, 422, "validation_error"),
    Case("graph-name-lone-surrogate", "POST", "/v1/graphs", lambda: raw_json(json.dumps(json_graph(name="\ud800"))),
         422, "invalid_graph"),
    Case("graph-layer-name-surrogate", "POST", "/v1/graphs",
         lambda: raw_json(json.dumps(json_graph(layers=[{"op": "relu", "name": "\udfff"}]))), 422, "invalid_graph"),
    Case("graph-query-name-nul", "POST", "/v1/graphs",
         lambda: {**octet(onnx_many_nodes(2)), "params": {"name": "a\x00b"}}, 400, "bad_request"),
    Case("graph-query-name-escape", "POST", "/v1/graphs",
         lambda: {**octet(onnx_many_nodes(2)), "params": {"name": "a\x1bb"}}, 422, "validation_error"),
    Case("onnx-conv-dim-2^31", "POST", "/v1/graphs", lambda: octet(onnx_conv_dim_2_31()), 422, "limit_exceeded",
         "dimension"),
    Case("onnx-opset-99", "POST", "/v1/graphs", lambda: octet(onnx_opset(99)), 422, "unsupported_opset"),
    Case("onnx-negative-dim-value", "POST", "/v1/graphs", lambda: octet(onnx_negative_dim()), 422, "invalid_graph"),
    Case("onnx-garbage", "POST", "/v1/graphs", lambda: octet(b"\xff" * 1000), 422, "invalid_graph"),
    Case("prediction-batch-true", "POST", "/v1/predictions", lambda: {"json": prediction(batch_size=True)}, 422,
         "validation_error"),
    Case("prediction-dims-2^31", "POST", "/v1/predictions", lambda: {"json": prediction(dims={"seq": 2**31})}, 422,
         "validation_error"),
    *[
        Case(f"inline-hardware-{field}-{label}", "POST", "/v1/predictions",
             lambda field=field, value=value: raw_json(json.dumps(inline_hardware(field, value))),
             422, "validation_error")
        for field in ("peak", "bandwidth")
        for label, value in (("5e-324", 5e-324), ("nan", math.nan), ("inf", math.inf), ("-1", -1.0))
    ],
    Case("hardware-path-nul", "GET", "/v1/hardware/a%00b", lambda: {}, 400, "bad_request"),
    Case("measurements-query-nul", "GET", "/v1/measurements", lambda: {"params": {"source": "a\x00b"}}, 400,
         "bad_request"),
    Case("multipart-name-nul", "POST", "/v1/graphs",
         lambda: {"files": {"file": ("m.onnx", onnx_many_nodes(2))}, "data": {"name": "a\x00b"}}, 422,
         "invalid_request"),
    Case("malformed-json-body", "POST", "/v1/measurements", lambda: raw_json('{"hardware_id": '), 422,
         "validation_error"),
    # json.loads raises UnicodeDecodeError / ValueError (not JSONDecodeError) for these: FastAPI said 400
    *[
        Case(f"non-utf8-json-body-{path.rsplit('/', 1)[-1]}", "POST", path,
             lambda path=path: {"content": b'{"hardware_id": "\xff\xfe"}',
                                "headers": {"content-type": "application/json"}}, 422, "validation_error")
        for path in ("/v1/predictions", "/v1/measurements", "/v1/hardware", "/v1/predictions/batch")
    ],
    Case("int-literal-4301-digits", "POST", "/v1/predictions",
         lambda: raw_json('{"batch_size": ' + "9" * 4301 + "}"), 422, "validation_error"),
    Case("negative-int-literal-5000-digits", "POST", "/v1/measurements",
         lambda: raw_json('{"measurements": [{"batch_size": -' + "9" * 5000 + "}]}"), 422, "validation_error"),
    Case("non-utf8-json-graph", "POST", "/v1/graphs",
         lambda: {"content": b'{"input_shape":[3],"layers":[{"op":"\xff"}]}',
                  "headers": {"content-type": "application/json"}}, 422, "invalid_graph"),
]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def hostile_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    db = tmp_path_factory.mktemp("hostile") / "hostile.db"
    settings = Settings(
        database_url=f"sqlite:///{db}", max_json_bytes=2 * MiB, max_upload_bytes=8 * MiB, max_nodes=2000,
    )
    upgrade(settings.database_url)  # migrated here, so every test using these settings runs alone too
    return settings


@pytest.fixture(scope="module")
def hostile_client(hostile_settings: Settings) -> Iterator[TestClient]:
    with TestClient(app.main.create_app(hostile_settings), raise_server_exceptions=False) as client:
        yield client


class _Alarm(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Alarm("case ran past its time bound")


def bounded(seconds: float, fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """Run ``fn`` under a ``seconds`` SIGALRM timer; returns its result, the peak of Python allocations
    it made (tracemalloc, bytes) and the growth of the process's peak RSS (bytes)."""
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    previous = signal.signal(signal.SIGALRM, _alarm)
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        result = fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, previous)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before_rss
    return result, peak, grown


# ------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(hostile_client: TestClient, case: Case) -> None:
    kwargs = case.kwargs()
    response, traced_peak, rss_growth = bounded(
        20.0, lambda: hostile_client.request(case.method, case.path, **kwargs)
    )
    assert response.status_code == case.status, response.text[:500]
    if case.code is not None:
        error = response.json()["error"]
        assert error["code"] == case.code, error
        if case.limit is not None:
            assert error["detail"]["limit"] == case.limit, error
            assert error["detail"]["value"] > error["detail"]["max"], error
        assert "Traceback" not in response.text and "/work/" not in response.text
    body_bytes = sum(len(v) if isinstance(v, bytes | str) else 0 for v in kwargs.values())
    assert traced_peak < 64 * MiB + 8 * body_bytes, f"{traced_peak / MiB:.0f} MiB of Python allocations"
    assert rss_growth < 256 * MiB, f"peak RSS grew by {rss_growth / MiB:.0f} MiB"


def test_large_constants_are_typed_not_materialised(hostile_client: TestClient) -> None:
    """The Expand case imports, with the expanded tensor sized (16384², never folded) and costed."""
    r = hostile_client.post("/v1/graphs", **octet(onnx_expand_16384sq()))
    assert r.status_code in (200, 201), r.text
    layers = hostile_client.get(f"/v1/graphs/{r.json()['id']}/layers", params={"batch_size": 2}).json()["layers"]
    assert [layer["output_shapes"] for layer in layers if layer["op_type"] == "Relu"] == [[[2, 4]]]


def test_default_limits_refuse_a_body_over_32_mib(settings: Settings) -> None:
    """The default JSON body bound (32 MiB) stops the issue's 100 MB measurement ``config`` string."""
    assert Settings.model_fields["max_json_bytes"].default == 32 * MiB
    upgrade(settings.database_url)
    with TestClient(app.main.create_app(settings)) as client:
        body = json.dumps(batch({**MEASUREMENT, "config": {"s": "x" * (33 * MiB)}})).encode()
        r = client.post("/v1/measurements", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["detail"] == {"limit": "json_bytes", "value": r.json()["error"]["detail"]["value"],
                                           "max": 32 * MiB}


def _drive(application: Any, path: str, headers: list[tuple[bytes, bytes]], chunk: bytes) -> tuple[int, int]:
    """Send an endless chunked body (no Content-Length) straight to the ASGI app; return the status
    and how many chunks the app pulled before answering."""
    pulled = 0
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        if pulled > 10_000:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"host", b"testserver"), *headers], "http_version": "1.1", "scheme": "http",
             "server": ("t", 80),
             "client": ("c", 1), "root_path": "", "app": application}
    asyncio.run(application(scope, receive, send))
    return status[0], pulled


@pytest.mark.parametrize(
    "content_type",
    [b"application/octet-stream", b"multipart/form-data; boundary=xyz", b"application/json"],
)
def test_chunked_upload_stops_reading_at_the_limit(hostile_client: TestClient, content_type: bytes) -> None:
    """A body without Content-Length is refused (413) after at most the limit plus one chunk is read,
    not buffered to the end (the issue saw 512 MB buffered before the 413)."""
    chunk = b"--xyz\r\n" if content_type.startswith(b"multipart") else b"\0" * MiB
    if content_type.startswith(b"multipart"):
        chunk = b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n" + b"\0" * MiB
    status, pulled = _drive(hostile_client.app, "/v1/graphs", [(b"content-type", content_type)], chunk)
    assert status == 413
    limit = 2 * MiB if content_type == b"application/json" else 8 * MiB
    assert pulled <= limit // MiB + 2


@pytest.mark.parametrize("how", ["absolute", "relative", "dotdot"])
def test_external_data_naming_a_fifo_is_never_opened(
    hostile_client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Opening a FIFO for reading blocks until a writer comes, so an importer that opened the path
    would hang: the time bound turns that into a failure. Every spelling of the path is tried."""
    import os

    (tmp_path / "sub").mkdir()
    fifo = tmp_path / "weights.fifo"
    os.mkfifo(fifo)
    monkeypatch.chdir(tmp_path / "sub" if how == "dotdot" else tmp_path)
    location = {"absolute": str(fifo), "relative": "weights.fifo", "dotdot": "../weights.fifo"}[how]
    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[64, 4])
    table.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(64 * 4 * 4))):
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8])
    content = _onnx([helper.make_node("Gather", ["table", "ids"], ["y"])], [table], [ids], ["y"])
    r, _, _ = bounded(15.0, lambda: hostile_client.post("/v1/graphs", **octet(content)))
    assert r.status_code in (200, 201), r.text
    assert r.json()["summary"]["params"] == 64 * 4
    layers, _, _ = bounded(15.0, lambda: hostile_client.get(f"/v1/graphs/{r.json()['id']}/layers"))
    assert layers.status_code == 200


def test_a_file_name_with_control_characters_is_cleaned() -> None:
    """Names taken from an upload's file name are cleaned rather than refused (the client did not
    choose them as names)."""
    from app.schemas import clean_name

    assert clean_name("evil\x00\x1b\ud800.onnx") == "evil.onnx"
    assert clean_name("x" * 500) == "x" * 200


def test_a_500_closes_the_connection(hostile_settings: Settings) -> None:
    application = app.main.create_app(hostile_settings)

    @application.get("/boom")
    def boom() -> None:
        raise RuntimeError("bug")

    with TestClient(application, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    assert r.status_code == 500
    assert r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "internal_error" and "bug" not in r.text


def test_openapi_lists_error_statuses_of_every_route(hostile_client: TestClient) -> None:
    schema = hostile_client.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert "500" in statuses, (method, path)
            if "requestBody" in operation:
                assert {"400", "413", "422"} <= statuses, (method, path, statuses)
            elif operation.get("parameters"):
                assert "422" in statuses, (method, path, statuses)


def test_uploads_are_imported_off_the_event_loop(hostile_client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The import (CPU) and its database work run in a worker thread: no event loop runs there, so a
    slow import cannot freeze other requests (the issue saw 42-88 s freezes)."""
    from app.graphs import service

    seen: list[bool] = []
    real = service.create_graph

    def spy(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "create_graph", spy)
    assert hostile_client.post("/v1/graphs", **octet(onnx_many_nodes(5))).status_code in (200, 201)
    assert hostile_client.post("/v1/graphs", json=json_graph(name="off-loop")).status_code in (200, 201)
    assert seen == [False, False]
