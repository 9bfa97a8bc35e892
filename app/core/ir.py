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
from typing import Any


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
class Layer:
    """One compute node of the network.

    ``inputs`` are the activations the layer reads (data path); ``weights`` are its trainable
    parameters (e.g. Conv ``W`` of shape ``(C_out, C_in/groups, *kernel)`` and bias ``(C_out,)``);
    ``buffers`` hold non-trainable state read by the layer (BatchNorm running mean/var).
    ``attrs`` keep the op attributes that cost formulas need (``kernel_shape``, ``strides``,
    ``pads``, ``dilations``, ``group``, ``activation``...).
    """

    name: str
    op_type: str
    kind: OpKind
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    weights: tuple[Tensor, ...] = ()
    buffers: tuple[Tensor, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> int:
        """Trainable parameter count (elements of ``weights``)."""
        return sum(w.numel for w in self.weights)


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
