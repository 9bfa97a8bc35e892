"""Small ONNX models the tests write themselves: a two-layer MLP whose hidden width is a parameter."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp_onnx(hidden: int, *, inputs: int = 256, outputs: int = 10, name: str = "mlp") -> bytes:
    """Serialized ONNX of ``Gemm(inputs→hidden) → Relu → Gemm(hidden→outputs)`` with a symbolic batch axis
    ``N`` (layers named ``fc1``, ``relu``, ``fc2``, whatever ``hidden`` is, so a gate can match them)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((hidden, inputs)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((outputs, hidden)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(outputs, np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Gemm", ["a", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", inputs])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", outputs])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()
