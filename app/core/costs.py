"""Analytical cost of one layer: FLOPs and MACs, parameters, bytes moved, forward/backward split.

Conventions (stated once, used everywhere):

* **MACs** count multiply-accumulates of the MAC-class ops (Conv, ConvTranspose, Gemm, MatMul,
  recurrent cells); **FLOPs = 2 × MACs** for them. A bias add is *not* counted, which is the convention
  of ``torch.utils.flop_counter.FlopCounterMode`` and fvcore (it is < 0.1 % of a conv's work).
* Non-MAC ops (norms, activations, elementwise, pooling, softmax, reductions) have ``macs == 0`` and a
  per-element FLOP count from :data:`ACTIVATION_FLOPS_PER_ELEMENT` and the formulas below. Those
  constants follow Paleo (Qi et al., ICLR 2017) and fvcore's per-element handlers; the oracle
  ``FlopCounterMode`` ignores these ops, so they are reported separately in ``forward_flops`` but can be
  summed over MAC-class layers only to compare with it.
* **Backward** of a MAC-class op is two products of the forward's size: the input gradient
  (skipped when the layer's input is a graph input, which needs no gradient) and the weight gradient;
  so ``backward_flops`` is 2 × forward for an inner layer (Justus et al. 2018; Hestness et al. 2019).
* **Bytes** are the unfused DRAM traffic of the op in isolation: every input, weight and buffer read
  once, every output written once (the roofline model's assumption, Williams et al. 2009). Backward reads
  the output gradient, the saved input and the weights, and writes the input and weight gradients.
* Data-movement ops (Concat, Reshape, Transpose, ...) cost 0 FLOPs and are counted as bytes moved.
  Reshape/Flatten/Squeeze/Unsqueeze/Identity are metadata-only views in every framework: 0 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2, prod

import numpy as np

from app.core.ir import (
    AttentionAttrs,
    ConvAttrs,
    EinsumAttrs,
    GemmAttrs,
    Layer,
    LrnAttrs,
    OpKind,
    PoolAttrs,
    RecurrentAttrs,
    TopKAttrs,
)

# FLOPs per output element of an activation, forward. Relu = 1 compare; Sigmoid = exp + add + div (+neg);
# Tanh ≈ 5; GELU (erf form) ≈ 8; SiLU = sigmoid + mul. Source: fvcore per-element handlers / Paleo.
ACTIVATION_FLOPS_PER_ELEMENT: dict[str, float] = {
    "Relu": 1, "LeakyRelu": 2, "PRelu": 2, "Clip": 2, "Elu": 3, "Selu": 4, "Sigmoid": 4,
    "HardSigmoid": 3, "HardSwish": 4, "Tanh": 5, "Softplus": 3, "Gelu": 8, "Erf": 4, "SiLU": 5,
    "Swish": 5, "Mish": 9, "Exp": 1, "Log": 1, "Sqrt": 1, "Reciprocal": 1, "Neg": 1, "Abs": 1,
    "Cast": 0, "Pow": 1, "Softsign": 3,
}

# FLOPs per output element of fused element-wise kernels whose inputs are not one operand per FLOP (the
# default, n inputs -> n - 1 FLOPs per output, counts SiLU-and-mul as 1 and RoPE's auxiliary cos/sin and
# position inputs as FLOPs). SiluAndMul: SiLU(gate) x up = SiLU (5) + mul (1) per output (vLLM/sarathi
# ``silu_and_mul``). Rope: rotate each (x1, x2) pair by (cos, sin): x1·cos - x2·sin, x2·cos + x1·sin = 2 mul +
# 1 add per output element (vLLM ``rotary_embedding``).
FUSED_ELEMENTWISE_FLOPS_PER_OUTPUT: dict[str, float] = {"SiluAndMul": ACTIVATION_FLOPS_PER_ELEMENT["SiLU"] + 1,
                                                        "Rope": 3}

# Tensors the size of the output sequence a recurrent layer saves for backward (gates and states).
_RECURRENT_SAVED_PER_OUTPUT: dict[str, int] = {"LSTM": 6, "GRU": 5, "RNN": 1}

# Ops whose output is integer (indices): no gradient flows back through them.
NON_DIFFERENTIABLE_OPS = frozenset({"ArgMax", "ArgMin"})

# Views that frameworks implement without copying memory (0 bytes moved).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})

# Per-parameter cost of one optimizer step in fp32: (FLOPs, state tensors the size of the weights).
# SGD: w -= lr*g (2 FLOPs). Momentum: v = mu*v + g; w -= lr*v (4). Adam/AdamW: two moment updates,
# bias correction, sqrt, divide, update, (decay) ≈ 12 FLOPs (PyTorch's foreach implementation).
OPTIMIZERS: dict[str, tuple[int, int]] = {
    "none": (0, 0),
    "sgd": (2, 0),
    "momentum": (4, 1),
    "nesterov": (5, 1),
    "adagrad": (5, 1),
    "adadelta": (9, 2),
    "rmsprop": (6, 1),
    "adam": (12, 2),
    "adamw": (13, 2),
}


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Analytical cost of one layer for one forward and one backward pass at the graph's batch size.

    All counts are totals for the whole batch. ``operational_intensity`` is FLOPs per byte moved
    (forward). ``supported`` is False when no formula exists for the op: every count is then 0 and the
    layer must be reported as unsupported, never summed as a zero-cost layer.
    """

    name: str
    op_type: str
    kind: OpKind
    supported: bool
    forward_macs: int
    forward_flops: int
    backward_input_flops: int
    backward_weight_flops: int
    params: int
    forward_bytes_read: int
    forward_bytes_written: int
    backward_bytes_read: int
    backward_bytes_written: int
    saved_activation_bytes: int

    @property
    def backward_flops(self) -> int:
        """Input-gradient plus weight-gradient FLOPs."""
        return self.backward_input_flops + self.backward_weight_flops

    @property
    def forward_bytes(self) -> int:
        """Forward DRAM traffic: bytes read plus bytes written."""
        return self.forward_bytes_read + self.forward_bytes_written

    @property
    def backward_bytes(self) -> int:
        """Backward DRAM traffic: bytes read plus bytes written."""
        return self.backward_bytes_read + self.backward_bytes_written

    @property
    def operational_intensity(self) -> float:
        """Forward FLOPs per byte moved (0.0 for pure data movement)."""
        b = self.forward_bytes
        return self.forward_flops / b if b else 0.0


