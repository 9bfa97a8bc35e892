"""ONNX import: real model-zoo graphs, torch exports with symbolic batch, errors."""

from __future__ import annotations

import io

import onnx
import pytest
from onnx import TensorProto, helper

from app.core.analysis import analyze
from app.core.costs import mac_count
from app.core.ir import GemmAttrs, OpKind
from app.core.onnx_import import import_onnx
from app.errors import InvalidGraph, UnboundDimension
from tests.helpers import light_model

ZOO = ["bvlc_alexnet", "zfnet512", "vgg19", "resnet50", "inception_v1", "inception_v2", "densenet121",
       "squeezenet", "shufflenet"]


@pytest.mark.parametrize(
    ("name", "params_m", "gmacs"),
    [
        # published figures: ResNet-50 25.6 M params, 4.1 GMACs (He et al. 2016, torchvision docs);
        # VGG-19 143.7 M params, 19.6 GMACs (Simonyan & Zisserman 2015, torchvision docs)
        ("resnet50", 25.6, 4.1),
        ("vgg19", 143.7, 19.6),
    ],
)
def test_published_params_and_macs_within_3_percent(name: str, params_m: float, gmacs: float) -> None:
    a = analyze(import_onnx(light_model(name), batch_size=1))
    assert a.params / 1e6 == pytest.approx(params_m, rel=0.03)
    assert a.forward_macs / 1e9 == pytest.approx(gmacs, rel=0.03)
    assert a.forward_flops >= 2 * a.forward_macs  # FLOPs = 2 x MACs for MAC ops, plus pointwise ops
    assert not a.unsupported


@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_graph_imports_fully_costed(name: str) -> None:
    g = import_onnx(light_model(name), batch_size=1)
    a = analyze(g)
    assert a.layer_count > 10
    assert not a.unsupported, a.unsupported
    # weights made by ConstantOfShape nodes are parameters, not layers
    assert "ConstantOfShape" not in a.op_counts
    assert a.params > 1e6
    assert all(c.forward_flops > 0 or c.kind in (OpKind.DATA_MOVEMENT, OpKind.DROPOUT) for c in a.costs)


@pytest.mark.parametrize("name", ["resnet50", "shufflenet", "inception_v1"])
def test_fixed_batch_export_is_rebound_and_scales_linearly(name: str) -> None:
    a1 = analyze(import_onnx(light_model(name), batch_size=1))
    g64 = import_onnx(light_model(name), batch_size=64)
    a64 = analyze(g64)
    assert a64.forward_macs == 64 * a1.forward_macs
    assert a64.params == a1.params  # weights do not grow with the batch
    assert g64.outputs[0].shape[0] == 64
    assert any("fixed batch size" in w for w in g64.warnings)


def test_repeated_imports_give_identical_numbers() -> None:
    content = light_model("resnet50")
    first = analyze(import_onnx(content, batch_size=8))
    second = analyze(import_onnx(content, batch_size=8))
    assert first.costs == second.costs
    assert first.forward_flops == second.forward_flops


def _small_net():
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(16)
            self.dw = torch.nn.Conv2d(16, 16, 3, groups=16, padding=1)
            self.fc = torch.nn.Linear(16, 10)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv(x)))
            x = self.dw(x)
            return self.fc(x.mean((2, 3)))

    return Net().eval()


@pytest.mark.parametrize("export_params", [True, False])
def test_torch_export_with_symbolic_batch(export_params: bool) -> None:
    torch = pytest.importorskip("torch")
    net = _small_net()
    buf = io.BytesIO()
    torch.onnx.export(
        net, torch.randn(2, 3, 32, 32), buf, export_params=export_params, input_names=["x"],
        dynamic_axes={"x": {0: "batch"}}, dynamo=False, do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
    )
    g = import_onnx(buf.getvalue(), batch_size=8)
    a = analyze(g)
    assert g.dims == {"batch": 8}
    assert a.params == sum(p.numel() for p in net.parameters())
    # conv 8*16*32*32*27 + depthwise 8*16*32*32*9 (not x16 for groups) + linear 8*16*10
    assert a.forward_macs == 8 * 16 * 1024 * 27 + 8 * 16 * 1024 * 9 + 8 * 16 * 10
    kinds = {layer.op_type: layer.kind for layer in g.layers}
    assert kinds["Conv"] is OpKind.CONV and kinds["Gemm"] is OpKind.GEMM


