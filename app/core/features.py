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

Physics anchor (DESIGN.md "Anchor the learned model to physics"): the first features are the log
roofline times of the pass (Williams et al. 2009), so a model that predicts log-time as a residual over
``log_roofline_ms`` degrades gracefully on hardware it never saw. Hardware enters only through datasheet
figures (peak FLOP/s, bandwidth, memory, SM count, clock), never a device id, for the same reason
(Syed & Srinivasan 2021; Justus et al. 2018 use the same kind of hardware features).

Passes: ``"forward"`` is one forward pass; ``"train_step"`` is forward + backward + the optimizer update
of the layer's parameters (the Justus et al. 2018 ``train_step`` measurement). Logs are natural logs of
values clipped below at :data:`LOG_FLOOR` (so zero work gives a finite feature).
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod
from typing import NamedTuple

import numpy as np

from app.core.costs import LayerCost, optimizer_update_cost
from app.core.hardware import HardwareSpec
from app.core.ir import Layer, OpKind

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
)
ROOFLINE_FEATURE_INDEX = 0


class FeatureInput(NamedTuple):
    """One row to featurise: the arguments of :func:`layer_features`."""

    layer: Layer
    cost: LayerCost
    hardware: HardwareSpec
    pass_: str
    optimizer: str
    precision: str = "fp32"


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


def _geometry(layer: Layer) -> tuple[float, float, float, float, float, float, float]:
    """(batch, kernel, stride, c_in, c_out, in_spatial, out_spatial) of a conv or gemm layer.

    Conv reads the weight ``(C_out, C_in/groups, *k)`` and derives spatial sizes by dividing numels, so
    NCHW and NHWC shapes give the same numbers. Gemm: in/out features are the last input/output dims and
    the batch is the product of the other input dims. Other kinds: batch = first input dim, rest 1.
    """
    x = layer.inputs[0].shape if layer.inputs else (1,)
    if layer.kind is OpKind.CONV and layer.weights:
        w = layer.weights[0].shape
        n = x[0]
        c_out, c_in_g = w[0], w[1]
        groups = int(layer.attrs.get("group", 1))
        c_in = c_in_g * groups
        ks = w[2:] or (1,)
        strides = tuple(layer.attrs.get("strides", ())) or (1,) * len(ks)
        in_sp = prod(x) / (n * c_in)
        out_sp = layer.outputs[0].numel / (n * c_out)
        kernel = prod(ks) ** (1.0 / len(ks))
        stride = prod(strides) ** (1.0 / len(strides))
        return float(n), float(kernel), float(stride), float(c_in), float(c_out), float(in_sp), float(out_sp)
    if layer.kind is OpKind.GEMM:
        k_in = x[-1]
        n_out = layer.outputs[0].shape[-1] if layer.outputs else 1
        batch = prod(x[:-1]) if len(x) > 1 else 1
        return float(batch), 1.0, 1.0, float(k_in), float(n_out), 1.0, 1.0
    return float(x[0] if x else 1), 1.0, 1.0, 1.0, 1.0, 1.0, 1.0


def raw_quantities(
    *, layer: Layer, cost: LayerCost, hardware: HardwareSpec, pass_: str, optimizer: str, precision: str
) -> tuple[float, ...]:
    """Physical quantities of one row, in :data:`RAW_FIELDS` order (units in the field comments).

    ``pass_`` is ``"forward"`` or ``"train_step"``; ``optimizer`` a key of
    :data:`app.core.costs.OPTIMIZERS` (``"none"`` for forward). The update cost is
    :func:`app.core.costs.optimizer_update_cost` over ``cost.params`` in fp32 (master weights).
    Raises ``ValueError`` for an unknown pass and ``KeyError`` for an unknown optimizer.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    train = pass_ == "train_step"
    opt = optimizer if train else "none"
    upd_flops, upd_bytes = optimizer_update_cost(cost.params, opt)
    flops = cost.forward_flops + (cost.backward_flops + upd_flops if train else 0)
    nbytes = cost.forward_bytes + (cost.backward_bytes + upd_bytes if train else 0)
    batch, kernel, stride, c_in, c_out, in_sp, out_sp = _geometry(layer)
    act = str(layer.attrs.get("activation", "none")).lower()
    opt_key = OPTIMIZER_ALIASES.get(opt, opt)
    has_bias = 1.0 if len(layer.weights) > 1 else 0.0
    return (
        float(layer.kind is OpKind.CONV),
        float(layer.kind is OpKind.GEMM),
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
    )


def _log(x: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(x, LOG_FLOOR))


def features_from_raw(raw: np.ndarray) -> np.ndarray:
    """Feature matrix ``[N, len(FEATURE_NAMES)]`` (float32) from raw quantities ``[N, len(RAW_FIELDS)]``.

    Vectorised; the only place where each feature is defined. Times are in milliseconds before the log.
    Raises ``ValueError`` if ``raw`` has the wrong number of columns.
    """
    raw = np.asarray(raw, dtype=np.float64)
    if raw.ndim != 2 or raw.shape[1] != len(RAW_FIELDS):
        raise ValueError(f"raw must have shape [N, {len(RAW_FIELDS)}], got {raw.shape}")

    def c(name: str) -> np.ndarray:
        return raw[:, _R[name]]

    peak = c("peak_flops_per_s")
    bw = c("bandwidth_bytes_per_s")
    compute_ms = c("pass_flops") / peak * 1e3
    memory_ms = c("pass_bytes") / bw * 1e3
    update_ms = c("update_bytes") / bw * 1e3
    cols = [
        _log(np.maximum(compute_ms, memory_ms)),
        _log(compute_ms),
        _log(memory_ms),
        _log(update_ms),
        _log(c("pass_flops")),
        _log(c("pass_bytes")),
        _log(c("forward_flops")),
        _log(c("pass_flops")) - _log(c("pass_bytes")),
        np.log1p(np.maximum(c("params"), 0.0)),
        _log(c("batch")),
        c("is_conv"),
        c("is_gemm"),
        _log(c("kernel")),
        _log(c("stride")),
        _log(c("c_in")),
        _log(c("c_out")),
        _log(c("in_spatial")),
        _log(c("out_spatial")),
        c("has_bias"),
        *(c(f"act_{a}") for a in ACTIVATIONS),
        c("is_train"),
        *(c(f"opt_{o}") for o in TRAINED_OPTIMIZERS),
        _log(peak),
        _log(bw),
        _log(c("memory_bytes")),
        _log(c("compute_units")),
        _log(c("clock_mhz")),
    ]
    out = np.stack(cols, axis=1).astype(np.float32)
    assert out.shape[1] == len(FEATURE_NAMES)
    return out


def layer_features(
    *, layer: Layer, cost: LayerCost, hardware: HardwareSpec, pass_: str, optimizer: str, precision: str
) -> np.ndarray:
    """Feature vector of one row, float32, shape ``(len(FEATURE_NAMES),)``.

    See :func:`raw_quantities` for the arguments and errors; equals the matching row of
    :func:`layer_features_batch`.
    """
    raw = raw_quantities(
        layer=layer, cost=cost, hardware=hardware, pass_=pass_, optimizer=optimizer, precision=precision
    )
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


def raw_index(name: str) -> int:
    """Column of ``name`` in :data:`RAW_FIELDS`; raises ``KeyError`` for an unknown name."""
    return _R[name]