def _sum_bytes(tensors: tuple) -> int:
    return sum(t.nbytes for t in tensors)


def einsum_macs(equation: str, shapes: tuple[tuple[int, ...], ...]) -> int | None:
    """MACs of a two-operand ``Einsum``: the product of the sizes of all distinct subscripts.

    Every output element sums over the contracted subscripts, so the loop nest visits each combination of
    all subscripts once (``bij,bjk->bik`` = b·i·j·k, the batched MatMul). An ellipsis ``...`` stands for the
    leading axes not named by letters; its axes broadcast across operands (numpy rules) and multiply in
    once. Returns None when the equation does not have exactly two operands or does not match the shapes
    (the layer is then listed as unsupported, never costed as zero).
    """
    lhs = equation.replace(" ", "").split("->")[0]
    terms = lhs.split(",")
    if len(terms) != 2 or len(shapes) != 2:
        return None
    sizes: dict[str, int] = {}
    ellipses: list[tuple[int, ...]] = []
    for term, shape in zip(terms, shapes, strict=True):
        if term.count("...") > 1 or ("." in term.replace("...", "")):
            return None
        letters = term.replace("...", "")
        if "..." in term:
            n_ell = len(shape) - len(letters)
            if n_ell < 0:
                return None
            at = term.index("...")
            ellipses.append(tuple(shape[at:at + n_ell]))
            shape = tuple(shape[:at]) + tuple(shape[at + n_ell:])
        if len(letters) != len(shape):
            return None
        for letter, size in zip(letters, shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    try:
        ell = np.broadcast_shapes(*ellipses) if ellipses else ()
    except ValueError:
        return None
    return int(prod(sizes.values())) * int(prod(ell))


def gemm_dims(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], int, int, int]:
    """``(batch, M, N, K)`` of numpy-style ``matmul(a, b)`` (ONNX MatMul semantics).

    A 1-D ``a`` is a row ``(1, K)`` and a 1-D ``b`` a column ``(K, 1)``, so ``(8,) @ (8,)`` is one
    8-long dot product (``M = N = 1``, ``K = 8``). Batch axes broadcast. Raises ``ValueError`` for
    scalars or batch axes that do not broadcast.
    """
    if not a or not b:
        raise ValueError("MatMul operands must have rank ≥ 1")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    batch = tuple(int(d) for d in np.broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2])))
    return batch, int(a2[-2]), int(b2[-1]), int(a2[-1])


