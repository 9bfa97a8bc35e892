"""JSON layer-list vocabulary beyond the sequential CNN: attention, recurrent stacks, transposed conv,
upsample, embeddings, conv1d/3d; each equivalent to the layers an ONNX export would have."""

from __future__ import annotations

import pytest

from app.core.analysis import analyze, mac_class_flops
from app.core.ir import OpKind
from app.core.json_import import DECLARED_INPUT_SIZES, DECLARED_SIZE_FIELDS, import_json
from app.errors import InvalidGraph


def test_multihead_attention_expands_to_projections_and_batched_products() -> None:
    s, e, h, b = 10, 32, 4, 2
    g = import_json({"input_shape": [s, e], "layers": [{"op": "layernorm"},
                    {"op": "multihead_attention", "num_heads": h}]}, batch_size=b)
    a = analyze(g)
    ops = [(layer.op_type, layer.kind) for layer in g.layers[1:]]
    assert ops == [("Gemm", OpKind.GEMM)] * 3 + [("MatMul", OpKind.MATMUL), ("Softmax", OpKind.SOFTMAX),
                                                 ("MatMul", OpKind.MATMUL), ("Gemm", OpKind.GEMM)]
    proj, attn = 4 * b * s * e * e, 2 * b * s * s * e
    assert a.forward_macs == proj + attn
    assert mac_class_flops(a) == 2 * (proj + attn)
    assert a.params == 2 * e + 4 * (e * e + e)
    assert g.outputs[0].shape == (b, s, e)
    qk = a.costs[4]
    assert qk.backward_input_flops == 2 * qk.forward_flops and qk.backward_weight_flops == 0


def test_lstm_stack_bidirectional_with_layers() -> None:
    t, emb, hid = 12, 64, 128
    g = import_json({"input_shape": [t], "input_dtype": "int64", "layers": [
        {"op": "embedding", "num_embeddings": 1000, "embedding_dim": emb},
        {"op": "lstm", "hidden_size": hid, "num_layers": 2, "bidirectional": True},
        {"op": "linear", "out_features": 1000}]}, batch_size=2)
    a = analyze(g)
    rec = [c for c in a.costs if c.kind is OpKind.RECURRENT]
    assert len(rec) == 2
    assert rec[0].forward_macs == t * 2 * 2 * 4 * hid * (emb + hid)
    assert rec[1].forward_macs == t * 2 * 2 * 4 * hid * (2 * hid + hid)
    assert g.outputs[0].shape == (2, t, 1000)
    assert a.params == 1000 * emb + 2 * 4 * hid * (emb + hid + 2) + 2 * 4 * hid * (2 * hid + hid + 2) + (
        2 * hid * 1000 + 1000)


def test_gru_rnn_gate_counts() -> None:
    for op, gates in (("gru", 3), ("rnn", 1)):
        g = import_json({"input_shape": [5, 8], "layers": [{"op": op, "hidden_size": 16}]}, batch_size=1)
        assert analyze(g).forward_macs == 5 * gates * 16 * (8 + 16)


def test_conv_transpose_and_upsample() -> None:
    g = import_json({"input_shape": [8, 7, 7], "layers": [
        {"op": "conv_transpose2d", "out_channels": 4, "kernel_size": 3, "stride": 2, "padding": 1,
         "output_padding": 1},
        {"op": "upsample", "scale_factor": 2}]}, batch_size=2)
    ct, up = g.layers
    assert ct.outputs[0].shape == (2, 4, 14, 14)
    assert up.outputs[0].shape == (2, 4, 28, 28)
    a = analyze(g)
    assert a.costs[0].forward_macs == 2 * 8 * 49 * 4 * 9
    assert a.costs[1].forward_flops == 0 and a.costs[1].forward_bytes == (2 * 4 * 196 + 2 * 4 * 784) * 4


@pytest.mark.parametrize(("op", "shape", "out"),
                         [("conv1d", [4, 20], (1, 8, 18)), ("conv3d", [4, 6, 6, 6], (1, 8, 4, 4, 4))])
