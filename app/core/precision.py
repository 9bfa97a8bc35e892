"""Precision semantics and the physics floor of a layer: the peak each op may use, the bytes it moves.

A request's precision is a *framework mode*, not a dtype (DESIGN.md, "Decisions added after measuring the
first version"); the semantics are those of PyTorch's defaults:

* ``fp32``: fp32 tensors with PyTorch's default flags. Matmuls (``torch.backends.cuda.matmul.allow_tf32``
  is False by default since PyTorch 1.12) run in strict fp32; cuDNN convolutions (and cuDNN RNNs, which
  read the same ``torch.backends.cudnn.allow_tf32`` flag, True by default) may run on TF32 tensor cores on
  devices that have them (Ampere and newer).
* ``fp32-strict``: fp32 everywhere, no tensor cores.
* ``tf32``: matmuls and convolutions on TF32 tensor cores (both flags on; the NGC-container default).
  Needs a device with TF32 tensor cores.
* ``fp16`` / ``bf16``: ``torch.autocast`` mixed precision. Matmul/conv/RNN/attention run at that type's
  (tensor-core) peak; activations and the 16-bit weight copies the kernels read take 2 bytes per element;
  the master weights, their gradients and the optimizer state stay fp32 (4 bytes per parameter).
  Element-wise, normalisation and reduction kernels keep 16-bit storage but compute in fp32 (PyTorch's
  ``opmath_t`` is ``float`` for Half and BFloat16), so they use the fp32 vector peak.

Only MAC-class ops (:data:`TENSOR_CORE_KINDS`) may use tensor cores. A MAC-class op may always fall back to
fp32 arithmetic (cuBLAS ``CUBLAS_COMPUTE_32F`` with 16-bit inputs), so its peak is the larger of the
type's rate and the fp32 rate: on a GTX 1080 Ti, whose native fp16 rate is 1/64 of fp32, an autocast GEMM
runs at the fp32 rate, not 64x slower. A precision the device lacks (no ``tf32`` peak before Ampere, no
``bf16`` peak on Volta/Turing/Pascal, no ``fp16`` peak on Kepler/Maxwell) raises
:class:`PrecisionNotSupported` (HTTP 422 ``precision_not_supported``): never a silent fp32 answer.

The floor (:func:`physics_floor_ms`) is the roofline bound (Williams et al. 2009) with the FLOPs of the
cheapest algorithm the library may pick (:func:`min_algorithm_flops_factor`): no kernel can beat it, so
every served time is clamped to it and the learned model predicts how far above it a layer lands.

Pure: no I/O, no torch, no web.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from app.core.costs import LayerCost, layer_cost, optimizer_update_cost
from app.core.hardware import HardwareSpec
from app.core.ir import BYTES_PER_ELEMENT, ConvAttrs, Layer, OpKind, Tensor
from app.core.vocab import Pass


class Precision(StrEnum):
    """Precision mode of a request (see module docstring for the semantics of each)."""

    FP32 = "fp32"
    FP32_STRICT = "fp32-strict"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"


PRECISION_SEMANTICS: Mapping[Precision, str] = {
    Precision.FP32: (
        "fp32 as PyTorch runs it by default: matmuls in strict fp32 (torch.backends.cuda.matmul.allow_tf32="
        "False), cuDNN convolutions and RNNs on TF32 tensor cores where the device has them "
        "(torch.backends.cudnn.allow_tf32=True); 4-byte activations and weights"
    ),
    Precision.FP32_STRICT: "strict fp32 everywhere, no tensor cores; 4-byte activations and weights",
    Precision.TF32: (
        "fp32 storage with matmuls and convolutions on TF32 tensor cores (both allow_tf32 flags on, the NGC "
        "container default); 4-byte activations and weights"
    ),
    Precision.FP16: (
        "torch.autocast(float16) mixed precision: matmul/conv/RNN/attention at the device's fp16 peak "
        "(tensor cores; where its fp16 rate is below its fp32 rate, e.g. GP102's 1/64-rate fp16, at the "
        "fp32 peak: the library computes in fp32), "
        "2-byte activations and weight copies, element-wise math in fp32 registers, fp32 master weights, "
        "gradients of the master weights and optimizer state (in inference, weights the graph stores in 16 "
        "bits are used as stored: no copy, no cast when already in this type)"
    ),
    Precision.BF16: (
        "torch.autocast(bfloat16) mixed precision: matmul/conv/RNN/attention at the device's bf16 peak "
        "(tensor cores; where its bf16 rate is below its fp32 rate, e.g. GP102's 1/64-rate fp16, at the "
        "fp32 peak: the library computes in fp32), "
        "2-byte activations and weight copies, element-wise math in fp32 registers, fp32 master weights, "
        "gradients of the master weights and optimizer state (in inference, weights the graph stores in 16 "
        "bits are used as stored: no copy, no cast when already in this type)"
    ),
}

# Ops whose arithmetic is matrix products and may run on tensor cores.
TENSOR_CORE_KINDS = frozenset(
    {OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM, OpKind.MATMUL, OpKind.RECURRENT, OpKind.ATTENTION}
)
# Of those, the ones cuDNN runs (torch.backends.cudnn.allow_tf32 applies): TF32 under plain ``fp32``.
CUDNN_KINDS = frozenset({OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.RECURRENT})


#: The 16-bit type ``torch.autocast`` computes in, per precision.
AUTOCAST_DTYPES: Mapping[str, str] = {"fp16": "float16", "bf16": "bfloat16"}
#: Floating types autocast casts to its 16-bit type (never float64: ``cached_cast`` skips double tensors).
_CASTABLE_DTYPES = frozenset({"float32", "float16", "bfloat16"})
#: DRAM bytes per parameter of the cast of an fp32 weight to 16 bits (``aten::_to_copy``): 4 read, 2 written.
AUTOCAST_FP32_CAST_BYTES = 6


def autocast_cast_bytes(layer: Layer, precision: str, *, training: bool) -> int:
    """DRAM bytes ``torch.autocast`` moves casting ``layer``'s weights to 16 bits for one forward under ``precision``
    (fp16/bf16; 0 under other precisions), for the weights of a conv, GEMM, matmul, recurrent or attention layer
    (:data:`TENSOR_CORE_KINDS`, autocast's lower-precision op list; norms and embeddings run on their own weights):
    each weight read in its stored type and written in 16 bits.

    Training: mixed precision trains fp32 master weights (``GradScaler`` refuses 16-bit gradients), so every
    floating weight is cast from fp32, 6 bytes per parameter, whatever the graph stores. Inference: each weight as
    the graph stores it; ``cached_cast`` (aten/src/ATen/autocast_mode.h) casts a floating, non-double tensor whose
    type differs from autocast's, so a weight already in that type (a model held in fp16, as LLM inference servers
    hold it) costs nothing, an fp32 one 4 + 2 bytes, a bf16 one under fp16 2 + 2."""
    target = AUTOCAST_DTYPES.get(str(precision))
    if target is None or layer.kind not in TENSOR_CORE_KINDS:
        return 0
    if training:
        return sum(w.numel for w in layer.weights if w.dtype in _CASTABLE_DTYPES) * AUTOCAST_FP32_CAST_BYTES
    return sum(w.numel * (BYTES_PER_ELEMENT[w.dtype] + 2) for w in layer.weights
               if w.dtype in _CASTABLE_DTYPES and w.dtype != target)


# The catalog peak each precision needs the device to list (None: fp32, always present).
_REQUIRED_PEAK: Mapping[Precision, str | None] = {
    Precision.FP32: None,
    Precision.FP32_STRICT: None,
    Precision.TF32: "tf32",
    Precision.FP16: "fp16",
    Precision.BF16: "bf16",
}
_FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
# Master weights, their gradients and optimizer state are fp32 under every precision (autocast keeps fp32
# parameters; the gradient flowing back through the autocast cast is fp32).
UPDATE_BYTES_PER_PARAM = 4

# Winograd minimal filtering (Lavin & Gray 2016, "Fast Algorithms for Convolutional Neural Networks", CVPR,
# Table 1 / Sec. 4): F(m x m, 3 x 3) needs (m+2)^2 multiplies per m x m output tile instead of 9 m^2;
# F(2x2,3x3) saves 2.25x and F(4x4,3x3) 4x. cuDNN ships both (CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD /
# _WINOGRAD_NONFUSED, also for backward data and filter), so a 3x3, stride-1, dilation-1, non-grouped
# convolution may run with 4x fewer multiplies than the direct convolution. The transforms' additions are
# not counted: the floor stays a lower bound.
WINOGRAD_3X3_FLOPS_FACTOR = 4.0


class PrecisionNotSupported(ValueError):
    """The device lacks the arithmetic the requested precision needs (no peak listed for it).

    ``hardware_id``, ``precision`` and ``missing_peak`` say which; ``code`` is the machine-readable code
    the API renders (HTTP 422).
    """

    code = "precision_not_supported"

    def __init__(self, *, hardware_id: str, precision: Precision, missing_peak: str,
                 supported: tuple[Precision, ...] = (Precision.FP32, Precision.FP32_STRICT)) -> None:
        self.hardware_id = hardware_id
        self.precision = precision
        self.missing_peak = missing_peak
        self.supported = supported
        alternatives = ", ".join(repr(s.value) for s in supported)
        super().__init__(
            f"hardware {hardware_id!r} has no {missing_peak} arithmetic (no '{missing_peak}' peak in its spec), "
            f"so precision {precision.value!r} cannot run on it; it supports {alternatives}"
        )


@dataclass(frozen=True, slots=True)
class OpPrecision:
    """How one op kind runs under one precision on one device.

    ``math`` is the catalog key of the rate used (``fp32``/``tf32``/``fp16``/``bf16``);
    ``peak_flops_per_s`` that rate (FLOP/s, dense, never below the fp32 rate for MAC-class ops);
    ``activation_bytes`` / ``weight_bytes`` bytes per element of the activations and of the weights as the
    kernel reads them; ``update_bytes_per_param`` bytes per element of master weights, gradients and
    optimizer state touched by the update.
    """

    math: str
    peak_flops_per_s: float
    tensor_cores: bool
    activation_bytes: int
    weight_bytes: int
    update_bytes_per_param: int = UPDATE_BYTES_PER_PARAM


def check_precision(hw: HardwareSpec, precision: Precision | str) -> Precision:
    """Validate that ``hw`` can run ``precision``; returns it as a :class:`Precision`.

    Raises ``ValueError`` for an unknown precision string and :class:`PrecisionNotSupported` when the
    device lists no peak for the arithmetic the precision needs (``tf32``, ``fp16`` or ``bf16``).
    """
    p = Precision(precision)
    need = _REQUIRED_PEAK[p]
    if need is not None and need not in hw.peak_flops_per_s:
        supported = tuple(q for q in Precision if _REQUIRED_PEAK[q] is None or _REQUIRED_PEAK[q] in hw.peak_flops_per_s)
        raise PrecisionNotSupported(hardware_id=hw.id, precision=p, missing_peak=need, supported=supported)
    return p


def activation_bytes_per_element(precision: Precision | str) -> int:
    """Bytes per activation element under ``precision``: 2 for fp16/bf16 autocast, else 4."""
    return 2 if Precision(precision) in (Precision.FP16, Precision.BF16) else 4


def storage_precision(precision: Precision | str) -> str:
    """The storage type of activations and weight copies: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (fp32,
    fp32-strict and tf32 all store fp32). This is the key :func:`app.core.memory.footprint` takes."""
    p = Precision(precision)
    return p.value if p in (Precision.FP16, Precision.BF16) else "fp32"


def op_precision(hw: HardwareSpec, precision: Precision | str, kind: OpKind) -> OpPrecision:
    """The compute peak and bytes per element an op of ``kind`` may use under ``precision`` on ``hw``.

    Rules (module docstring): non-MAC ops use the fp32 vector peak; MAC-class ops use fp32 under
    ``fp32-strict``, TF32 for cuDNN ops under ``fp32`` where the device lists a ``tf32`` peak, TF32 under
    ``tf32``, and the fp16/bf16 peak under autocast; a MAC-class op's peak is never below the fp32 rate.
    Raises :class:`PrecisionNotSupported` like :func:`check_precision`, ``KeyError`` when ``hw`` has no
    ``fp32`` peak.
    """
    p = check_precision(hw, precision)
    peaks = hw.peak_flops_per_s
    fp32 = float(peaks["fp32"])
    act = activation_bytes_per_element(p)
    math = "fp32"
    if kind in TENSOR_CORE_KINDS:
        if p is Precision.TF32 or (p is Precision.FP32 and kind in CUDNN_KINDS and "tf32" in peaks):
            math = "tf32"
        elif p in (Precision.FP16, Precision.BF16):
            math = p.value
    rate = float(peaks[math]) if math != "fp32" else fp32
    if rate < fp32:  # the library may always compute in fp32 (e.g. fp16 at 1/64 rate on GP102)
        math, rate = "fp32", fp32
    return OpPrecision(
        math=math,
        peak_flops_per_s=rate,
        tensor_cores=math != "fp32",
        activation_bytes=act,
        weight_bytes=act,
    )


def min_algorithm_flops_factor(layer: Layer) -> float:
    """How many times fewer FLOPs than the direct algorithm the cheapest library algorithm may need (≥ 1).

    4.0 (:data:`WINOGRAD_3X3_FLOPS_FACTOR`, Winograd F(4x4,3x3), Lavin & Gray 2016) for a 2-D convolution
    (or transposed convolution) with a 3x3 kernel, stride 1, dilation 1 and one group; 1.0 for everything
    else. Applies to forward and both backward products (cuDNN has Winograd for all three).
    """
    a = layer.attrs
    if layer.kind not in (OpKind.CONV, OpKind.CONV_TRANSPOSE) or not isinstance(a, ConvAttrs):
        return 1.0
    if tuple(a.kernel_shape) != (3, 3) or a.group != 1:
        return 1.0
    if any(s != 1 for s in a.strides) or any(d != 1 for d in a.dilations):
        return 1.0
    return WINOGRAD_3X3_FLOPS_FACTOR


def _retype(tensors: tuple[Tensor, ...], dtype: str) -> tuple[Tensor, ...]:
    return tuple(replace(t, dtype=dtype) if t.dtype in _FLOAT_DTYPES and t.dtype != dtype else t for t in tensors)


def cost_at_precision(layer: Layer, cost: LayerCost, precision: Precision | str) -> LayerCost:
    """``cost`` with its bytes recomputed for the storage types of ``precision``.

    Float activations (inputs, outputs) and weights take :func:`activation_bytes_per_element` bytes (fp32
    for fp32/fp32-strict/tf32, 16-bit under autocast, whatever the graph's dtype); integer tensors (indices,
    masks) and buffers (BatchNorm running statistics, fp32 under autocast) keep theirs. FLOPs are those of
    ``cost``. Returns ``cost`` itself when nothing changes. Under autocast, ops that PyTorch upcasts
    (softmax, layer_norm) are also taken at 16-bit traffic, which fused kernels achieve: optimistic, so a
    floor built on it stays a lower bound.
    """
    dtype = "float32" if activation_bytes_per_element(precision) == 4 else (
        "bfloat16" if Precision(precision) is Precision.BF16 else "float16")
    retyped = replace(
        layer,
        inputs=_retype(layer.inputs, dtype),
        outputs=_retype(layer.outputs, dtype),
        weights=_retype(layer.weights, dtype),
    )
    if retyped == layer:
        return cost
    rebytes = layer_cost(retyped)
    return replace(
        cost,
        forward_bytes_read=rebytes.forward_bytes_read,
        forward_bytes_written=rebytes.forward_bytes_written,
        backward_bytes_read=rebytes.backward_bytes_read,
        backward_bytes_written=rebytes.backward_bytes_written,
        saved_activation_bytes=rebytes.saved_activation_bytes,
    )


@dataclass(frozen=True, slots=True)
class PassWork:
    """Work of one pass at a precision: minimal FLOPs, DRAM bytes, and the peak that applies (FLOP/s)."""

    flops_min: float
    bytes_: float
    peak_flops_per_s: float


def pass_work(
    layer: Layer,
    cost: LayerCost,
    hw: HardwareSpec,
    precision: Precision | str,
    pass_: Pass | str,
    *,
    optimizer: str = "none",
    rescaled: LayerCost | None = None,
) -> PassWork:
    """Minimal FLOPs, bytes and peak of one pass of ``layer`` (see :func:`physics_floor_ms`).

    ``rescaled`` may pass ``cost_at_precision(layer, cost, precision)`` when the caller already has it.

    ``cost`` is ``layer_cost(layer)`` (bytes at the graph's dtypes; rescaled here to ``precision``). An
    inference ``forward`` of a dropout layer is the identity (``nn.Dropout`` in eval mode): 0 FLOPs, 0 bytes,
    floor 0 (``train_forward`` keeps the mask draw and scaling). The
    update pass is the optimizer step over the layer's parameters in fp32 (master weights) and runs at
    the fp32 vector peak; ``optimizer`` is a key of :data:`app.core.costs.OPTIMIZERS`.
    Raises :class:`PrecisionNotSupported`, ``ValueError`` for an unknown pass, ``train_step`` (several
    peaks: :func:`physics_floor_ms` sums its passes), ``backward_input``/``backward_weight`` or an unsupported
    cost, ``KeyError`` for an unknown optimizer.
    """
    if not cost.supported:
        raise ValueError(f"layer {cost.name!r} ({cost.op_type}) has no cost formula; it has no floor")
    p = Pass(pass_)
    if p is Pass.TRAIN_STEP:
        raise ValueError("a training step runs at several peaks; take the sum of its passes (physics_floor_ms)")
    if p is Pass.UPDATE:
        op = op_precision(hw, precision, OpKind.ELEMENTWISE)
        upd_flops, upd_bytes = optimizer_update_cost(
            cost.params, optimizer, bytes_per_param=op.update_bytes_per_param)
        return PassWork(float(upd_flops), float(upd_bytes), op.peak_flops_per_s)
    if p in (Pass.BACKWARD_INPUT, Pass.BACKWARD_WEIGHT):
        raise ValueError(f"pass {p.value!r} has no byte split in the cost model; use 'backward'")
    op = op_precision(hw, precision, layer.kind)
    if layer.kind is OpKind.DROPOUT and p is Pass.FORWARD:
        # an inference forward runs dropout as the identity (nn.Dropout in eval mode returns its input,
        # no kernel runs): no FLOPs, no bytes. ``train_forward`` draws the mask and scales, and pays.
        return PassWork(0.0, 0.0, op.peak_flops_per_s)
    c = rescaled if rescaled is not None else cost_at_precision(layer, cost, precision)
    factor = min_algorithm_flops_factor(layer)
    if p in (Pass.FORWARD, Pass.TRAIN_FORWARD):
        mac_flops = 2.0 * c.forward_macs
        flops = mac_flops / factor + (c.forward_flops - mac_flops)
        return PassWork(max(flops, 0.0), float(c.forward_bytes), op.peak_flops_per_s)
    return PassWork(c.backward_flops / factor, float(c.backward_bytes), op.peak_flops_per_s)


def physics_floor_ms(
    layer: Layer,
    cost: LayerCost,
    hw: HardwareSpec,
    precision: Precision | str,
    pass_: Pass | str,
    *,
    optimizer: str = "none",
) -> float:
    """The time no kernel can beat, ms: ``max(FLOPs_min / peak_at_precision, bytes_at_precision / bandwidth)``.

    ``FLOPs_min`` is the FLOPs of the cheapest algorithm the library may pick
    (:func:`min_algorithm_flops_factor`), ``peak_at_precision`` the rate the op may use
    (:func:`op_precision`), ``bytes_at_precision`` its DRAM traffic with the storage types of the precision
    (:func:`cost_at_precision`), ``bandwidth`` the datasheet DRAM bandwidth. ``pass_`` (a
    :class:`app.core.vocab.Pass`) is ``forward``/``train_forward``, ``backward``, ``update`` (the optimizer
    step of the layer's parameters, ``optimizer``; 0 for ``"none"``) or ``train_step`` (the sum of the
    three; ``backward_input``/``backward_weight`` raise ``ValueError``: no byte split).
    Roofline: Williams, Waterman & Patterson 2009 (CACM 52(4)). Errors as :func:`pass_work`.
    """
    if Pass(pass_) is Pass.TRAIN_STEP:  # the passes run one after the other: the step's floor is their sum
        return sum(physics_floor_ms(layer, cost, hw, precision, p, optimizer=optimizer)
                   for p in (Pass.TRAIN_FORWARD, Pass.BACKWARD, Pass.UPDATE))
    return _floor_ms(pass_work(layer, cost, hw, precision, pass_, optimizer=optimizer), hw)


def _floor_ms(w: PassWork, hw: HardwareSpec) -> float:
    return max(w.flops_min / w.peak_flops_per_s, w.bytes_ / hw.memory_bandwidth_bytes_per_s) * 1e3



def floors_by_pass_ms(
    layer: Layer,
    cost: LayerCost,
    hw: HardwareSpec,
    precision: Precision | str,
    *,
    training: bool,
    optimizer: str = "none",
) -> tuple[float, float, float]:
    """``(forward, backward, update)`` physics floors in ms (:func:`physics_floor_ms` of each pass), the
    bytes rescaled to the precision once; backward and update are 0 when not ``training``, whose forward is
    the training forward (``train_forward``: dropout draws its mask; inference dropout is the identity)."""
    rescaled = cost_at_precision(layer, cost, precision)

    def floor(p: Pass) -> float:
        return _floor_ms(pass_work(layer, cost, hw, precision, p, optimizer=optimizer, rescaled=rescaled), hw)

    if not training:
        return floor(Pass.FORWARD), 0.0, 0.0
    return floor(Pass.TRAIN_FORWARD), floor(Pass.BACKWARD), floor(Pass.UPDATE)