def mac_count(layer: Layer) -> int:
    """Multiply-accumulates of a MAC-class layer (0 for others); the one place MACs are computed.

    Conv: ``N · C_out · ∏out_spatial · (C_in/groups) · ∏kernel`` (grouped/depthwise divide by groups
    once, through the filter shape ``(C_out, C_in/groups, *k)``). ConvTranspose: ``N · C_in · ∏in_spatial ·
    (C_out/groups) · ∏kernel``. Gemm/MatMul: ``∏batch · M · N · K``. Einsum: :func:`einsum_macs`.
    Recurrent (LSTM/GRU/RNN, all timesteps and directions): ``seq · batch · dirs · gates · H · (I + H)``,
    the input and recurrent projections; the elementwise gate math is omitted (< 2 % for H ≥ 64; Hestness
    et al. 2019, §4). Attention: projection ``rows · in · out`` plus ``B · Lq · Lk · (qk_width + v_width)``
    for ``Q·Kᵀ`` and ``A·V``.
    """
    a = layer.attrs
    if isinstance(a, ConvAttrs):
        w = a.weight_shape
        if layer.kind is OpKind.CONV_TRANSPOSE:
            return int(prod(layer.inputs[0].shape) * prod(w[1:]))
        return int(prod(layer.outputs[0].shape) * prod(w[1:]))
    if isinstance(a, GemmAttrs):
        return int(prod(a.batch)) * a.m * a.n * a.k
    if isinstance(a, EinsumAttrs):
        return einsum_macs(a.equation, a.operand_shapes) or 0
    if isinstance(a, RecurrentAttrs):
        return a.seq_len * a.batch * a.num_directions * a.gates * a.hidden_size * (a.input_size + a.hidden_size)
    if isinstance(a, AttentionAttrs):
        return _attention_proj_macs(a) + a.batch * a.q_len * a.kv_len * (a.qk_width + a.v_width)
    return 0


def _attention_proj_macs(a: AttentionAttrs) -> int:
    return a.proj_rows * a.proj_in * a.proj_out


