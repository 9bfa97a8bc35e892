"""Weights by provenance, not position (issue 7 item 1), on hand-built graphs.

A graph input that feeds a weight operand (directly or through Transpose/Reshape/Cast/Identity/Unsqueeze)
is a parameter whatever its symbolic dims; its axes are never bound to the batch size. Every op kind with
a weight is checked with that weight as a graph input whose dims are symbolic.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from app.core.analysis import analyze
from app.core.onnx_import import import_onnx
from app.errors import InvalidGraph, UnboundDimension
from tests.core.test_op_coverage import _model, _w, _x

B = 4  # batch size of every import: differs from every weight dim, so a rebinding would show


def _graph(nodes, inputs, inits=(), opset=17) -> bytes:  # noqa: ANN001
    return _model(nodes, inputs, inits, opset=opset)


# op kind → (nodes, inputs, dims, expected params, expected forward MACs at batch B)
CASES = {
    "Conv": (
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
        [_x("x", ["batch", 3, 8, 8]), _x("w", ["c_out", 3, 3, 3])], {"c_out": 16},
        16 * 27, B * 16 * 64 * 27),
    "ConvTranspose": (
        [helper.make_node("ConvTranspose", ["x", "w"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
        [_x("x", ["batch", 8, 4, 4]), _x("w", [8, "c_out", 2, 2])], {"c_out": 6},
        8 * 6 * 4, B * 8 * 16 * 6 * 4),
    "Gemm": (
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
        [_x("x", ["batch", 32]), _x("w", ["n_out", 32]), _x("b", ["n_out"])], {"n_out": 10},
        10 * 32 + 10, B * 32 * 10),
    "MatMul through Transpose": (  # nn.Linear of a weightless torch export (BERT)
        [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])],
        [_x("x", ["batch", "seq", 64]), _x("w", ["hidden", 64])], {"seq": 5, "hidden": 48},
        48 * 64, B * 5 * 64 * 48),
    "Einsum": (
        [helper.make_node("Einsum", ["x", "w"], ["y"], equation="bsd,de->bse")],
        [_x("x", ["batch", 5, 16]), _x("w", [16, "e"])], {"e": 12},
        16 * 12, B * 5 * 16 * 12),
    "LSTM": (
        [helper.make_node("LSTM", ["x", "W", "R", "Bias"], ["y"], hidden_size=8)],
        [_x("x", ["seq", "batch", 16]), _x("W", [1, "g", 16]), _x("R", [1, "g", 8]), _x("Bias", [1, "g2"])],
        {"seq": 7, "g": 32, "g2": 64}, 32 * 16 + 32 * 8 + 64, 7 * B * 32 * (16 + 8)),
    "BatchNormalization": (
        [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])],
        [_x("x", ["batch", "c", 6, 6]), *(_x(n, ["c"]) for n in "sbmv")], {"c": 5}, 10, 0),
    "LayerNormalization": (
        [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
        [_x("x", ["batch", 5, "d"]), _x("s", ["d"]), _x("b", ["d"])], {"d": 24}, 48, 0),
    "Gather (embedding)": (
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 5]), _x("table", ["vocab", 16])],
        {"vocab": 100}, 1600, 0),
    "PRelu": (
        [helper.make_node("PRelu", ["x", "slope"], ["y"])],
        [_x("x", ["batch", "c", 4, 4]), _x("slope", ["c", 1, 1])], {"c": 3}, 3, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_weight_graph_input_with_symbolic_dims_is_a_weight(case: str) -> None:
    nodes, inputs, dims, params, macs = CASES[case]
    g = import_onnx(_graph(nodes, inputs), batch_size=B, dims=dims)
    a = analyze(g)
    assert not a.unsupported, a.unsupported
    assert a.params == params  # counted, at the bound size, never rebound to the batch
    assert a.forward_macs == macs
    assert [t.name for t in g.inputs] == [inputs[0].name]  # the only data input


@pytest.mark.parametrize("case", sorted(CASES))
def test_unbound_symbolic_weight_dim_is_a_422_naming_it(case: str) -> None:
    nodes, inputs, dims, _, _ = CASES[case]
    weight_dims = {d.dim_param for vi in inputs[1:] for d in vi.type.tensor_type.shape.dim if d.dim_param}
    name = sorted(weight_dims)[0]
    with pytest.raises(UnboundDimension) as err:
        import_onnx(_graph(nodes, inputs), batch_size=B, dims={k: v for k, v in dims.items() if k != name})
    assert err.value.status_code == 422
    assert err.value.detail["dimension"] == name


def test_bias_added_first_is_a_parameter() -> None:
    # torch's weightless export of nn.Linear writes Add(bias, MatMul(x, Wᵀ)): the bias feeds Add only
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Add", ["bias", "h"], ["y"])]
    g = import_onnx(_graph(nodes, [_x("x", ["batch", 32]), _x("w", [16, 32]), _x("bias", [16])]), batch_size=B)
    assert analyze(g).params == 16 * 32 + 16
    assert [t.name for t in g.inputs] == ["x"]


def test_class_token_and_position_embedding_are_parameters_not_batch_bound() -> None:
    # ViT embeddings in a weightless export: Concat(Expand(cls), patches) + pos
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"], start=0, end=1),
        helper.make_node("Concat", ["xs", "one_one"], ["es"], axis=0),
        helper.make_node("Expand", ["cls", "es"], ["cls_b"]),
        helper.make_node("Concat", ["cls_b", "x"], ["tok"], axis=1),
        helper.make_node("Add", ["tok", "pos"], ["y"]),
    ]
    one_one = onnx.numpy_helper.from_array(np.array([1, 1], dtype=np.int64), "one_one")
    content = _graph(nodes, [_x("x", ["batch", 9, 16]), _x("cls", [1, 1, 16]), _x("pos", [1, 10, 16])], [one_one])
    g = import_onnx(content, batch_size=B)
    a = analyze(g)
    assert a.params == 16 + 10 * 16
    assert [t.name for t in g.inputs] == ["x"]
    assert not any("fixed batch" in w for w in g.warnings)  # the (1, …) parameters were not rebound
    assert g.layers[-1].outputs[0].shape == (B, 10, 16)


@pytest.mark.parametrize("layout", [0, 1])
def test_rnn_batch_axis_follows_the_layout(layout: int) -> None:
    # seq-first X (seq, batch, in) and initial state (dirs, batch, H): the batch is axis 1, not 0
    x_dims, h_dims = (["seq", "batch", 16], [1, "batch", 8]) if layout == 0 else (["batch", "seq", 16], ["batch", 1, 8])
    node = helper.make_node("LSTM", ["x", "W", "R", "", "", "h0"], ["y"], hidden_size=8, layout=layout)
    content = _graph([node], [_x("x", x_dims), _x("h0", h_dims)], [_w("W", (1, 32, 16)), _w("R", (1, 32, 8))])
    with pytest.raises(UnboundDimension) as err:
        import_onnx(content, batch_size=B)
    assert err.value.detail["dimension"] == "seq"
    g = import_onnx(content, batch_size=B, dims={"seq": 7})
    assert g.dims == {"seq": 7, "batch": B}
    assert analyze(g).forward_macs == 7 * B * 32 * (16 + 8)


def test_fixed_seq_first_rnn_input_is_rebound_on_its_batch_axis() -> None:
    node = helper.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=8)
    content = _graph([node], [_x("x", [7, 1, 16])], [_w("W", (1, 32, 16)), _w("R", (1, 32, 8))])
    g = import_onnx(content, batch_size=B)
    assert g.inputs[0].shape == (7, B, 16)  # axis 1 rebound, the 7 time steps kept
    assert analyze(g).forward_macs == 7 * B * 32 * (16 + 8)


def test_tied_lm_head_of_a_weightless_export_is_counted_once_with_a_warning() -> None:
    # GPT-2 without weights: wte (V, D) feeds Gather; the folded Transpose(wte) is a separate graph
    # input 'onnx::MatMul_9' (D, V) feeding the output projection
    v, d = 50, 8
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["h"]),
             helper.make_node("MatMul", ["h", "onnx::MatMul_9"], ["logits"])]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 5])
    g = import_onnx(_graph(nodes, [ids, _x("wte", [v, d]), _x("onnx::MatMul_9", [d, v])]), batch_size=B)
    assert analyze(g).params == v * d
    (warning,) = [w for w in g.warnings if "tied" in w]
    assert "'onnx::MatMul_9'" in warning and "'wte'" in warning
    assert "wte" in g.shared_weights


def test_module_named_head_of_transposed_shape_is_not_taken_as_tied() -> None:
    # only an exporter-named tensor is a folded transpose: a module's own parameter keeps its count
    v, d = 50, 8
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["h"]), helper.make_node("MatMul", ["h", "head.w"], ["y"])]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 5])
    g = import_onnx(_graph(nodes, [ids, _x("wte", [v, d]), _x("head.w", [d, v])]), batch_size=B)
    assert analyze(g).params == 2 * v * d
    assert not any("tied" in w for w in g.warnings)


def test_undeclared_tensors_are_a_clear_invalid_graph() -> None:
    # torch.onnx.export(dynamo=True, export_params=False) leaves weights neither inputs nor initializers
    nodes = [helper.make_node("MatMul", ["x", "fc.weight"], ["y"])]
    with pytest.raises(InvalidGraph) as err:
        import_onnx(_graph(nodes, [_x("x", ["batch", 4])]), batch_size=B)
    assert err.value.detail["undeclared_tensors"] == ["fc.weight"]
    assert "export_params=False" in str(err.value)


def test_model_local_functions_are_inlined() -> None:
    # the dynamo exporter can write a module as a model-local function; its body is what costs
    fn = helper.make_function("pkg.mod", "Lin", ["a", "w"], ["o"],
                              [helper.make_node("MatMul", ["a", "w"], ["m"]), helper.make_node("Relu", ["m"], ["o"])],
                              [helper.make_opsetid("", 18)])
    graph = helper.make_graph([helper.make_node("Lin", ["x", "w"], ["y"], domain="pkg.mod")], "g",
                              [_x("x", ["batch", 16])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [_w("w", (16, 4))])
    model = helper.make_model(graph, functions=[fn],
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("pkg.mod", 1)])
    a = analyze(import_onnx(model.SerializeToString(), batch_size=B))
    assert not a.unsupported
    assert a.forward_macs == B * 16 * 4 and a.params == 64


def test_value_less_shape_constant_is_sized_by_the_exporters_value_info() -> None:
    # dynamo with keep_initializers_as_inputs: the Reshape target is an input without data; the exporter
    # recorded the result as (batch*seq, 8), an expression of the symbolic dims
    nodes = [helper.make_node("Reshape", ["x", "val_3"], ["flat"]), helper.make_node("Relu", ["flat"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [_x("x", ["batch", "seq", 8]), helper.make_tensor_value_info("val_3", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        value_info=[_x("flat", ["batch*seq", 8])])
    content = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    g = import_onnx(content, batch_size=B, dims={"seq": 3})
    assert not analyze(g).unsupported
    assert [t.name for t in g.inputs] == ["x"]  # the constant is neither data nor a parameter
    assert g.layers[-1].inputs[0].shape == (B * 3, 8)
