"""Cost formulas on hand-checkable layers (JSON importer builds them)."""

from __future__ import annotations

import pytest

from app.core.analysis import analyze
from app.core.costs import layer_cost, optimizer_update_cost
from app.core.json_import import import_json
from app.errors import InvalidGraph


def _one(layer: dict, shape: list[int], batch: int = 2):
    g = import_json({"input_shape": shape, "layers": [{"op": "relu"}, layer]}, batch_size=batch)
    return g.layers[1], layer_cost(g.layers[1])


def test_conv_macs_and_flops_named_separately() -> None:
    layer, c = _one({"op": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1}, [4, 10, 10])
    assert c.forward_macs == 2 * 8 * 10 * 10 * 4 * 9
    assert c.forward_flops == 2 * c.forward_macs
    assert c.params == 8 * 4 * 9 + 8
    # inner layer: input gradient and weight gradient, each the size of the forward
    assert c.backward_input_flops == c.forward_flops
    assert c.backward_weight_flops == c.forward_flops


def test_depthwise_is_not_overcounted_by_the_group_factor() -> None:
    _, dense = _one({"op": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1}, [32, 8, 8])
    _, dw = _one({"op": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1, "groups": 32}, [32, 8, 8])
    assert dense.forward_macs == 32 * dw.forward_macs
    assert dw.forward_macs == 2 * 32 * 8 * 8 * 9
    assert dw.params == 32 * 9 + 32


def test_strided_dilated_conv_output_shape() -> None:
    layer, c = _one({"op": "conv2d", "out_channels": 4, "kernel_size": 3, "stride": 2, "dilation": 2}, [1, 11, 11])
    assert layer.outputs[0].shape == (2, 4, 4, 4)  # (11 - 2*2 - 1)//2 + 1 = 4
    assert c.forward_macs == 2 * 4 * 16 * 9


def test_first_layer_needs_no_input_gradient() -> None:
    g = import_json({"input_shape": [16], "layers": [{"op": "linear", "out_features": 4}]}, batch_size=3)
    c = layer_cost(g.layers[0])
    assert c.forward_macs == 3 * 16 * 4
    assert c.backward_input_flops == 0
    assert c.backward_weight_flops == c.forward_flops


def test_relu_is_memory_bound_conv_is_not() -> None:
    g = import_json(
        {"input_shape": [64, 56, 56], "layers": [{"op": "conv2d", "out_channels": 64, "kernel_size": 3,
                                                   "padding": 1}, {"op": "relu"}]},
        batch_size=32,
    )
    conv, relu = (layer_cost(x) for x in g.layers)
    assert conv.operational_intensity > 50
    assert relu.operational_intensity < 1
    assert relu.forward_bytes == 2 * g.layers[1].inputs[0].nbytes


def test_optimizer_update_cost_scales_with_state() -> None:
    sgd = optimizer_update_cost(1000, "sgd")
    adam = optimizer_update_cost(1000, "adam")
    assert sgd == (2000, 1000 * 4 * 3)
    assert adam[0] > sgd[0] and adam[1] > sgd[1]
    assert optimizer_update_cost(1000, "none") == (0, 0)


def test_json_graph_totals() -> None:
    doc = {
        "input_shape": [3, 32, 32],
        "layers": [
            {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1},
            {"op": "batchnorm"}, {"op": "relu"}, {"op": "maxpool", "kernel_size": 2},
            {"op": "flatten"}, {"op": "linear", "out_features": 10}, {"op": "softmax"},
        ],
    }
    a = analyze(import_json(doc, batch_size=4))
    assert a.params == (16 * 27 + 16) + 32 + (16 * 16 * 16 * 10 + 10)
    assert a.forward_macs == 4 * 16 * 1024 * 27 + 4 * 4096 * 10
    assert a.graph.outputs[0].shape == (4, 10)


@pytest.mark.parametrize(
    "doc",
    [
        {"input_shape": [3, 8, 8], "layers": [{"op": "teleport"}]},
        {"input_shape": [3, 8, 8], "layers": [{"op": "conv2d", "kernel_size": 3}]},
        {"input_shape": [3, 4, 4], "layers": [{"op": "conv2d", "out_channels": 2, "kernel_size": 7}]},
        {"input_shape": [3, 8, 8], "layers": [{"op": "conv2d", "out_channels": 4, "kernel_size": 3, "groups": 2}]},
        {"input_shape": [0], "layers": [{"op": "relu"}]},
        {"input_shape": [4], "layers": []},
    ],
)
def test_malformed_json_graph_is_invalid(doc: dict) -> None:
    with pytest.raises(InvalidGraph):
        import_json(doc, batch_size=1)