def _elementwise_flops(layer: Layer) -> float:
    """Forward FLOPs of a non-MAC op from per-element constants (see module docstring).

    TopK selects ``k`` of ``n`` elements per row with a heap: ``n · ⌈log₂ k⌉`` comparisons (at least one
    per element); ArgMax/ArgMin and reductions one per input element; CumSum one add per element.
    """
    out_numel = sum(t.numel for t in layer.outputs)
    in_numel = sum(t.numel for t in layer.inputs)
    op = layer.op_type
    kind = layer.kind
    attrs = layer.attrs
    if kind is OpKind.ACTIVATION:
        return ACTIVATION_FLOPS_PER_ELEMENT.get(op, 1) * out_numel
    if kind is OpKind.ELEMENTWISE:
        if op in FUSED_ELEMENTWISE_FLOPS_PER_OUTPUT:
            return FUSED_ELEMENTWISE_FLOPS_PER_OUTPUT[op] * out_numel
        n_in = max(len(layer.inputs) + len(layer.weights), 2)
        return (n_in - 1) * out_numel
    if kind is OpKind.BATCHNORM:
        # training-mode BN: mean (1), variance (2), normalize (2), scale+shift (2) per element.
        return 7 * in_numel
    if kind is OpKind.NORM:
        if isinstance(attrs, LrnAttrs):
            return (attrs.size + 3) * in_numel
        return 7 * in_numel
    if kind is OpKind.POOL:
        k = prod(attrs.kernel_shape) if isinstance(attrs, PoolAttrs) else 1
        return k * out_numel
    if isinstance(attrs, TopKAttrs):
        return in_numel * max(1, ceil(log2(max(attrs.k, 1))))
    if kind is OpKind.GLOBAL_POOL or kind is OpKind.REDUCE:
        return in_numel
    if kind is OpKind.SOFTMAX:
        # max, subtract, exp, sum, divide
        return 5 * in_numel
    if kind is OpKind.DROPOUT:
        return 2 * out_numel
    return 0