def test_conv1d_conv3d(op: str, shape: list[int], out: tuple[int, ...]) -> None:
    g = import_json({"input_shape": shape, "layers": [{"op": op, "out_channels": 8, "kernel_size": 3}]})
    assert g.layers[0].outputs[0].shape == out


@pytest.mark.parametrize(("shape", "spec", "field"), [
    ([3, 32, 32], {"op": "conv2d", "out_channels": 16}, "kernel_size"),
    ([3, 32, 32], {"op": "conv2d", "out_channels": 16, "kernal_size": 3}, "kernel_size"),  # misspelt
    ([4, 20], {"op": "conv1d", "out_channels": 8, "stride": 2}, "kernel_size"),
    ([3, 32, 32], {"op": "conv", "out_channels": 8}, "kernel_size"),
    ([8, 7, 7], {"op": "conv_transpose2d", "out_channels": 4, "stride": 2}, "kernel_size"),
    ([3, 32, 32], {"op": "maxpool", "stride": 2}, "kernel_size"),
    ([3, 32, 32], {"op": "avgpool"}, "kernel_size"),
    ([3, 32, 32], {"op": "upsample"}, "scale_factor"),
    ([3, 32, 32], {"op": "conv2d", "kernel_size": 3}, "out_channels"),
])
def test_a_required_geometry_field_has_no_silent_default(shape: list[int], spec: dict[str, object],
                                                         field: str) -> None:
    """A field PyTorch's module requires (a conv's or pool's kernel, upsample's scale) is an error naming the
    layer and the field, not a guessed 1x1 / 2x2 kernel or a x2 scale."""
    with pytest.raises(InvalidGraph) as e:
        import_json({"input_shape": shape, "layers": [{"op": "relu"}, spec]})
    assert e.value.code == "invalid_graph" and e.value.status_code == 422
    assert e.value.detail == {"layer_index": 1, "field": field}
    assert f"layer 1: '{field}' is required" == e.value.message


@pytest.mark.parametrize(("spec", "field"), [
    ({"op": "conv2d", "out_channels": 8, "kernel_size": 3, "stride": None}, "stride"),
    ({"op": "conv2d", "out_channels": 8, "kernel_size": 3, "groups": None}, "groups"),
])
def test_an_explicit_null_of_an_optional_field_is_a_type_error_not_required(spec: dict[str, object],
                                                                            field: str) -> None:
    """``"stride": null`` is not a missing field (stride has PyTorch's default 1): the message must not call
    it required, as it names the value that was given."""
    with pytest.raises(InvalidGraph) as e:
        import_json({"input_shape": [3, 32, 32], "layers": [spec]})
    assert e.value.message.startswith(f"layer 0: '{field}' must be an integer ≥ 1")
    assert e.value.message.endswith("got None") and "required" not in e.value.message


def test_pool_stride_defaults_to_the_kernel_as_in_pytorch() -> None:
    for stride in ({}, {"stride": None}):
        g = import_json({"input_shape": [3, 32, 32], "layers": [{"op": "maxpool", "kernel_size": 4, **stride}]})
        assert g.layers[0].outputs[0].shape == (1, 3, 8, 8)


def test_attention_heads_must_divide_width() -> None:
    with pytest.raises(InvalidGraph):
        import_json({"input_shape": [4, 30], "layers": [{"op": "multihead_attention", "num_heads": 4}]})


