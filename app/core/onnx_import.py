"""ONNX model → layer IR, with concrete shapes from ONNX shape inference.

Handles the graphs people actually send:

* old-opset model-zoo graphs (``onnx/backend/test/data/light``) whose weights are produced by
  ``ConstantOfShape`` nodes from shape initializers, whose initializers are repeated as graph inputs
  (IR v3), and whose ``Reshape`` targets hard-code the export batch size;
* ``torch.onnx.export`` graphs with a symbolic batch dimension, weights as initializers or (with
  ``export_params=False``) as graph inputs, and ``Shape → Gather → Concat → Reshape`` shape subgraphs;
* torch 2.13's default dynamo exporter: opset 18+, ``torch.export`` naming (``s27`` dims, ``val_*``
  constants), model-local functions (inlined), and with ``keep_initializers_as_inputs`` weights *and*
  shape constants as value-less graph inputs (the exporter's ``value_info`` then sizes the tensors).

Algorithm: (1) classify every graph input as data, parameter or constant by provenance — what op operand
it reaches, through views (:func:`_classify_inputs`); (2) bind symbolic dimensions (the batch axis of each
data input, by what the op reading it means, ← the batch size; any other name from ``dims``, else
:class:`UnboundDimension`); (3) when the export batch size is fixed and differs from the requested one,
rebind it and rewrite constant ``Reshape`` targets that carry it to ``0`` ("copy this axis", ONNX Reshape
semantics); (4) run ``onnx.shape_inference.infer_shapes`` with data propagation, then
:func:`app.core.shape_prop.propagate_shapes`, and refuse a ``Reshape`` whose input and output sizes differ at
this binding (:func:`_refuse_inconsistent_reshapes`); (5) mark "static" tensors (initializers, parameter and
constant inputs, outputs of nodes fed only by static tensors or by ``Shape``) — nodes with no non-static input
are weight/shape bookkeeping, not layers; (6) emit one :class:`Layer` per remaining node with its typed
attribute record, after checking that its operands fit (:func:`_check_operands`).
"""

from __future__ import annotations

import ast
import io
import math
import operator
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.descriptor import FieldDescriptor
from onnx import TensorProto, helper, numpy_helper, shape_inference

from app.core.costs import einsum_macs, gemm_dims
from app.core.ir import (
    EVAL_EXPORT_WARNING,
    AttentionAttrs,
    ConvAttrs,
    EinsumAttrs,
    GemmAttrs,
    Graph,
    Layer,
    LayerAttrs,
    LrnAttrs,
    OpKind,
    PoolAttrs,
    RecurrentAttrs,
    Tensor,
    TopKAttrs,
    UnsupportedAttrs,
)
from app.core.limits import Deadline, Limits, current_limits
from app.core.onnx_weights import drop_external_data, has_inline_data
from app.core.onnx_wire import WireError, read_model
from app.core.shape_prop import MAX_VALUE_NUMEL, propagate_shapes
from app.errors import BatchAxisInDims, GraphTooLarge, InvalidGraph, LimitExceeded, UnboundDimension, UnsupportedOpset

# op_type → cost family. Anything absent is OpKind.UNSUPPORTED (listed, never counted as zero).
OP_KINDS: dict[str, OpKind] = {
    "Conv": OpKind.CONV,
    "ConvTranspose": OpKind.CONV_TRANSPOSE,
    "Gemm": OpKind.GEMM,
    "MatMul": OpKind.GEMM,  # becomes MATMUL when both operands are activations
    "BatchNormalization": OpKind.BATCHNORM,
    "LayerNormalization": OpKind.NORM,
    "GroupNormalization": OpKind.NORM,
    "InstanceNormalization": OpKind.NORM,
    "LRN": OpKind.NORM,
    "MaxPool": OpKind.POOL,
    "AveragePool": OpKind.POOL,
    "LpPool": OpKind.POOL,
    "GlobalAveragePool": OpKind.GLOBAL_POOL,
    "GlobalMaxPool": OpKind.GLOBAL_POOL,
    "Softmax": OpKind.SOFTMAX,
    "LogSoftmax": OpKind.SOFTMAX,
    "Dropout": OpKind.DROPOUT,
    "ReduceMean": OpKind.REDUCE,
    "ReduceSum": OpKind.REDUCE,
    "ReduceMax": OpKind.REDUCE,
    "ReduceMin": OpKind.REDUCE,
    "ReduceProd": OpKind.REDUCE,
    "ReduceL2": OpKind.REDUCE,
    "ReduceSumSquare": OpKind.REDUCE,
    "ArgMax": OpKind.REDUCE,
    "ArgMin": OpKind.REDUCE,
    "TopK": OpKind.REDUCE,
    "CumSum": OpKind.ELEMENTWISE,  # one add per element along the axis
    "LSTM": OpKind.RECURRENT,
    "GRU": OpKind.RECURRENT,
    "RNN": OpKind.RECURRENT,
}
for _op in ("Relu", "LeakyRelu", "PRelu", "Clip", "Elu", "Selu", "Sigmoid", "HardSigmoid", "HardSwish",
            "Tanh", "Softplus", "Softsign", "Gelu", "Erf", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs",
            "Mish", "Cast", "Pow"):
    OP_KINDS[_op] = OpKind.ACTIVATION
for _op in ("Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Mean", "Where", "Equal", "Less", "Greater",
            "LessOrEqual", "GreaterOrEqual", "And", "Or", "Not", "Xor", "BitwiseAnd", "BitwiseOr", "BitwiseNot"):
    OP_KINDS[_op] = OpKind.ELEMENTWISE
for _op in ("Concat", "Split", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Pad",
            "Identity", "Expand", "Tile", "Gather", "Resize", "Upsample", "DepthToSpace", "SpaceToDepth",
            "ScatterND", "GatherElements", "Trilu"):
    OP_KINDS[_op] = OpKind.DATA_MOVEMENT

OP_KINDS["Attention"] = OpKind.ATTENTION  # ai.onnx opset 23: softmax(Q·Kᵀ/√d + mask)·V on Q, K, V activations
OP_KINDS["Einsum"] = OpKind.GEMM  # becomes MATMUL when no operand is a weight
OP_KINDS["Upsample"] = OpKind.DATA_MOVEMENT
# ONNX Runtime contrib ops (domain com.microsoft) that transformer exports/optimizers emit.
MS_OP_KINDS: dict[str, OpKind] = {
    "Attention": OpKind.ATTENTION,  # packed QKV projection + attention
    "MultiHeadAttention": OpKind.ATTENTION,  # attention on projected Q, K, V
    "Gelu": OpKind.ACTIVATION, "FastGelu": OpKind.ACTIVATION, "BiasGelu": OpKind.ACTIVATION,
    "QuickGelu": OpKind.ACTIVATION,
    "SkipLayerNormalization": OpKind.NORM, "SimplifiedLayerNormalization": OpKind.NORM,
    "SkipSimplifiedLayerNormalization": OpKind.NORM,
}
_MS_WEIGHT_SLOTS: dict[str, tuple[int, ...]] = {
    "Attention": (1, 2), "MultiHeadAttention": (3,), "FastGelu": (1,), "BiasGelu": (1,),
    "SkipLayerNormalization": (2, 3, 4), "SimplifiedLayerNormalization": (1,),
    "SkipSimplifiedLayerNormalization": (2,),
}

# Input slots holding trainable parameters (index → True) and non-trainable buffers.
_WEIGHT_SLOTS: dict[str, tuple[int, ...]] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "BatchNormalization": (1, 2),
    "LayerNormalization": (1, 2), "GroupNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "PRelu": (1,), "LSTM": (1, 2, 3), "GRU": (1, 2, 3), "RNN": (1, 2, 3),
}
_BUFFER_SLOTS: dict[str, tuple[int, ...]] = {"BatchNormalization": (3, 4)}
# Ops that only re-view a parameter (their output is the same trainable tensor under another name).
# Expand broadcasts a parameter (ViT's class token to the batch): the parameter is its root's size.
_ALIAS_OPS = frozenset({"Unsqueeze", "Reshape", "Cast", "Identity", "Squeeze", "Transpose", "Flatten", "Expand"})
# Ops whose outputs are shapes/metadata, not data: their consumers treat them as static.
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape", "EyeLike", "Range"})

_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
_DTYPES = {
    TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "float64", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
    TensorProto.INT16: "int16", TensorProto.INT32: "int32", TensorProto.INT64: "int64",
    TensorProto.BOOL: "bool",
}


