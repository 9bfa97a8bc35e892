"""Concrete shape propagation through an ONNX graph, with constant folding of its shape subgraphs.

ONNX's whole-graph shape inference (even with ``data_prop``) loses concrete sizes on the shape
arithmetic that exporters emit for real models: ``Shape → Gather → Div → Concat → Reshape`` in attention
heads, ``Shape → Sub → Max → Pad`` for TensorFlow-style "same" padding (transformers' MobileNetV2),
``Equal/Where/Expand`` in attention masks. Once the graph inputs are bound to concrete shapes every such
value is a plain small integer tensor, so this module walks the nodes in (topological) order and:

1. evaluates every node whose inputs are all known constants (initializers of at most
   :data:`MAX_VALUE_NUMEL` elements, ``Shape``/``Size`` of a tensor with a known shape, ``Constant``,
   and the results of earlier folds) with the ONNX reference implementation of the op;
2. infers every other node's output types with the op schema's own inference function
   (``onnx.shape_inference.infer_node_outputs``), passing the folded constants as input data, so a
   ``Reshape`` whose target was computed from ``Shape`` gets a concrete output shape.

Nodes that neither works for (ops from other domains without a schema, control flow) keep whatever
the caller's whole-graph inference found (``fallback``). Large float weights are never materialised:
only their shapes are used. Source of the approach: onnx-simplifier's constant folding + per-node
inference, restricted to shape-sized values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.shape_inference import infer_node_outputs

from app.core.limits import Deadline

MAX_VALUE_NUMEL = 1 << 16  # largest tensor kept as a folded constant (shape-sized, not weights)

# Ops never folded even with constant inputs (random, or producing weight-sized tensors we only size).
_NO_FOLD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                      "Bernoulli", "Dropout", "If", "Loop", "Scan"})

Shape = tuple[int | str | None, ...]


def _type_proto(shape: Shape | None, elem: int) -> onnx.TypeProto:
    if shape is None:
        return helper.make_tensor_type_proto(elem, None)
    return helper.make_tensor_type_proto(elem, [d if isinstance(d, int) else None for d in shape])


def _read_type(tp: onnx.TypeProto) -> tuple[Shape | None, int]:
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return None, tt.elem_type
    dims: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tuple(dims), tt.elem_type


def _concrete(shape: Shape | None) -> bool:
    return shape is not None and all(isinstance(d, int) and d >= 0 for d in shape)


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    from app.core.onnx_weights import has_inline_data  # onnx_weights imports this module

    for a in node.attribute:
        if a.name == "value":
            # a stripped or external-data weight: only its shape is known, never its values
            return numpy_helper.to_array(a.t) if has_inline_data(a.t) else None
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None


# Ops whose output holds at most as many elements as their largest input (shape-sized inputs are
# at most MAX_VALUE_NUMEL elements, so folding them is bounded even when schema inference cannot
# size the output first).
_SIZE_PRESERVING = frozenset({
    "Cast", "CastLike", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Reshape", "Transpose", "Slice",
    "Neg", "Abs", "Floor", "Ceil", "Round", "Sqrt", "Reciprocal", "Not", "Sign", "Relu", "Shape", "Size",
    "ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin", "ReduceMean", "ArgMax", "ArgMin", "NonZero",
})


def _fold_is_small(op: str, outs: list[str], sized: Mapping[str, tuple[Shape | None, int]]) -> bool:
    """Whether evaluating a node keeps every output within :data:`MAX_VALUE_NUMEL` elements."""
    shapes = [sized.get(o, (None, 0))[0] for o in outs]
    if all(_concrete(shp) for shp in shapes):
        return all(math.prod(int(d) for d in shp or () if isinstance(d, int)) <= MAX_VALUE_NUMEL for shp in shapes)
    return op in _SIZE_PRESERVING


def _eval(node: onnx.NodeProto, args: list[np.ndarray | None], opsets: Mapping[str, int]) -> list[Any] | None:
    """Evaluate one node on constant inputs with the ONNX reference runtime; None when it cannot."""
    from onnx.reference import ReferenceEvaluator

    names = [f"i{k}" if n else "" for k, n in enumerate(node.input)]
    feeds = {nm: v for nm, v in zip(names, args, strict=True) if nm}
    clone = helper.make_node(node.op_type, names, [f"o{k}" for k in range(len(node.output))],
                             domain=node.domain)
    clone.attribute.extend(node.attribute)
    model = helper.make_model(
        helper.make_graph(
            [clone], "fold",
            [helper.make_tensor_value_info(nm, TensorProto.UNDEFINED, None) for nm in feeds],
            [helper.make_tensor_value_info(f"o{k}", TensorProto.UNDEFINED, None) for k in range(len(node.output))],
        ),
        opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
    )
    try:
        return list(ReferenceEvaluator(model).run(None, feeds))
    except Exception:  # noqa: BLE001 - any failure just means "not foldable"; inference still runs
        return None


def propagate_shapes(
    model: onnx.ModelProto,
    *,
    known: Mapping[str, tuple[Shape, int]],
    fallback: Mapping[str, tuple[Shape, int]] | None = None,
    deadline: Deadline | None = None,
) -> dict[str, tuple[Shape, int]]:
    """Concrete output shape and ONNX element type of every tensor of ``model.graph`` that can be sized.

    ``known`` gives the graph inputs (bound to concrete shapes) and every initializer as
    ``name → (shape, TensorProto elem type)``; ``fallback`` the result of whole-graph shape inference,
    used for nodes this pass cannot type. Returns ``name → (shape, elem type)`` for inputs,
    initializers and node outputs; an unknown dimension is ``None`` (or its symbolic name).
    Never raises on a node it cannot handle: the node's outputs are simply left to ``fallback``;
    raises :class:`app.errors.LimitExceeded` (``import_seconds``) once ``deadline`` has passed.

    Bounded memory: a node is evaluated only when the schema's own inference sizes every output at
    most :data:`MAX_VALUE_NUMEL` elements first (or, for ops whose output is never larger than their
    inputs, :data:`_SIZE_PRESERVING`, when inference cannot size it), so ``Range`` to 10¹², ``Expand`` to
    16384² or ``ConstantOfShape`` are typed from their shapes and never materialised.
    """
    g = model.graph
    fallback = fallback or {}
    opsets = {imp.domain or "": int(imp.version) for imp in model.opset_import}
    opsets.setdefault("", 17)
    types: dict[str, tuple[Shape | None, int]] = dict(known)
    values: dict[str, np.ndarray] = {}
    from app.core.onnx_weights import has_inline_data  # onnx_weights imports this module

    for init in g.initializer:
        numel = int(np.prod(init.dims)) if init.dims else 1
        if numel <= MAX_VALUE_NUMEL and has_inline_data(init):
            values[init.name] = numpy_helper.to_array(init)

    for node in g.node:
        if deadline is not None:
            deadline.check()
        op = node.op_type
        ins = list(node.input)
        outs = [o for o in node.output if o]
        result: list[np.ndarray] | None = None
        if node.domain in ("", "ai.onnx"):
            if op == "Constant":
                v = _constant_value(node)
                result = [v] if v is not None else None
            elif op in ("Shape", "Size") and ins and _concrete(types.get(ins[0], (None, 0))[0]):
                shp = tuple(types[ins[0]][0])  # type: ignore[arg-type]
                if op == "Size":
                    result = [np.array(int(np.prod([int(d) for d in shp])) if shp else 1,  # type: ignore[arg-type]
                                       dtype=np.int64)]
                else:
                    a = {x.name: x.i for x in node.attribute}
                    start, end = a.get("start", 0), a.get("end", len(shp))
                    result = [np.array(shp[start:end] if "end" in a else shp[start:], dtype=np.int64)]
            elif op == "ConstantOfShape" and ins and ins[0] in values:
                target = tuple(int(x) for x in values[ins[0]].reshape(-1))
                elem = TensorProto.FLOAT
                for x in node.attribute:
                    if x.name == "value":
                        elem = x.t.data_type
                if int(np.prod(target)) > MAX_VALUE_NUMEL:
                    types[outs[0]] = (target, elem)
                    continue
            if result is None and op not in _NO_FOLD and all((not i) or i in values for i in ins) and ins:
                sized = _infer(node, types, values, opsets, model.ir_version)
                if _fold_is_small(op, [o for o in node.output if o], sized):
                    result = _eval(node, [values[i] if i else None for i in ins], opsets)
        if result is not None and len(result) >= len(outs):
            for oname, v in zip(node.output, result, strict=False):
                if not oname:
                    continue
                arr = np.asarray(v)
                elem = helper.np_dtype_to_tensor_dtype(arr.dtype) if arr.dtype != object else TensorProto.FLOAT
                types[oname] = (tuple(int(d) for d in arr.shape), elem)
                if arr.size <= MAX_VALUE_NUMEL:
                    values[oname] = arr
            continue
        if node.domain == "com.microsoft":
            inferred = _ms_infer(node, types)
        else:
            inferred = _infer(node, types, values, opsets, model.ir_version)
            if op == "Einsum" and outs and not _concrete(inferred.get(outs[0], (None, 0))[0]):
                inferred = _einsum_infer(node, types)
        for oname in outs:
            if oname in inferred and _concrete(inferred[oname][0]):
                types[oname] = inferred[oname]
            elif oname in fallback and _concrete(fallback[oname][0]):
                types[oname] = fallback[oname]
            elif oname in inferred:
                types[oname] = inferred[oname]
            elif oname in fallback:
                types[oname] = fallback[oname]
    return {k: v for k, v in types.items() if v[0] is not None}  # type: ignore[misc]


def _ms_infer(
    node: onnx.NodeProto, types: Mapping[str, tuple[Shape | None, int]]
) -> dict[str, tuple[Shape | None, int]]:
    """Output shapes of the ONNX Runtime contrib ops the cost model knows (no ONNX schema exists for them).

    Attention: (B, S, Dv) from X (B, S, D_in) and W (D_in, Dq+Dk+Dv) (``qkv_hidden_sizes`` or thirds);
    MultiHeadAttention: (B, S, Dv) from Q and V; Gelu family, (Skip)(Simplified)LayerNormalization:
    output 0 has the shape of input 0.
    """
    ins = [i for i in node.input]
    first = types.get(ins[0]) if ins and ins[0] else None
    if first is None or first[0] is None:
        return {}
    shape: Any = first[0]
    elem = first[1]
    out: Shape | None = None
    op = node.op_type
    try:
        if op == "Attention":
            w: Any = types[ins[1]][0]
            sizes = next((tuple(a.ints) for a in node.attribute if a.name == "qkv_hidden_sizes"), None)
            dv = sizes[2] if sizes else int(w[1]) // 3  # type: ignore[index,arg-type]
            out = (shape[0], shape[1], dv)
        elif op == "MultiHeadAttention":
            v: Any = types[ins[2]][0] if len(ins) > 2 and ins[2] else None
            out = (shape[0], shape[1], v[-1]) if v is not None and len(shape) == 3 else None
        elif op in ("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "SkipLayerNormalization",
                    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"):
            out = shape
    except (KeyError, IndexError, TypeError):
        return {}
    return {node.output[0]: (out, elem)} if out is not None and node.output else {}


def einsum_output_shape(equation: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """Output shape of ``Einsum(equation)`` on operands of ``shapes`` (numpy ``einsum`` semantics).

    An ellipsis stands for the operand's unnamed leading axes; the ellipses of all operands broadcast
    (ONNX shape inference rejects operands whose ellipses have different ranks, which numpy and torch
    accept). Implicit mode (no ``->``): the ellipsis axes, then the letters used once, alphabetically.
    None when the equation does not match the shapes.
    """
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return None
    sizes: dict[str, int] = {}
    ellipses: list[tuple[int, ...]] = []
    counts: dict[str, int] = {}
    for term, shape in zip(terms, shapes, strict=True):
        letters = term.replace("...", "")
        if "." in letters:
            return None
        n_ell = len(shape) - len(letters)
        if n_ell < 0 or (n_ell and "..." not in term):
            return None
        at = term.find("...")
        if at >= 0:
            ellipses.append(tuple(shape[at:at + n_ell]))
            shape = tuple(shape[:at]) + tuple(shape[at + n_ell:])
        for letter, size in zip(letters, shape, strict=True):
            counts[letter] = counts.get(letter, 0) + 1
            if sizes.get(letter, 1) not in (1, size) and size != 1:
                return None
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    try:
        ell = tuple(int(d) for d in np.broadcast_shapes(*ellipses)) if ellipses else ()
    except ValueError:
        return None
    if "->" not in eq:
        return ell + tuple(sizes[c] for c in sorted(c for c, n in counts.items() if n == 1))
    out: list[int] = []
    rest = rhs
    if "..." in rest:
        head, _, tail = rest.partition("...")
        out = [sizes[c] for c in head if c in sizes] + list(ell) + [sizes[c] for c in tail if c in sizes]
        letters = head + tail
    else:
        out = [sizes[c] for c in rest if c in sizes]
        letters = rest
    return tuple(out) if len(out) == len(letters) + (len(ell) if "..." in rest else 0) else None


def _einsum_infer(
    node: onnx.NodeProto, types: Mapping[str, tuple[Shape | None, int]]
) -> dict[str, tuple[Shape | None, int]]:
    equation = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "equation"), b"")
    equation = equation.decode() if isinstance(equation, bytes) else str(equation)
    shapes = [types.get(i, (None, 0)) for i in node.input]
    if not node.output or any(not _concrete(shp) for shp, _ in shapes):
        return {}
    out = einsum_output_shape(equation, [tuple(int(d) for d in shp) for shp, _ in shapes])  # type: ignore[union-attr,arg-type]
    return {node.output[0]: (out, shapes[0][1])} if out is not None else {}


def _infer(
    node: onnx.NodeProto,
    types: Mapping[str, tuple[Shape | None, int]],
    values: Mapping[str, np.ndarray],
    opsets: Mapping[str, int],
    ir_version: int,
) -> dict[str, tuple[Shape | None, int]]:
    domain = node.domain or ""
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except Exception:  # noqa: BLE001 - no schema (custom domain): nothing to infer here
        return {}
    in_types: dict[str, onnx.TypeProto] = {}
    for i in node.input:
        if i and i in types:
            shp, elem = types[i]
            in_types[i] = _type_proto(shp, elem or TensorProto.FLOAT)
        elif i:
            return {}
    data = {i: numpy_helper.from_array(values[i], i) for i in node.input if i in values}
    try:
        out = infer_node_outputs(
            schema, node, in_types, data,
            opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()], ir_version=ir_version,
        )
    except Exception:  # noqa: BLE001 - inconsistent or unsupported node: leave it to the fallback
        return {}
    return {k: _read_type(v) for k, v in out.items()}