def test_fields_no_builder_reads_are_named_in_a_warning() -> None:
    """A misspelt optional field falls back to the default (here padding 0): the graph must say so, not stay
    silent."""
    g = import_json({"input_shape": [3, 32, 32], "layers": [
        {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "paddding": 1},
        {"op": "relu", "inplace": True},
        {"op": "maxpool", "kernel_size": 2, "stride": 2},
        {"op": "flatten", "name": "flat"},
        {"op": "linear", "out_features": 10, "bias": False}]})
    assert g.layers[0].outputs[0].shape == (1, 16, 30, 30)  # the default (no padding) the typo left in place
    assert len(g.warnings) == 1
    assert "layer 0 (conv2d): 'paddding'; layer 1 (relu): 'inplace'" in g.warnings[0]
    assert "maxpool" not in g.warnings[0] and "linear" not in g.warnings[0]  # every field read: not named
    clean = import_json({"input_shape": [10, 32], "layers": [
        {"op": "multihead_attention", "num_heads": 4, "bias": True},
        {"op": "lstm", "hidden_size": 16, "num_layers": 2, "bidirectional": True}]})
    assert clean.warnings == ()
    noisy = import_json({"input_shape": [8], "layers": [{"op": "relu", **{f"k{j:05d}": j for j in range(5000)}}] * 50})
    assert len(noisy.warnings[0]) < 2000  # bounded whatever the document holds
    assert "'k00009' and 4990 more" in noisy.warnings[0] and "and 40 more layer(s)" in noisy.warnings[0]


def test_a_graph_ending_in_softmax_gets_nll_not_a_second_softmax() -> None:
    """Cross-entropy after the graph's own softmax would run softmax twice: the loss is then NLL on its output,
    and the whole training step costs what ``F.cross_entropy`` on the logits does (plus one add per row)."""
    from dataclasses import replace

    from app.core.analysis import LOSS_OP_TYPE, NLL_OP_TYPE

    b, classes = 8, 1000
    head = [{"op": "flatten"}, {"op": "linear", "out_features": classes}]
    logits = analyze(import_json({"input_shape": [64], "layers": head}, batch_size=b))
    probs_graph = import_json({"input_shape": [64], "layers": [*head, {"op": "softmax"}]}, batch_size=b)
    probs = analyze(probs_graph)
    assert logits.loss is not None and logits.loss.op_type == LOSS_OP_TYPE
    assert logits.loss_cost is not None and logits.loss_cost.forward_flops == 5 * b * classes
    assert probs.loss is not None and probs.loss.op_type == NLL_OP_TYPE and probs.loss.kind is OpKind.ELEMENTWISE
    assert probs.loss.inputs == probs_graph.outputs and probs.loss.outputs[0].shape == (b,)
    assert probs.loss_cost is not None and probs.loss_cost.forward_flops == b  # one per row, no softmax
    assert probs.loss_cost.backward_bytes_written == 4 * b * classes  # the probabilities' gradient

    def step(a: object, key: str) -> int:
        return sum(getattr(c, key) for _, c in a.step_layers(True))  # type: ignore[attr-defined]

    for key in ("forward_flops", "backward_flops"):
        assert step(probs, key) == step(logits, key) + b, key  # one softmax in both steps, not two
    log_probs = replace(probs_graph, layers=(*probs_graph.layers[:-1],
                                             replace(probs_graph.layers[-1], op_type="LogSoftmax")))
    assert analyze(log_probs).loss.op_type == NLL_OP_TYPE  # type: ignore[union-attr]
    relu_end = import_json({"input_shape": [64], "layers": [*head, {"op": "relu"}]}, batch_size=b)
    assert analyze(relu_end).loss.op_type == LOSS_OP_TYPE  # type: ignore[union-attr]


def test_a_view_after_the_graphs_softmax_still_makes_the_loss_nll() -> None:
    """An export that ends ``Softmax -> Flatten`` (a view: no value moves) has run the loss's softmax too; a
    compute layer after it (here ``relu``) has not: the loss is cross-entropy again."""
    from app.core.analysis import LOSS_OP_TYPE, NLL_OP_TYPE

    head = [{"op": "linear", "out_features": 100}, {"op": "softmax"}]
    b = 4
    for tail, op in (([{"op": "flatten"}], NLL_OP_TYPE), ([{"op": "flatten"}, {"op": "flatten"}], NLL_OP_TYPE),
                     ([{"op": "flatten"}, {"op": "relu"}], LOSS_OP_TYPE)):
        g = import_json({"input_shape": [64], "layers": [*head, *tail]}, batch_size=b)
        assert g.layers[-1].op_type in ("Flatten", "Relu")
        a = analyze(g)
        assert a.loss is not None and a.loss.op_type == op, tail
        assert a.loss_cost is not None and a.loss_cost.forward_flops == (b if op == NLL_OP_TYPE else 5 * b * 100)