def parse_model(content: bytes | IO[bytes]) -> onnx.ModelProto:
    """Deserialize ONNX bytes, or a seekable binary file from its position to its end, read in bounded
    slices (:func:`app.core.onnx_wire.read_model`: the file is never held whole as bytes next to the
    parsed model). External-data references are kept as references; nothing is opened.

    Raises :class:`InvalidGraph` (code ``invalid_graph``) when the bytes are not a ModelProto with at
    least one node.
    """
    try:
        model = read_model(io.BytesIO(content) if isinstance(content, bytes) else content)
    except Exception as exc:  # WireError, protobuf DecodeError and friends
        why = str(exc)[:200] if isinstance(exc, WireError) else exc.__class__.__name__  # our own, bounded text
        raise InvalidGraph(f"not a valid ONNX model: the bytes are not a protobuf ModelProto ({why})") from exc
    if not model.graph.node:
        raise InvalidGraph("ONNX model has no nodes (empty graph or not an ONNX file)")
    check_model_bounds(model, current_limits())
    return model


def check_model_bounds(model: onnx.ModelProto, limits: Limits) -> None:
    """Refuse a model before any inference runs on it: an opset newer than the installed onnx
    (:class:`UnsupportedOpset`, 422), more nodes than ``limits.max_nodes`` counting those of every
    subgraph, or subgraphs (If/Loop/Scan bodies) nested deeper than ``limits.max_subgraph_depth``
    (:class:`GraphTooLarge`, 413). The walk is iterative, so nesting depth costs no Python stack.
    """
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and not 1 <= imp.version <= newest:
            raise UnsupportedOpset(
                f"ONNX opset {imp.version} is not supported; this service reads opsets 1 to {newest}",
                detail={"opset": int(imp.version), "max_opset": newest},
            )
    if _has_invalid_utf8(model):
        raise InvalidGraph("ONNX model has a string field (a name, op type, domain...) that is not valid UTF-8")
    count = 0
    stack: list[tuple[onnx.GraphProto, int]] = [(model.graph, 0)]
    while stack:
        graph, depth = stack.pop()
        if depth > limits.max_subgraph_depth:
            raise GraphTooLarge("subgraph_depth", depth, limits.max_subgraph_depth,
                                f"subgraphs nest {depth} deep; the limit is {limits.max_subgraph_depth}")
        count += len(graph.node)
        limits.check_nodes(count)
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append((attr.g, depth + 1))
                stack.extend((sub, depth + 1) for sub in attr.graphs)


def _has_invalid_utf8(model: onnx.ModelProto) -> bool:
    """Whether any ``string`` field of ``model`` holds invalid UTF-8 (protobuf then hands it back as
    ``bytes``, which later breaks sorting and JSON encoding of names: a 500). Walked iteratively."""
    string, message = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE
    stack: list[Any] = [model]
    while stack:
        msg = stack.pop()
        for fd, value in msg.ListFields():
            values = value if fd.is_repeated else (value,)
            if fd.type == string and not all(isinstance(v, str) for v in values):
                return True
            if fd.type == message:
                stack.extend(values)
    return False


def _inline_data_fits(t: TensorProto) -> bool:
    """Whether a tensor's inline data holds exactly its element count (numpy would raise on reading it
    otherwise). Shape-sized tensors are decoded to check; larger ones with ``raw_data`` are checked by
    byte length for fixed-width types, the rest are taken as they are (never decoded: weights)."""
    n = math.prod(t.dims)
    if n <= MAX_VALUE_NUMEL:
        try:
            return int(numpy_helper.to_array(t).size) == n
        except (ValueError, TypeError, KeyError):  # KeyError: an element type onnx does not know
            return False
    if t.HasField("raw_data") and t.data_type in _DTYPES and t.data_type != TensorProto.BOOL:
        return len(t.raw_data) == n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return True


def _check_declared_dims(g: onnx.GraphProto, limits: Limits) -> None:
    """Negative declared dims are :class:`InvalidGraph`; ranks, dims and sizes over ``limits`` are
    :class:`app.errors.LimitExceeded`. Covers graph inputs, initializers and ``Constant`` values."""
    declared: list[tuple[str, list[int]]] = []
    for vi in g.input:
        declared.append((vi.name, [d for d in _dims(vi) if isinstance(d, int)]))
    declared.extend((t.name, list(t.dims)) for t in g.initializer)
    for node in g.node:
        if node.op_type == "Constant":
            declared.extend((node.output[0] if node.output else node.name, list(a.t.dims))
                            for a in node.attribute if a.HasField("t"))
    tensors = [*g.initializer,
               *(a.t for n in g.node if n.op_type == "Constant" for a in n.attribute if a.HasField("t"))]
    for t in tensors:
        if any(d < 0 for d in t.dims) or not has_inline_data(t) or _inline_data_fits(t):
            continue
        raise InvalidGraph(f"tensor '{t.name}' holds data that does not match its dims {list(t.dims)}",
                           detail={"tensor": t.name, "shape": list(t.dims)})
    for name, shape in declared:
        if any(d < 0 for d in shape):
            raise InvalidGraph(f"tensor '{name}' declares a negative dimension: {shape}",
                               detail={"tensor": name, "shape": shape})
        limits.check_shape(shape, name)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return []
    out: list[int | str | None] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def _opset(model: onnx.ModelProto) -> int | None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return None


# Ops through which a parameter keeps its identity when classifying graph inputs (a view or copy of it).
# Slice/Split: the dynamo exporter cuts an LSTM's weights into gates and concatenates them back.
_VIEW_OPS = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten", "Slice", "Split"})
# Index operands: an integer input read here is data (token ids), never a shape constant.
_INDEX_USES = frozenset({("Gather", 1), ("GatherElements", 1), ("GatherND", 1), ("ScatterND", 1),
                         ("ScatterElements", 1)})
_INT_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL})
# Ops that combine a tensor with the data path (a bias, a class token, a position embedding, a scale).
_COMBINE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Concat", "Expand", "Where", "Pow"})
_RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})


@dataclass(frozen=True, slots=True)
class _InputRoles:
    """What the graph inputs that are not initializers are (see :func:`_classify_inputs`)."""

    data: list[onnx.ValueInfoProto]
    params: list[onnx.ValueInfoProto]
    constants: set[str]  # integer shape/axis constants kept as inputs without values (not parameters)
    batch_axis: dict[str, int]  # data input → axis that carries the batch
    tied: dict[str, str]  # anonymous transposed copy of an embedding table → the table
    warnings: list[str]


def _terminal_uses(name: str, uses: Mapping[str, list[tuple[onnx.NodeProto, int]]]) -> list[tuple[onnx.NodeProto, int]]:
    """Uses of ``name``, followed through view ops (:data:`_VIEW_OPS`) taken at their data operand."""
    out: list[tuple[onnx.NodeProto, int]] = []
    todo, seen = [name], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for node, idx in uses.get(cur, []):
            if node.op_type in _VIEW_OPS and node.domain in ("", "ai.onnx") and idx == 0:
                todo.extend(o for o in node.output if o)
            else:
                out.append((node, idx))
    return out


def _use_role(node: onnx.NodeProto, idx: int, rank: int, unbatched: bool) -> str:
    """``"weight"`` (a weight operand: a weight/buffer slot, an embedding table, the second operand of a
    rank ≤ 2 matrix product without a batch dim), ``"combine"`` (an operand of :data:`_COMBINE_OPS`) or
    ``"data"``."""
    op = node.op_type
    slots = _MS_WEIGHT_SLOTS.get(op, ()) if node.domain == "com.microsoft" else (
        _WEIGHT_SLOTS.get(op, ()) + _BUFFER_SLOTS.get(op, ()))
    if node.domain not in ("", "ai.onnx", "com.microsoft"):
        return "data"
    if idx in slots or (op == "Gather" and idx == 0):
        return "weight"
    if op in ("MatMul", "Einsum") and idx == 1 and rank <= 2 and unbatched:
        return "weight"
    if op in _COMBINE_OPS:
        return "combine"
    return "data"


