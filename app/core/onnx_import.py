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

from app.core.ir import Graph, Layer, OpKind, Tensor
from app.errors import InvalidGraph, UnboundDimension

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
            "ScatterND", "GatherElements"):
    OP_KINDS[_op] = OpKind.DATA_MOVEMENT

# Input slots holding trainable parameters (index → True) and non-trainable buffers.
_WEIGHT_SLOTS: dict[str, tuple[int, ...]] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "BatchNormalization": (1, 2),
    "LayerNormalization": (1, 2), "GroupNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "PRelu": (1,), "LSTM": (1, 2, 3), "GRU": (1, 2, 3), "RNN": (1, 2, 3),
}
_BUFFER_SLOTS: dict[str, tuple[int, ...]] = {"BatchNormalization": (3, 4)}
# Ops whose outputs are shapes/metadata, not data: their consumers treat them as static.
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape", "EyeLike", "Range"})

_DTYPES = {
    TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "float64", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
    TensorProto.INT16: "int16", TensorProto.INT32: "int32", TensorProto.INT64: "int64",
    TensorProto.BOOL: "bool",
}


def parse_model(content: bytes) -> onnx.ModelProto:
    """Deserialize ONNX bytes.

    Raises :class:`InvalidGraph` (code ``invalid_graph``) when the bytes are not a ModelProto with at
    least one node.
    """
    try:
        model = onnx.load_model_from_string(content)
    except Exception as exc:  # protobuf DecodeError and friends
        raise InvalidGraph(f"not a valid ONNX model: {exc.__class__.__name__}") from exc
    if not model.graph.node:
        raise InvalidGraph("ONNX model has no nodes (empty graph or not an ONNX file)")
    return model


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

    Axis 0 of every data input of rank ≥ 1 is the batch axis. Returns the binding used, the export's
    fixed batch size if one had to be overridden (else None) and warnings.
    Raises :class:`UnboundDimension` naming the first symbolic dimension with no value.
    """
    binding: dict[str, int] = {}
    fixed_batch: int | None = None
    warnings: list[str] = []
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
            elif axis == 0 and d.dim_value != batch_size and len(shape.dim) >= 2:
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


def _matmul_macs(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """MACs of numpy-style ``matmul(a, b)``: ∏broadcast(batch) · M · N · K."""
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    m, k = a[-2], a[-1]
    n = b[-1]
    batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])) if (len(a) > 2 or len(b) > 2) else ()
    return int(np.prod(batch, dtype=np.int64)) * m * n * k if batch else m * n * k


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
    model = parse_model(content) if isinstance(content, bytes) else onnx.ModelProto.FromString(
        content.SerializeToString()
    )
    g = model.graph
    data_inputs, param_inputs = _classify_inputs(model)
    if not data_inputs:
        raise InvalidGraph("ONNX graph has no data input (all inputs are initializers or unused)")
    binding, fixed_batch, warnings = _bind_inputs(model, data_inputs, batch_size=batch_size, dims=dims)
    if fixed_batch is not None:
        _rewrite_fixed_batch_reshapes(model, fixed_batch)

    # Strip value_info/output shapes that would conflict with a rebound batch, then infer.
    del g.value_info[:]
    for out in g.output:
        if out.type.tensor_type.HasField("shape"):
            out.type.tensor_type.ClearField("shape")
    try:
        inferred = shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:
        raise InvalidGraph(f"ONNX shape inference failed: {exc}") from exc
    ig = inferred.graph

    shapes: dict[str, tuple[list[int | str | None], str]] = {}
    for vi in [*ig.input, *ig.value_info, *ig.output]:
        shapes[vi.name] = (_dims(vi), _DTYPES.get(vi.type.tensor_type.elem_type, "float32"))
    for init in ig.initializer:
        shapes[init.name] = (list(init.dims), _DTYPES.get(init.data_type, "float32"))

    init_names = {i.name for i in ig.initializer}
    data_names = {vi.name for vi in data_inputs}
    static: set[str] = set(init_names) | set(param_inputs)
    # tensors that are raw parameters (possibly through Unsqueeze/Reshape/Cast/Identity of a parameter)
    param_like: set[str] = set(init_names) | set(param_inputs)
    for node in ig.node:
        ins = [i for i in node.input if i]
        if node.op_type in _SHAPE_OPS or all(i in static for i in ins):
            static.update(o for o in node.output if o)
            if node.op_type in ("ConstantOfShape", "Constant") or (
                node.op_type in ("Unsqueeze", "Reshape", "Cast", "Identity", "Squeeze")
                and ins and ins[0] in param_like
            ):
                param_like.update(o for o in node.output if o)

    def tensor(name: str) -> Tensor | None:
        if name not in shapes:
            return None
        raw, dtype = shapes[name]
        if not raw and name not in init_names:
            return None
        if any(not isinstance(d, int) or d <= 0 for d in raw):
            # zero-sized dims are legal (empty tensors) but cost nothing; unknown dims are not usable
            if all(isinstance(d, int) and d >= 0 for d in raw):
                return Tensor(name, tuple(int(d) for d in raw), dtype)  # type: ignore[arg-type]
            return None
        return Tensor(name, tuple(int(d) for d in raw), dtype)  # type: ignore[arg-type]

    layers: list[Layer] = []
    unknown_shape_layers: list[str] = []
    used_names: Counter[str] = Counter()
    for idx, node in enumerate(ig.node):
        ins = [i for i in node.input if i]
        if node.op_type in _SHAPE_OPS or all(i in static for i in ins):
            continue
        op = node.op_type
        kind = OP_KINDS.get(op, OpKind.UNSUPPORTED) if node.domain in ("", "ai.onnx") else OpKind.UNSUPPORTED
        weight_slots = _WEIGHT_SLOTS.get(op, ())
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
                    and (op in ("MatMul", "Gemm", "Add", "Mul", "Sub", "Div", "PRelu")
                         or (op == "Gather" and slot == 0))
                ):
                    weights.append(t)
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
        attrs = _attrs(node)
        attrs["needs_input_grad"] = not all(i in data_names for i in ins if i not in static)

        if op == "MatMul" and not weights:
            kind = OpKind.MATMUL
        if op == "Gemm" and not weights:
            kind = OpKind.MATMUL
        if op == "Gather" and weights:
            kind = OpKind.EMBEDDING
        if missing and kind is not OpKind.UNSUPPORTED:
            unknown_shape_layers.append(node.name or f"{op}_{idx}")
            kind = OpKind.UNSUPPORTED
            attrs["unsupported_reason"] = "shape could not be inferred"
        elif kind is OpKind.UNSUPPORTED:
            attrs["unsupported_reason"] = f"no cost formula for op '{op}' (domain '{node.domain or 'ai.onnx'}')"

        if kind in (OpKind.GEMM, OpKind.MATMUL) and not missing:
            a_shape = act_in[0].shape if act_in else weights[0].shape
            if op == "Gemm":
                # Gemm: A (M,K) or transposed; B (K,N) or transposed
                b_t = weights[0] if weights else (act_in[1] if len(act_in) > 1 else None)
                if b_t is None:
                    kind = OpKind.UNSUPPORTED
                    attrs["unsupported_reason"] = "Gemm operand shape unknown"
                else:
                    m, k = (a_shape[1], a_shape[0]) if attrs.get("transA", 0) else (a_shape[0], a_shape[1])
                    n = b_t.shape[0] if attrs.get("transB", 0) else b_t.shape[1]
                    attrs["macs"] = m * n * k
            else:
                operands = [tensor(i) for i in node.input[:2]]
                if any(o is None for o in operands):
                    kind = OpKind.UNSUPPORTED
                    attrs["unsupported_reason"] = "MatMul operand shape unknown"
                else:
                    attrs["macs"] = _matmul_macs(operands[0].shape, operands[1].shape)  # type: ignore[union-attr]
                    attrs["grad_operands"] = tuple(i not in static for i in node.input[:2])
        if kind is OpKind.RECURRENT and not missing:
            attrs["macs"] = _recurrent_macs(op, act_in, weights, attrs)
        if kind is OpKind.POOL and "kernel_shape" not in attrs:
            attrs["kernel_shape"] = (1,)

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
            )
        )
    if unknown_shape_layers:
        warnings.append(
            f"{len(unknown_shape_layers)} layer(s) have shapes ONNX shape inference could not resolve and are "
            f"listed as unsupported: {', '.join(unknown_shape_layers[:5])}"
        )
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
    )


def _recurrent_macs(op: str, act_in: list[Tensor], weights: list[Tensor], attrs: Mapping[str, Any]) -> int:
    """MACs of an ONNX LSTM/GRU/RNN over all timesteps and directions.

    ``W`` is (dirs, gates·H, I) and ``R`` is (dirs, gates·H, H); per timestep and sample each direction
    does ``gates·H·(I + H)`` MACs (input and recurrent projections). Gate count: LSTM 4, GRU 3, RNN 1.
    Elementwise gate math is omitted (< 2 % for H ≥ 64). Source: Hestness et al. 2019, §4.
    """
    x = act_in[0].shape  # (seq, batch, input) with layout=0, (batch, seq, input) with layout=1
    seq, batch = (x[1], x[0]) if attrs.get("layout", 0) == 1 else (x[0], x[1])
    w, r = weights[0].shape, weights[1].shape
    dirs = w[0]
    return int(seq * batch * dirs * (w[1] * w[2] + r[1] * r[2]))
