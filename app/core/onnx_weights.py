"""Weight data of an ONNX model: what is inline, what is stripped before storage, what is never read.

The service costs a graph from its structure and tensor shapes only. Weight *values* are never needed
(only shape-sized tensors, at most :data:`app.core.shape_prop.MAX_VALUE_NUMEL` elements, are folded), so:

* tensors stored as external data (``data_location = EXTERNAL``, a ``location`` path in the file) are
  costed from their declared ``dims`` and ``data_type``; the path is dropped and **never opened**
  (:func:`drop_external_data`). A path like ``../../etc/passwd`` or ``/proc/self/environ`` is just text;
* before a graph is stored, the data of every weight-sized tensor is removed and only its name, dims and
  dtype are kept (:func:`strip_weights`), so a 1.5 GB upload stores a few hundred kB and re-imports fast.

Tied weights stored as a copy (exporters constant-fold ``Transpose(wte)`` of GPT-2's tied LM head into a
second initializer with the same values transposed) can only be recognised by value, so
:func:`strip_weights` replaces such a copy with an explicit ``Transpose`` (or ``Identity``) node of the
original before the values go; the importer then sees one parameter viewed twice, as with the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from app.core.shape_prop import MAX_VALUE_NUMEL

_DATA_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
TIED_NODE_PREFIX = "layercast_tied/"
"""Name prefix of the view nodes :func:`strip_weights` puts in place of a tied copy."""


@dataclass(frozen=True)
class StripReport:
    """What :func:`strip_weights` removed: ``stripped_bytes`` of inline weight data (declared element
    count × element size, the bytes a framework would hold; tied copies included), in
    ``stripped_tensors`` tensors;
    ``external_tensors`` external-data references dropped (their bytes are in ``external_bytes``, never
    read); ``tied_copies`` initializers that were value copies of another one, replaced by a view node."""

    stripped_bytes: int
    stripped_tensors: int
    external_tensors: int
    external_bytes: int
    tied_copies: int


def numel(t: TensorProto) -> int:
    """Element count from the declared dims (1 for a scalar)."""
    return int(np.prod([int(d) for d in t.dims], dtype=np.int64)) if t.dims else 1


def nbytes(t: TensorProto) -> int:
    """Declared size in bytes: element count × element size of ``data_type`` (strings count 0)."""
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    if t.data_type == TensorProto.STRING:
        return 0
    return numel(t) * itemsize


def is_external(t: TensorProto) -> bool:
    """True when the tensor's values live in a file named inside the model (never read here)."""
    return t.data_location == TensorProto.EXTERNAL


def has_inline_data(t: TensorProto) -> bool:
    """True when the tensor's values are in the model itself, so ``numpy_helper.to_array`` can read
    them without touching the filesystem; False for external-data and stripped tensors."""
    if is_external(t):
        return False
    if numel(t) == 0:
        return True
    return t.HasField("raw_data") or any(len(getattr(t, f)) for f in _DATA_FIELDS)


def _clear_data(t: TensorProto) -> None:
    t.ClearField("raw_data")
    for f in _DATA_FIELDS:
        t.ClearField(f)
    del t.external_data[:]
    t.data_location = TensorProto.DEFAULT


