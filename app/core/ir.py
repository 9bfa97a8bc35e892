"""Layer IR: the framework-free description of a network that every later stage reads.

A :class:`Graph` is an ordered list of :class:`Layer` records, one per compute node of the model, with
fully resolved (concrete) tensor shapes. Importers (ONNX, JSON layer list) produce it; the cost model,
the feature function and the predictor consume it. Nothing here imports FastAPI, a database or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from math import prod


class OpKind(StrEnum):
    """Cost family of a layer; decides which cost formula applies (see :mod:`app.core.costs`)."""

    CONV = "conv"  # Conv 1D/2D/3D, grouped, depthwise, dilated
    CONV_TRANSPOSE = "conv_transpose"
    GEMM = "gemm"  # Gemm, MatMul with a weight operand (fully connected / linear)
    MATMUL = "matmul"  # MatMul between two activations (batched, attention)
    BATCHNORM = "batchnorm"
    NORM = "norm"  # LayerNormalization, GroupNormalization, InstanceNormalization, LRN
    POOL = "pool"  # MaxPool, AveragePool, LpPool
    GLOBAL_POOL = "global_pool"
    ACTIVATION = "activation"  # Relu, Sigmoid, Tanh, Gelu, ...
    ELEMENTWISE = "elementwise"  # Add, Mul, Sub, Div, Sum, ...
    SOFTMAX = "softmax"
    REDUCE = "reduce"
    DROPOUT = "dropout"
    DATA_MOVEMENT = "data_movement"  # Concat, Reshape, Flatten, Transpose, ... (bytes only)
    EMBEDDING = "embedding"  # Gather on a weight table
    RECURRENT = "recurrent"  # LSTM, GRU, RNN
    ATTENTION = "attention"  # fused softmax(Q·Kᵀ)·V (ONNX Attention, com.microsoft (MultiHead)Attention)
    UNSUPPORTED = "unsupported"


BYTES_PER_ELEMENT: Mapping[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "float8": 1,
}


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor with a concrete shape.

    ``shape`` is a tuple of positive ints (empty for a scalar); ``dtype`` a key of
    :data:`BYTES_PER_ELEMENT` (``float32`` when unknown).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        return int(prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Size in bytes: ``numel × bytes per element`` of ``dtype``."""
        return self.numel * BYTES_PER_ELEMENT.get(self.dtype, 4)


@dataclass(frozen=True, slots=True)
class ConvAttrs:
    """Geometry of a Conv or ConvTranspose layer (ONNX attribute semantics, defaults filled in).

    ``weight_shape`` is the filter's shape whether or not the filter is a trainable weight of the layer
    (it may be an activation): Conv ``(C_out, C_in/groups, *kernel)``, ConvTranspose
    ``(C_in, C_out/groups, *kernel)``. ``kernel_shape``, ``strides``, ``dilations`` have one entry per
    spatial axis, ``pads`` two (begins then ends, ONNX order; all zero when ``auto_pad`` decides them).
    ``activation`` names an activation fused after the layer (``"none"`` for ONNX graphs, which keep it
    as its own node).
    """

    weight_shape: tuple[int, ...]
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int = 1
    output_padding: tuple[int, ...] = ()
    auto_pad: str = "NOTSET"
    activation: str = "none"


@dataclass(frozen=True, slots=True)
class GemmAttrs:
    """Dimensions of a (batched) matrix product ``(batch…, M, K) @ (batch…, K, N)``.

    ``batch`` is the broadcast batch shape (``()`` for a plain GEMM); MACs are ``∏batch · M · N · K``
    (:func:`app.core.costs.mac_count`). ``grad_operands`` says, per operand, whether backward computes a
    gradient for it (an activation that is not a graph input); only read for activation × activation
    products (kind MATMUL). ``activation`` as in :class:`ConvAttrs`.
    """

    m: int
    n: int
    k: int
    batch: tuple[int, ...] = ()
    grad_operands: tuple[bool, ...] = (True, True)
    activation: str = "none"


@dataclass(frozen=True, slots=True)
class EinsumAttrs:
    """An ``Einsum`` contraction: its equation and the shape of every operand, in equation order.

    ``grad_operands`` as in :class:`GemmAttrs`. MACs: :func:`app.core.costs.einsum_macs`.
    """

    equation: str
    operand_shapes: tuple[tuple[int, ...], ...]
    grad_operands: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class RecurrentAttrs:
    """An LSTM/GRU/RNN layer over a whole sequence.

    ``gates`` per cell (LSTM 4, GRU 3, RNN 1), ``num_directions`` 1 or 2, ``layout`` 0 for ONNX's
    sequence-first input ``(seq, batch, input)``, 1 for batch-first.
    """

    seq_len: int
    batch: int
    input_size: int
    hidden_size: int
    num_directions: int = 1
    gates: int = 4
    layout: int = 0


@dataclass(frozen=True, slots=True)
class AttentionAttrs:
    """A fused ``softmax(Q·Kᵀ)·V`` (plus an optional packed input projection).

    ``qk_width`` and ``v_width`` are the query/key and value widths summed over heads
    (``heads × head_dim``); the products are ``batch · q_len · kv_len · (qk_width + v_width)`` MACs and the
    softmax has ``batch · heads · q_len · kv_len`` scores. The projection (com.microsoft ``Attention``) is
    a GEMM of ``proj_rows × proj_in`` by ``proj_in × proj_out`` (all 0 when absent).
    """

    batch: int
    heads: int
    q_len: int
    kv_len: int
    qk_width: int
    v_width: int
    proj_rows: int = 0
    proj_in: int = 0
    proj_out: int = 0


