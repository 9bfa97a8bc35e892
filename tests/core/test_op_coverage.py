"""Op coverage of the ONNX importer on hand-built graphs: each op's MACs/FLOPs/bytes checked by hand.

Also one test per counting bug users report of other tools (see the issue's first paragraph):
batched MatMul / attention / LSTM counted as zero, depthwise overcounted by the group factor, tied
weights counted twice, MACs vs FLOPs, counts growing on repeated calls, symbolic-dimension crashes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from app.core.analysis import analyze, mac_class_flops
from app.core.costs import layer_cost
from app.core.ir import OpKind
from app.core.onnx_import import EVAL_EXPORT_WARNING, import_onnx
from app.errors import UnboundDimension

F = TensorProto.FLOAT


def _model(nodes, inputs, inits=(), opset=17, extra_opsets=()):
    outs = [helper.make_tensor_value_info(nodes[-1].output[0], F, None)]
    g = helper.make_graph(nodes, "g", inputs, outs, list(inits))
    ops = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    return helper.make_model(g, opset_imports=ops).SerializeToString()


def _x(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def _w(name, shape, seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def _single(content, **kw):
    g = import_onnx(content, batch_size=kw.pop("batch_size", 1), **kw)
    return g, analyze(g)


# --- counting bug: batched MatMul and the attention pattern counted as zero -------------------------


def test_batched_broadcast_matmul_between_activations_is_counted() -> None:
    # (B, h, S, d) @ (h, d, S) broadcast over B: B·h·S·S·d MACs, MATMUL (two activation operands).
    # (k's leading axis equals the batch so the fixed-batch rebinding of zoo graphs leaves it alone.)
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"])]
    content = _model(nodes, [_x("q", ["batch", 3, 16, 8]), _x("k", [3, 8, 16])])
    g, a = _single(content, batch_size=3)
    (layer,) = g.layers
    assert layer.kind is OpKind.MATMUL
    assert layer.outputs[0].shape == (3, 3, 16, 16)
    assert a.forward_macs == 3 * 3 * 16 * 16 * 8
    assert a.forward_flops == 2 * a.forward_macs  # FLOPs = 2 × MACs, named apart


def test_matmul_softmax_matmul_attention_pattern() -> None:
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    shape = ["batch", 2, 10, 4]
    content = _model(nodes, [_x("q", shape), _x("k", shape), _x("v", shape)])
    g, a = _single(content, batch_size=2)
    kinds = [layer.kind for layer in g.layers]
    assert kinds == [OpKind.DATA_MOVEMENT, OpKind.MATMUL, OpKind.SOFTMAX, OpKind.MATMUL]
    qk, av = a.costs[1], a.costs[3]
    assert qk.forward_macs == av.forward_macs == 2 * 2 * 10 * 10 * 4
    assert a.costs[2].forward_flops == 5 * 2 * 2 * 10 * 10
    assert mac_class_flops(a) == 2 * (qk.forward_macs + av.forward_macs)
    # Transpose is real data movement: read + write of the tensor
    assert a.costs[0].forward_bytes == 2 * 2 * 2 * 10 * 4 * 4


def test_onnx23_fused_attention_op() -> None:
    nodes = [helper.make_node("Attention", ["q", "k", "v"], ["o"])]
    content = _model(nodes, [_x("q", ["batch", 8, 32, 16]), _x("k", ["batch", 2, 48, 16]),
                             _x("v", ["batch", 2, 48, 24])], opset=23)
    g, a = _single(content, batch_size=2)
    (layer,) = g.layers
    assert layer.kind is OpKind.ATTENTION
    assert layer.outputs[0].shape == (2, 8, 32, 24)
    # grouped-query heads: Q·Kᵀ 2·8·32·48·16 + A·V 2·8·32·48·24
    assert a.forward_macs == 2 * 8 * 32 * 48 * (16 + 24)
    assert mac_class_flops(a) == 2 * a.forward_macs
    assert a.forward_flops == 2 * a.forward_macs + 5 * 2 * 8 * 32 * 48


def test_com_microsoft_attention_and_multihead_attention() -> None:
    e, s, heads = 64, 12, 4
    nodes = [
        helper.make_node("Attention", ["x", "w", "b"], ["a"], domain="com.microsoft", num_heads=heads),
        helper.make_node("MultiHeadAttention", ["a", "a", "a"], ["o"], domain="com.microsoft", num_heads=heads),
    ]
    content = _model(nodes, [_x("x", ["batch", s, e])], [_w("w", (e, 3 * e)), _w("b", (3 * e,))],
                     extra_opsets=[("com.microsoft", 1)])
    g, a = _single(content, batch_size=2)
    att, mha = a.costs
    assert not a.unsupported
    assert att.params == e * 3 * e + 3 * e
    assert att.forward_macs == 2 * s * e * 3 * e + 2 * s * s * 2 * e
    assert mha.forward_macs == 2 * s * s * 2 * e
    assert att.backward_weight_flops == 2 * (2 * s * e * 3 * e)
    assert g.layers[1].outputs[0].shape == (2, s, e)


# --- counting bug: LSTM / GRU counted as zero ------------------------------------------------------


@pytest.mark.parametrize(("op", "gates", "dirs"), [("LSTM", 4, 1), ("LSTM", 4, 2), ("GRU", 3, 2), ("RNN", 1, 1)])
def test_recurrent_ops_count_all_timesteps_and_directions(op: str, gates: int, dirs: int) -> None:
    i_size, h, t = 16, 32, 7
    direction = "bidirectional" if dirs == 2 else "forward"
    nodes = [helper.make_node(op, ["x", "W", "R", "B"], ["y"], hidden_size=h, direction=direction)]
    inits = [_w("W", (dirs, gates * h, i_size)), _w("R", (dirs, gates * h, h), 1), _w("B", (dirs, 2 * gates * h), 2)]
    content = _model(nodes, [_x("x", ["seq", "batch", i_size])], inits)
    # ONNX recurrent ops are sequence-first: axis 0 is the sequence, bound by name
    g, a = _single(content, batch_size=3, dims={"seq": t})  # batch_size binds the batch axis (axis 1 here)
    (c,) = a.costs
    assert c.kind is OpKind.RECURRENT
    assert c.forward_macs == t * 3 * dirs * gates * h * (i_size + h)
    assert c.params == dirs * gates * h * (i_size + h + 2)
    assert c.backward_weight_flops == c.forward_flops


# --- counting bug: depthwise conv overcounted; conv 1-D/3-D, dilated, strided; ConvTranspose ------


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs", "out_shape"),
    [
        ((1, 8, 20), (16, 8, 3), {"pads": [1, 1]}, (1, 16, 20)),  # conv1d
        ((1, 4, 6, 8, 8), (8, 4, 3, 3, 3), {"strides": [2, 2, 2], "pads": [1] * 6}, (1, 8, 3, 4, 4)),  # conv3d
        ((1, 32, 16, 16), (32, 1, 3, 3), {"group": 32, "pads": [1] * 4}, (1, 32, 16, 16)),  # depthwise
        ((1, 8, 16, 16), (8, 4, 3, 3), {"group": 2, "dilations": [2, 2]}, (1, 8, 12, 12)),  # grouped+dilated
    ],
)
def test_conv_variants(x_shape, w_shape, attrs, out_shape) -> None:
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)]
    g, a = _single(_model(nodes, [_x("x", list(x_shape))], [_w("w", w_shape)]))
    (layer,) = g.layers
    assert layer.outputs[0].shape == out_shape
    # N · C_out · ∏out · (C_in/groups) · ∏k: the group factor divides once, through the weight shape
    assert a.forward_macs == int(np.prod(out_shape)) * int(np.prod(w_shape[1:]))


def test_conv_transpose() -> None:
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[1, 1, 1, 1],
                              output_padding=[1, 1])]
    g, a = _single(_model(nodes, [_x("x", [2, 8, 7, 7])], [_w("w", (8, 4, 3, 3))]), batch_size=2)
    assert g.layers[0].outputs[0].shape == (2, 4, 14, 14)
    assert a.forward_macs == 2 * 8 * 49 * 4 * 9  # every input pixel scatters C_out/g · ∏k products


# --- data movement, resize, norms, reductions, unknown ops ---------------------------------------


def test_data_movement_ops_are_bytes_not_flops() -> None:
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("Split", ["p", "split"], ["s1", "s2"], axis=1),
        helper.make_node("Concat", ["s2", "s1"], ["c"], axis=1),
        helper.make_node("Slice", ["c", "st", "en", "ax"], ["sl"]),
        helper.make_node("Resize", ["sl", "", "scales"], ["r"], mode="nearest"),
        helper.make_node("Reshape", ["r", "shape"], ["y"]),
    ]
    ints = lambda n, v: numpy_helper.from_array(np.array(v, dtype=np.int64), n)  # noqa: E731
    inits = [ints("pads", [0, 0, 1, 1, 0, 0, 1, 1]), ints("split", [2, 2]), ints("st", [1]), ints("en", [9]),
             ints("ax", [2]), numpy_helper.from_array(np.array([1, 1, 2, 2], dtype=np.float32), "scales"),
             ints("shape", [0, -1])]
    g, a = _single(_model(nodes, [_x("x", ["batch", 4, 8, 8])], inits), batch_size=2)
    shapes = {layer.op_type: layer.outputs[0].shape for layer in g.layers}
    assert shapes == {"Pad": (2, 4, 10, 10), "Split": (2, 2, 10, 10), "Concat": (2, 4, 10, 10),
                      "Slice": (2, 4, 8, 10), "Resize": (2, 4, 16, 20), "Reshape": (2, 1280)}
    assert all(c.kind is OpKind.DATA_MOVEMENT and c.forward_flops == 0 for c in a.costs)
    by_op = {c.op_type: c for c in a.costs}
    assert by_op["Resize"].forward_bytes == (2 * 4 * 8 * 10 + 2 * 4 * 16 * 20) * 4
    assert by_op["Reshape"].forward_bytes == 0  # a view
    assert not a.unsupported


@pytest.mark.parametrize(("op", "kind", "per_elem"), [
    ("LayerNormalization", OpKind.NORM, 7), ("InstanceNormalization", OpKind.NORM, 7),
    ("ReduceMean", OpKind.REDUCE, 1), ("Softmax", OpKind.SOFTMAX, 5), ("Gelu", OpKind.ACTIVATION, 8),
    ("Sigmoid", OpKind.ACTIVATION, 4), ("Erf", OpKind.ACTIVATION, 4),
])
def test_pointwise_and_norm_ops_have_per_element_flops(op: str, kind: OpKind, per_elem: int) -> None:
    inputs = ["x"]
    inits = []
    if op in ("LayerNormalization", "InstanceNormalization"):
        c = 6 if op == "LayerNormalization" else 4
        inputs += ["g", "b"]
        inits = [_w("g", (c,)), _w("b", (c,), 1)]
    nodes = [helper.make_node(op, inputs, ["y"])]
    g, a = _single(_model(nodes, [_x("x", ["batch", 4, 5, 6])], inits, opset=20), batch_size=2)
    (c,) = a.costs
    assert c.kind is kind
    assert c.forward_macs == 0
    assert c.forward_flops == per_elem * 2 * 4 * 5 * 6


def test_einsum_batched_product() -> None:
    nodes = [helper.make_node("Einsum", ["a", "b"], ["y"], equation="bhqd,bhkd->bhqk")]
    g, a = _single(_model(nodes, [_x("a", ["batch", 2, 5, 8]), _x("b", ["batch", 2, 7, 8])], opset=17),
                   batch_size=3)
    assert g.layers[0].kind is OpKind.MATMUL
    assert a.forward_macs == 3 * 2 * 5 * 7 * 8


def test_unknown_ops_are_listed_with_their_count() -> None:
    nodes = [helper.make_node("Hardmax", ["x"], ["h"]), helper.make_node("Hardmax", ["h"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["y"])]
    g, a = _single(_model(nodes, [_x("x", [1, 8])]))
    (u,) = a.unsupported
    assert (u.op_type, u.count) == ("Hardmax", 2)
    assert a.unsupported_layer_count == 2
    assert all(c.forward_flops == 0 and not c.supported for c in a.costs if c.op_type == "Hardmax")


def test_other_domain_op_is_unsupported_not_zero() -> None:
    nodes = [helper.make_node("FancyOp", ["x"], ["y"], domain="com.example")]
    g, a = _single(_model(nodes, [_x("x", [1, 8])], extra_opsets=[("com.example", 1)]))
    assert [u.op_type for u in a.unsupported] == ["FancyOp"]


# --- counting bug: symbolic dimension crash; repeated calls grow -----------------------------------


def test_symbolic_dimension_is_named_not_a_crash() -> None:
    content = _model([helper.make_node("Relu", ["x"], ["y"])], [_x("x", ["batch", "tokens", 8])])
    with pytest.raises(UnboundDimension) as err:
        import_onnx(content, batch_size=2)
    assert err.value.detail["dimension"] == "tokens"
    assert "tokens" in str(err.value)


def test_repeated_calls_do_not_grow() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    content = _model(nodes, [_x("x", ["batch", 16])], [_w("w", (16, 4))])
    results = [analyze(import_onnx(content, batch_size=4)) for _ in range(3)]
    assert len({(r.forward_flops, r.params, r.backward_flops) for r in results}) == 1


# --- counting bug: tied (shared) weights counted twice --------------------------------------------


def test_tied_weight_through_transpose_and_folded_copy_counted_once() -> None:
    vocab, d = 100, 32
    table = _w("emb", (vocab, d))
    folded = numpy_helper.from_array(numpy_helper.to_array(table).T.copy(), "head_t")  # constant-folded copy
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["h"]),
        helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "emb_t"], ["logits"]),
        helper.make_node("MatMul", ["h", "head_t"], ["y"]),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    g = import_onnx(_model(nodes, [ids], [table, folded]), batch_size=2, dims={"seq": 5})
    a = analyze(g)
    assert a.params == vocab * d  # one table, three users
    assert g.shared_weights == ("emb",)
    assert [layer.kind for layer in g.layers] == [OpKind.EMBEDDING, OpKind.GEMM, OpKind.GEMM]


def test_distinct_weights_with_equal_statistics_are_not_merged() -> None:
    a_ = _w("a", (64, 64))
    b_ = numpy_helper.from_array(np.flip(numpy_helper.to_array(a_)).copy(), "b")  # same min/max, other values
    nodes = [helper.make_node("MatMul", ["x", "a"], ["h"]), helper.make_node("MatMul", ["h", "b"], ["y"])]
    g = import_onnx(_model(nodes, [_x("x", ["batch", 64])], [a_, b_]), batch_size=1)
    assert g.params == 2 * 64 * 64
    assert g.shared_weights == ()


# --- eval-mode export hygiene ---------------------------------------------------------------------


def _conv_bn(torch):
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 8, 3, bias=False)
            self.bn = torch.nn.BatchNorm2d(8)
            self.c2 = torch.nn.Conv2d(8, 8, 3)

        def forward(self, x):
            return self.c2(torch.relu(self.bn(self.c1(x))))

    return Net()


@pytest.mark.parametrize(("training", "folding", "expect"), [
    ("EVAL", True, "folded"), ("EVAL", False, "inference mode"), ("TRAINING", False, None),
])
def test_eval_mode_export_is_flagged(training: str, folding: bool, expect: str | None) -> None:
    torch = pytest.importorskip("torch")
    net = _conv_bn(torch)
    mode = getattr(torch.onnx.TrainingMode, training)
    net.train(training == "TRAINING")
    buf = io.BytesIO()
    torch.onnx.export(net, (torch.randn(1, 3, 16, 16),), buf, training=mode, do_constant_folding=folding,
                      dynamo=False, input_names=["x"])
    g = import_onnx(buf.getvalue(), batch_size=1)
    flagged = [w for w in g.warnings if w.startswith(EVAL_EXPORT_WARNING)]
    if expect is None:
        assert not flagged
        assert "BatchNormalization" in {layer.op_type for layer in g.layers}
    else:
        assert len(flagged) == 1 and expect in flagged[0]


def test_bn_free_cnn_is_not_flagged() -> None:
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).eval()
    buf = io.BytesIO()
    torch.onnx.export(net, (torch.randn(1, 3, 16, 16),), buf, dynamo=False, input_names=["x"])
    assert not import_onnx(buf.getvalue(), batch_size=1).warnings


def test_layer_cost_is_pure() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    g = import_onnx(_model(nodes, [_x("x", ["batch", 16])], [_w("w", (16, 4))]), batch_size=2)
    assert layer_cost(g.layers[0]) == layer_cost(g.layers[0])