def _graphs(g: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``g`` and every subgraph below it (If/Loop/Scan bodies)."""
    out = [g]
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out.extend(_graphs(a.g))
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    out.extend(_graphs(sub))
    return out


def _tensors(model: onnx.ModelProto) -> list[TensorProto]:
    """Every tensor of the model that can carry data: initializers, sparse initializers' values and
    indices, ``Constant`` values and tensor attributes, in the main graph, subgraphs and functions."""
    out: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    for g in _graphs(model.graph):
        out.extend(g.initializer)
        for sp in g.sparse_initializer:
            out.extend((sp.values, sp.indices))
        nodes.extend(g.node)
    for fn in model.functions:
        nodes.extend(fn.node)
    for node in nodes:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                out.append(a.t)
            elif a.type == onnx.AttributeProto.TENSORS:
                out.extend(a.tensors)
            elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                out.extend((a.sparse_tensor.values, a.sparse_tensor.indices))
    return out


def drop_external_data(model: onnx.ModelProto) -> tuple[int, int]:
    """Turn every external-data reference of ``model`` into a data-less tensor with its declared dims
    and dtype, in place; the referenced files are never opened.

    Returns ``(tensors, declared bytes)`` of the references dropped.
    """
    count = size = 0
    for t in _tensors(model):
        if is_external(t):
            count += 1
            size += nbytes(t)
            _clear_data(t)
    return count, size


def _value_key(arr: np.ndarray) -> tuple[int, float, float] | None:
    """A fingerprint of the multiset of ``arr``'s values, equal for two arrays that ``np.array_equal``
    calls equal in any element order (so for a tensor and its transpose): the wrapping uint64 sum of the
    elements' bit patterns with ``-0.0`` counted as ``+0.0``, the minimum and the maximum. ``None`` for a
    constant-valued array (freshly initialised constant tensors match by accident)."""
    lo, hi = arr.min(), arr.max()
    if lo == hi:
        return None
    flat = np.ascontiguousarray(arr).reshape(-1)
    bits = flat.view(np.dtype(f"u{flat.dtype.itemsize}"))
    sign = 1 << (8 * flat.dtype.itemsize - 1)
    negative_zeros = int(np.count_nonzero(bits == sign))
    total = (int(bits.sum(dtype=np.uint64)) - negative_zeros * sign) % 2**64
    return total, float(lo), float(hi)


def _tied_copies(g: onnx.GraphProto) -> dict[str, tuple[str, bool]]:
    """Initializers (weight-sized, float, rank ≥ 2, not constant-valued) that hold exactly the values of
    an earlier one or of its 2-D transpose: ``copy name → (original name, transposed)``.

    Only tensors whose (element count, dtype, sorted dims) collide are decoded, one at a time, to a
    value fingerprint (:func:`_value_key`); only those whose fingerprints collide are compared element
    by element, so a model without tied copies compares nothing and holds one decoded tensor at a time.
    """
    groups: dict[tuple, list[TensorProto]] = {}
    for init in g.initializer:
        if len(init.dims) >= 2 and init.data_type in _FLOAT_TYPES and numel(init) > MAX_VALUE_NUMEL \
                and has_inline_data(init):
            groups.setdefault((numel(init), init.data_type, tuple(sorted(init.dims))), []).append(init)
    out: dict[str, tuple[str, bool]] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        seen: dict[tuple[int, float, float], list[TensorProto]] = {}
        for init in members:
            key = _value_key(numpy_helper.to_array(init))  # decoded, fingerprinted, dropped
            if key is None:
                continue
            for original in seen.get(key, ()):
                arr, other = numpy_helper.to_array(init), numpy_helper.to_array(original)
                if other.shape == arr.shape and np.array_equal(other, arr):
                    out[init.name] = (original.name, False)
                    break
                if arr.ndim == 2 and other.shape == arr.shape[::-1] and np.array_equal(other.T, arr):
                    out[init.name] = (original.name, True)
                    break
            else:
                seen.setdefault(key, []).append(init)
    return out


def strip_weights(model: onnx.ModelProto) -> StripReport:
    """Remove weight data from ``model`` in place, keeping structure, names, dims and dtypes.

    * external-data references are dropped (:func:`drop_external_data`; nothing is read);
    * an initializer that is a value copy (or transposed copy) of another becomes a ``Transpose`` /
      ``Identity`` node of the original (node name prefix :data:`TIED_NODE_PREFIX`), so the tie
      survives the loss of the values;
    * the data of every tensor with more than :data:`MAX_VALUE_NUMEL` elements is cleared. Smaller
      tensors keep their values: shape arithmetic (Reshape targets, Resize scales) needs them.

    Returns a :class:`StripReport`.
    """
    ext_count, ext_bytes = drop_external_data(model)
    g = model.graph
    tied = _tied_copies(g)
    stripped = sum(nbytes(init) for init in g.initializer if init.name in tied)
    count = len(tied)
    if tied:
        keep = [init for init in g.initializer if init.name not in tied]
        del g.initializer[:]
        g.initializer.extend(keep)
        inputs = [vi for vi in g.input if vi.name not in tied]
        del g.input[:]
        g.input.extend(inputs)
        views = [
            helper.make_node("Transpose", [orig], [copy], name=f"{TIED_NODE_PREFIX}{copy}", perm=[1, 0])
            if transposed
            else helper.make_node("Identity", [orig], [copy], name=f"{TIED_NODE_PREFIX}{copy}")
            for copy, (orig, transposed) in tied.items()
        ]
        nodes = list(g.node)
        del g.node[:]
        g.node.extend([*views, *nodes])
    for t in _tensors(model):
        if numel(t) > MAX_VALUE_NUMEL and has_inline_data(t):
            stripped += nbytes(t)
            count += 1
            _clear_data(t)
    return StripReport(
        stripped_bytes=stripped,
        stripped_tensors=count,
        external_tensors=ext_count,
        external_bytes=ext_bytes,
        tied_copies=len(tied),
    )