def _classify_inputs(model: onnx.ModelProto) -> _InputRoles:
    """Split the graph inputs that are not initializers into data and parameters, by provenance.

    A graph input is a **parameter** (a weightless export, ``export_params=False``) when it feeds a weight
    operand (:func:`_use_role`), directly or through Transpose/Reshape/Cast/Identity/Unsqueeze/Squeeze/
    Flatten, and no data operand, whatever its position or the symbolic names of its dims; or when it only
    combines with the data path (Add/Concat/Expand…: a bias added first, ViT's class token and position
    embeddings), is a float tensor of concrete shape, and another input carries a symbolic batch axis that
    it does not (so it is not per-sample data). An integer or boolean input of rank ≤ 1 and concrete shape that is
    never an index operand is a **constant** (a shape or axis the dynamo exporter keeps as an input with
    ``keep_initializers_as_inputs``), and so is one of higher rank when another input carries a symbolic
    batch axis (BERT's ``position_ids`` buffer). Everything else is **data**. A parameter's axes are never bound to
    the batch size.

    The batch axis of a data input follows what the op reading it means: axis 1 for the
    sequence-first ``X`` (``layout=0``) and for the initial states of LSTM/GRU/RNN, axis 0 otherwise.

    Tied weights: an exporter-named parameter (``onnx::…``) of shape ``(D, V)`` feeding the last matrix
    product of the graph (the output projection), where ``(V, D)`` is an embedding table's shape, is the
    constant-folded ``Transpose(table)`` of a tied LM head: it is mapped to the table (counted once) and a
    warning names both. Inputs used by no node are ignored.
    """
    g = model.graph
    init_names = {i.name for i in g.initializer}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in g.node:
        for idx, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append((node, idx))
    candidates = [vi for vi in g.input if vi.name not in init_names and vi.name in uses]
    terminal = {vi.name: _terminal_uses(vi.name, uses) for vi in candidates}

    def use_roles(vi: onnx.ValueInfoProto, batch_names: set[str]) -> set[str]:
        dims = _dims(vi)
        unbatched = not any(d in batch_names for d in dims)
        return {_use_role(n, i, len(dims), unbatched) for n, i in terminal[vi.name]}

    # a rank ≤ 2 second matrix-product operand is a weight unless it carries a data input's batch dim
    first = {vi.name: use_roles(vi, set()) for vi in candidates}
    batch_names = {d for vi in candidates if "data" in first[vi.name] for d in _dims(vi)[:1] if isinstance(d, str)}
    roles = {vi.name: use_roles(vi, batch_names) for vi in candidates}

    def symbolic_axis0(vi: onnx.ValueInfoProto) -> bool:
        d = _dims(vi)
        return bool(d) and not isinstance(d[0], int)

    batched = any(symbolic_axis0(vi) for vi in candidates if "data" in roles[vi.name])
    data: list[onnx.ValueInfoProto] = []
    params: list[onnx.ValueInfoProto] = []
    constants: set[str] = set()
    for vi in candidates:
        r = roles[vi.name]
        dims = _dims(vi)
        if (
            vi.type.tensor_type.elem_type in _INT_TYPES and all(isinstance(d, int) for d in dims)
            and (len(dims) <= 1 or batched) and not any((n.op_type, i) in _INDEX_USES for n, i in uses[vi.name])
        ):
            constants.add(vi.name)
            continue
        float_input = vi.type.tensor_type.elem_type in _FLOAT_TYPES
        concrete = all(isinstance(d, int) for d in _dims(vi))
        feeds_weight = "weight" in r and "data" not in r
        broadcast_param = r == {"combine"} and float_input and concrete and batched and not symbolic_axis0(vi)
        (params if feeds_weight or broadcast_param else data).append(vi)

    batch_axis: dict[str, int] = {}
    for vi in data:
        axis = 0
        for node, idx in terminal[vi.name]:
            if node.op_type in _RECURRENT_OPS and node.domain in ("", "ai.onnx"):
                layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
                if (idx == 0 and layout == 0) or (idx in (5, 6) and layout == 0):
                    axis = 1
        batch_axis[vi.name] = axis

    tied, warnings = _tied_weight_inputs(g, params, terminal)
    return _InputRoles(data, params, constants, batch_axis, tied, warnings)


