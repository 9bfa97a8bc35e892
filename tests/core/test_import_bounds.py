"""Import bounds (:mod:`app.core.limits`) and the batch-binding rules they sit beside."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from app.config import Settings
from app.core.analysis import analyze
from app.core.json_import import import_json
from app.core.limits import Limits, json_bytes_depth, json_bytes_depth_over, json_depth, json_text_problem, use_limits
from app.core.onnx_import import import_onnx
from app.errors import GraphTooLarge, InvalidGraph, LimitExceeded


def _model(nodes, inputs, inits=()) -> bytes:  # noqa: ANN001 - onnx protos
    graph = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_inputs_without_a_common_batch_axis_keep_their_shapes(batch_size: int) -> None:
    """(2,1,4,8) @ (3,8,5) broadcasts to (2,3,4,5): 2·3·4·5·8 = 960 MACs whatever batch_size says."""
    content = _model(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 1, 4, 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 8, 5])],
    )
    graph = import_onnx(content, batch_size=batch_size)
    assert analyze(graph).forward_macs == 960
    assert graph.layers[0].outputs[0].shape == (2, 3, 4, 5)
    assert any("different fixed leading dimensions [2, 3]" in w for w in graph.warnings)


def test_inputs_sharing_a_fixed_batch_are_still_rebound() -> None:
    content = _model(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 4, 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 8, 5])],
    )
    graph = import_onnx(content, batch_size=3)
    assert analyze(graph).forward_macs == 3 * 4 * 8 * 5


def test_hard_coded_batch_one_reshape_is_rewritten_with_a_warning() -> None:
    """A symbolic-batch export with ``Reshape [1, 2048]``: at batch 4 the classifier sees 4 rows."""
    content = _model(
        [helper.make_node("Reshape", ["x", "s"], ["r"], name="flatten"), helper.make_node("MatMul", ["r", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2048, 1, 1])],
        [numpy_helper.from_array(np.array([1, 2048], np.int64), "s"),
         numpy_helper.from_array(np.ones((2048, 10), np.float32), "w")],
    )
    graph = import_onnx(content, batch_size=4)
    assert analyze(graph).forward_macs == 4 * 2048 * 10
    assert [layer.outputs[0].shape for layer in graph.layers] == [(4, 2048), (4, 10)]
    assert any("Reshape 'flatten'" in w and "[1, 2048]" in w for w in graph.warnings)
    assert not any("Reshape" in w for w in import_onnx(content, batch_size=1).warnings)


def test_an_inconsistent_reshape_is_refused_at_that_binding_only() -> None:
    """(N, 6) reshaped to a fixed [3, 4] holds at N=2 and nowhere else: at N=4 onnxruntime refuses the node and
    the layers after it would be costed at the export's size (it used to be a warning and a number)."""
    content = _model(
        [helper.make_node("Reshape", ["x", "s"], ["r"], name="odd"), helper.make_node("Relu", ["r"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [numpy_helper.from_array(np.array([3, 4], np.int64), "s")],
    )
    assert [layer.outputs[0].shape for layer in import_onnx(content, batch_size=2).layers] == [(3, 4), (3, 4)]
    with pytest.raises(InvalidGraph) as err:
        import_onnx(content, batch_size=4)
    assert err.value.code == "invalid_graph" and err.value.status_code == 422
    assert err.value.message.startswith("Reshape 'odd' (node 0) turns 24 elements [4, 6] into 12 [3, 4]")
    assert err.value.detail == {"node": "odd", "node_index": 0, "op_type": "Reshape", "field": "shape",
                                "input_shape": [4, 6], "output_shape": [3, 4], "batch_size": 4, "dims": {"N": 4},
                                "nodes": ["odd"]}


def test_the_deadline_stops_an_import() -> None:
    content = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", 1, ["N", 4])])
    with use_limits(Limits(import_timeout_s=-1.0)), pytest.raises(LimitExceeded) as err:
        import_onnx(content)
    assert err.value.detail["limit"] == "import_seconds"
    with use_limits(Limits(import_timeout_s=-1.0)), pytest.raises(LimitExceeded):
        import_json({"input_shape": [4], "layers": [{"op": "relu"}]})
    assert import_onnx(content).layers  # the default budget is ample


def test_limits_follow_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERCAST_MAX_NODES", "10")
    monkeypatch.setenv("LAYERCAST_MAX_DIM", "1000")
    limits = Settings().limits()
    assert (limits.max_nodes, limits.max_dim) == (10, 1000)
    with use_limits(limits):
        with pytest.raises(GraphTooLarge) as err:
            import_json({"input_shape": [4], "layers": [{"op": "relu"}] * 11})
        assert err.value.detail == {"limit": "layers", "value": 11, "max": 10}
        with pytest.raises(LimitExceeded) as dim:
            import_json({"input_shape": [1001], "layers": [{"op": "relu"}]})
        assert dim.value.detail["limit"] == "dimension"


def test_json_depth_measures_without_recursing() -> None:
    assert json_depth([[[]]], 64) == 3
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert json_depth(deep, 64) == 65  # stops early, no RecursionError
    assert json_bytes_depth(b'{"a": "[[[\\"[", "b": [1, {"c": []}]}') == 4
    assert json_bytes_depth(b"[" * 100_000) == 100_000


@pytest.mark.parametrize("body", [
    b"[]", b'{"a": [1, {"b": []}]}', b'{"a": "[[[[[[", "b": 1}', b'{"a": "[[[[[[[[", "b": [[1]]}', b"[" * 5,
    b"[" * 6, b"[[[" + b'"]]]]]]]"' + b"]]]", b'[{"a": [{"b": [1]}]}]',
])
@pytest.mark.parametrize("limit", [0, 1, 3, 4, 5, 6])
def test_the_depth_check_by_counting_brackets_answers_what_measuring_answers(body: bytes, limit: int) -> None:
    # strings' brackets count toward the bound, never toward the depth: the bound only decides when to measure
    depth = json_bytes_depth(body)
    assert json_bytes_depth_over(body, limit) == (depth if depth > limit else None)


@pytest.mark.parametrize("body", [
    b'{"a": "\xff"}', b'{"a": ' + b"9" * 4301 + b"}", b'[1, -' + b"9" * 5000 + b"]",
])
def test_json_text_problem_finds_what_json_loads_refuses_without_a_decode_error(body: bytes) -> None:
    assert json_text_problem(body) is not None
    with pytest.raises(ValueError) as exc:
        json.loads(body)
    assert not isinstance(exc.value, json.JSONDecodeError)


@pytest.mark.parametrize("body", [
    b'{"a": ' + b"9" * 4300 + b"}", b'{"a": ' + b"9" * 5000 + b".5}", b'{"a": 1e' + b"9" * 5000 + b"}",
    b'{"a": 0.' + b"9" * 5000 + b"}", b'{"a": "' + b"9" * 5000 + b'"}', b'{"' + b"9" * 5000 + b'": 1}',
    b'{"a": "\\"' + b"9" * 5000 + b'"}', '{"a": "\u00e9"}'.encode("utf-16-le"), '{"a": "é"}'.encode(),
])
def test_json_text_problem_passes_what_json_loads_reads(body: bytes) -> None:
    json.loads(body)
    assert json_text_problem(body) is None


@pytest.mark.parametrize("layer", [
    {"op": "linear", "out_features": 2**31 - 1},          # a 3072 x 2^31 weight: 6.6e12 elements
    {"op": "embedding", "num_embeddings": 2**31 - 1, "embedding_dim": 2**20},
])
def test_json_weights_are_held_to_the_tensor_element_bound(layer: dict) -> None:
    """A JSON layer's weights are tensors too: a weight over ``max_tensor_elements`` is refused like an
    activation is (it was stored, and its parameter and FLOP counts overflowed 64-bit integers)."""
    shape = [3072] if layer["op"] == "linear" else [8]
    with pytest.raises(LimitExceeded) as info:
        import_json({"input_shape": shape, "input_dtype": "float32" if layer["op"] == "linear" else "int64",
                     "layers": [layer]})
    assert info.value.detail["limit"] == "tensor_elements"


@pytest.mark.parametrize("digits", [637, 638, 639, 640, 641, 642])
def test_the_digit_check_by_length_answers_what_parsing_answers(digits: int) -> None:
    # bodies around the digit limit (640 here): one no longer than the limit is passed without being measured
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        body = b"[" + b"9" * digits + b"]"
        refused = False
        try:
            json.loads(body)
        except ValueError:
            refused = True
        assert (json_text_problem(body) is not None) == refused == (digits > 640)
    finally:
        sys.set_int_max_str_digits(old)


def test_a_long_utf16_body_with_a_lone_surrogate_is_read_as_json_reads_it() -> None:
    # json.loads decodes UTF-16 with surrogatepass; re-encoding that text as UTF-8 must not raise (it was a 500)
    body = ('{"a": "\ud800' + "x" * 5000 + '", "b": 1}').encode("utf-16-le", "surrogatepass")
    json.loads(body)
    assert json_text_problem(body) is None
