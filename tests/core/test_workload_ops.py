"""Ops real workloads use (issue 7 item 6): CumSum, Trilu, ArgMax/ArgMin, TopK, Einsum with ``...``, 1-D MatMul.

Each graph puts a Relu before the op so the op is an inner layer (its input needs a gradient); every count
is derived by hand in the test.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from app.core.costs import einsum_macs
from app.core.ir import EinsumAttrs, GemmAttrs, OpKind, TopKAttrs
from app.core.shape_prop import einsum_output_shape
from tests.core.test_op_coverage import _model, _single, _w, _x


def _int_init(name: str, value) -> object:  # noqa: ANN001
    return numpy_helper.from_array(np.array(value, dtype=np.int64), name)


def _after_relu(node, shape, inits=(), batch=None):  # noqa: ANN001, ANN202
    nodes = [helper.make_node("Relu", ["x"], ["h"]), node]
    g, a = _single(_model(nodes, [_x("x", shape)], inits), batch_size=batch or shape[0])
    return g.layers[1], a.costs[1]


def test_cumsum_is_one_add_per_element_forward_and_backward() -> None:
    layer, c = _after_relu(helper.make_node("CumSum", ["h", "axis"], ["y"]), [4, 16], [_int_init("axis", 1)])
    assert layer.kind is OpKind.ELEMENTWISE and c.supported
    assert [t.shape for t in layer.inputs] == [(4, 16)]  # the axis is not an operand
    assert c.forward_flops == 64 and c.backward_input_flops == 64  # the gradient is a reversed cumsum
    assert (c.forward_bytes_read, c.forward_bytes_written) == (4 * 64, 4 * 64)


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu_is_a_masked_copy(upper: int) -> None:
    layer, c = _after_relu(helper.make_node("Trilu", ["h"], ["y"], upper=upper), [2, 8, 8])
    assert layer.kind is OpKind.DATA_MOVEMENT and c.supported
    assert c.forward_flops == 0
    assert (c.forward_bytes_read, c.forward_bytes_written) == (4 * 128, 4 * 128)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_argmax_argmin_compare_every_element_and_have_no_gradient(op: str) -> None:
    layer, c = _after_relu(helper.make_node(op, ["h"], ["y"], axis=1), [4, 10])
    assert layer.kind is OpKind.REDUCE and c.supported
    assert layer.outputs[0].shape == (4, 1) and layer.outputs[0].dtype == "int64"
    assert c.forward_flops == 40  # one comparison per input element
    assert c.backward_flops == 0 and c.backward_bytes == 0 and c.saved_activation_bytes == 0
    assert c.forward_bytes_written == 4 * 8  # int64 indices


def test_topk_is_heap_selection_and_scatters_its_gradient() -> None:
    layer, c = _after_relu(helper.make_node("TopK", ["h", "k"], ["v", "i"], axis=-1), [4, 100], [_int_init("k", [8])])
    assert layer.kind is OpKind.REDUCE and layer.attrs == TopKAttrs(k=8, axis_size=100)
    assert [t.shape for t in layer.outputs] == [(4, 8), (4, 8)]
    assert c.forward_flops == 400 * 3  # n · ⌈log₂ 8⌉
    assert c.backward_input_flops == 4 * 8  # the 8 selected gradients per row


def test_topk_of_one_is_one_comparison_per_element() -> None:
    _, c = _after_relu(helper.make_node("TopK", ["h", "k"], ["v", "i"], axis=1), [4, 100], [_int_init("k", [1])])
    assert c.forward_flops == 400


@pytest.mark.parametrize(("equation", "a", "b", "macs"), [
    ("...ij,...jk->...ik", [2, 3, 4, 5], (5, 6), 2 * 3 * 4 * 5 * 6),  # ellipsis only on one side
    ("...ij,...jk->...ik", [2, 3, 4, 5], (3, 5, 6), 2 * 3 * 4 * 5 * 6),  # ellipsis axes broadcast
    ("b...d,b...d->b...", [2, 7, 16], (2, 7, 16), 2 * 7 * 16),  # ellipsis in the middle
    ("bhqd,bhkd->bhqk", [2, 4, 8, 16], (2, 4, 8, 16), 2 * 4 * 8 * 8 * 16),  # no ellipsis, as before
])
def test_einsum_with_ellipsis(equation: str, a: list[int], b: tuple[int, ...], macs: int) -> None:
    node = helper.make_node("Einsum", ["h", "w"], ["y"], equation=equation)
    layer, c = _after_relu(node, a, [_w("w", b)])
    assert layer.kind is OpKind.GEMM and isinstance(layer.attrs, EinsumAttrs)  # w is a weight
    assert c.forward_macs == macs and c.forward_flops == 2 * macs


def test_einsum_macs_rejects_what_it_cannot_cost() -> None:
    assert einsum_macs("ij,jk,kl->il", ((2, 3), (3, 4), (4, 5))) is None  # three operands
    assert einsum_macs("ijk,jk->i", ((2, 3), (3, 4))) is None  # rank does not match the subscripts
    assert einsum_macs("...ij,...jk->...ik", ((2, 3, 4), (5, 4, 6))) is None  # ellipses do not broadcast


@pytest.mark.parametrize(("a", "b", "out", "macs"), [
    ([8], (8,), (), 8),  # a dot product: 8 MACs, a scalar result
    ([8], (8, 16), (16,), 8 * 16),  # vector · matrix
    ([1, 4, 8], (8,), (1, 4), 4 * 8),  # matrix · vector, batched
])
def test_one_dimensional_matmul_operands(a: list[int], b: tuple[int, ...], out: tuple[int, ...], macs: int) -> None:
    layer, c = _after_relu(helper.make_node("MatMul", ["h", "w"], ["y"]), a, [_w("w", b)], batch=1)
    assert c.supported and layer.kind is OpKind.GEMM
    assert layer.outputs[0].shape == out
    assert isinstance(layer.attrs, GemmAttrs) and c.forward_macs == macs


def test_dot_product_of_two_activations() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["x"], ["z"]),
             helper.make_node("MatMul", ["h", "z"], ["y"])]
    g, a = _single(_model(nodes, [_x("x", [8])]), batch_size=1)
    mm = g.layers[2]
    assert mm.kind is OpKind.MATMUL and mm.outputs[0].shape == () and not a.unsupported
    assert a.costs[2].forward_macs == 8
    assert a.costs[2].backward_input_flops == 2 * 2 * 8  # gradients for both operands


@pytest.mark.parametrize(("equation", "shapes"), [
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (5, 6)]),
    ("...ij,...jk", [(3, 1, 4, 5), (2, 5, 6)]),
    ("b...d,b...d->b...", [(2, 7, 16), (2, 7, 16)]),
    ("ij,jk", [(2, 3), (3, 4)]),
    ("bhqd,bhkd->bhqk", [(2, 4, 8, 16), (2, 4, 8, 16)]),
    ("i,i->", [(8,), (8,)]),
])
def test_einsum_output_shape_matches_numpy(equation: str, shapes: list[tuple[int, ...]]) -> None:
    arrays = [np.ones(s, dtype=np.float32) for s in shapes]
    assert einsum_output_shape(equation, shapes) == np.einsum(equation, *arrays).shape
