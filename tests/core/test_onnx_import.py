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