def test_symbolic_non_batch_dimension_must_be_bound() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])
    w = helper.make_tensor("w", TensorProto.FLOAT, [64, 32], [0.0] * (64 * 32))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(
        helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    content = model.SerializeToString()
    with pytest.raises(UnboundDimension) as err:
        import_onnx(content, batch_size=4)
    assert err.value.detail["dimension"] == "seq"
    with pytest.raises(UnboundDimension) as err:  # a misnamed binding: the message shows what was given
        import_onnx(content, batch_size=4, dims={"sequence": 128})
    assert "does not bind (it binds 'sequence', not 'seq')" in err.value.message
    assert err.value.detail["given_dims"] == ["sequence"]
    g = import_onnx(content, batch_size=4, dims={"seq": 128})
    (layer,) = g.layers
    assert layer.kind is OpKind.GEMM
    assert layer.attrs == GemmAttrs(m=128, n=32, k=64, batch=(4,), grad_operands=(True, False))
    assert mac_count(layer) == 4 * 128 * 64 * 32


def test_unknown_op_is_listed_as_unsupported_not_zero() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    node = helper.make_node("Relu", ["x"], ["h"])
    odd = helper.make_node("Hardmax", ["h"], ["y"])
    model = helper.make_model(helper.make_graph([node, odd], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    a = analyze(import_onnx(model.SerializeToString(), batch_size=1))
    assert [u.op_type for u in a.unsupported] == ["Hardmax"]
    assert a.unsupported[0].count == 1


@pytest.mark.parametrize("content", [b"", b"not an onnx file at all", b"\x08\x07" * 50])
def test_garbage_bytes_raise_invalid_graph(content: bytes) -> None:
    with pytest.raises(InvalidGraph):
        import_onnx(content, batch_size=1)


def test_non_positive_batch_is_rejected() -> None:
    with pytest.raises(ValueError):
        import_onnx(light_model("squeezenet"), batch_size=0)


def test_model_proto_input_is_not_mutated() -> None:
    model = onnx.load_model_from_string(light_model("vgg19"))
    before = model.SerializeToString()
    import_onnx(model, batch_size=16)
    assert model.SerializeToString() == before


def _one_node(op: str, x_shape: list[int | str], weights: dict[str, tuple[int, ...]], **attrs: object) -> bytes:
    """A graph of one ``op`` node on data input ``x`` and float initializers ``weights`` (operand order)."""
    import numpy as np
    from onnx import numpy_helper

    inits = [numpy_helper.from_array(np.full(shape, 0.5, np.float32), name) for name, shape in weights.items()]
    node = helper.make_node(op, ["x", *weights], ["y"], name="n", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _ort_runs(content: bytes, x_shape: tuple[int, ...]) -> bool:
    """Whether onnxruntime builds and runs the model on zeros of ``x_shape`` (the oracle for "the shapes chain")."""
    import numpy as np
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(content, providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.zeros(x_shape, np.float32)})
    except Exception:  # noqa: BLE001 - onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
        return False
    return True


_SHAPE_CASES = [
    # (op, x, weights, attrs, refused field or None, forward MACs at batch 2 when accepted)
    ("MatMul", ["N", 784], {"w": (100, 10)}, {}, "B", None),
    ("MatMul", ["N", 784], {"w": (784, 10)}, {}, None, 2 * 784 * 10),
    ("MatMul", ["N", 3, 4, 8], {"w": (2, 8, 5)}, {}, "B", None),  # batch axes (N, 3) and (2,) do not broadcast
    ("Gemm", ["N", 784], {"w": (100, 10)}, {}, "B", None),
    ("Gemm", ["N", 784], {"w": (784, 10)}, {"transB": 1}, "B", None),
    ("Gemm", ["N", 784], {"w": (10, 784)}, {"transB": 1}, None, 2 * 784 * 10),
    # A (K, M) under transA: the importer takes axis 0 for the batch axis (it would rebind a fixed 784 to the
    # batch size), so these are imported at batch_size 784, with dims binding M
    ("Gemm", [784, "M"], {"w": (784, 10)}, {"transA": 1}, None, 2 * 784 * 10),
    ("Gemm", [784, "M"], {"w": (100, 10)}, {"transA": 1}, "B", None),
    ("Gemm", ["N", 784], {"w": (784, 10), "c": (7,)}, {}, "C", None),
    ("Gemm", ["N", 784], {"w": (784, 10), "c": (10,)}, {}, None, 2 * 784 * 10),
    ("Conv", ["N", 3, 32, 32], {"w": (8, 5, 3, 3)}, {}, "W", None),  # C_in 3 != 5
    ("Conv", ["N", 3, 32, 32], {"w": (8, 3, 3, 3)}, {}, None, 2 * 8 * 30 * 30 * 3 * 9),
    ("Conv", ["N", 4, 8, 8], {"w": (8, 4, 3, 3)}, {"group": 2}, "W", None),  # 4 x 2 != 4
    ("Conv", ["N", 4, 8, 8], {"w": (8, 2, 3, 3)}, {"group": 2}, None, 2 * 8 * 6 * 6 * 2 * 9),
    ("Conv", ["N", 4, 8, 8], {"w": (7, 2, 3, 3)}, {"group": 2}, "group", None),  # 2 groups of 7 filters
    ("Conv", ["N", 3, 32, 32], {"w": (8, 3, 3, 3), "b": (9,)}, {}, "B", None),
    ("ConvTranspose", ["N", 4, 8, 8], {"w": (3, 2, 3, 3)}, {}, "W", None),  # W's first axis is C_in
    ("ConvTranspose", ["N", 4, 8, 8], {"w": (4, 2, 3, 3)}, {}, None, 2 * 4 * 64 * 2 * 9),
]


@pytest.mark.parametrize(("op", "x", "weights", "attrs", "field", "macs"), _SHAPE_CASES)
def test_operands_that_do_not_fit_are_refused_as_onnxruntime_refuses_them(
        op: str, x: list[int | str], weights: dict[str, tuple[int, ...]], attrs: dict[str, object],
        field: str | None, macs: int | None) -> None:
    """A MatMul of x (N, 784) with W (100, 10) was stored and costed with K = 784 (or listed as "shape could
    not be inferred"); onnx's strict inference and onnxruntime refuse it. onnxruntime is the oracle here: every
    refused case fails to run there and every accepted one runs."""
    content = _one_node(op, x, weights, **attrs)
    x_shape = tuple(2 if isinstance(d, str) else d for d in x)
    dims, batch = ({"M": 2}, 784) if "M" in x else ({}, 2)
    assert _ort_runs(content, x_shape) is (field is None)
    if field is None:
        a = analyze(import_onnx(content, batch_size=batch, dims=dims))
        assert not a.unsupported and a.forward_macs == macs
        return
    with pytest.raises(InvalidGraph) as err:
        import_onnx(content, batch_size=batch, dims=dims)
    assert err.value.code == "invalid_graph" and err.value.status_code == 422
    detail = err.value.detail
    assert (detail["node"], detail["node_index"], detail["op_type"], detail["field"]) == ("n", 0, op, field)
    slot = "W" if field == "group" else field  # the operand the message shows (ONNX spec names: A, B, C, X, W)
    init = {"W": "w", "C": "c", "B": "w" if op in ("MatMul", "Gemm") else "b"}[slot]
    assert detail["shapes"][slot] == list(weights[init])
    assert err.value.message.startswith(f"{op} 'n' (node 0): ")


def test_a_transformer_export_is_refused_at_a_sequence_length_its_reshapes_do_not_hold() -> None:
    """``torch.nn.TransformerEncoder`` traced at seq 16 bakes ``[16, batch·heads, head_dim]`` into its
    attention Reshapes, even with a dynamic ``seq`` axis: at ``seq=64`` onnxruntime refuses the node, and the
    import used to warn "inconsistent at this binding" and cost every later layer at seq 16."""
    torch = pytest.importorskip("torch")
    import warnings

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(encoder, (torch.randn(1, 16, 64),), buf, input_names=["x"],
                          dynamic_axes={"x": {0: "batch", 1: "seq"}}, dynamo=False, opset_version=17)
    content = buf.getvalue()
    assert _ort_runs(content, (1, 16, 64)) and not _ort_runs(content, (1, 64, 64))
    g = import_onnx(content, batch_size=1, dims={"seq": 16})
    assert g.outputs[0].shape == (1, 16, 64) and not any("Reshape" in w for w in g.warnings)
    with pytest.raises(InvalidGraph) as err:
        import_onnx(content, batch_size=1, dims={"seq": 64})
    detail = err.value.detail
    assert detail["op_type"] == "Reshape" and detail["field"] == "shape" and detail["dims"]["seq"] == 64
    assert detail["input_shape"] == [64, 1, 64] and detail["output_shape"] == [16, 4, 16]
    assert len(detail["nodes"]) == 2 and detail["node"] in detail["nodes"]
    assert "inconsistent at this binding" in err.value.message