@pytest.mark.parametrize(("shape", "spec", "field", "declared", "actual"), [
    ([784], {"op": "linear", "in_features": 100, "out_features": 10}, "in_features", 100, 784),
    ([784], {"op": "dense", "in_features": 100, "out_features": 10}, "in_features", 100, 784),
    ([3, 32, 32], {"op": "conv2d", "in_channels": 1, "out_channels": 8, "kernel_size": 3}, "in_channels", 1, 3),
    ([8, 7, 7], {"op": "conv_transpose2d", "in_channels": 4, "out_channels": 4, "kernel_size": 3}, "in_channels",
     4, 8),
    ([16, 64], {"op": "multihead_attention", "embed_dim": 128, "num_heads": 4}, "embed_dim", 128, 64),
    ([16, 64], {"op": "multihead_attention", "num_heads": 4, "kdim": 32}, "kdim", 32, 64),
    ([16, 64], {"op": "layernorm", "normalized_shape": 128}, "normalized_shape", 128, 64),
    ([16, 64], {"op": "layernorm", "normalized_shape": [8, 64]}, "normalized_shape", [8, 64], [16, 64]),
    ([3, 32, 32], {"op": "batchnorm", "num_features": 16}, "num_features", 16, 3),
    ([8, 4, 4], {"op": "groupnorm", "num_groups": 2, "num_channels": 16}, "num_channels", 16, 8),
    ([12, 64], {"op": "lstm", "input_size": 32, "hidden_size": 16}, "input_size", 32, 64),
])
def test_a_declared_input_size_that_contradicts_the_input_is_refused(
        shape: list[int], spec: dict[str, object], field: str, declared: object, actual: object) -> None:
    """PyTorch's constructor takes these sizes (``nn.Linear(100, 10)``) and raises on a 784-wide input; they
    used to be ignored with the generic "fields not read ... misspelt" warning and the graph stored and costed
    with the input's size."""
    with pytest.raises(InvalidGraph) as e:
        import_json({"input_shape": shape, "layers": [{"op": "relu"}, spec]})
    assert e.value.code == "invalid_graph" and e.value.status_code == 422
    assert e.value.detail == {"layer_index": 1, "field": field, "declared": declared, "actual": actual}
    assert e.value.message.startswith(f"layer 1: '{field}' is {declared} but its input (layer 0's output)")
    with pytest.raises(InvalidGraph) as first:  # the first layer's input is the document's input_shape
        import_json({"input_shape": shape, "layers": [spec]})
    assert first.value.detail["layer_index"] == 0 and "('input_shape')" in first.value.message


