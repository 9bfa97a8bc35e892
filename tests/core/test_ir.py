"""The typed layer-attribute contract: each kind carries its own record, checked when the layer is built."""

from __future__ import annotations

import pytest

from app.core.costs import layer_cost, mac_count
from app.core.ir import (
    ATTRS_FOR_KIND,
    AttentionAttrs,
    ConvAttrs,
    GemmAttrs,
    Layer,
    OpKind,
    PoolAttrs,
    RecurrentAttrs,
    Tensor,
    UnsupportedAttrs,
)


def _layer(kind: OpKind, attrs, **kw) -> Layer:  # noqa: ANN001
    return Layer("l", "Op", kind, (Tensor("x", (2, 4, 8, 8)),), (Tensor("y", (2, 4, 8, 8)),), attrs=attrs, **kw)


NEEDS_RECORD = sorted((k for k, types in ATTRS_FOR_KIND.items() if type(None) not in types), key=lambda k: k.value)


def test_every_mac_class_kind_needs_a_record() -> None:
    mac_kinds = {OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM, OpKind.MATMUL, OpKind.RECURRENT, OpKind.ATTENTION}
    assert mac_kinds <= set(NEEDS_RECORD)


@pytest.mark.parametrize("kind", NEEDS_RECORD)
def test_a_kind_that_needs_a_record_rejects_a_layer_without_it(kind: OpKind) -> None:
    with pytest.raises(TypeError, match=kind.value):
        _layer(kind, None)


def test_a_record_of_another_kind_is_rejected_at_construction() -> None:
    conv = ConvAttrs((4, 4, 3, 3), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    with pytest.raises(TypeError, match="GemmAttrs"):
        _layer(OpKind.GEMM, conv)
    with pytest.raises(TypeError, match="NoneType"):
        _layer(OpKind.ACTIVATION, PoolAttrs((2, 2), (2, 2), (0, 0, 0, 0)))


def test_records_are_frozen() -> None:
    a = GemmAttrs(m=2, n=3, k=4)
    with pytest.raises(AttributeError):
        a.m = 5  # type: ignore[misc]


def test_macs_come_from_the_records_in_one_place() -> None:
    conv = _layer(OpKind.CONV, ConvAttrs((4, 2, 3, 3), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), group=2))
    assert mac_count(conv) == 2 * 4 * 8 * 8 * 2 * 9  # ∏out · C_in/groups · ∏k
    gemm = _layer(OpKind.MATMUL, GemmAttrs(m=8, n=8, k=8, batch=(2, 4)))
    assert mac_count(gemm) == 2 * 4 * 8 * 8 * 8
    rnn = _layer(OpKind.RECURRENT, RecurrentAttrs(seq_len=5, batch=2, input_size=3, hidden_size=7, gates=3))
    assert mac_count(rnn) == 5 * 2 * 3 * 7 * (3 + 7)
    att = _layer(OpKind.ATTENTION, AttentionAttrs(batch=2, heads=4, q_len=8, kv_len=6, qk_width=32, v_width=16,
                                                  proj_rows=16, proj_in=32, proj_out=96))
    assert mac_count(att) == 16 * 32 * 96 + 2 * 8 * 6 * (32 + 16)
    assert mac_count(_layer(OpKind.ACTIVATION, None)) == 0


def test_layer_properties_read_the_record() -> None:
    conv = _layer(OpKind.CONV, ConvAttrs((4, 2, 3, 3), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), group=2,
                                         activation="ReLU"))
    assert (conv.group, conv.activation) == (2, "relu")
    plain = _layer(OpKind.SOFTMAX, None)
    assert (plain.group, plain.activation, plain.needs_input_grad) == (1, "none", True)


def test_unsupported_layer_carries_its_reason_and_costs_nothing() -> None:
    layer = _layer(OpKind.UNSUPPORTED, UnsupportedAttrs("no cost formula for op 'Op'"))
    c = layer_cost(layer)
    assert not c.supported and c.forward_flops == 0
    assert layer.attrs.reason == "no cost formula for op 'Op'"


def test_needs_input_grad_is_a_field_of_the_layer() -> None:
    gemm = GemmAttrs(m=8, n=8, k=8)
    first = layer_cost(_layer(OpKind.GEMM, gemm, needs_input_grad=False))
    inner = layer_cost(_layer(OpKind.GEMM, gemm))
    assert first.backward_input_flops == 0 and inner.backward_input_flops == inner.forward_flops
