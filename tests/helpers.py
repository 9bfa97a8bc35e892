"""Shared test helpers (paths to shared data and to the onnx wheel's model-zoo graphs; an app served by
uvicorn on a free port)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()
LIGHT_MODELS = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def seq_matmul_onnx(k: int = 16, n: int = 4) -> bytes:
    """ONNX bytes of ``y = x[batch, seq, k] @ w[k, n]`` (``w`` all 0.5): a graph with a symbolic batch axis and a
    symbolic sequence axis that every upload, prediction and layer table must bind (``dims={"seq": ...}``)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])
    w = helper.make_tensor("w", TensorProto.FLOAT, [k, n], [0.5] * (k * n))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def baked_seq_reshape_onnx(seq: int = 16, k: int = 8) -> bytes:
    """ONNX bytes of ``y = relu(reshape(x[batch, seq, k], [1, seq, 2, k/2]))``: a symbolic ``seq`` axis whose
    Reshape target ``[1, seq, 2, k/2]`` was fixed at export at ``seq`` and batch 1, as a trace bakes it. It holds
    at batch 1 and that ``seq`` only; onnxruntime refuses any other binding."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])
    target = numpy_helper.from_array(np.array([1, seq, 2, k // 2], np.int64), "target")
    nodes = [helper.make_node("Reshape", ["x", "target"], ["heads"], name="split_heads"),
             helper.make_node("Relu", ["heads"], ["y"])]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], [target])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def light_model(name: str) -> bytes:
    """Bytes of ``light_<name>.onnx`` shipped inside the onnx wheel."""
    return (LIGHT_MODELS / f"light_{name}.onnx").read_bytes()


def import_measurements(database_url: str, dataset: str, *args: str) -> None:
    """``layercast import <dataset> --database-url URL *args`` (migrates and seeds first); raises on failure."""
    from app.measurements.cli import main

    code = main([dataset, "--database-url", database_url, *args])
    if code != 0:
        raise RuntimeError(f"layercast import {dataset} {' '.join(args)} failed with exit code {code}")


@contextmanager
def serve(app: Any, *, start_timeout_s: float = 60) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free local port in a thread of this process (its lifespan run) and
    yield its base URL; stopped on exit. For clients outside the process: a browser, ``curl``, a CLI."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