def layer_cost(layer: Layer) -> LayerCost:
    """Cost of ``layer`` at its resolved shapes.

    Returns a :class:`LayerCost` with totals for the whole batch (see module docstring for conventions).
    An op with :attr:`OpKind.UNSUPPORTED` yields ``supported=False`` and zero counts; callers must list it
    as unsupported. Never raises for a well-formed :class:`Layer`.
    """
    kind = layer.kind
    params = layer.params
    if kind is OpKind.UNSUPPORTED:
        return LayerCost(layer.name, layer.op_type, kind, False, 0, 0, 0, 0, params, 0, 0, 0, 0, 0)

    in_bytes = _sum_bytes(layer.inputs)
    out_bytes = _sum_bytes(layer.outputs)
    w_bytes = _sum_bytes(layer.weights)
    buf_bytes = _sum_bytes(layer.buffers)
    needs_input_grad = layer.needs_input_grad and layer.op_type not in NON_DIFFERENTIABLE_OPS
    attrs = layer.attrs

    macs = mac_count(layer)
    if isinstance(attrs, AttentionAttrs):
        # fused softmax(Q·Kᵀ)·V (+ packed projection for com.microsoft Attention): 2 × MACs of the products
        # plus the softmax (5 FLOPs per score). Backward: dQ, dK, dV, dA are four products of the forward
        # attention size (2 × its forward), softmax backward 1.5 × forward; the projection is a Gemm.
        proj = _attention_proj_macs(attrs)
        scores = attrs.batch * attrs.heads * attrs.q_len * attrs.kv_len
        attn_bwd = 4 * (macs - proj) + int(round(7.5 * scores))
        fwd = 2 * macs + 5 * scores
        if proj:
            b_in = attn_bwd + (2 * proj if needs_input_grad else 0)
            b_w = 2 * proj
        else:
            b_in = attn_bwd if needs_input_grad else 0
            b_w = 0
    elif kind in (OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM, OpKind.MATMUL, OpKind.RECURRENT):
        fwd = 2 * macs
        if kind is OpKind.MATMUL:
            # both operands are activations: two input gradients, no weight gradient
            grads = attrs.grad_operands if isinstance(attrs, GemmAttrs | EinsumAttrs) else (True, True)
            n_grads = sum(1 for t in grads if t)
            b_in = fwd * n_grads if needs_input_grad else 0
            b_w = 0
        else:
            b_in = fwd if needs_input_grad else 0
            b_w = fwd if layer.weights else 0
    elif kind in (OpKind.DATA_MOVEMENT, OpKind.EMBEDDING):
        fwd = 0
        b_in = 0
        b_w = 0
        if kind is OpKind.EMBEDDING:
            # gradient scatter-add into the table: one add per output element
            b_w = sum(t.numel for t in layer.outputs)
    else:
        fwd = int(round(_elementwise_flops(layer)))
        # backward of a pointwise/normalisation op costs about as much as its forward (1-2x); we use 1x
        # for activations/elementwise/pooling and 1.5x for norms/softmax (extra reductions).
        factor = 1.5 if kind in (OpKind.BATCHNORM, OpKind.NORM, OpKind.SOFTMAX) else 1.0
        b_in = int(round(fwd * factor)) if needs_input_grad else 0
        if isinstance(attrs, TopKAttrs):
            # the gradient of the k selected values is scattered into a zero tensor of the input's size
            b_in = layer.outputs[0].numel if needs_input_grad else 0
        b_w = (2 * sum(t.numel for t in layer.outputs)) if layer.weights else 0

    # Bytes moved.
    if layer.op_type in VIEW_OPS:
        f_read = f_write = 0
        bw_read = bw_write = 0
        saved = 0
    elif kind is OpKind.EMBEDDING:
        # reads only the gathered rows (output-sized) plus the indices
        idx_bytes = in_bytes
        f_read = idx_bytes + out_bytes
        f_write = out_bytes
        bw_read = out_bytes + idx_bytes
        bw_write = out_bytes  # scatter into the gradient rows
        saved = idx_bytes
    else:
        f_read = in_bytes + w_bytes + buf_bytes
        f_write = out_bytes
        bw_read = out_bytes + in_bytes + w_bytes  # grad_out, saved input, weights
        bw_write = (in_bytes if needs_input_grad else 0) + w_bytes
        saved = in_bytes if kind not in (OpKind.DATA_MOVEMENT,) else 0
        if kind is OpKind.RECURRENT:
            # autograd keeps every timestep's gates and states: LSTM 4 gates + c + h, GRU 3 gates + h + r·h,
            # RNN h, each the size of the output sequence (T·B·dirs·H); plus the input
            saved = in_bytes + out_bytes * _RECURRENT_SAVED_PER_OUTPUT.get(layer.op_type, 1)
        if kind is OpKind.ATTENTION:
            saved = in_bytes + out_bytes  # flash-style: Q, K, V and the output (scores are recomputed)
        if kind is OpKind.ACTIVATION and layer.op_type == "Relu":
            saved = out_bytes  # Relu saves its output (or a mask) for backward
        if kind is OpKind.DATA_MOVEMENT:
            bw_read = out_bytes
            bw_write = in_bytes if needs_input_grad else 0
        if layer.op_type in NON_DIFFERENTIABLE_OPS:
            bw_read = bw_write = saved = 0

    return LayerCost(
        name=layer.name,
        op_type=layer.op_type,
        kind=kind,
        supported=True,
        forward_macs=macs,
        forward_flops=fwd,
        backward_input_flops=b_in,
        backward_weight_flops=b_w,
        params=params,
        forward_bytes_read=f_read,
        forward_bytes_written=f_write,
        backward_bytes_read=bw_read,
        backward_bytes_written=bw_write,
        saved_activation_bytes=saved,
    )


def optimizer_update_cost(params: int, optimizer: str, *, bytes_per_param: int = 4) -> tuple[int, int]:
    """FLOPs and bytes moved by one optimizer step over ``params`` parameters.

    Bytes: read weights, gradients and each state tensor, write weights and each state tensor (the
    update is a streaming, memory-bound kernel). Per-parameter FLOPs from :data:`OPTIMIZERS`.
    Raises ``KeyError`` for an optimizer not in :data:`OPTIMIZERS`.
    """
    flops_per, states = OPTIMIZERS[optimizer]
    if optimizer == "none":
        return 0, 0
    read = params * bytes_per_param * (2 + states)
    write = params * bytes_per_param * (1 + states)
    return flops_per * params, read + write
