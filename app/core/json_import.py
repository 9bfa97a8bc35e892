"""JSON layer list → layer IR, by shape propagation through a sequential stack.

The format (``POST /v1/graphs`` with ``application/json``)::

    {"name": "small-cnn",
     "input_shape": [3, 32, 32],          # one sample, without the batch axis
     "input_dtype": "float32",            # optional
     "layers": [
        {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "stride": 1, "padding": 1},
        {"op": "batchnorm"}, {"op": "relu"}, {"op": "maxpool", "kernel_size": 2},
        {"op": "flatten"}, {"op": "linear", "out_features": 10}, {"op": "softmax"}]}

Layers are applied in order; each receives the previous layer's output. Layout is channels-first
(PyTorch): ``(C, *spatial)`` for conv/pool/norm inputs, ``(features,)`` or ``(seq, features)`` for linear.
Every layer becomes the :class:`Layer` an equivalent ONNX node would, so one cost model serves both
importers. Errors raise :class:`InvalidGraph` naming the layer index and the field.

A layer may repeat a size of its input the way PyTorch's module constructor takes it
(:data:`DECLARED_INPUT_SIZES`: ``in_features`` of ``linear``, ``in_channels`` of a convolution,
``embed_dim`` of ``multihead_attention``, ``normalized_shape`` of ``layernorm``...). The input decides the
size, so the field is optional; given, it must equal the size the previous layer delivers, else the graph does
not chain (PyTorch raises on the first forward) and the import is an :class:`InvalidGraph` with
``detail = {"layer_index", "field", "declared", "actual"}``. This importer is the one place that rule lives:
the measurement checks (:mod:`app.measurements.validation`) rebuild their layers through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from math import prod
from typing import Any

from app.core.costs import gemm_dims
from app.core.ir import (
    BYTES_PER_ELEMENT,
    ConvAttrs,
    GemmAttrs,
    Graph,
    Layer,
    OpKind,
    PoolAttrs,
    RecurrentAttrs,
    Tensor,
)
from app.core.limits import Deadline, current_limits, json_depth
from app.errors import InvalidGraph, LimitExceeded

_ACTIVATIONS = {
    "relu": "Relu", "gelu": "Gelu", "sigmoid": "Sigmoid", "tanh": "Tanh", "silu": "SiLU", "swish": "SiLU",
    "leaky_relu": "LeakyRelu", "elu": "Elu", "hardswish": "HardSwish", "softplus": "Softplus", "mish": "Mish",
}
SUPPORTED_OPS: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "conv", "linear", "dense", "batchnorm", "layernorm", "groupnorm",
    "instancenorm", "maxpool", "avgpool", "global_avgpool", "global_maxpool", "flatten", "dropout",
    "softmax", "embedding", "lstm", "gru", "rnn", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_transpose", "upsample", "multihead_attention", *_ACTIVATIONS,
)


#: Fields that repeat a size of the layer's input (PyTorch's constructor arguments of the same name), by op:
#: optional, and refused when they differ from the input (module doc). ``kdim``/``vdim`` are the key's and
#: value's widths, which in this self-attention are the input's too.
DECLARED_INPUT_SIZES: dict[str, tuple[str, ...]] = {
    **{op: ("in_features",) for op in ("linear", "dense")},
    **{op: ("in_channels",) for op in ("conv1d", "conv2d", "conv3d", "conv", "conv_transpose1d",
                                       "conv_transpose2d", "conv_transpose3d", "conv_transpose")},
    **{op: ("num_features",) for op in ("batchnorm", "instancenorm")},
    "groupnorm": ("num_channels",),
    "layernorm": ("normalized_shape",),
    **{op: ("input_size",) for op in ("lstm", "gru", "rnn")},
    "multihead_attention": ("embed_dim", "kdim", "vdim"),
}
#: Every field of :data:`DECLARED_INPUT_SIZES`.
DECLARED_SIZE_FIELDS: frozenset[str] = frozenset(f for fields in DECLARED_INPUT_SIZES.values() for f in fields)


def _err(i: int, msg: str, field: str | None = None, **extra: Any) -> InvalidGraph:
    """:class:`InvalidGraph` of layer ``i``: ``detail = {"layer_index": i, "field": field, **extra}`` (no
    ``field`` key when None)."""
    detail: dict[str, Any] = {"layer_index": i}
    if field is not None:
        detail["field"] = field
    detail.update(extra)
    return InvalidGraph(f"layer {i}: {msg}", detail=detail)


def _missing(i: int, key: str) -> InvalidGraph:
    """A required field (one PyTorch's module has no default for, e.g. ``kernel_size``) is absent: 422
    ``invalid_graph`` with ``detail = {"layer_index": i, "field": key}``, never a guessed value."""
    return _err(i, f"'{key}' is required", field=key)


def _int(spec: Mapping[str, Any], key: str, i: int, default: int | None = None, minimum: int = 1) -> int:
    """``spec[key]`` as an integer ≥ ``minimum``; ``default`` when absent, or :func:`_missing` when ``default``
    is None (a required field). An explicit null of an optional field is a type error, not "required"."""
    v = spec.get(key, default)
    if v is None and default is None:
        raise _missing(i, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(i, f"'{key}' must be an integer ≥ {minimum}, got {v!r}", field=key)
    return v


def _tuple(spec: Mapping[str, Any], key: str, n: int, i: int, default: int | None,
           minimum: int = 1) -> tuple[int, ...]:
    """``spec[key]`` as ``n`` integers ≥ ``minimum`` (one integer is repeated); ``default`` when absent, or
    :func:`_missing` when ``default`` is None (a required field). An explicit null of an optional field
    (``"stride": null`` of a conv, which PyTorch refuses too) is a type error, not "required"."""
    v = spec.get(key, default)
    if v is None and default is None:
        raise _missing(i, key)
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v] * n
    if not isinstance(v, list | tuple) or len(v) != n or any(
        isinstance(x, bool) or not isinstance(x, int) or x < minimum for x in v
    ):
        raise _err(i, f"'{key}' must be an integer ≥ {minimum} or a list of {n} such integers, got {v!r}",
                   field=key)
    return tuple(v)


def _source(i: int) -> str:
    """What feeds layer ``i``, for messages: the document's ``input_shape`` or the previous layer."""
    return "'input_shape'" if i == 0 else f"layer {i - 1}'s output"


def _declared(spec: Mapping[str, Any], key: str, i: int, actual: int, what: str) -> None:
    """Check the optional declared input size ``spec[key]`` (:data:`DECLARED_INPUT_SIZES`) against ``actual``,
    the size of the layer's input it repeats (``what`` names that axis for the message): absent or equal is
    fine (and the field counts as read); anything else is :class:`InvalidGraph` with ``detail =
    {"layer_index": i, "field": key, "declared": value, "actual": actual}``."""
    if key not in spec:
        return
    v = spec[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(i, f"'{key}' must be an integer ≥ 1, got {v!r}", field=key)
    if v != actual:
        raise _err(i, f"'{key}' is {v} but its input ({_source(i)}) has {actual} {what}: the layers do not "
                      f"chain (omit '{key}': the input sets it)", field=key, declared=v, actual=actual)


def _normalized_shape(spec: Mapping[str, Any], i: int, x: Tensor) -> tuple[int, ...]:
    """``layernorm``'s normalized shape: ``normalized_shape`` (an integer or a list, as ``torch.nn.LayerNorm``
    takes it), which must equal the trailing axes of one sample of the input ``x`` (batched), else
    :class:`InvalidGraph` (field ``normalized_shape``, ``declared`` and ``actual`` as in :func:`_declared`:
    ``actual`` is the trailing axis, or axes for a list); absent, the last axis."""
    if "normalized_shape" not in spec:
        return (x.shape[-1],)
    v = spec["normalized_shape"]
    shape = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if (not isinstance(shape, list) or not shape
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)):
        raise _err(i, f"'normalized_shape' must be an integer ≥ 1 or a non-empty list of them, got {v!r}",
                   field="normalized_shape")
    sample = list(x.shape[1:])
    trailing = sample[-len(shape):] if len(shape) <= len(sample) else sample
    if shape != trailing:
        axes = "its last axis" if len(shape) == 1 else f"its last {len(shape)} axes"
        raise _err(i, f"'normalized_shape' is {v} but its input ({_source(i)}) is {sample} per sample: it must be "
                      f"{axes} (omit it to normalize the last axis)", field="normalized_shape", declared=v,
                   actual=trailing[0] if isinstance(v, int) else trailing)
    return tuple(shape)


class _ReadFields(Mapping[str, Any]):
    """A layer spec that records which of its fields the builder read (``get``, ``[]``, ``in``), so that a
    field no op reads (a misspelt ``kernal_size``, PyTorch's ``inplace``) is reported, not silently dropped."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._spec = spec
        self.read: set[str] = {"op", "name"}

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._spec[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return key in self._spec

    def __iter__(self) -> Iterator[str]:
        return iter(self._spec)

    def __len__(self) -> int:
        return len(self._spec)

    def unread(self) -> list[str]:
        return sorted(str(k) for k in self._spec if k not in self.read)


_UNREAD_SHOWN = 10  # layers, and fields per layer, named in the unread-fields warning; the rest are counted


def _unread_warning(unread: list[tuple[int, str, list[str]]]) -> str:
    """One :attr:`Graph.warnings` line naming the fields no builder read, per layer (the first
    :data:`_UNREAD_SHOWN` layers and fields of each, names cut to 40 characters, then counts: the line stays
    short whatever the document holds)."""

    def fields(keys: list[str]) -> str:
        named = ", ".join(repr(k[:40]) for k in keys[:_UNREAD_SHOWN])
        return named + (f" and {len(keys) - _UNREAD_SHOWN} more" if len(keys) > _UNREAD_SHOWN else "")

    shown = "; ".join(f"layer {i} ({op[:40]}): {fields(keys)}" for i, op, keys in unread[:_UNREAD_SHOWN])
    more = f"; and {len(unread) - _UNREAD_SHOWN} more layer(s)" if len(unread) > _UNREAD_SHOWN else ""
    return (f"JSON layer fields not read, so they do not change the cost (misspelt, or not part of the cost "
            f"model; defaults were used): {shown}{more}")


def import_json(doc: Mapping[str, Any], *, batch_size: int = 1) -> Graph:
    """Build a :class:`Graph` from a JSON layer list at ``batch_size``.

    Raises :class:`InvalidGraph` for a malformed document (unknown op, missing or non-positive field,
    shapes that do not chain, e.g. a conv kernel larger than its padded input or a declared input size,
    :data:`DECLARED_INPUT_SIZES`, that differs from the input), ``ValueError`` for a
    non-positive ``batch_size``, and for documents over the active :class:`app.core.limits.Limits`
    :class:`app.errors.GraphTooLarge` (more layers than ``max_nodes``) or
    :class:`app.errors.LimitExceeded` (nesting over ``max_json_depth``, a tensor (output, weight or buffer)
    over the rank, dimension or element bounds, or past ``import_timeout_s``).
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not isinstance(doc, Mapping):
        raise InvalidGraph("a JSON graph must be an object with 'input_shape' and 'layers'")
    limits = current_limits()
    deadline = Deadline(limits.import_timeout_s)
    depth = json_depth(doc, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise LimitExceeded("json_depth", depth, limits.max_json_depth,
                            f"the JSON graph nests deeper than {limits.max_json_depth} levels")
    if isinstance(doc.get("layers"), list):
        limits.check_nodes(len(doc["layers"]), "layers")
    shape_in = doc.get("input_shape")
    if (
        not isinstance(shape_in, list)
        or not shape_in
        or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape_in)
    ):
        raise InvalidGraph("'input_shape' must be a non-empty list of positive integers (one sample, no batch)")
    dtype = str(doc.get("input_dtype", "float32"))
    if dtype not in BYTES_PER_ELEMENT:
        raise InvalidGraph(f"unknown 'input_dtype' {dtype!r}", detail={"allowed": sorted(BYTES_PER_ELEMENT)})
    specs = doc.get("layers")
    if not isinstance(specs, list) or not specs:
        raise InvalidGraph("'layers' must be a non-empty list")

    limits.check_shape((batch_size, *shape_in), "input")
    x = Tensor("input", (batch_size, *shape_in), dtype)
    graph_input = x
    act_dtype = "float32" if dtype.startswith("int") else dtype
    layers: list[Layer] = []
    unread: list[tuple[int, str, list[str]]] = []
    for i, raw_spec in enumerate(specs):
        if not isinstance(raw_spec, Mapping) or not isinstance(raw_spec.get("op"), str):
            raise _err(i, "each layer must be an object with a string 'op'")
        spec = _ReadFields(raw_spec)
        op = spec["op"].lower()
        name = str(spec.get("name") or f"{op}_{i}")
        built = _build(i, op, name, spec, x, act_dtype, first=(i == 0))
        if not_read := spec.unread():
            unread.append((i, op, not_read))
        block = built if isinstance(built, list) else [built]
        for layer in block:
            for t in (*layer.outputs, *layer.weights, *layer.buffers):
                limits.check_shape(t.shape, t.name)
        deadline.check()
        layers.extend(block)
        x = block[-1].outputs[0]
    return Graph(
        name=str(doc.get("name") or "json-model"),
        layers=tuple(layers),
        inputs=(graph_input,),
        outputs=(x,),
        batch_size=batch_size,
        source_format="json",
        warnings=(_unread_warning(unread),) if unread else (),
    )


def _conv_geometry(
    i: int, op: str, nd: int, spec: Mapping[str, Any], x: Tensor
) -> tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """Validated ``(c_in, c_out, kernel, stride, padding, dilation, groups)`` of an ``nd``-D (transposed)
    convolution on input ``x`` of shape ``(N, C, *spatial)``; raises :class:`InvalidGraph` naming the field."""
    if len(x.shape) != nd + 2:
        raise _err(i, f"{op} expects an input of rank {nd + 1} per sample (C, *spatial), got {x.shape[1:]}")
    c_in = x.shape[1]
    _declared(spec, "in_channels", i, c_in, "channels")
    c_out = _int(spec, "out_channels", i)
    k = _tuple(spec, "kernel_size", nd, i, None)  # required, as in torch.nn.Conv*d / ConvTranspose*d
    s = _tuple(spec, "stride", nd, i, 1)
    p = _tuple(spec, "padding", nd, i, 0, minimum=0)
    d = _tuple(spec, "dilation", nd, i, 1)
    groups = _int(spec, "groups", i, 1)
    if c_in % groups or c_out % groups:
        raise _err(i, f"groups={groups} must divide in_channels={c_in} and out_channels={c_out}")
    return c_in, c_out, k, s, p, d, groups


def _conv_out(size: int, k: int, s: int, p: int, d: int, i: int) -> int:
    out = (size + 2 * p - d * (k - 1) - 1) // s + 1
    if out <= 0:
        raise _err(i, f"kernel {k} (dilation {d}) does not fit an input of size {size} with padding {p}")
    return out


def _build(
    i: int, op: str, name: str, spec: Mapping[str, Any], x: Tensor, dt: str, *, first: bool
) -> Layer | list[Layer]:
    b = x.shape[0]
    nig = not first

    def t(suffix: str, shape: Sequence[int]) -> Tensor:
        return Tensor(f"{name}.{suffix}", tuple(int(s) for s in shape), dt)

    if op in ("conv1d", "conv2d", "conv3d", "conv"):
        nd = {"conv1d": 1, "conv2d": 2, "conv3d": 3}.get(op, len(x.shape) - 2)
        c_in, c_out, k, s, p, d, groups = _conv_geometry(i, op, nd, spec, x)
        spatial = [_conv_out(x.shape[2 + j], k[j], s[j], p[j], d[j], i) for j in range(nd)]
        weights = [t("weight", (c_out, c_in // groups, *k))]
        if spec.get("bias", True):
            weights.append(t("bias", (c_out,)))
        attrs = ConvAttrs(weights[0].shape, k, s, p + p, d, groups)
        return Layer(name, "Conv", OpKind.CONV, (x,), (t("out", (b, c_out, *spatial)),), tuple(weights), (), attrs,
                     nig)
    if op in ("linear", "dense"):
        f_in = x.shape[-1]
        _declared(spec, "in_features", i, f_in, "features (its last axis)")
        f_out = _int(spec, "out_features", i)
        weights = [t("weight", (f_out, f_in))]
        if spec.get("bias", True):
            weights.append(t("bias", (f_out,)))
        gemm = GemmAttrs(m=prod(x.shape[:-1]), n=f_out, k=f_in)
        return Layer(name, "Gemm", OpKind.GEMM, (x,), (t("out", (*x.shape[:-1], f_out)),), tuple(weights), (), gemm,
                     nig)
    if op in _ACTIVATIONS:
        return Layer(name, _ACTIVATIONS[op], OpKind.ACTIVATION, (x,), (t("out", x.shape),), (), (), None, nig)
    if op in ("batchnorm", "instancenorm", "groupnorm", "layernorm"):
        if len(x.shape) < 2:
            raise _err(i, f"{op} needs a channel axis")
        if op == "layernorm":
            norm_shape = _normalized_shape(spec, i, x)
        else:
            norm_shape = (x.shape[1],)
            _declared(spec, "num_channels" if op == "groupnorm" else "num_features", i, x.shape[1], "channels")
        c = x.shape[1]
        affine = bool(spec.get("affine", True))
        norm_w: tuple[Tensor, ...] = (t("weight", norm_shape), t("bias", norm_shape)) if affine else ()
        if op == "batchnorm":
            bufs = (t("running_mean", (c,)), t("running_var", (c,)))
            return Layer(name, "BatchNormalization", OpKind.BATCHNORM, (x,), (t("out", x.shape),), norm_w, bufs,
                         None, nig)
        onnx_op = {"instancenorm": "InstanceNormalization", "groupnorm": "GroupNormalization",
                   "layernorm": "LayerNormalization"}[op]
        if op == "groupnorm":
            g = _int(spec, "num_groups", i)
            if c % g:
                raise _err(i, f"num_groups={g} must divide channels={c}")
        return Layer(name, onnx_op, OpKind.NORM, (x,), (t("out", x.shape),), norm_w, (), None, nig)
    if op in ("maxpool", "avgpool"):
        nd = len(x.shape) - 2
        if nd < 1:
            raise _err(i, f"{op} expects (C, *spatial) per sample, got {x.shape[1:]}")
        k = _tuple(spec, "kernel_size", nd, i, None)  # required, as in torch.nn.MaxPool*d / AvgPool*d
        # PyTorch: stride None (or absent) is the kernel size
        s = k if spec.get("stride") is None else _tuple(spec, "stride", nd, i, None)
        p = _tuple(spec, "padding", nd, i, 0, minimum=0)
        spatial = [_conv_out(x.shape[2 + j], k[j], s[j], p[j], 1, i) for j in range(nd)]
        onnx_op = "MaxPool" if op == "maxpool" else "AveragePool"
        return Layer(name, onnx_op, OpKind.POOL, (x,), (t("out", (b, x.shape[1], *spatial)),), (), (),
                     PoolAttrs(k, s, p + p), nig)
    if op in ("global_avgpool", "global_maxpool"):
        onnx_op = "GlobalAveragePool" if op == "global_avgpool" else "GlobalMaxPool"
        out = (b, x.shape[1], *([1] * (len(x.shape) - 2)))
        return Layer(name, onnx_op, OpKind.GLOBAL_POOL, (x,), (t("out", out),), (), (), None, nig)
    if op == "flatten":
        flat = t("out", (b, prod(x.shape[1:])))
        return Layer(name, "Flatten", OpKind.DATA_MOVEMENT, (x,), (flat,), (), (), None, nig)
    if op == "dropout":
        return Layer(name, "Dropout", OpKind.DROPOUT, (x,), (t("out", x.shape),), (), (), None, nig)
    if op == "softmax":
        return Layer(name, "Softmax", OpKind.SOFTMAX, (x,), (t("out", x.shape),), (), (), None, nig)
    if op == "embedding":
        n = _int(spec, "num_embeddings", i)
        dim = _int(spec, "embedding_dim", i)
        idx = Tensor(x.name, x.shape, "int64")
        return Layer(name, "Gather", OpKind.EMBEDDING, (idx,), (t("out", (*x.shape, dim)),),
                     (t("weight", (n, dim)),), (), None, nig)
    if op in ("lstm", "gru", "rnn"):
        return _recurrent(i, op, name, spec, x, dt, nig)
    if op in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_transpose"):
        return _conv_transpose(i, op, name, spec, x, dt, nig)
    if op == "upsample":
        nd = len(x.shape) - 2
        if nd < 1:
            raise _err(i, f"upsample expects (C, *spatial) per sample, got {x.shape[1:]}")
        scale = _tuple(spec, "scale_factor", nd, i, None)  # required: torch.nn.Upsample has no default scale
        out = (b, x.shape[1], *(x.shape[2 + j] * scale[j] for j in range(nd)))
        return Layer(name, "Resize", OpKind.DATA_MOVEMENT, (x,), (t("out", out),), (), (), None, nig)
    if op == "multihead_attention":
        return _attention(i, name, spec, x, dt, nig)
    raise _err(i, f"unknown op '{op}'; supported: {', '.join(SUPPORTED_OPS)}")


def _recurrent(i: int, op: str, name: str, spec: Mapping[str, Any], x: Tensor, dt: str,
               nig: bool) -> list[Layer]:
    """``num_layers`` stacked LSTM/GRU/RNN layers (ONNX weight layout), ``bidirectional`` optional.

    Layer ℓ > 0 reads the ``dirs × hidden`` features of layer ℓ−1. MACs per layer:
    ``seq · batch · dirs · gates · H · (I + H)`` (gates: LSTM 4, GRU 3, RNN 1).
    """
    if len(x.shape) != 3:
        raise _err(i, f"{op} expects (seq, features) per sample, got {x.shape[1:]}")
    _declared(spec, "input_size", i, x.shape[2], "features (its last axis)")
    hidden = _int(spec, "hidden_size", i)
    num_layers = _int(spec, "num_layers", i, 1)
    dirs = 2 if spec.get("bidirectional", False) else 1
    gates = {"lstm": 4, "gru": 3, "rnn": 1}[op]
    b, seq = x.shape[0], x.shape[1]
    layers: list[Layer] = []
    for ell in range(num_layers):
        lname = name if num_layers == 1 else f"{name}.l{ell}"
        f_in = x.shape[2]
        weights = tuple(
            Tensor(f"{lname}.{k}", shp, dt)
            for k, shp in (("W", (dirs, gates * hidden, f_in)), ("R", (dirs, gates * hidden, hidden)),
                           ("B", (dirs, 2 * gates * hidden)))
        )
        a = RecurrentAttrs(seq_len=seq, batch=b, input_size=f_in, hidden_size=hidden, num_directions=dirs,
                           gates=gates, layout=1)
        out = Tensor(f"{lname}.out", (b, seq, dirs * hidden), dt)
        layers.append(Layer(lname, op.upper(), OpKind.RECURRENT, (x,), (out,), weights, (), a, nig or ell > 0))
        x = out
    return layers


def _conv_transpose(i: int, op: str, name: str, spec: Mapping[str, Any], x: Tensor, dt: str,
                    nig: bool) -> Layer:
    """ConvTranspose: out = (in − 1)·s − 2p + d·(k − 1) + output_padding + 1 (PyTorch/ONNX)."""
    nd = {"conv_transpose1d": 1, "conv_transpose2d": 2, "conv_transpose3d": 3}.get(op, len(x.shape) - 2)
    c_in, c_out, k, s, p, d, groups = _conv_geometry(i, op, nd, spec, x)
    op_ = _tuple(spec, "output_padding", nd, i, 0, minimum=0)
    spatial = [(x.shape[2 + j] - 1) * s[j] - 2 * p[j] + d[j] * (k[j] - 1) + op_[j] + 1 for j in range(nd)]
    if any(v <= 0 for v in spatial):
        raise _err(i, f"padding {p} leaves no output")
    weights = [Tensor(f"{name}.weight", (c_in, c_out // groups, *k), dt)]
    if spec.get("bias", True):
        weights.append(Tensor(f"{name}.bias", (c_out,), dt))
    attrs = ConvAttrs(weights[0].shape, k, s, p + p, d, groups, output_padding=op_)
    out = Tensor(f"{name}.out", (x.shape[0], c_out, *spatial), dt)
    return Layer(name, "ConvTranspose", OpKind.CONV_TRANSPOSE, (x,), (out,), tuple(weights), (), attrs, nig)


def _attention(i: int, name: str, spec: Mapping[str, Any], x: Tensor, dt: str, nig: bool) -> list[Layer]:
    """Multi-head self-attention block on (seq, embed_dim) samples, expanded to the layers an export has.

    Q, K, V projections (Gemm E→E each), ``Q·Kᵀ`` per head (MatMul, B·h·S·S·d MACs), Softmax over
    (B, h, S, S), ``A·V`` (MatMul, B·h·S·S·d MACs) and the output projection (Gemm E→E), with
    ``d = E / num_heads``; ``bias`` (default true) adds the projection biases. Layout and head
    reshapes are views (0 bytes) and are omitted.
    """
    if len(x.shape) != 3:
        raise _err(i, f"multihead_attention expects (seq, embed_dim) per sample, got {x.shape[1:]}")
    b, seq, e = x.shape
    for key in ("embed_dim", "kdim", "vdim"):  # self-attention: query, key and value are all the input
        _declared(spec, key, i, e, "features (its last axis)")
    heads = _int(spec, "num_heads", i)
    if e % heads:
        raise _err(i, f"num_heads={heads} must divide embed_dim={e}")
    d = e // heads
    bias = bool(spec.get("bias", True))

    def proj(suffix: str, inp: Tensor) -> Layer:
        w = [Tensor(f"{name}.{suffix}.weight", (e, e), dt)]
        if bias:
            w.append(Tensor(f"{name}.{suffix}.bias", (e,), dt))
        out = Tensor(f"{name}.{suffix}.out", (b, seq, e), dt)
        return Layer(f"{name}.{suffix}", "Gemm", OpKind.GEMM, (inp,), (out,), tuple(w), (),
                     GemmAttrs(m=b * seq, n=e, k=e), nig)

    def bmm(lname: str, a: Tensor, bt: Tensor, out: Tensor) -> Layer:
        batch, m, n, k = gemm_dims(a.shape, bt.shape)
        return Layer(lname, "MatMul", OpKind.MATMUL, (a, bt), (out,), (), (), GemmAttrs(m=m, n=n, k=k, batch=batch))

    q, k, v = proj("q_proj", x), proj("k_proj", x), proj("v_proj", x)
    qh = Tensor(q.outputs[0].name, (b, heads, seq, d), dt)
    kt = Tensor(k.outputs[0].name, (b, heads, d, seq), dt)
    vh = Tensor(v.outputs[0].name, (b, heads, seq, d), dt)
    scores = Tensor(f"{name}.scores", (b, heads, seq, seq), dt)
    qk = bmm(f"{name}.qk", qh, kt, scores)
    probs = Tensor(f"{name}.probs", scores.shape, dt)
    sm = Layer(f"{name}.softmax", "Softmax", OpKind.SOFTMAX, (scores,), (probs,))
    ctx = Tensor(f"{name}.context", (b, heads, seq, d), dt)
    av = bmm(f"{name}.av", probs, vh, ctx)
    merged = Tensor(ctx.name, (b, seq, e), dt)
    o = replace(proj("out_proj", merged), needs_input_grad=True)
    return [q, k, v, qk, sm, av, o]