def _tied_weight_inputs(
    g: onnx.GraphProto, params: list[onnx.ValueInfoProto], terminal: Mapping[str, list[tuple[onnx.NodeProto, int]]]
) -> tuple[dict[str, str], list[str]]:
    """Exporter-named parameters that are the folded transpose of an embedding table (see
    :func:`_classify_inputs`), mapped to the table, with one warning each."""
    products = [n for n in g.node if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx")]
    if not products:
        return {}, []
    last = products[-1]
    tables: dict[tuple, str] = {}
    for vi in params:
        shp = _dims(vi)
        if len(shp) == 2 and any(n.op_type == "Gather" and i == 0 for n, i in terminal[vi.name]):
            tables.setdefault(tuple(shp), vi.name)
    tied: dict[str, str] = {}
    warnings: list[str] = []
    for vi in params:
        shp = _dims(vi)
        if not vi.name.startswith("onnx::") or len(shp) != 2:
            continue
        table = tables.get((shp[1], shp[0]))
        if table is None or not any(n is last for n, _ in terminal[vi.name]):
            continue
        tied[vi.name] = table
        warnings.append(
            f"weightless export: parameter '{vi.name}' {tuple(shp)} is taken as the tied transpose of embedding "
            f"table '{table}' {tuple(shp[::-1])} (exporter-named, transposed shape, feeds the output projection) "
            "and counted once"
        )
    return tied, warnings


def _batch_axis_names(roles: _InputRoles) -> dict[str, str]:
    """Symbolic batch-axis name → the first data input carrying it (unnamed axes as ``input[axis]``, the
    name :func:`_bind_inputs` binds them under)."""
    names: dict[str, str] = {}
    for vi in roles.data:
        axis = roles.batch_axis.get(vi.name, 0)
        shape = vi.type.tensor_type.shape.dim
        if len(shape) > axis and not shape[axis].HasField("dim_value"):
            names.setdefault(shape[axis].dim_param or f"{vi.name}[{axis}]", vi.name)
    return names


def _refuse_batch_axis_in_dims(roles: _InputRoles, *, batch_size: int, dims: Mapping[str, int]) -> None:
    """Raise :class:`BatchAxisInDims` when ``dims`` names a symbolic batch axis of a data input.

    ``batch_size`` binds that axis: before this check a ``dims`` value won silently, so an answer echoed
    ``batch_size=32`` while its times and memory were those of the ``dims`` batch (even an equal value is
    refused, so a request means one thing whatever its numbers).
    """
    inputs = _batch_axis_names(roles)
    named = sorted(set(dims) & set(inputs))
    if named:
        raise BatchAxisInDims(
            f"dims names the batch axis {', '.join(map(repr, named))} (of input "
            f"{', '.join(repr(inputs[n]) for n in named)}), which batch_size binds (batch_size={batch_size} "
            f"here): drop it from dims and set batch_size to the batch you mean",
            detail={"dimensions": named, "inputs": [inputs[n] for n in named], "batch_size": batch_size,
                    "dims": {n: dims[n] for n in named}},
        )


def _bind_inputs(
    model: onnx.ModelProto,
    roles: _InputRoles,
    *,
    batch_size: int,
    dims: Mapping[str, int],
) -> tuple[dict[str, int], int | None, list[str]]:
    """Replace symbolic dims of graph inputs with values, in place.

    The batch axis of each data input (``roles.batch_axis``) takes ``batch_size``; ``dims`` naming it is
    :class:`BatchAxisInDims` (see :func:`_refuse_batch_axis_in_dims`); every other symbolic dim of a data
    input or a parameter comes from ``dims`` (or from the same name
    already bound on a data input). A data input exported with a fixed batch size other than
    ``batch_size`` (rank ≥ 2) is rebound. Returns the binding used, the export's fixed batch size if one had
    to be overridden (else None) and warnings. Raises :class:`UnboundDimension` naming the first symbolic
    dimension with no value, or a non-positive value, and :class:`BatchAxisInDims`.
    A fixed batch axis is rebound only when every data input agrees on its value (inputs of (2,1,4,8)
    and (3,8,5) have no common batch); otherwise a warning says the fixed shapes were kept.
    """
    binding: dict[str, int] = {}
    fixed_batch: int | None = None
    warnings: list[str] = []
    # A fixed batch axis is an export batch only when every data input agrees on it: inputs of (2,1,4,8)
    # and (3,8,5) have no common batch axis, and rebinding both would change what the graph computes.
    leading = set()
    for vi in roles.data:
        dims_vi = vi.type.tensor_type.shape.dim
        axis = roles.batch_axis.get(vi.name, 0)
        if len(dims_vi) >= 2 and len(dims_vi) > axis and dims_vi[axis].HasField("dim_value"):
            leading.add(int(dims_vi[axis].dim_value))
    rebind_fixed = len(leading) <= 1
    _refuse_batch_axis_in_dims(roles, batch_size=batch_size, dims=dims)
    if not rebind_fixed:
        warnings.append(
            f"data inputs have different fixed leading dimensions {sorted(leading)}: no common batch axis, "
            f"so the fixed shapes were kept and batch_size={batch_size} applies only to symbolic batch axes"
        )
    for vi, is_param in [*((v, False) for v in roles.data), *((v, True) for v in roles.params)]:
        shape = vi.type.tensor_type.shape
        batch_axis = None if is_param else roles.batch_axis.get(vi.name, 0)
        for axis, d in enumerate(shape.dim):
            if d.HasField("dim_param") and d.dim_param or not d.HasField("dim_value"):
                name = d.dim_param if d.dim_param else f"{vi.name}[{axis}]"
                if name in dims:
                    value = int(dims[name])
                elif name in binding:
                    value = binding[name]
                elif axis == batch_axis:
                    value = batch_size
                else:
                    kind = "parameter" if is_param else "input"
                    given = f" (it binds {', '.join(map(repr, sorted(dims)))}, not '{name}')" if dims else ""
                    raise UnboundDimension(
                        f"{kind} '{vi.name}' has symbolic dimension '{name}' (axis {axis}) that the request "
                        f"does not bind{given}; pass it in 'dims'",
                        detail={"dimension": name, "input": vi.name, "axis": axis, "given_dims": sorted(dims)},
                    )
                if value <= 0:
                    raise UnboundDimension(
                        f"dimension '{name}' must be positive, got {value}", detail={"dimension": name}
                    )
                binding[name] = value
                d.Clear()
                d.dim_value = value
            elif axis == batch_axis and rebind_fixed and d.dim_value != batch_size and len(shape.dim) >= 2:
                fixed_batch = int(d.dim_value)
                d.dim_value = batch_size
    if fixed_batch is not None:
        warnings.append(
            f"graph was exported with a fixed batch size of {fixed_batch}; rebound to {batch_size}"
        )
    return binding, fixed_batch, warnings


def _inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its model-local functions inlined (the dynamo exporter can emit module calls as local
    functions; their bodies are the ops that carry the cost). Raises :class:`InvalidGraph` when a function
    cannot be inlined."""
    if not model.functions:
        return model
    try:
        return onnx.inliner.inline_local_functions(model)
    except Exception as exc:  # noqa: BLE001 - onnx raises plain RuntimeError/ValueError for a bad function
        raise InvalidGraph(f"model-local functions could not be inlined: {exc}") from exc


def _check_declared(g: onnx.GraphProto) -> None:
    """Raise :class:`InvalidGraph` when nodes read tensors that nothing declares.

    ``torch.onnx.export(..., dynamo=True, export_params=False)`` drops the weights and constants from the
    file entirely (neither initializers nor graph inputs), so their shapes, and the parameter count, are
    unknowable.
    """
    declared = {vi.name for vi in g.input} | {i.name for i in g.initializer} | {
        o for n in g.node for o in n.output if o}
    missing = list(dict.fromkeys(i for n in g.node for i in n.input if i and i not in declared))
    if missing:
        raise InvalidGraph(
            f"{len(missing)} tensor(s) read by nodes are neither graph inputs, initializers nor node outputs "
            f"(e.g. {', '.join(repr(m) for m in missing[:3])}): the file has no shapes for them. "
            "torch.onnx.export(dynamo=True, export_params=False) drops weights and constants this way; export "
            "with weights (external_data=True keeps the .onnx small) or add keep_initializers_as_inputs=True",
            detail={"undeclared_tensors": missing[:20], "undeclared_count": len(missing)},
        )


def _exported_shapes(g: onnx.GraphProto, binding: Mapping[str, int]) -> dict[str, tuple[tuple[int, ...], int]]:
    """Shapes the exporter recorded in ``value_info`` and on the outputs, with symbolic dims replaced by
    ``binding``, including integer expressions of them (``s77*s27``, ``s27 + 1``); a tensor with a dim the
    binding does not resolve is left out.

    The dynamo exporter records every intermediate shape; with ``keep_initializers_as_inputs`` its shape
    constants are inputs without values, so ONNX inference cannot size a ``Reshape`` on its own.
    """
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for vi in [*g.value_info, *g.output]:
        if not vi.type.tensor_type.HasField("shape"):
            continue
        resolved = [d if isinstance(d, int) else _eval_dim(d, binding) if isinstance(d, str) else None
                    for d in _dims(vi)]
        if all(isinstance(d, int) and d >= 0 for d in resolved):
            out[vi.name] = (tuple(int(d) for d in resolved), vi.type.tensor_type.elem_type)  # type: ignore[arg-type]
    return out


_DIM_OPS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


_MAX_DIM_EXPR_CHARS = 256  # torch.export's dim expressions are a few names long


def _eval_dim(expr: str, binding: Mapping[str, int]) -> int | None:
    """Value of a symbolic dim (a name or an integer expression of names with ``+ - * // %`` and
    ``Min``/``Max``, as torch.export writes them) under ``binding``; None when a name is unbound or the
    expression has anything else in it."""
    if expr in binding:
        return int(binding[expr])
    if len(expr) > _MAX_DIM_EXPR_CHARS:  # a hostile file's megabyte-long sum would recurse in ev()
        return None
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return binding.get(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Min", "Max", "min",
                                                                                               "max"):
            args = [ev(a) for a in node.args]
            if not args or any(a is None for a in args):
                return None
            return (min if node.func.id.lower() == "min" else max)(args)  # type: ignore[type-var]
        if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
            a, b = ev(node.left), ev(node.right)
            if a is None or b is None or (b == 0 and isinstance(node.op, ast.FloorDiv | ast.Mod)):
                return None
            return int(_DIM_OPS[type(node.op)](a, b))
        return None

    return ev(tree)


def _rewrite_fixed_batch_reshapes(model: onnx.ModelProto, fixed_batch: int) -> None:
    """Make constant Reshape targets that start with the export batch size copy axis 0 instead.

    ONNX Reshape with ``allowzero=0`` reads a 0 in the target shape as "copy this input dimension", so
    ``[1, 2048] → [0, 2048]`` keeps the batch axis whatever its size. Only initializer targets whose first
    element equals ``fixed_batch`` are touched; the target tensor is copied if other nodes share it.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    users = Counter(name for n in g.node for name in n.input)
    for node in g.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        if not has_inline_data(inits[node.input[1]]):
            continue
        if any(a.name == "allowzero" and a.i == 1 for a in node.attribute):
            continue
        target = numpy_helper.to_array(inits[node.input[1]]).copy()
        if target.ndim != 1 or target.size < 2 or int(target[0]) != fixed_batch:
            continue
        target[0] = 0
        new_tensor = numpy_helper.from_array(target.astype(np.int64), node.input[1])
        if users[node.input[1]] > 1:
            new_tensor.name = f"{node.input[1]}__layercast_{node.name or id(node)}"
            g.initializer.append(new_tensor)
            node.input[1] = new_tensor.name
        else:
            inits[node.input[1]].CopyFrom(new_tensor)


def _rewrite_batch_one_reshapes(
    model: onnx.ModelProto, shapes: Mapping[str, tuple[tuple[int | str | None, ...], int]], batch_size: int
) -> list[str]:
    """Rewrite hard-coded batch-1 Reshape targets that cannot hold the bound batch; one warning each.

    A symbolic-batch export can still carry a constant target such as ``[1, 2048]`` (traced at batch 1):
    at batch 4 the input holds 4 × 2048 elements, and ONNX shape inference answers (1, 2048) anyway, so
    the classifier would be costed at batch 1. A target whose element count differs from its input's
    by exactly the factor ``batch_size``, with a leading 1, and input axis 0 equal to ``batch_size``,
    gets its leading 1 turned into 0 ("copy axis 0", ``allowzero=0``); any other mismatch is left alone
    here, for :func:`_refuse_inconsistent_reshapes` once the shapes are propagated again.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    users = Counter(name for n in g.node for name in n.input)
    out: list[str] = []
    for node in g.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or not node.output:
            continue
        src, dst = shapes.get(node.input[0]), shapes.get(node.output[0])
        if src is None or dst is None or not all(isinstance(d, int) for d in (*src[0], *dst[0])):
            continue
        n_in = int(np.prod([int(d) for d in src[0] if isinstance(d, int)]))
        n_out = int(np.prod([int(d) for d in dst[0] if isinstance(d, int)]))
        if n_in == n_out:
            continue
        label = node.name or node.output[0]
        target_init = inits.get(node.input[1])
        target = (numpy_helper.to_array(target_init).reshape(-1) if target_init is not None
                  and has_inline_data(target_init) else None)
        if (
            target is not None and target.size >= 2 and int(target[0]) == 1 and src[0] and src[0][0] == batch_size
            and n_in == n_out * batch_size and not any(a.name == "allowzero" and a.i == 1 for a in node.attribute)
        ):
            fixed = target.astype(np.int64).copy()
            fixed[0] = 0
            new_tensor = numpy_helper.from_array(fixed, node.input[1])
            if users[node.input[1]] > 1:
                new_tensor.name = f"{node.input[1]}__layercast_{label}"
                g.initializer.append(new_tensor)
                node.input[1] = new_tensor.name
            else:
                target_init.CopyFrom(new_tensor)  # type: ignore[union-attr]
            out.append(
                f"Reshape '{label}' has the hard-coded target {target.tolist()}, which holds one sample, on a "
                f"batch of {batch_size}; its leading 1 was read as the batch axis and rewritten to copy axis 0"
            )
    return out


def _refuse_inconsistent_reshapes(
    model: onnx.ModelProto, shapes: Mapping[str, tuple[tuple[int | str | None, ...], int]], *, batch_size: int,
    binding: Mapping[str, int],
) -> None:
    """Raise :class:`InvalidGraph` when a ``Reshape`` node's input and output (concrete ``shapes``, after
    :func:`_rewrite_batch_one_reshapes`) hold different numbers of elements.

    That is a target shape the exporter baked in at other sizes (torch's ``nn.MultiheadAttention`` traced at
    ``seq=16`` reshapes to ``[16, batch·heads, head_dim]`` whatever ``dims`` binds): onnxruntime refuses to run
    the node at this binding, and every layer after it would be costed at the export's sizes, so the number
    would be wrong. ``detail``: ``node`` (name, or first output), ``node_index``, ``op_type``, ``field``
    (``shape``, the target input), ``input_shape``, ``output_shape``, the binding (``batch_size``, ``dims``)
    and ``nodes`` (every such Reshape, up to 20).
    """
    bad: list[tuple[int, str, list[int], list[int]]] = []
    for idx, node in enumerate(model.graph.node):
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2 or not node.output:
            continue
        src, dst = shapes.get(node.input[0]), shapes.get(node.output[0])
        if src is None or dst is None or not all(isinstance(d, int) for d in (*src[0], *dst[0])):
            continue
        a, b = [int(d) for d in src[0]], [int(d) for d in dst[0]]  # type: ignore[arg-type]
        if math.prod(a) != math.prod(b):
            bad.append((idx, node.name or node.output[0], a, b))
    if not bad:
        return
    idx, label, a, b = bad[0]
    more = f" (and {len(bad) - 1} more Reshape node(s))" if len(bad) > 1 else ""
    bound = "".join(f", {k}={v}" for k, v in binding.items())
    raise InvalidGraph(
        f"Reshape '{label}' (node {idx}) turns {math.prod(a)} elements {a} into {math.prod(b)} {b}{more}: the "
        f"graph is inconsistent at this binding (batch_size={batch_size}{bound}). Its "
        "target shape was fixed at export for other sizes, so onnxruntime cannot run it and the layers after it "
        "would be costed at the wrong size: bind the sizes it was exported at, or export with that axis dynamic",
        detail={"node": label, "node_index": idx, "op_type": "Reshape", "field": "shape", "input_shape": a,
                "output_shape": b, "batch_size": batch_size, "dims": dict(binding),
                "nodes": [n for _, n, _, _ in bad[:20]]},
    )


def _is_float_table(entry: tuple[list[int | str | None], str] | None) -> bool:
    if entry is None:
        return False
    shp, dtype = entry
    return len(shp) == 2 and dtype.startswith(("float", "bfloat"))


def _duplicate_initializers(g: onnx.GraphProto) -> dict[str, str]:
    """Map initializers that are exact copies of an earlier one (same or transposed data) to it.

    Exporters constant-fold ``Transpose(tied_embedding)`` into a second initializer, so the tied LM head
    of GPT-2 arrives as a separate 38.6 M-element tensor with the embedding table's values transposed.
    Candidates are float tensors of rank ≥ 2 with ≥ 1024 non-constant elements (so freshly initialised
    all-ones/all-zeros tensors never match by accident), grouped by (element count, dtype, min, max),
    which transposition preserves exactly, then compared element by element.
    """
    groups: dict[tuple, list[tuple[str, np.ndarray]]] = {}
    alias: dict[str, str] = {}
    for init in g.initializer:
        if len(init.dims) < 2 or init.data_type not in _FLOAT_TYPES:
            continue
        numel = int(np.prod(init.dims))
        if numel < 1024 or not has_inline_data(init):
            continue
        arr = numpy_helper.to_array(init)
        lo, hi = float(arr.min()), float(arr.max())
        if lo == hi:
            continue
        bucket = groups.setdefault((numel, init.data_type, lo, hi), [])
        for name, other in bucket:
            if (other.shape == arr.shape and np.array_equal(other, arr)) or (
                arr.ndim == 2 and other.shape == arr.shape[::-1] and np.array_equal(other, arr.T)
            ):
                alias[init.name] = name
                break
        else:
            bucket.append((init.name, arr))
    return alias


def _light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the data of large initializers (they become typed graph inputs).

    Whole-graph shape inference only needs the values of shape-sized tensors; copying hundreds of MB of
    weights through it (it serializes the model) dominated the import time of BERT/GPT-2 graphs.
    """
    g = model.graph
    light = onnx.ModelProto()
    light.ir_version = max(model.ir_version, 4)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    lg = light.graph
    lg.name = g.name
    lg.node.extend(g.node)
    lg.output.extend(g.output)
    lg.value_info.extend(g.value_info)
    input_names = {vi.name for vi in g.input}
    lg.input.extend(g.input)
    for init in g.initializer:
        numel = int(np.prod(init.dims)) if init.dims else 1
        if numel <= MAX_VALUE_NUMEL and has_inline_data(init):
            lg.initializer.append(init)
        elif init.name not in input_names:
            lg.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return light


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, list | tuple):
            v = tuple(x.decode() if isinstance(x, bytes) else x for x in v)
        elif not isinstance(v, int | float | str):
            continue  # tensors/graphs attributes are not needed by cost formulas
        out[a.name] = v
    return out


