"""ONNX model → layer IR, with concrete shapes from ONNX shape inference.

Handles the graphs people actually send:

* old-opset model-zoo graphs (``onnx/backend/test/data/light``) whose weights are produced by
  ``ConstantOfShape`` nodes from shape initializers, whose initializers are repeated as graph inputs
  (IR v3), and whose ``Reshape`` targets hard-code the export batch size;
* ``torch.onnx.export`` graphs with a symbolic batch dimension, weights as initializers or (with
  ``export_params=False``) as graph inputs, and ``Shape → Gather → Concat → Reshape`` shape subgraphs.

Algorithm: (1) classify every graph input as data or parameter; (2) bind symbolic dimensions (axis 0 of
data inputs ← the batch size; any other name from ``dims``, else :class:`UnboundDimension`); (3) when the
export batch size is fixed and differs from the requested one, rebind axis 0 and rewrite constant
``Reshape`` targets that carry it to ``0`` ("copy this axis", ONNX Reshape semantics); (4) run
``onnx.shape_inference.infer_shapes`` with data propagation; (5) mark "static" tensors (initializers,
parameter inputs, outputs of nodes fed only by static tensors or by ``Shape``) — nodes with no non-static
input are weight/shape bookkeeping, not layers; (6) emit one :class:`Layer` per remaining node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from app.core.costs import einsum_macs, gemm_dims
from app.core.ir import (
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
from app.core.shape_prop import MAX_VALUE_NUMEL, propagate_shapes
from app.errors import GraphTooLarge, InvalidGraph, LimitExceeded, UnboundDimension, UnsupportedOpset

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
            "And", "Or", "Not"):
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
_ALIAS_OPS = frozenset({"Unsqueeze", "Reshape", "Cast", "Identity", "Squeeze", "Transpose", "Flatten"})
# Ops whose outputs are shapes/metadata, not data: their consumers treat them as static.
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape", "EyeLike", "Range"})

_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
_DTYPES = {
    TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "float64", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
    TensorProto.INT16: "int16", TensorProto.INT32: "int32", TensorProto.INT64: "int64",
    TensorProto.BOOL: "bool",
}


def parse_model(content: bytes) -> onnx.ModelProto:
    """Deserialize ONNX bytes (external-data references are kept as references; nothing is opened).

    Raises :class:`InvalidGraph` (code ``invalid_graph``) when the bytes are not a ModelProto with at
    least one node.
    """
    try:
        model = onnx.load_model_from_string(content)
    except Exception as exc:  # protobuf DecodeError and friends
        raise InvalidGraph(f"not a valid ONNX model: {exc.__class__.__name__}") from exc
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


def _classify_inputs(model: onnx.ModelProto) -> tuple[list[onnx.ValueInfoProto], set[str]]:
    """Split non-initializer graph inputs into data inputs and parameter inputs.

    A graph input is a parameter (``export_params=False``) when every consumer uses it in a weight or
    buffer slot, or as the table of a Gather, or as the second operand of a MatMul while being rank 2
    with no symbolic dimension. Inputs used by no node are ignored.
    """
    g = model.graph
    init_names = {i.name for i in g.initializer}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in g.node:
        for idx, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append((node, idx))
    data: list[onnx.ValueInfoProto] = []
    params: set[str] = set()
    for vi in g.input:
        if vi.name in init_names or vi.name not in uses:
            continue
        dims = _dims(vi)
        symbolic = any(not isinstance(d, int) for d in dims)

        def is_param_use(node: onnx.NodeProto, idx: int, dims=dims, symbolic=symbolic) -> bool:
            op = node.op_type
            if idx in _WEIGHT_SLOTS.get(op, ()) or idx in _BUFFER_SLOTS.get(op, ()):
                return True
            if op == "Gather" and idx == 0 and not symbolic:
                return True
            return op in ("MatMul", "Add", "Mul") and idx == 1 and not symbolic and len(dims) <= 2

        if all(is_param_use(n, i) for n, i in uses[vi.name]) and not symbolic:
            params.add(vi.name)
        else:
            data.append(vi)
    return data, params


def _bind_inputs(
    model: onnx.ModelProto,
    data_inputs: list[onnx.ValueInfoProto],
    *,
    batch_size: int,
    dims: Mapping[str, int],
) -> tuple[dict[str, int], int | None, list[str]]:
    """Replace symbolic dims of data inputs with values, in place.

    Axis 0 of every data input of rank ≥ 1 is the batch axis (a fixed axis 0 only when all data inputs
    share its value, else a warning says the fixed shapes were kept). Returns the binding used, the export's
    fixed batch size if one had to be overridden (else None) and warnings.
    Raises :class:`UnboundDimension` naming the first symbolic dimension with no value.
    """
    binding: dict[str, int] = {}
    fixed_batch: int | None = None
    warnings: list[str] = []
    # A fixed axis 0 is an export batch only when every data input agrees on it: inputs of (2,1,4,8)
    # and (3,8,5) have no common batch axis, and rebinding both would change what the graph computes.
    leading = {
        int(vi.type.tensor_type.shape.dim[0].dim_value)
        for vi in data_inputs
        if len(vi.type.tensor_type.shape.dim) >= 2 and vi.type.tensor_type.shape.dim[0].HasField("dim_value")
    }
    rebind_fixed = len(leading) <= 1
    if not rebind_fixed:
        warnings.append(
            f"data inputs have different fixed leading dimensions {sorted(leading)}: no common batch axis, "
            f"so the fixed shapes were kept and batch_size={batch_size} applies only to symbolic batch axes"
        )
    for vi in data_inputs:
        shape = vi.type.tensor_type.shape
        for axis, d in enumerate(shape.dim):
            if d.HasField("dim_param") and d.dim_param or not d.HasField("dim_value"):
                name = d.dim_param if d.dim_param else f"{vi.name}[{axis}]"
                if name in dims:
                    value = int(dims[name])
                elif axis == 0:
                    value = batch_size
                else:
                    raise UnboundDimension(
                        f"input '{vi.name}' has symbolic dimension '{name}' (axis {axis}) that the request "
                        f"does not bind; pass it in 'dims'",
                        detail={"dimension": name, "input": vi.name, "axis": axis},
                    )
                if value <= 0:
                    raise UnboundDimension(
                        f"dimension '{name}' must be positive, got {value}", detail={"dimension": name}
                    )
                binding[name] = value
                d.Clear()
                d.dim_value = value
            elif axis == 0 and rebind_fixed and d.dim_value != batch_size and len(shape.dim) >= 2:
                fixed_batch = int(d.dim_value)
                d.dim_value = batch_size
    if fixed_batch is not None:
        warnings.append(
            f"graph was exported with a fixed batch size of {fixed_batch}; rebound to {batch_size}"
        )
    return binding, fixed_batch, warnings


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
    gets its leading 1 turned into 0 ("copy axis 0", ``allowzero=0``); any other mismatch is reported
    as a warning and left alone.
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
        else:
            out.append(
                f"Reshape '{label}' turns {n_in} elements {list(src[0])} into {n_out} {list(dst[0])}: the graph "
                "is inconsistent at this binding and the layers after it may be costed at the wrong size"
            )
    return out


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

    ``dims`` binds symbolic dimensions other than the batch axis (e.g. ``{"sequence": 128}``).
    Raises :class:`InvalidGraph` for bytes that are not ONNX or a graph whose shapes cannot be inferred,
    :class:`UnboundDimension` for a symbolic dimension without a value, ``ValueError`` for a
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
    g = model.graph
    data_inputs, param_inputs = _classify_inputs(model)
    if not data_inputs:
        raise InvalidGraph("ONNX graph has no data input (all inputs are initializers or unused)")
    _check_declared_dims(g, limits)
    binding, fixed_batch, warnings = _bind_inputs(model, data_inputs, batch_size=batch_size, dims=dims)
    if fixed_batch is not None:
        _rewrite_fixed_batch_reshapes(model, fixed_batch)

    # Strip value_info/output shapes that would conflict with a rebound batch, then infer.
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
    fallback = {
        vi.name: (tuple(_dims(vi)), vi.type.tensor_type.elem_type)
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
        if vi.type.tensor_type.HasField("shape")
    }
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
    shapes: dict[str, tuple[list[int | str | None], str]] = {
        k: (list(shp), _DTYPES.get(elem, "float32"))  # type: ignore[call-overload]
        for k, (shp, elem) in propagated.items()
    }
    for tname, (shp, _dtype) in shapes.items():
        limits.check_shape([d for d in shp if isinstance(d, int)], tname)

    init_names = {i.name for i in ig.initializer}
    data_names = {vi.name for vi in data_inputs}
    static: set[str] = set(init_names) | set(param_inputs)
    # tensors that are raw parameters (possibly through Unsqueeze/Reshape/Cast/Identity of a parameter)
    param_like: set[str] = set(init_names) | set(param_inputs)
    # weight aliases: views/copies of a parameter (Transpose of a tied embedding, Identity, Cast...) and
    # initializers that are exact (possibly transposed) copies of another one, e.g. a tied LM head
    # constant-folded to ``Transpose(wte)`` by the exporter; all are named after their root parameter.
    alias: dict[str, str] = _duplicate_initializers(g)
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
                t = Tensor(alias[iname], t.shape, t.dtype)
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
                    and (op in ("MatMul", "Gemm", "Einsum", "Add", "Mul", "Sub", "Div", "PRelu")
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


EVAL_EXPORT_WARNING = "eval-mode export"  # prefix of the warnings below; the API shows them for training


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
        a_shape = act_in[0].shape if act_in else weights[0].shape
        b_t = weights[0] if weights else (act_in[1] if len(act_in) > 1 else None)
        if b_t is None or len(a_shape) != 2 or len(b_t.shape) != 2:
            raise _NotCosted("Gemm operand shape unknown")
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