@dataclass(frozen=True, slots=True)
class PoolAttrs:
    """Window of a MaxPool/AveragePool/LpPool: one ``kernel_shape``/``strides`` entry per spatial axis,
    ``pads`` two (begins then ends)."""

    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LrnAttrs:
    """Local response normalisation across ``size`` channels."""

    size: int


@dataclass(frozen=True, slots=True)
class TopKAttrs:
    """TopK selecting ``k`` of the ``axis_size`` elements along its axis."""

    k: int
    axis_size: int


@dataclass(frozen=True, slots=True)
class UnsupportedAttrs:
    """Why no cost formula applies (the reason the API reports for the layer)."""

    reason: str


LayerAttrs = (
    ConvAttrs | GemmAttrs | EinsumAttrs | RecurrentAttrs | AttentionAttrs | PoolAttrs | LrnAttrs | TopKAttrs
    | UnsupportedAttrs | None
)

# The attribute records a layer of each kind may carry; kinds absent here carry none (``None``).
ATTRS_FOR_KIND: Mapping[OpKind, tuple[type, ...]] = {
    OpKind.CONV: (ConvAttrs,),
    OpKind.CONV_TRANSPOSE: (ConvAttrs,),
    OpKind.GEMM: (GemmAttrs, EinsumAttrs),
    OpKind.MATMUL: (GemmAttrs, EinsumAttrs),
    OpKind.RECURRENT: (RecurrentAttrs,),
    OpKind.ATTENTION: (AttentionAttrs,),
    OpKind.POOL: (PoolAttrs,),
    OpKind.NORM: (LrnAttrs, type(None)),
    OpKind.REDUCE: (TopKAttrs, type(None)),
    OpKind.UNSUPPORTED: (UnsupportedAttrs,),
}


@dataclass(frozen=True, slots=True)
class Layer:
    """One compute node of the network.

    ``inputs`` are the activations the layer reads (data path); ``weights`` are its trainable
    parameters (e.g. Conv ``W`` of shape ``(C_out, C_in/groups, *kernel)`` and bias ``(C_out,)``);
    ``buffers`` hold non-trainable state read by the layer (BatchNorm running mean/var).
    ``attrs`` is the typed attribute record of the layer's kind (:data:`ATTRS_FOR_KIND`; ``None`` for
    kinds whose cost needs only the shapes). ``needs_input_grad`` is False when every activation input
    is a graph input, so backward computes no input gradient.

    Raises ``TypeError`` when ``attrs`` is not a record the kind accepts (an importer bug, caught at
    construction rather than as a missing key in the cost code).
    """

    name: str
    op_type: str
    kind: OpKind
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    weights: tuple[Tensor, ...] = ()
    buffers: tuple[Tensor, ...] = ()
    attrs: LayerAttrs = None
    needs_input_grad: bool = True

    def __post_init__(self) -> None:
        allowed = ATTRS_FOR_KIND.get(self.kind, (type(None),))
        if not isinstance(self.attrs, allowed):
            names = ", ".join(t.__name__ for t in allowed)
            raise TypeError(f"layer {self.name!r} of kind {self.kind.value} needs attrs of type {names}, "
                            f"got {type(self.attrs).__name__}")

    @property
    def params(self) -> int:
        """Trainable parameter count (elements of ``weights``)."""
        return sum(w.numel for w in self.weights)

    @property
    def activation(self) -> str:
        """Lower-case name of the activation fused after the layer, ``"none"`` when there is none."""
        a = self.attrs
        return a.activation.lower() if isinstance(a, ConvAttrs | GemmAttrs) else "none"

    @property
    def group(self) -> int:
        """Convolution groups (1 for every other kind)."""
        return self.attrs.group if isinstance(self.attrs, ConvAttrs) else 1


EVAL_EXPORT_WARNING = "eval-mode export"
"""Prefix of the :attr:`Graph.warnings` an importer writes for a graph exported in inference mode
(BatchNormalization folded or in eval mode); the API shows them for training requests only."""


@dataclass(frozen=True, slots=True)
class Graph:
    """An imported network at one concrete binding of its symbolic dimensions.

    ``batch_size`` is the batch the shapes were resolved for; ``dims`` maps every symbolic dimension
    name of the source to the value it was bound to. ``shared_weights`` lists weight tensors used by
    more than one layer (tied embeddings): they are counted once in :func:`Graph.params`.
    """

    name: str
    layers: tuple[Layer, ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    batch_size: int
    dims: Mapping[str, int] = field(default_factory=dict)
    source_format: str = "onnx"
    opset: int | None = None
    warnings: tuple[str, ...] = ()
    shared_weights: tuple[str, ...] = ()

    @property
    def params(self) -> int:
        """Trainable parameters of the whole graph, each distinct weight tensor counted once."""
        seen: dict[str, int] = {}
        for layer in self.layers:
            for w in layer.weights:
                seen.setdefault(w.name, w.numel)
        return sum(seen.values())
