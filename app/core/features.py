"""THE feature function of the learned per-layer runtime predictor (training and serving share it).

One row of features describes one (layer, pass, optimizer, hardware, precision) combination. Numpy only:
the API imports this module, torch never does.

Two steps, each defined exactly once:

1. :func:`raw_quantities` reads a :class:`~app.core.ir.Layer`, its :class:`~app.core.costs.LayerCost`
   and a :class:`~app.core.hardware.HardwareSpec` into a flat vector of physical quantities
   (:data:`RAW_FIELDS`: FLOPs, bytes, geometry, hardware peaks...).
2. :func:`features_from_raw` turns a matrix of those quantities ``[N, len(RAW_FIELDS)]`` into the
   predictor input ``[N, len(FEATURE_NAMES)]`` (float32) with vectorised numpy.

:func:`layer_features` (one row) and :func:`layer_features_batch` (many rows) are both step 1 + step 2,
so training (which featurises the 250k Justus rows through the batched path) and serving compute every
feature with the same code.

Physics anchor (DESIGN.md "Anchor the learned model to physics"): ``log_floor_ms`` is the log physics
floor of the pass (roofline, Williams et al. 2009, at the op's peak for the precision, the cheapest
algorithm's FLOPs and the precision's bytes: :func:`pass_floor_ms`); the v3 model predicts how far above
it a layer lands, so it degrades gracefully on hardware it never saw and is never below it. Hardware
enters only through datasheet figures (peak FLOP/s, bandwidth, memory, SM count, clock, L2) and wave
quantisation, never a device id, for the same reason
(Syed & Srinivasan 2021; Justus et al. 2018 use the same kind of hardware features).

Feature schemas: :data:`FEATURE_NAMES` is every feature this module defines. An artifact stores the
(ordered) subset its model reads in its metadata (``feature_names``) and :func:`select_features` picks
those columns, so older artifacts keep working when features are added (every name keeps its
definition forever; new features are appended): the first 34 are those of the first, conv/gemm GPU
model; the op-kind, grouping, precision and CPU features came with v2; the columns after
``hw_log_l2_cache_bytes`` with v3 (the physics floor at the precision and the op's peak from
:mod:`app.core.precision`, implicit-GEMM tiles and waves over the SMs, the software stack).

Passes: ``"forward"`` is one forward pass; ``"train_step"`` is forward + backward + the optimizer update
of the layer's parameters (the Justus et al. 2018 ``train_step`` measurement). Logs are natural logs of
values clipped below at :data:`LOG_FLOOR` (so zero work gives a finite feature).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from math import prod
from typing import NamedTuple

import numpy as np

from app.core.costs import LayerCost, optimizer_update_cost
from app.core.hardware import HardwareSpec
from app.core.ir import ConvAttrs, GemmAttrs, Layer, OpKind, PoolAttrs, RecurrentAttrs
from app.core.precision import op_precision, physics_floor_ms
from app.core.vocab import SoftwareStack

PASSES: tuple[str, ...] = ("forward", "train_step")

# Activations fused after the layer in the Justus data (``none`` = no activation: all flags 0).
ACTIVATIONS: tuple[str, ...] = ("relu", "tanh", "sigmoid")

# Optimizers measured in the Justus data, in one-hot order (``none`` = forward only: all flags 0).
TRAINED_OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adagrad", "adadelta", "adam", "rmsprop")

# Optimizers of app.core.costs.OPTIMIZERS that were not measured, mapped to the closest measured one
# for the one-hot block (their update cost still uses their own FLOP/state counts). The learned
# predictor flags them out of distribution.
OPTIMIZER_ALIASES: dict[str, str] = {"nesterov": "momentum", "adamw": "adam"}

# Lower clip of every logged value (ms, FLOPs, bytes, counts): keeps log(0) finite.
LOG_FLOOR = 1e-9

# Clock assumed when a HardwareSpec lists neither boost nor base clock (MHz).
DEFAULT_CLOCK_MHZ = 1000.0

# Op kinds with their own one-hot flag after conv/gemm (``is_conv``/``is_gemm`` are the v1 flags).
EXTRA_KINDS: tuple[OpKind, ...] = (
    OpKind.CONV_TRANSPOSE,
    OpKind.MATMUL,
    OpKind.RECURRENT,
    OpKind.ATTENTION,
    OpKind.BATCHNORM,
    OpKind.NORM,
    OpKind.POOL,
    OpKind.GLOBAL_POOL,
    OpKind.ACTIVATION,
    OpKind.ELEMENTWISE,
    OpKind.SOFTMAX,
    OpKind.REDUCE,
    OpKind.DROPOUT,
    OpKind.DATA_MOVEMENT,
    OpKind.EMBEDDING,
)

# Precisions stored in 2 bytes (their own flag; fp32/tf32 are 0).
HALF_PRECISIONS: frozenset[str] = frozenset({"fp16", "bf16"})

#: Software stacks a row may run under (:class:`app.core.vocab.SoftwareStack`); the default is the serving
#: default, PyTorch eager. Two features carry the stack: ``stack_tf1_session`` (a TensorFlow 1.x
#: ``session.run`` per iteration, Justus et al. 2018: ~0.25 ms floor) and ``stack_kernel_time`` (the time
#: has no launch gaps: CUDA-graph replays, library kernels queued back to back from C++ with no framework
#: between them (:data:`NO_LAUNCH_GAP_STACKS`), or measurements that sum kernel durations, as Vidur's Kineto
#: sums do, ``launch_gaps=False``).
STACKS: tuple[str, ...] = tuple(s.value for s in SoftwareStack)
#: Stacks whose kernels run back to back on the GPU (``stack_kernel_time`` = 1): a CUDA-graph replay, and a
#: vendor library called from C++ (``cuda-library``: DeepBench queues its repetitions asynchronously, with no
#: framework dispatch between them, so the learned per-launch overhead of eager PyTorch does not apply; the
#: stack's own per-kernel floor, ``KERNEL_FLOOR_MS_BY_STACK``, still does). Featurised as an eager PyTorch call,
#: DeepBench's held-out fp32 kernels came out 1.81x too slow at the median, 1.31x without the launch gaps
#: (scripts/served_kernels.py).
NO_LAUNCH_GAP_STACKS: frozenset[str] = frozenset({SoftwareStack.PYTORCH_CUDA_GRAPH.value,
                                                  SoftwareStack.CUDA_LIBRARY.value})
DEFAULT_STACK: str = SoftwareStack.PYTORCH_EAGER.value

#: Output tile of a GEMM thread block used for wave quantisation (Habitat, Yu et al. ATC 2021; NeuSight,
#: Lee et al. ASPLOS 2025 tile a GEMM's output into blocks and count waves of blocks over the SMs).
GEMM_TILE = 128
#: Elements per thread block of a memory-bound (elementwise, norm, softmax) kernel for the same count:
#: 128 threads x 4 vectorised elements, PyTorch's ``vectorized_elementwise_kernel`` launch.
ELEMENTWISE_TILE = 512
#: Smaller output tile for the second wave count (v4): cuBLAS/cuDNN pick 32-64 wide tiles for skinny GEMMs
#: (NeuSight's data: ``sgemm_32x32_sliced1x4``, ``sgemm_64x32``, ``128x32``); with both counts the model can
#: see whether a GEMM fills the GPU at either tile size.
GEMM_TILE_SMALL = 64

RAW_FIELDS: tuple[str, ...] = (
    "is_conv",  # 1 for OpKind.CONV
    "is_gemm",  # 1 for OpKind.GEMM
    "batch",  # samples (conv: N; gemm: product of the leading dims of the input)
    "pass_flops",  # FLOPs of the pass: forward (+ backward + optimizer update for train_step)
    "pass_bytes",  # DRAM bytes of the pass, same composition
    "update_bytes",  # bytes of the optimizer update (0 for forward)
    "forward_flops",  # forward FLOPs alone
    "params",  # trainable parameters
    "kernel",  # geometric mean of the kernel sides (1 for gemm)
    "stride",  # geometric mean of the strides (1 for gemm)
    "c_in",  # input channels (gemm: in_features)
    "c_out",  # output channels (gemm: out_features)
    "in_spatial",  # input spatial elements per channel and sample (1 for gemm)
    "out_spatial",  # output spatial elements per channel and sample (1 for gemm)
    "has_bias",  # 1 when the layer has a bias weight
    *(f"act_{a}" for a in ACTIVATIONS),
    "is_train",  # 1 for train_step
    *(f"opt_{o}" for o in TRAINED_OPTIMIZERS),
    "peak_flops_per_s",  # HardwareSpec.peak_for(precision)
    "bandwidth_bytes_per_s",
    "memory_bytes",
    "compute_units",
    "clock_mhz",  # boost clock, else base clock, else DEFAULT_CLOCK_MHZ
    # --- added after v1 (multi-op, CPU) ---
    *(f"is_{k.value}" for k in EXTRA_KINDS),
    "groups",  # conv groups (1 otherwise)
    "seq_len",  # recurrent: time steps; matmul: rows M of the left operand; 1 otherwise
    "in_elems",  # elements of all activation inputs
    "out_elems",  # elements of all outputs
    "needs_input_grad",  # 1 when backward computes the input gradient (inner layer)
    "is_half",  # precision in HALF_PRECISIONS
    "is_cpu",  # HardwareSpec.kind == "cpu"
    "l2_cache_bytes",  # HardwareSpec.l2_cache_bytes (0 when unknown)
    # --- added for v3 (efficiency over the physics floor) ---
    "op_peak_flops_per_s",  # peak this op may use at the precision (app.core.precision.op_precision)
    "floor_ms",  # physics floor of the pass in ms (pass_floor_ms)
    "gemm_batch",  # implicit-GEMM view of the op (gemm_dims()): independent products
    "gemm_m",  # rows of the output
    "gemm_n",  # columns of the output
    "gemm_k",  # reduction length
    "stack_tf1_session",  # 1 under a TensorFlow 1.x session
    "stack_kernel_time",  # 1 when the time has no launch gaps (NO_LAUNCH_GAP_STACKS; Kineto kernel sums)
    "fp32_peak_flops_per_s",  # the device's fp32 (CUDA-core / vector) peak
)
_R = {name: i for i, name in enumerate(RAW_FIELDS)}

FEATURE_NAMES: tuple[str, ...] = (
    "log_roofline_ms",  # ln max(compute, memory) roofline time of the pass; index 0 is the prior anchor
    "log_compute_ms",  # ln pass_flops / peak
    "log_memory_ms",  # ln pass_bytes / bandwidth
    "log_update_memory_ms",  # ln update_bytes / bandwidth (optimizer step, memory-bound)
    "log_flops",
    "log_bytes",
    "log_forward_flops",
    "log_intensity",  # ln pass_flops / pass_bytes
    "log_params",  # ln (1 + params)
    "log_batch",
    "is_conv",
    "is_gemm",
    "log_kernel",
    "log_stride",
    "log_c_in",
    "log_c_out",
    "log_in_spatial",
    "log_out_spatial",
    "has_bias",
    *(f"act_{a}" for a in ACTIVATIONS),
    "is_train",
    *(f"opt_{o}" for o in TRAINED_OPTIMIZERS),
    "hw_log_peak_flops_per_s",
    "hw_log_bandwidth_bytes_per_s",
    "hw_log_memory_bytes",
    "hw_log_compute_units",
    "hw_log_clock_mhz",
    # --- added after v1 ---
    *(f"is_{k.value}" for k in EXTRA_KINDS),
    "log_groups",
    "is_depthwise",  # groups > 1 and groups == c_in
    "log_seq_len",
    "log_in_elems",
    "log_out_elems",
    "needs_input_grad",
    "is_half",
    "is_cpu",
    "hw_log_ridge_flops_per_byte",  # ln peak / bandwidth (roofline ridge point)
    "hw_log_l2_cache_bytes",  # ln L2 bytes (LOG_FLOOR when unknown)
    # --- added for v3 ---
    "log_floor_ms",  # ln physics floor of the pass (the anchor of the efficiency target)
    "log_op_compute_ms",  # ln pass_flops / op peak
    "log_floor_over_memory",  # ln floor_ms / memory_ms (0 when memory-bound)
    "hw_log_op_peak_flops_per_s",  # ln peak the op may use at the precision
    "hw_log_op_ridge_flops_per_byte",  # ln op peak / bandwidth
    "uses_tensor_cores",  # op peak above the fp32 peak
    "log_gemm_m",
    "log_gemm_n",
    "log_gemm_k",
    "log_tiles",  # ln thread blocks of the op (GEMM_TILE^2 output tiles, or ELEMENTWISE_TILE elements)
    "log_waves",  # ln tiles / SMs
    "wave_efficiency",  # tiles / (ceil(tiles / SMs) * SMs): share of the last wave's SMs doing work
    "log_work_per_sm",  # ln pass_flops / SMs
    "log_bytes_over_l2",  # ln pass_bytes / L2 bytes
    "stack_tf1_session",
    "stack_kernel_time",
    # --- added for v4 (per-SM, per-cycle ratios: NeuSight-style hardware-relative features) ---
    "log_wave_floor_ms",  # ln floor x ceil(waves) / waves: the floor with the last wave's idle SMs counted
    "log_sm_cycle_ms",  # ln out_elems / (SMs x clock): time at one output element per SM per cycle
    "hw_log_flops_per_sm_cycle",  # ln op peak / (SMs x clock): FLOPs per SM per cycle at the precision
    "hw_log_bytes_per_sm_cycle",  # ln bandwidth / (SMs x clock): DRAM bytes per SM per cycle
    "hw_log_l2_per_sm",  # ln L2 bytes / SMs
    "log_waves_small_tile",  # ln waves of GEMM_TILE_SMALL^2 output tiles (cuBLAS's pick for skinny GEMMs)
    "wave_efficiency_small_tile",  # last-wave fill of those tiles
)
ROOFLINE_FEATURE_INDEX = 0
_F = {name: i for i, name in enumerate(FEATURE_NAMES)}


class FeatureInput(NamedTuple):
    """One row to featurise: the arguments of :func:`layer_features`."""

    layer: Layer
    cost: LayerCost
    hardware: HardwareSpec
    pass_: str
    optimizer: str
    precision: str = "fp32"
    stack: str = DEFAULT_STACK


def hardware_raw(hardware: HardwareSpec, precision: str = "fp32") -> tuple[float, float, float, float, float]:
    """The hardware part of :data:`RAW_FIELDS`: (peak FLOP/s, bandwidth B/s, memory B, units, clock MHz).

    Raises ``KeyError`` if the device has neither ``precision`` nor an fp32 peak.
    """
    clock = hardware.boost_clock_mhz or hardware.base_clock_mhz or DEFAULT_CLOCK_MHZ
    return (
        float(hardware.peak_for(precision)),
        float(hardware.memory_bandwidth_bytes_per_s),
        float(hardware.memory_bytes),
        float(hardware.compute_units),
        float(clock),
    )


def gemm_dims(layer: Layer) -> tuple[float, float, float, float]:
    """Implicit-GEMM view ``(batch, M, N, K)`` of a layer, for wave quantisation.

    Conv: ``M = N·out_spatial``, ``N = C_out/groups``, ``K = C_in/groups·∏kernel``, ``batch = groups``;
    Gemm: ``M`` = rows, ``N`` = out features, ``K`` = in features; MatMul ``(..., M, K) @ (..., K, N)``;
    recurrent: per time step ``M`` = batch, ``N`` = hidden, ``K`` = input + hidden, ``batch`` = steps.
    Other ops: ``M`` = output elements, ``N = K = 1``.
    """
    batch, kernel, _stride, c_in, c_out, _in_sp, out_sp = _geometry(layer)
    if layer.kind in (OpKind.CONV, OpKind.CONV_TRANSPOSE):
        g = float(layer.group)
        ks = float(prod(layer.weights[0].shape[2:])) if layer.weights else kernel
        return g, batch * out_sp, max(c_out / g, 1.0), max(c_in / g, 1.0) * ks
    if layer.kind is OpKind.GEMM:
        return 1.0, batch, c_out, c_in
    if layer.kind is OpKind.MATMUL:
        return batch, out_sp, c_out, c_in
    if layer.kind is OpKind.RECURRENT:
        return out_sp, batch, c_out, c_in + c_out
    out = float(sum(t.numel for t in layer.outputs)) or 1.0
    return 1.0, out, 1.0, 1.0


def precision_spec(hardware: HardwareSpec, precision: str) -> HardwareSpec:
    """The spec whose peaks :mod:`app.core.precision` reads for ``precision``.

    GPUs: ``hardware`` itself (a precision the GPU lacks raises ``PrecisionNotSupported`` there). CPUs that
    list no peak for a 16-bit precision run it by converting to fp32 in the vector units (PyTorch's CPU
    bf16/fp16 kernels without AMX/AVX512-FP16): the spec with that peak set to the fp32 peak.
    """
    if hardware.kind != "cpu" or precision in hardware.peak_flops_per_s or precision not in HALF_PRECISIONS:
        return hardware
    peaks = {**hardware.peak_flops_per_s, precision: float(hardware.peak_flops_per_s["fp32"])}
    return dataclasses.replace(hardware, peak_flops_per_s=peaks)


def pass_floor_ms(
    *, layer: Layer, cost: LayerCost, hardware: HardwareSpec, pass_: str, optimizer: str, precision: str
) -> float:
    """Physics floor of a feature pass in ms: :func:`app.core.precision.physics_floor_ms` of the inference
    forward (a dropout layer's is 0: the identity in eval mode), or for ``"train_step"`` the sum of the
    training forward, backward and optimizer-update floors (the passes run one after the other). Raises like
    :func:`app.core.precision.physics_floor_ms` (``PrecisionNotSupported`` for a precision the device lacks).
    """
    hardware = precision_spec(hardware, precision)
    if pass_ != "train_step":
        return physics_floor_ms(layer, cost, hardware, precision, "forward")
    return physics_floor_ms(layer, cost, hardware, precision, "train_step", optimizer=optimizer)


def _geometry(layer: Layer) -> tuple[float, float, float, float, float, float, float]:
    """(batch, kernel, stride, c_in, c_out, in_spatial, out_spatial) of a conv or gemm layer.

    Conv reads the weight ``(C_out, C_in/groups, *k)`` and derives spatial sizes by dividing numels, so
    NCHW and NHWC shapes give the same numbers. Gemm: in/out features are the last input/output dims and
    the batch is the product of the other input dims, except a 2-D first input stored ``(K, M)`` (an ONNX
    ``Gemm`` with ``transA=1``: its last dim is not the GemmAttrs' K, its first is), whose K, M and N are read
    from its :class:`~app.core.ir.GemmAttrs`. Other kinds: batch = first input dim, rest 1.
    """
    x = layer.inputs[0].shape if layer.inputs else (1,)
    if layer.kind is OpKind.CONV and layer.weights:
        w = layer.weights[0].shape
        n = x[0]
        c_out, c_in_g = w[0], w[1]
        c_in = c_in_g * layer.group
        ks = w[2:] or (1,)
        strides = (layer.attrs.strides if isinstance(layer.attrs, ConvAttrs) else ()) or (1,) * len(ks)
        in_sp = prod(x) / (n * c_in)
        out_sp = layer.outputs[0].numel / (n * c_out)
        kernel = prod(ks) ** (1.0 / len(ks))
        stride = prod(strides) ** (1.0 / len(strides))
        return float(n), float(kernel), float(stride), float(c_in), float(c_out), float(in_sp), float(out_sp)
    if layer.kind is OpKind.GEMM:
        a = layer.attrs
        if isinstance(a, GemmAttrs) and len(x) == 2 and x[-1] != a.k and x[0] == a.k:
            # A stored (K, M), as an ONNX Gemm with transA=1 has it: its last dim is M, not K (the shape test
            # fires only then; M, K and N are the importer's GemmAttrs, the true dimensions)
            return float(prod(a.batch) * a.m), 1.0, 1.0, float(a.k), float(a.n), 1.0, 1.0
        k_in = x[-1]
        n_out = layer.outputs[0].shape[-1] if layer.outputs else 1
        batch = prod(x[:-1]) if len(x) > 1 else 1
        return float(batch), 1.0, 1.0, float(k_in), float(n_out), 1.0, 1.0
    return _geometry_other(layer)


def _geometry_other(layer: Layer) -> tuple[float, float, float, float, float, float, float]:
    """Geometry of the kinds added after v1 (same tuple as :func:`_geometry`).

    MatMul ``(..., M, K) @ (..., K, N)``: batch = product of the leading dims, c_in = K, c_out = N,
    spatial = M. Recurrent: batch, c_in = input features, c_out = hidden, spatial = time steps
    (from :class:`~app.core.ir.RecurrentAttrs`). Embedding: batch = number of indices,
    c_in = vocabulary, c_out = embedding dim. Everything else (norms, pooling, activations...):
    channels-first ``(N, C, *spatial)``: batch = N, c_in = C, c_out = output C, spatial = elements per
    channel, kernel/stride from ``kernel_shape``/``strides``.
    """
    x = layer.inputs[0].shape if layer.inputs else (1,)
    y = layer.outputs[0].shape if layer.outputs else (1,)
    if layer.kind is OpKind.MATMUL and len(layer.inputs) >= 2 and len(x) >= 2:
        b = layer.inputs[1].shape
        return (
            float(prod(x[:-2]) if len(x) > 2 else 1),
            1.0,
            1.0,
            float(x[-1]),
            float(b[-1]),
            float(x[-2]),
            float(x[-2]),
        )
    if isinstance(layer.attrs, RecurrentAttrs) and len(x) == 3:
        r = layer.attrs
        return float(r.batch), 1.0, 1.0, float(x[2]), float(r.hidden_size), float(r.seq_len), float(r.seq_len)
    if layer.kind is OpKind.EMBEDDING and layer.weights:
        vocab, dim = layer.weights[0].shape[0], layer.weights[0].shape[-1]
        return float(prod(x) if x else 1), 1.0, 1.0, float(vocab), float(dim), 1.0, 1.0
    n = x[0] if x else 1
    c_in = x[1] if len(x) > 1 else 1
    c_out = y[1] if len(y) > 1 else 1
    in_sp = prod(x) / max(n * c_in, 1)
    out_sp = prod(y) / max(y[0] * c_out, 1) if y else 1
    window = layer.attrs if isinstance(layer.attrs, ConvAttrs | PoolAttrs) else None
    ks = (window.kernel_shape if window else ()) or (1,)
    st = (window.strides if window else ()) or (1,)
    kernel = prod(ks) ** (1.0 / len(ks))
    stride = prod(st) ** (1.0 / len(st))
    return float(n), float(kernel), float(stride), float(c_in), float(c_out), float(in_sp), float(out_sp)


#: The :data:`RAW_FIELDS` that describe a layer's shape to the model (:func:`geometry_fields`).
GEOMETRY_FIELDS: tuple[str, ...] = ("is_conv", "is_gemm", "batch", "kernel", "stride", "in_spatial", "out_spatial")


def is_pointwise_conv(layer: Layer) -> bool:
    """True for a convolution that is a plain matrix multiply: every kernel side 1, stride 1, no padding, one
    group (a 1x1 convolution in 2-D; any rank). Its output ``[N, C_out, *S]`` is ``W [C_out, C_in]`` times the
    input ``[N, C_in, *S]`` at every one of the ``N x prod(S)`` positions: a GEMM with ``M = N x prod(S)``,
    ``N = C_out``, ``K = C_in`` and no im2col expansion, the same FLOPs and bytes (cuDNN runs it as one,
    Chetlur et al. 2014, "cuDNN: Efficient Primitives for Deep Learning", section 3)."""
    a = layer.attrs
    if layer.kind is not OpKind.CONV or not layer.weights or not isinstance(a, ConvAttrs) or a.group != 1:
        return False
    return all(k == 1 for k in layer.weights[0].shape[2:]) and all(s == 1 for s in a.strides) and not any(a.pads)


def gemm_view_applies(hardware_kind: str, stack: str) -> bool:
    """Whether a pointwise convolution is featurised as the GEMM it is (:func:`geometry_fields` with
    ``gemm_view``) on ``hardware_kind`` under ``stack``.

    GPUs under every stack but ``tf1-session``: the conv training rows there (NeuSight, PyTorch 2.1) are 3x3
    only, so a 1x1 convolution with hundreds of channels featurised as a convolution is an extrapolation the
    model got 2.2x too slow on DeepBench's held-out 1x1 convolutions (cuDNN, never trained on; 1.06x as the
    GEMM it is; ``scripts/served_kernels.py``, models/README.md). Not under a TensorFlow 1.x session, whose
    training rows (Justus et al. 2018) time 1x1 convolutions on NHWC tensors with TensorFlow's layout work
    around cuDNN's NCHW kernels, about 4x slower than the GEMM view answers; not on CPUs, whose training rows
    (the profiler's PyTorch convolutions) measured them as convolutions."""
    return hardware_kind == "gpu" and stack != SoftwareStack.TF1_SESSION


def geometry_fields(layer: Layer, *, gemm_view: bool = False) -> tuple[float, ...]:
    """The :data:`GEOMETRY_FIELDS` of ``layer`` as :func:`raw_quantities` writes them. ``gemm_view`` (for a
    pointwise convolution, :func:`is_pointwise_conv`): as the GEMM it is, a fully connected layer over
    ``batch x out_spatial`` rows with kernel, stride and spatial sizes 1; its channels, FLOPs, bytes, floors and
    implicit-GEMM dims are the same either way."""
    return _geometry_fields(layer, _geometry(layer), gemm_view)


def _geometry_fields(layer: Layer, geometry: tuple[float, ...], gemm_view: bool) -> tuple[float, ...]:
    """:func:`geometry_fields` from the layer's :func:`_geometry` tuple (computed once by the caller)."""
    batch, kernel, stride, _, _, in_sp, out_sp = geometry
    if gemm_view:
        return 0.0, 1.0, batch * out_sp, 1.0, 1.0, 1.0, 1.0
    return float(layer.kind is OpKind.CONV), float(layer.kind is OpKind.GEMM), batch, kernel, stride, in_sp, out_sp


def _needs_input_grad(layer: Layer) -> bool:
    return layer.needs_input_grad


def raw_quantities(
    *,
    layer: Layer,
    cost: LayerCost,
    hardware: HardwareSpec,
    pass_: str,
    optimizer: str,
    precision: str,
    stack: str = DEFAULT_STACK,
    launch_gaps: bool = True,
) -> tuple[float, ...]:
    """Physical quantities of one row, in :data:`RAW_FIELDS` order (units in the field comments).

    ``pass_`` is ``"forward"`` or ``"train_step"``; ``optimizer`` a key of
    :data:`app.core.costs.OPTIMIZERS` (``"none"`` for forward); ``stack`` one of :data:`STACKS`;
    ``launch_gaps`` False for a time that sums kernel durations only (Vidur). The update cost is
    :func:`app.core.costs.optimizer_update_cost` over ``cost.params`` in fp32 (master weights).
    A pointwise convolution is described as the GEMM it is where :func:`gemm_view_applies`.
    Raises ``ValueError`` for an unknown pass or stack and ``KeyError`` for an unknown optimizer.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    train = pass_ == "train_step"
    opt = optimizer if train else "none"
    upd_flops, upd_bytes = optimizer_update_cost(cost.params, opt)
    flops = cost.forward_flops + (cost.backward_flops + upd_flops if train else 0)
    nbytes = cost.forward_bytes + (cost.backward_bytes + upd_bytes if train else 0)
    geometry = _geometry(layer)
    _, _, _, c_in, c_out, _, _ = geometry
    act = layer.activation
    opt_key = OPTIMIZER_ALIASES.get(opt, opt)
    has_bias = 1.0 if len(layer.weights) > 1 else 0.0
    groups = layer.group
    seq = geometry[6] if layer.kind in (OpKind.MATMUL, OpKind.RECURRENT) else 1.0  # their out_spatial
    is_conv, is_gemm, batch, kernel, stride, in_sp, out_sp = _geometry_fields(
        layer, geometry, is_pointwise_conv(layer) and gemm_view_applies(hardware.kind, stack))
    return (
        is_conv,
        is_gemm,
        batch,
        float(flops),
        float(nbytes),
        float(upd_bytes),
        float(cost.forward_flops),
        float(cost.params),
        kernel,
        stride,
        c_in,
        c_out,
        in_sp,
        out_sp,
        has_bias,
        *(float(act == a) for a in ACTIVATIONS),
        float(train),
        *(float(opt_key == o) for o in TRAINED_OPTIMIZERS),
        *hardware_raw(hardware, precision),
        *(float(layer.kind is k) for k in EXTRA_KINDS),
        float(groups),
        float(seq),
        float(sum(t.numel for t in layer.inputs)),
        float(sum(t.numel for t in layer.outputs)),
        float(_needs_input_grad(layer)),
        float(precision in HALF_PRECISIONS),
        float(hardware.kind == "cpu"),
        float(hardware.l2_cache_bytes or 0.0),
        op_precision(precision_spec(hardware, precision), precision, layer.kind).peak_flops_per_s,
        pass_floor_ms(layer=layer, cost=cost, hardware=hardware, pass_=pass_, optimizer=opt, precision=precision),
        *gemm_dims(layer),
        float(stack == SoftwareStack.TF1_SESSION),
        float(not launch_gaps or stack in NO_LAUNCH_GAP_STACKS),
        float(hardware.peak_flops_per_s["fp32"]),
    )  # fmt: skip


#: Raw fields that are features as they are (flags, one-hot blocks), and the raw fields whose log (``_log``) is a
#: feature as it is, each with its feature: :func:`features_from_raw` copies or logs each group in one numpy call.
_COPIED: tuple[tuple[str, str], ...] = (
    ("is_conv", "is_conv"), ("is_gemm", "is_gemm"), ("has_bias", "has_bias"),
    *((f"act_{a}", f"act_{a}") for a in ACTIVATIONS), ("is_train", "is_train"),
    *((f"opt_{o}", f"opt_{o}") for o in TRAINED_OPTIMIZERS), *((f"is_{k.value}", f"is_{k.value}") for k in EXTRA_KINDS),
    ("needs_input_grad", "needs_input_grad"), ("is_half", "is_half"), ("is_cpu", "is_cpu"),
    ("stack_tf1_session", "stack_tf1_session"), ("stack_kernel_time", "stack_kernel_time"),
)
_LOGGED: tuple[tuple[str, str], ...] = (
    ("log_flops", "pass_flops"), ("log_bytes", "pass_bytes"), ("log_forward_flops", "forward_flops"),
    ("log_batch", "batch"), ("log_kernel", "kernel"), ("log_stride", "stride"), ("log_c_in", "c_in"),
    ("log_c_out", "c_out"), ("log_in_spatial", "in_spatial"), ("log_out_spatial", "out_spatial"),
    ("hw_log_peak_flops_per_s", "peak_flops_per_s"), ("hw_log_bandwidth_bytes_per_s", "bandwidth_bytes_per_s"),
    ("hw_log_memory_bytes", "memory_bytes"), ("hw_log_compute_units", "compute_units"),
    ("hw_log_clock_mhz", "clock_mhz"), ("log_groups", "groups"), ("log_seq_len", "seq_len"),
    ("log_in_elems", "in_elems"), ("log_out_elems", "out_elems"), ("hw_log_l2_cache_bytes", "l2_cache_bytes"),
    ("log_floor_ms", "floor_ms"), ("hw_log_op_peak_flops_per_s", "op_peak_flops_per_s"), ("log_gemm_m", "gemm_m"),
    ("log_gemm_n", "gemm_n"), ("log_gemm_k", "gemm_k"),
)
#: Features that are the log of a quotient ``_log(numerator / denominator * scale)``: the quotients of every row
#: are formed as one ``[N, len(_QUOTIENTS)]`` block (each element the same float64 operations in the same order as
#: one column at a time) and logged in one call. Denominators: a raw field, or ``"sms"`` (``max(compute_units,
#: 1)``), ``"sm_hz"`` (``sms x clock_mhz x 1e6``: SM cycles per second, all SMs).
_QUOTIENTS: tuple[tuple[str, str, str, float | None], ...] = (
    ("log_compute_ms", "pass_flops", "peak_flops_per_s", 1e3),
    ("log_memory_ms", "pass_bytes", "bandwidth_bytes_per_s", 1e3),
    ("log_update_memory_ms", "update_bytes", "bandwidth_bytes_per_s", 1e3),
    ("log_op_compute_ms", "pass_flops", "op_peak_flops_per_s", 1e3),
    ("log_work_per_sm", "pass_flops", "sms", None),
    ("log_sm_cycle_ms", "out_elems", "sm_hz", 1e3),
    ("hw_log_flops_per_sm_cycle", "op_peak_flops_per_s", "sm_hz", None),
    ("hw_log_bytes_per_sm_cycle", "bandwidth_bytes_per_s", "sm_hz", None),
    ("hw_log_l2_per_sm", "l2_cache_bytes", "sms", None),
)
_F_COPIED = np.asarray([FEATURE_NAMES.index(f) for f, _ in _COPIED], dtype=np.intp)
_R_COPIED = np.asarray([_R[r] for _, r in _COPIED], dtype=np.intp)
_F_LOGGED = np.asarray([FEATURE_NAMES.index(f) for f, _ in _LOGGED], dtype=np.intp)
_R_LOGGED = np.asarray([_R[r] for _, r in _LOGGED], dtype=np.intp)
_L = {r: j for j, (_, r) in enumerate(_LOGGED)}  # a logged raw field's column in the block of logs
_F_QUOTIENTS = np.asarray([FEATURE_NAMES.index(q[0]) for q in _QUOTIENTS], dtype=np.intp)
_R_NUMERATORS = np.asarray([_R[q[1]] for q in _QUOTIENTS], dtype=np.intp)
_Q = {q[0]: j for j, q in enumerate(_QUOTIENTS)}


def _log(x: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(x, LOG_FLOOR))


def features_from_raw(raw: np.ndarray) -> np.ndarray:
    """Feature matrix ``[N, len(FEATURE_NAMES)]`` (float32) from raw quantities ``[N, len(RAW_FIELDS)]``.

    Vectorised; the only place where each feature is defined (:data:`FEATURE_NAMES` names them; the copied,
    logged and quotient features by the tables :data:`_COPIED`, :data:`_LOGGED` and :data:`_QUOTIENTS`, the
    rest below). Times are in milliseconds before the log. Each kind of feature is computed for all its columns
    in one numpy call (a feature's value is the same float64 arithmetic on the same raw values as on its own
    column: ``tests/core/test_features_blocks.py`` checks it bit for bit against the column-by-column definition).
    Raises ``ValueError`` if ``raw`` has the wrong number of columns.
    """
    raw = np.asarray(raw, dtype=np.float64)
    if raw.ndim != 2 or raw.shape[1] != len(RAW_FIELDS):
        raise ValueError(f"raw must have shape [N, {len(RAW_FIELDS)}], got {raw.shape}")
    n = raw.shape[0]
    out = np.empty((n, len(FEATURE_NAMES)), dtype=np.float64)
    out[:, _F_COPIED] = raw[:, _R_COPIED]
    logs = _log(raw[:, _R_LOGGED])
    out[:, _F_LOGGED] = logs

    def c(name: str) -> np.ndarray:
        return raw[:, _R[name]]

    def lg(name: str) -> np.ndarray:
        return logs[:, _L[name]]

    sms = np.maximum(c("compute_units"), 1.0)
    sm_hz = sms * c("clock_mhz") * 1e6
    den = {"sms": sms, "sm_hz": sm_hz}
    quotients = raw[:, _R_NUMERATORS] / np.stack([den[d] if d in den else c(d) for _, _, d, _ in _QUOTIENTS], axis=1)
    scaled = [j for j, q in enumerate(_QUOTIENTS) if q[3] is not None]
    quotients[:, scaled] *= 1e3
    q_logs = _log(quotients)
    out[:, _F_QUOTIENTS] = q_logs
    compute_ms, memory_ms = quotients[:, _Q["log_compute_ms"]], quotients[:, _Q["log_memory_ms"]]
    log_memory_ms = q_logs[:, _Q["log_memory_ms"]]
    tiles, tiles_small = _tiles(raw), _tiles(raw, GEMM_TILE_SMALL)
    waves, waves_small = tiles / sms, tiles_small / sms
    ceil_waves = np.ceil(waves)
    derived = {
        "log_roofline_ms": _log(np.maximum(compute_ms, memory_ms)),
        "log_intensity": lg("pass_flops") - lg("pass_bytes"),
        "log_params": np.log1p(np.maximum(c("params"), 0.0)),
        "is_depthwise": ((c("groups") > 1) & (c("groups") == c("c_in"))).astype(np.float64),
        "hw_log_ridge_flops_per_byte": lg("peak_flops_per_s") - lg("bandwidth_bytes_per_s"),
        # --- v3 (efficiency over the physics floor) ---
        "log_floor_over_memory": lg("floor_ms") - log_memory_ms,
        "hw_log_op_ridge_flops_per_byte": lg("op_peak_flops_per_s") - lg("bandwidth_bytes_per_s"),
        "uses_tensor_cores": (c("op_peak_flops_per_s") > c("fp32_peak_flops_per_s") * 1.01).astype(np.float64),
        "log_tiles": _log(tiles),
        "log_waves": _log(waves),
        "wave_efficiency": waves / ceil_waves,
        "log_bytes_over_l2": lg("pass_bytes") - lg("l2_cache_bytes"),
        # --- v4 (per-SM, per-cycle ratios: the quotients above; the wave-quantised floor) ---
        "log_wave_floor_ms": _log(c("floor_ms") * ceil_waves / waves),
        "log_waves_small_tile": _log(waves_small),
        "wave_efficiency_small_tile": waves_small / np.ceil(waves_small),
    }
    for name, col in derived.items():
        out[:, _F[name]] = col
    assert len(_COPIED) + len(_LOGGED) + len(_QUOTIENTS) + len(derived) == len(FEATURE_NAMES)
    return out.astype(np.float32)


def _tiles(raw: np.ndarray, gemm_tile: int = GEMM_TILE) -> np.ndarray:
    """Thread blocks of each row's op ``[N]`` (>= 1): ``gemm_tile``² output tiles of the implicit GEMM for
    multiply-accumulate ops, ``ELEMENTWISE_TILE`` output elements per block otherwise."""

    def c(name: str) -> np.ndarray:
        return raw[:, _R[name]]

    mac = sum(c(name) for name in ("is_conv", "is_gemm", "is_conv_transpose", "is_matmul", "is_recurrent",
                                   "is_attention")) > 0.5  # fmt: skip
    m, n = c("gemm_m"), c("gemm_n")
    tiles = np.where(
        mac,
        c("gemm_batch") * np.ceil(m / gemm_tile) * np.ceil(n / gemm_tile),
        np.ceil(m / ELEMENTWISE_TILE),
    )
    return np.maximum(tiles, 1.0)


def floor_ms_from_raw(raw: np.ndarray) -> np.ndarray:
    """Physics floor of each row's pass in ms, ``[N]`` (the ``floor_ms`` raw column, :func:`pass_floor_ms`)."""
    return np.asarray(raw, dtype=np.float64)[:, _R["floor_ms"]]


def layer_features(
    *,
    layer: Layer,
    cost: LayerCost,
    hardware: HardwareSpec,
    pass_: str,
    optimizer: str,
    precision: str,
    stack: str = DEFAULT_STACK,
) -> np.ndarray:
    """Feature vector of one row, float32, shape ``(len(FEATURE_NAMES),)``.

    See :func:`raw_quantities` for the arguments and errors; equals the matching row of
    :func:`layer_features_batch`.
    """
    raw = raw_quantities(
        layer=layer, cost=cost, hardware=hardware, pass_=pass_, optimizer=optimizer, precision=precision,
        stack=stack,
    )  # fmt: skip
    return features_from_raw(np.asarray([raw]))[0]


def raw_matrix(rows: Iterable[FeatureInput]) -> np.ndarray:
    """Raw quantities ``[N, len(RAW_FIELDS)]`` (float64) of many rows (see :func:`raw_quantities`)."""
    data = [
        raw_quantities(
            layer=r.layer,
            cost=r.cost,
            hardware=r.hardware,
            pass_=r.pass_,
            optimizer=r.optimizer,
            precision=r.precision,
            stack=r.stack,
        )
        for r in rows
    ]
    if not data:
        return np.zeros((0, len(RAW_FIELDS)), dtype=np.float64)
    return np.asarray(data, dtype=np.float64)


def layer_features_batch(rows: Iterable[FeatureInput]) -> np.ndarray:
    """Feature matrix ``[N, len(FEATURE_NAMES)]`` (float32) of many rows; row i equals
    :func:`layer_features` of ``rows[i]``."""
    return features_from_raw(raw_matrix(rows))


def roofline_ms_from_raw(raw: np.ndarray) -> np.ndarray:
    """Pure roofline time of the pass in ms, ``[N]``: ``max(pass_flops / peak, pass_bytes / bw)``.

    Same formula as :func:`app.core.roofline.roofline_time_s` (Williams et al. 2009), vectorised.
    """
    raw = np.asarray(raw, dtype=np.float64)
    compute = raw[:, _R["pass_flops"]] / raw[:, _R["peak_flops_per_s"]]
    memory = raw[:, _R["pass_bytes"]] / raw[:, _R["bandwidth_bytes_per_s"]]
    return np.maximum(compute, memory) * 1e3


def select_features(features: np.ndarray, names: Iterable[str]) -> np.ndarray:
    """Columns ``names`` (in that order) of a full feature matrix ``[N, len(FEATURE_NAMES)]``.

    This is how an artifact trained on a subset of the features (its metadata ``feature_names``) reads
    its input. Raises ``KeyError`` for a name this module does not define.
    """
    idx = [feature_index(n) for n in names]
    return np.ascontiguousarray(np.asarray(features)[:, idx], dtype=np.float32)



def feature_index(name: str) -> int:
    """Column of ``name`` in :data:`FEATURE_NAMES`; raises ``KeyError`` for an unknown name."""
    return _F[name]


def raw_index(name: str) -> int:
    """Column of ``name`` in :data:`RAW_FIELDS`; raises ``KeyError`` for an unknown name."""
    return _R[name]