def import_onnx(
    content: bytes | onnx.ModelProto,
    *,
    batch_size: int = 1,
    dims: Mapping[str, int] | None = None,
    name: str | None = None,
) -> Graph:
    """Import an ONNX model as a :class:`Graph` at ``batch_size``.

    ``dims`` binds symbolic dimensions other than the batch axis (e.g. ``{"sequence": 128}``); naming the
    batch axis there is :class:`BatchAxisInDims` (``batch_size`` binds it).
    Raises :class:`InvalidGraph` for bytes that are not ONNX, a graph whose shapes cannot be inferred, or one
    whose shapes do not chain at this binding (:func:`_refuse_inconsistent_reshapes`, :func:`_check_operands`),
    :class:`UnboundDimension` for a symbolic dimension without a value, :class:`BatchAxisInDims` when
    ``dims`` names the batch axis, ``ValueError`` for a
    non-positive ``batch_size``.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    dims = dict(dims or {})
    limits = current_limits()
    deadline = Deadline(limits.import_timeout_s)
    if isinstance(content, bytes):
        model = parse_model(content)
    else:
        model = onnx.ModelProto.FromString(content.SerializeToString())
        check_model_bounds(model, limits)
    for key, value in dims.items():
        if value > limits.max_dim:
            raise LimitExceeded("dimension", value, limits.max_dim,
                                f"dims binds '{key}' to {value}; the limit is {limits.max_dim}")
    drop_external_data(model)  # costed from declared dims; the files a model names are never opened
    model = _inline_functions(model)
    g = model.graph
    _check_declared(g)
    roles = _classify_inputs(model)
    data_inputs, param_inputs = roles.data, {vi.name for vi in roles.params}
    if not data_inputs:
        raise InvalidGraph("ONNX graph has no data input (all inputs are initializers, parameters or unused)")
    _check_declared_dims(g, limits)
    binding, fixed_batch, warnings = _bind_inputs(model, roles, batch_size=batch_size, dims=dims)
    warnings.extend(roles.warnings)
    if fixed_batch is not None:
        _rewrite_fixed_batch_reshapes(model, fixed_batch)

    # Strip value_info/output shapes that would conflict with a rebound batch, then infer; the exporter's
    # own shapes, at the binding, stand in where inference cannot size a tensor.
    exported = {} if fixed_batch is not None else _exported_shapes(g, binding)
    del g.value_info[:]
    for out in g.output:
        if out.type.tensor_type.HasField("shape"):
            out.type.tensor_type.ClearField("shape")
    try:
        # no data_prop: ONNX's data propagation materialises values (a Range to 10^12 is std::bad_alloc
        # after 17 GB); concrete shape arithmetic is propagate_shapes' job, which bounds what it folds.
        inferred = shape_inference.infer_shapes(
            _light_copy(model), check_type=False, strict_mode=False, data_prop=False
        )
    except Exception as exc:
        raise InvalidGraph(f"ONNX shape inference failed: {exc}") from exc
    fallback = dict(exported)
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        shp = tuple(_dims(vi))
        if vi.type.tensor_type.HasField("shape") and (
            vi.name not in fallback or all(isinstance(d, int) for d in shp)
        ):
            fallback[vi.name] = (shp, vi.type.tensor_type.elem_type)  # type: ignore[assignment]
    known: dict[str, tuple[tuple[int | str | None, ...], int]] = {}
    for vi in g.input:
        if vi.type.tensor_type.HasField("shape"):
            known[vi.name] = (tuple(_dims(vi)), vi.type.tensor_type.elem_type)
    for init in g.initializer:
        known[init.name] = (tuple(int(d) for d in init.dims), init.data_type)
    ig = g
    propagated = propagate_shapes(model, known=known, fallback=fallback, deadline=deadline)
    reshape_warnings = _rewrite_batch_one_reshapes(model, propagated, batch_size)
    if reshape_warnings:
        warnings.extend(reshape_warnings)
        propagated = propagate_shapes(model, known=known, fallback=fallback, deadline=deadline)
    _refuse_inconsistent_reshapes(model, propagated, batch_size=batch_size, binding=binding)
    shapes: dict[str, tuple[list[int | str | None], str]] = {
        k: (list(shp), _DTYPES.get(elem, "float32"))  # type: ignore[call-overload]
        for k, (shp, elem) in propagated.items()
    }
    for tname, (tshape, _dtype) in shapes.items():
        limits.check_shape([d for d in tshape if isinstance(d, int)], tname)

    init_names = {i.name for i in ig.initializer}
    data_names = {vi.name for vi in data_inputs}
    static: set[str] = set(init_names) | set(param_inputs) | roles.constants
    # tensors that are raw parameters (possibly through Unsqueeze/Reshape/Cast/Identity of a parameter)
    param_like: set[str] = set(init_names) | set(param_inputs)
    # weight aliases: views/copies of a parameter (Transpose of a tied embedding, Identity, Cast...) and
    # initializers that are exact (possibly transposed) copies of another one, e.g. a tied LM head
    # constant-folded to ``Transpose(wte)`` by the exporter; all are named after their root parameter.
    alias: dict[str, str] = {**_duplicate_initializers(g), **roles.tied}
    # Gather of a weight table with static indices (position/token-type embeddings indexed by a
    # Range/arange of the sequence length): an embedding layer, not shape bookkeeping.
    table_gathers: set[int] = set()
    for idx, node in enumerate(ig.node):
        ins = [i for i in node.input if i]
        if (
            node.op_type == "Gather" and len(ins) == 2 and ins[0] in param_like and ins[1] in static
            and node.domain in ("", "ai.onnx") and _is_float_table(shapes.get(ins[0]))
        ):
            table_gathers.add(idx)
            continue
        if node.op_type in _SHAPE_OPS or all(i in static for i in ins):
            static.update(o for o in node.output if o)
            if node.op_type in ("ConstantOfShape", "Constant") or (
                node.op_type in _ALIAS_OPS and ins and ins[0] in param_like
            ):
                param_like.update(o for o in node.output if o)
                if node.op_type in _ALIAS_OPS and node.output and node.output[0]:
                    alias[node.output[0]] = alias.get(ins[0], ins[0])

    def tensor(name: str) -> Tensor | None:
        if name not in shapes:
            return None
        raw, dtype = shapes[name]
        # a known rank-0 shape is a scalar (a dot product's result); zero-sized dims are legal (empty
        # tensors) but cost nothing; unknown dims are not usable
        if all(isinstance(d, int) and d >= 0 for d in raw):
            return Tensor(name, tuple(int(d) for d in raw), dtype)  # type: ignore[arg-type]
        return None

    layers: list[Layer] = []
    unknown_shape_layers: list[str] = []
    used_names: Counter[str] = Counter()
    for idx, node in enumerate(ig.node):
        ins = [i for i in node.input if i]
        if (node.op_type in _SHAPE_OPS or all(i in static for i in ins)) and idx not in table_gathers:
            continue
        op = node.op_type
        if node.domain in ("", "ai.onnx"):
            kind = OP_KINDS.get(op, OpKind.UNSUPPORTED)
            weight_slots = _WEIGHT_SLOTS.get(op, ())
        elif node.domain == "com.microsoft":
            kind = MS_OP_KINDS.get(op, OpKind.UNSUPPORTED)
            weight_slots = _MS_WEIGHT_SLOTS.get(op, ())
        else:
            kind, weight_slots = OpKind.UNSUPPORTED, ()
        buffer_slots = _BUFFER_SLOTS.get(op, ())
        act_in: list[Tensor] = []
        weights: list[Tensor] = []
        buffers: list[Tensor] = []
        missing = False
        for slot, iname in enumerate(node.input):
            if not iname:
                continue
            t = tensor(iname)
            is_static = iname in static
            if t is not None and iname in alias:
                # a view or copy of a parameter is that parameter, at its root's size
                root = tensor(alias[iname])
                t = root if root is not None and root.numel != t.numel else Tensor(alias[iname], t.shape, t.dtype)
            if slot in weight_slots and is_static:
                (weights.append(t) if t is not None else None)
            elif slot in buffer_slots and is_static:
                (buffers.append(t) if t is not None else None)
            elif is_static:
                # a static operand of a generic op: a parameter when it is a raw float parameter tensor
                # with more than one element (bias of MatMul+Add, Caffe2 scale layers, embedding tables)
                if (
                    t is not None
                    and iname in param_like
                    and t.dtype.startswith(("float", "bfloat"))
                    and t.numel > 1
                    and (op in ("MatMul", "Gemm", "Einsum", "Add", "Mul", "Sub", "Div", "PRelu", "Concat")
                         or (op == "Gather" and slot == 0))
                ):
                    weights.append(t)
                elif op == "Gather" and slot == 1 and t is not None and idx in table_gathers:
                    act_in.append(t)  # static indices of a table lookup
            else:
                if t is None:
                    missing = True
                else:
                    act_in.append(t)
        outs: list[Tensor] = []
        # Dropout's mask, BatchNormalization's running stats and MaxPool's indices are side outputs
        out_names = [o for o in node.output if o]
        if op in ("Dropout", "BatchNormalization", "MaxPool"):
            out_names = out_names[:1]
        for oname in out_names:
            t = tensor(oname)
            if t is None:
                missing = True
            else:
                outs.append(t)
        raw = _attrs(node)
        if node.domain in ("", "ai.onnx"):
            _check_operands(idx, node, raw, tensor)
        needs_input_grad = not all(i in data_names for i in ins if i not in static)

        if op in ("MatMul", "Gemm", "Einsum") and not weights:
            kind = OpKind.MATMUL
        if op == "Gather" and weights:
            kind = OpKind.EMBEDDING
        attrs: LayerAttrs
        if missing and kind is not OpKind.UNSUPPORTED:
            unknown_shape_layers.append(node.name or f"{op}_{idx}")
            kind, attrs = OpKind.UNSUPPORTED, UnsupportedAttrs("shape could not be inferred")
        elif kind is OpKind.UNSUPPORTED:
            attrs = UnsupportedAttrs(f"no cost formula for op '{op}' (domain '{node.domain or 'ai.onnx'}')")
        else:
            try:
                attrs = _layer_attrs(node, kind, raw, act_in, weights, outs, tensor, static)
            except _NotCosted as exc:
                kind, attrs = OpKind.UNSUPPORTED, UnsupportedAttrs(str(exc))

        lname = node.name or f"{op}_{idx}"
        used_names[lname] += 1
        if used_names[lname] > 1:
            lname = f"{lname}_{used_names[lname]}"
        layers.append(
            Layer(
                name=lname,
                op_type=op,
                kind=kind,
                inputs=tuple(act_in),
                outputs=tuple(outs),
                weights=tuple(weights),
                buffers=tuple(buffers),
                attrs=attrs,
                needs_input_grad=needs_input_grad,
            )
        )
    if unknown_shape_layers:
        warnings.append(
            f"{len(unknown_shape_layers)} layer(s) have shapes ONNX shape inference could not resolve and are "
            f"listed as unsupported: {', '.join(unknown_shape_layers[:5])}"
        )
    weight_users = Counter(w.name for layer in layers for w in set(layer.weights))
    shared = tuple(sorted(n for n, c in weight_users.items() if c > 1))
    warnings.extend(_export_mode_warnings(model, layers))
    warnings.extend(_merged_constant_warnings(g, shared))
    inputs = tuple(t for t in (tensor(vi.name) for vi in data_inputs) if t is not None)
    outputs = tuple(t for t in (tensor(o.name) for o in ig.output) if t is not None)
    return Graph(
        name=name or g.name or "onnx-model",
        layers=tuple(layers),
        inputs=inputs,
        outputs=outputs,
        batch_size=batch_size,
        dims=binding,
        source_format="onnx",
        opset=_opset(model),
        warnings=tuple(warnings),
        shared_weights=shared,
    )


def _export_mode_warnings(model: onnx.ModelProto, layers: list[Layer]) -> list[str]:
    """Warnings when the graph looks exported for inference, which understates a training estimate.

    Detection, from what the file can honestly tell:

    * ``BatchNormalization`` nodes with ``training_mode=0`` and a single output are the inference form
      (a training export has ``training_mode=1`` and/or the running-statistics outputs). We still cost them
      as training-mode BN, but say so.
    * Folded BN leaves no node behind. Its signature in a ``torch.onnx.export`` graph (producer
      ``pytorch``) is a Conv whose weight is an exporter-generated constant named ``onnx::Conv_<n>``
      instead of the module's parameter name: constant folding computed ``W·γ/σ`` and ``β − μ·γ/σ``.
      A plain Conv without BN keeps its parameter name, so a BN-free CNN (VGG) is not flagged. Graphs from
      other producers are never flagged: the evidence is not there, and guessing would be dishonest.
    """
    out: list[str] = []
    bn = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    training_bn = any(
        any(a.name == "training_mode" and a.i == 1 for a in n.attribute) or len([o for o in n.output if o]) > 1
        for n in bn
    )
    if bn and not training_bn:
        out.append(
            f"{EVAL_EXPORT_WARNING}: {len(bn)} BatchNormalization layer(s) were exported in inference mode "
            "(running statistics); they are costed as training-mode BatchNormalization"
        )
    convs = [layer for layer in layers if layer.kind is OpKind.CONV and layer.weights]
    folded = [layer for layer in convs if layer.weights[0].name.startswith("onnx::")]
    if model.producer_name == "pytorch" and folded and not training_bn:
        out.append(
            f"{EVAL_EXPORT_WARNING}: BatchNormalization appears folded into {len(folded)} of {len(convs)} "
            "convolutions (their weights are exporter-generated 'onnx::Conv_*' constants, the mark of "
            "torch.onnx.export's eval-mode constant folding); the folded BN layers, their parameters, training "
            "compute and activation memory are missing from a training estimate. Export with "
            "training=torch.onnx.TrainingMode.TRAINING (or do_constant_folding=False) to cost them"
        )
    return out


def _merged_constant_warnings(g: onnx.GraphProto, shared: tuple[str, ...]) -> list[str]:
    """Warn when constant-valued tensors are shared: exporters merge equal initializers (untrained zero
    biases, unit LayerNorm gains), so distinct parameters would be counted once."""
    inits = {i.name: i for i in g.initializer}
    merged = []
    for name in shared:
        if name in inits and has_inline_data(inits[name]):
            arr = numpy_helper.to_array(inits[name])
            if arr.size > 1 and arr.min() == arr.max():
                merged.append(name)
    if not merged:
        return []
    return [
        f"{len(merged)} constant-valued parameter tensor(s) (e.g. '{merged[0]}') are shared by several layers: "
        "the exporter merges initializers with equal values, as in an untrained model, so distinct parameters "
        "may be counted once"
    ]


def _check_operands(idx: int, node: onnx.NodeProto, raw: Mapping[str, Any], tensor: Any) -> None:
    """Raise :class:`InvalidGraph` when the operands of a ``MatMul``, ``Gemm``, ``Conv`` or ``ConvTranspose``
    node, at the shapes of this binding (``tensor(name)``: a :class:`Tensor` or None when unknown), do not fit
    each other: what onnx's strict shape inference and onnxruntime refuse, and what per-node inference
    (:func:`app.core.shape_prop.propagate_shapes`) leaves to the fallback, which used to cost such a node with
    one operand's sizes.

    * ``MatMul`` A (…, M, K) · B (…, K, N) (numpy ``matmul``; a 1-D operand is a row / a column): the two K
      differ, or the batch axes do not broadcast (field ``B``).
    * ``Gemm`` A (M, K) · B (K, N), each transposed by ``transA``/``transB``: the two K differ (field ``B``);
      C does not broadcast to (M, N) one-way (field ``C``).
    * ``Conv`` X (N, C, …) with W (M, C/group, k…): W's rank is not X's, W's second axis × ``group`` is not C
      (field ``W``), ``group`` does not divide M (field ``group``), B is not (M,) (field ``B``).
    * ``ConvTranspose`` X (N, C, …) with W (C, M/group, k…): W's rank is not X's, W's first axis is not C
      (field ``W``), ``group`` does not divide C (field ``group``), B is not (M/group · group,) (field ``B``).

    ``detail``: ``node`` (name or ``<op>_<index>``), ``node_index``, ``op_type``, ``field`` (the operand as
    the ONNX operator spec names it, or the attribute) and ``shapes`` (operand name → shape). Operands of
    unknown shape are not checked.
    """
    op = node.op_type
    names = {"MatMul": ("A", "B"), "Gemm": ("A", "B", "C"), "Conv": ("X", "W", "B"),
             "ConvTranspose": ("X", "W", "B")}.get(op)
    if names is None:
        return
    operands: dict[str, tuple[int, ...]] = {}
    for slot, iname in zip(names, node.input, strict=False):
        t = tensor(iname) if iname else None
        if t is not None:
            operands[slot] = t.shape
    label = node.name or f"{op}_{idx}"

    def refuse(field: str, why: str) -> InvalidGraph:
        shown = ", ".join(f"{k} {list(v)}" for k, v in operands.items())
        return InvalidGraph(
            f"{op} '{label}' (node {idx}): {why} ({shown}); onnxruntime refuses to run this node, so the graph "
            "cannot be costed", detail={"node": label, "node_index": idx, "op_type": op, "field": field,
                                        "shapes": {k: list(v) for k, v in operands.items()}})

    if op == "MatMul":
        a, b = operands.get("A"), operands.get("B")
        if a is None or b is None or not a or not b:
            return
        k_a, k_b = a[-1], (b[0] if len(b) == 1 else b[-2])
        if k_a != k_b:
            raise refuse("B", f"A has {k_a} columns (its last axis) but B has {k_b} rows "
                              f"({'its only axis' if len(b) == 1 else 'its second-to-last axis'})")
        try:
            np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
        except ValueError:
            raise refuse("B", f"the batch axes {list(a[:-2])} and {list(b[:-2])} do not broadcast") from None
        return
    if op == "Gemm":
        a, b = operands.get("A"), operands.get("B")
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            return
        trans_a, trans_b = bool(raw.get("transA", 0)), bool(raw.get("transB", 0))
        m, k_a = (a[1], a[0]) if trans_a else (a[0], a[1])
        k_b, n = (b[1], b[0]) if trans_b else (b[0], b[1])
        if k_a != k_b:
            raise refuse("B", f"A{'ᵀ' if trans_a else ''} has K={k_a} (transA={int(trans_a)}) but "
                              f"B{'ᵀ' if trans_b else ''} has K={k_b} (transB={int(trans_b)})")
        c = operands.get("C")
        if c is not None and (len(c) > 2 or any(d not in (1, full) for d, full in zip(c[::-1], (n, m),
                                                                                         strict=False))):
            raise refuse("C", f"C does not broadcast to the product's shape [{m}, {n}]")
        return
    x, w = operands.get("X"), operands.get("W")
    if x is None or w is None:
        return
    group = int(raw.get("group", 1))
    if len(w) != len(x) or len(x) < 3:
        raise refuse("W", f"W has rank {len(w)} but X has rank {len(x)} (N, C, spatial...)")
    if op == "Conv":
        if w[1] * group != x[1]:
            raise refuse("W", f"X has C={x[1]} channels but W's second axis × group is {w[1]} × {group} = "
                              f"{w[1] * group}")
        out_channels = w[0]
        if w[0] % group:
            raise refuse("group", f"group={group} does not divide W's {w[0]} output channels")
    else:
        if w[0] != x[1]:
            raise refuse("W", f"X has C={x[1]} channels but W's first axis is {w[0]}")
        out_channels = w[1] * group
        if x[1] % group:
            raise refuse("group", f"group={group} does not divide X's {x[1]} channels")
    bias = operands.get("B")
    if bias is not None and tuple(bias) != (out_channels,):
        raise refuse("B", f"B must be [{out_channels}], one value per output channel")


class _NotCosted(Exception):
    """A node of a costed op whose attributes or operand shapes the cost formula cannot use."""


def _ints(raw: Mapping[str, Any], key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    v = raw.get(key)
    return tuple(int(x) for x in v) if v else default


def _layer_attrs(
    node: onnx.NodeProto,
    kind: OpKind,
    raw: Mapping[str, Any],
    act_in: list[Tensor],
    weights: list[Tensor],
    outs: list[Tensor],
    tensor: Any,
    static: set[str],
) -> LayerAttrs:
    """The typed attribute record of a costed node (:data:`app.core.ir.ATTRS_FOR_KIND`).

    Reads ONNX attributes with their spec defaults and the operand shapes. Raises :class:`_NotCosted`
    with the reason when the formula cannot apply (a filter or operand of unknown shape, an Einsum
    that is not a two-operand contraction, an attention layout not handled).
    """
    op = node.op_type
    if kind in (OpKind.CONV, OpKind.CONV_TRANSPOSE):
        # the filter's shape, whether it is a weight of the layer or an activation
        filt = tensor(node.input[1]) if len(node.input) > 1 else None
        if filt is None or len(filt.shape) < 3:
            raise _NotCosted(f"{op} filter shape unknown")
        w = filt.shape
        nd = len(w) - 2
        return ConvAttrs(
            weight_shape=w, kernel_shape=_ints(raw, "kernel_shape", tuple(w[2:])),
            strides=_ints(raw, "strides", (1,) * nd), pads=_ints(raw, "pads", (0,) * (2 * nd)),
            dilations=_ints(raw, "dilations", (1,) * nd), group=int(raw.get("group", 1)),
            output_padding=_ints(raw, "output_padding", ()), auto_pad=str(raw.get("auto_pad", "NOTSET")),
        )
    if op == "Einsum":
        operands = [tensor(i) for i in node.input]
        if any(o is None for o in operands):
            raise _NotCosted("Einsum operand shape unknown")
        ea = EinsumAttrs(str(raw.get("equation", "")), tuple(o.shape for o in operands),
                         tuple(i not in static for i in node.input))
        if einsum_macs(ea.equation, ea.operand_shapes) is None:
            raise _NotCosted("Einsum equation not costed (needs two operands whose ranks match the subscripts)")
        return ea
    if op == "Gemm":
        a_t, b_t = (tensor(i) for i in node.input[:2])
        if a_t is None or b_t is None or len(a_t.shape) != 2 or len(b_t.shape) != 2:
            raise _NotCosted("Gemm operand shape unknown")
        a_shape = a_t.shape
        m, k = (a_shape[1], a_shape[0]) if raw.get("transA", 0) else (a_shape[0], a_shape[1])
        n = b_t.shape[0] if raw.get("transB", 0) else b_t.shape[1]
        return GemmAttrs(m=m, n=n, k=k)
    if op == "MatMul":
        operands = [tensor(i) for i in node.input[:2]]
        if any(o is None for o in operands):
            raise _NotCosted("MatMul operand shape unknown")
        try:
            batch, m, n, k = gemm_dims(operands[0].shape, operands[1].shape)
        except ValueError as exc:
            raise _NotCosted(f"MatMul operands not costed: {exc}") from exc
        return GemmAttrs(m=m, n=n, k=k, batch=batch, grad_operands=tuple(i not in static for i in node.input[:2]))
    if kind is OpKind.RECURRENT:
        return _recurrent_attrs(op, act_in, weights, raw)
    if kind is OpKind.ATTENTION:
        try:
            return _attention_attrs(node, raw, tensor)
        except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, AttributeError) as exc:
            raise _NotCosted(f"{op} layout not costed: {exc}") from exc
    if kind is OpKind.POOL:
        if "kernel_shape" not in raw:
            raise _NotCosted(f"{op} without kernel_shape")
        ks = _ints(raw, "kernel_shape", ())
        return PoolAttrs(ks, _ints(raw, "strides", (1,) * len(ks)), _ints(raw, "pads", (0,) * (2 * len(ks))))
    if op == "LRN":
        return LrnAttrs(int(raw.get("size", 5)))
    if op == "TopK":
        x, values = act_in[0].shape, outs[0].shape
        axis = int(raw.get("axis", -1)) % len(x)
        return TopKAttrs(k=int(values[axis]), axis_size=int(x[axis]))
    return None


def _attention_attrs(node: onnx.NodeProto, raw: Mapping[str, Any], tensor: Any) -> AttentionAttrs:
    """Geometry of a fused attention node.

    * ai.onnx ``Attention`` (opset 23): Q (B, Hq, Lq, E) or (B, Lq, Hq·E), K (B, Hkv, Lk, E), V (B, Hkv, Lk,
      Ev) (3-D forms with ``q_num_heads``/``kv_num_heads``), optional ``past_key``/``past_value`` that
      lengthen Lk; grouped-query heads broadcast, so both products run over Hq heads.
    * com.microsoft ``Attention``: X (B, S, D_in) · W (D_in, Dq+Dk+Dv) projection (``qkv_hidden_sizes`` or
      thirds), then attention over S.
    * com.microsoft ``MultiHeadAttention``: projected Q (B, S, D), K (B, L, D), V (B, L, Dv).
    Raises ``ValueError`` for other layouts (packed QKV).
    """
    ins = list(node.input) + [""] * 6
    op = node.op_type
    if node.domain == "com.microsoft" and op == "Attention":
        x, w = tensor(ins[0]).shape, tensor(ins[1]).shape
        heads = int(raw["num_heads"])
        sizes = raw.get("qkv_hidden_sizes") or (w[1] // 3,) * 3
        b, s, d_in = x
        return AttentionAttrs(batch=b, heads=heads, q_len=s, kv_len=s, qk_width=int(sizes[0]),
                              v_width=int(sizes[2]), proj_rows=b * s, proj_in=d_in, proj_out=w[1])
    if node.domain == "com.microsoft":
        q, k, v = (tensor(i).shape if i else None for i in ins[:3])
        if q is None or k is None or v is None or len(q) != 3 or len(k) != 3:
            raise ValueError("only separate 3-D query, key and value are supported")
        b, s, d = q
        return AttentionAttrs(batch=b, heads=int(raw["num_heads"]), q_len=s, kv_len=k[1], qk_width=d, v_width=v[2])
    q, k, v = (tensor(i).shape for i in ins[:3])
    past = tensor(ins[4]).shape[-2] if ins[4] else 0
    if len(q) == 4:
        b, hq, lq, e = q
        lk, ev = k[2] + past, v[3]
    else:
        hq, hkv = int(raw["q_num_heads"]), int(raw["kv_num_heads"])
        b, lq, dq = q
        lk = k[1] + past
        e, ev = dq // hq, v[2] // hkv
    return AttentionAttrs(batch=b, heads=hq, q_len=lq, kv_len=lk, qk_width=hq * e, v_width=hq * ev)


def _recurrent_attrs(op: str, act_in: list[Tensor], weights: list[Tensor], raw: Mapping[str, Any]) -> RecurrentAttrs:
    """Geometry of an ONNX LSTM/GRU/RNN: ``W`` is (dirs, gates·H, I) and ``R`` is (dirs, gates·H, H);
    ``X`` is (seq, batch, I) with ``layout=0`` and (batch, seq, I) with ``layout=1``.

    Raises :class:`_NotCosted` when the input or the ``W``/``R`` weights are missing or misshapen.
    """
    if not act_in or len(weights) < 2 or len(act_in[0].shape) != 3:
        raise _NotCosted(f"{op} input or W/R weights of unknown shape")
    x, w, r = act_in[0].shape, weights[0].shape, weights[1].shape
    if len(w) != 3 or len(r) != 3 or r[2] <= 0 or w[1] % r[2]:
        raise _NotCosted(f"{op} weights W {w} and R {r} do not have the ONNX layout")
    layout = int(raw.get("layout", 0))
    seq, batch = (x[1], x[0]) if layout == 1 else (x[0], x[1])
    return RecurrentAttrs(seq_len=seq, batch=batch, input_size=w[2], hidden_size=r[2], num_directions=w[0],
                          gates=w[1] // r[2], layout=layout)
