"""Reading a ModelProto from a file in bounded slices (app.core.onnx_wire) and the value fingerprint that
finds tied weight copies (app.core.onnx_weights)."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from app.core import onnx_wire
from app.core.onnx_import import parse_model
from app.core.onnx_weights import _tied_copies
from app.errors import InvalidGraph
from tests.helpers import light_model


def _with_big_initializer() -> bytes:
    """A model whose one initializer record (1 MB) is longer than the slices the test reads in, with
    metadata fields before and after the graph."""
    w = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 512])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="p")
    model.doc_string = "after the graph"
    helper.set_model_props(model, {"k": "v"})
    return model.SerializeToString()


@pytest.mark.parametrize("chunk", [1, 64, 4096, onnx_wire.CHUNK_BYTES])
@pytest.mark.parametrize("content", [light_model("resnet50"), light_model("bvlc_alexnet"), _with_big_initializer()],
                         ids=["resnet50", "alexnet", "big-initializer"])
def test_read_in_slices_is_the_message_onnx_parses(monkeypatch: pytest.MonkeyPatch, chunk: int,
                                                   content: bytes) -> None:
    monkeypatch.setattr(onnx_wire, "CHUNK_BYTES", chunk)
    f = io.BytesIO(b"prefix" + content)
    f.seek(len(b"prefix"))
    model = onnx_wire.read_model(f)
    assert model == onnx.load_model_from_string(content)
    assert model.SerializeToString() == content
    assert f.tell() == len(b"prefix") + len(content)


def test_slices_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No read is longer than a slice, except a single record that is longer by itself."""
    content = light_model("resnet50")
    sizes: list[int] = []

    class Spy(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            out = super().read(n)
            sizes.append(len(out))
            return out

    monkeypatch.setattr(onnx_wire, "CHUNK_BYTES", 4096)
    model = onnx_wire.read_model(Spy(content))
    assert model == onnx.load_model_from_string(content)
    g = model.graph
    longest_record = max(m.ByteSize() for m in [*g.node, *g.initializer, *g.input, *g.output, *g.value_info])
    assert max(sizes) <= max(4096, longest_record + 20)  # + the record's tag and length
    assert max(sizes) < len(content) / 8


@pytest.mark.parametrize("content", [b"\x0f\x00\x00", b"\xff" * 40, _with_big_initializer()[:-300],
                                     b"\x3a\xff\xff\xff\xff\x0f" + b"\0" * 10],
                         ids=["wire-type-7", "overlong-varint", "truncated", "length-past-the-end"])
def test_bytes_that_are_not_a_model_are_invalid_graph(content: bytes) -> None:
    with pytest.raises(InvalidGraph, match="not a valid ONNX model"):
        parse_model(io.BytesIO(content))
    with pytest.raises(InvalidGraph, match="not a valid ONNX model") as info:
        parse_model(content)
    # the message says what is wrong in a user's words, not only the parser's class name
    assert "not a protobuf ModelProto (" in info.value.message and "WireError" not in info.value.message


def _graph_with(*arrays: tuple[str, np.ndarray]) -> onnx.GraphProto:
    return helper.make_graph([], "g", [], [], [numpy_helper.from_array(a, n) for n, a in arrays])


def test_tied_copies_found_by_fingerprint_match_array_equal() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 400)).astype(np.float32)
    w[0, 0] = 0.0
    copy_t = w.T.copy()
    copy_t[0, 0] = -0.0  # equal to +0.0 for np.array_equal, another bit pattern
    same_values_permuted = np.roll(w, 1, axis=1)  # the same multiset of values, not a copy
    g = _graph_with(("w", w), ("other", rng.standard_normal((300, 400)).astype(np.float32)),
                    ("w_t", copy_t), ("w_again", w.copy()), ("permuted", same_values_permuted),
                    ("const_a", np.ones((300, 400), np.float32)), ("const_b", np.ones((300, 400), np.float32)))
    assert _tied_copies(g) == {"w_t": ("w", True), "w_again": ("w", False)}