@pytest.mark.parametrize(("shape", "spec"), [
    ([784], {"op": "linear", "in_features": 784, "out_features": 10}),
    ([3, 32, 32], {"op": "conv2d", "in_channels": 3, "out_channels": 8, "kernel_size": 3}),
    ([8, 7, 7], {"op": "conv_transpose2d", "in_channels": 8, "out_channels": 4, "kernel_size": 3}),
    ([16, 64], {"op": "multihead_attention", "embed_dim": 64, "kdim": 64, "vdim": 64, "num_heads": 4}),
    ([16, 64], {"op": "layernorm", "normalized_shape": 64}),
    ([16, 64], {"op": "layernorm", "normalized_shape": [64]}),
    ([3, 32, 32], {"op": "batchnorm", "num_features": 3}),
    ([3, 32, 32], {"op": "instancenorm", "num_features": 3}),
    ([8, 4, 4], {"op": "groupnorm", "num_groups": 2, "num_channels": 8}),
    ([12, 64], {"op": "gru", "input_size": 64, "hidden_size": 16, "num_layers": 2}),
])
def test_a_declared_input_size_equal_to_the_input_is_read_and_changes_nothing(
        shape: list[int], spec: dict[str, object]) -> None:
    """The same layer without the field: same layers, same costs, and no "fields not read" warning."""
    key = next(k for k in spec if k in DECLARED_SIZE_FIELDS)
    g = import_json({"input_shape": shape, "layers": [spec]}, batch_size=2)
    plain = import_json({"input_shape": shape, "layers": [{k: v for k, v in spec.items() if k not in
                                                           DECLARED_SIZE_FIELDS}]}, batch_size=2)
    assert g.warnings == plain.warnings == ()
    assert g.layers == plain.layers, key
    assert analyze(g).forward_macs == analyze(plain).forward_macs


def test_a_layernorm_over_several_axes_has_their_gains() -> None:
    """``nn.LayerNorm([16, 64])`` on a (16, 64) sample: weight and bias of shape (16, 64), as in PyTorch."""
    g = import_json({"input_shape": [16, 64], "layers": [{"op": "layernorm", "normalized_shape": [16, 64]}]})
    assert [w.shape for w in g.layers[0].weights] == [(16, 64), (16, 64)]
    assert analyze(g).params == 2 * 16 * 64


def test_a_declared_size_on_an_op_without_it_is_still_only_unread() -> None:
    """``in_channels`` is no field of ``linear`` (PyTorch's ``nn.Linear`` has none): a warning, as any unread
    field, not a refusal."""
    g = import_json({"input_shape": [784], "layers": [{"op": "linear", "in_channels": 3, "out_features": 10}]})
    assert len(g.warnings) == 1 and "layer 0 (linear): 'in_channels'" in g.warnings[0]


_CONV_SHAPES = {"1": [3, 10], "2": [3, 10, 10], "3": [3, 6, 6, 6], "": [3, 10, 10]}
#: op → (one sample's shape, the op's required fields, the input size its declared fields repeat)
_DECLARING_OPS: dict[str, tuple[list[int], dict[str, object], int]] = {
    **{op: ([8], {"out_features": 4}, 8) for op in ("linear", "dense")},
    **{f"{base}{nd}{'d' if nd else ''}": (shape, {"out_channels": 4, "kernel_size": 3}, 3)
       for base in ("conv", "conv_transpose") for nd, shape in _CONV_SHAPES.items()},
    **{op: ([3, 10, 10], {}, 3) for op in ("batchnorm", "instancenorm")},
    "groupnorm": ([4, 5, 5], {"num_groups": 2}, 4),
    "layernorm": ([5, 8], {}, 8),
    **{op: ([5, 8], {"hidden_size": 4}, 8) for op in ("lstm", "gru", "rnn")},
    "multihead_attention": ([5, 8], {"num_heads": 2}, 8),
}


@pytest.mark.parametrize(("op", "field"), [(op, f) for op, fields in DECLARED_INPUT_SIZES.items() for f in fields])
def test_every_declared_input_size_is_checked_by_its_op(op: str, field: str) -> None:
    """Each field :data:`DECLARED_INPUT_SIZES` lists is read by its op (no warning when equal) and refused when
    it differs; a new op with such a field needs a line in ``_DECLARING_OPS``."""
    assert set(_DECLARING_OPS) == set(DECLARED_INPUT_SIZES)
    shape, required, size = _DECLARING_OPS[op]
    assert import_json({"input_shape": shape, "layers": [{"op": op, **required, field: size}]}).warnings == ()
    with pytest.raises(InvalidGraph) as e:
        import_json({"input_shape": shape, "layers": [{"op": op, **required, field: size + 1}]})
    assert e.value.detail == {"layer_index": 0, "field": field, "declared": size + 1, "actual": size}
