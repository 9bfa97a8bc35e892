"""Cross-GPU transfer by roofline ratio ("wave scaling", Yu et al., USENIX ATC 2021, Habitat).

A learned model extrapolates badly to GPUs faster than every GPU it was trained on. For a GPU outside
the training set the layer is therefore predicted on a *reference* training GPU (where the model is in
distribution) and scaled to the target by the ratio of the pass's roofline times, the per-layer
overhead floor left unscaled::

    t_target = o + (t_ref − o) · roofline_target / roofline_ref,   o = min(t_ref, floor_ms(pass))

with ``roofline_x = max(FLOPs / peak_x, bytes / bandwidth_x)`` (:func:`app.core.features.roofline_ms_from_raw`)
and ``floor_ms`` the fitted roofline fallback's per-layer floor (forward / train step). Reference:
``"nearest"`` — the training GPU nearest in (ln peak FLOP/s, ln bandwidth); ``"weighted"`` — geometric
mean of the transfers from every training GPU, weighted by inverse squared distance in that plane (a
reference at distance 0 takes all the weight). Applied to each quantile (p10/p50/p90) alike.

Numpy only; serving (:class:`app.predictor.onnx_model.LearnedPredictor`) and the leave-one-GPU-out
evaluation (:mod:`app.training.evaluate`) call the same :func:`transfer_ln`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from app.core.features import RAW_FIELDS, features_from_raw, hardware_raw, roofline_ms_from_raw
from app.core.hardware import HardwareSpec

_R = {name: i for i, name in enumerate(RAW_FIELDS)}
_HW_FIELDS = ("peak_flops_per_s", "bandwidth_bytes_per_s", "memory_bytes", "compute_units", "clock_mhz")

#: Variant served (see the module docstring); LOGO-evaluated in app.training.evaluate.
DEFAULT_REFERENCE = "weighted"
DEFAULT_OVERHEAD = "floor"

#: Served only for GPUs whose fp32 peak or bandwidth exceeds every training GPU's by more than this factor
#: (extrapolation to faster hardware, where the learned model fails); inside it the learned model's own
#: prediction is kept (it interpolates better than the roofline ratio across architectures).
EXTRAPOLATION_MARGIN = 1.25


@dataclass(frozen=True)
class Transfer:
    """Result of :func:`transfer_ln`: ln ms quantiles ``[N, 3]`` and the reference id(s) used."""

    ln_ms: np.ndarray
    references: tuple[str, ...]


def _point(hw: HardwareSpec) -> np.ndarray:
    return np.array([np.log(hw.peak_for("fp32")), np.log(hw.memory_bandwidth_bytes_per_s)])


def reference_weights(target: HardwareSpec, refs: Sequence[HardwareSpec], reference: str) -> np.ndarray:
    """Weights (summing to 1) of ``refs`` for ``target``: one-hot nearest or inverse squared distance."""
    d = np.array([float(np.linalg.norm(_point(target) - _point(r))) for r in refs])
    w = np.zeros(len(refs))
    if reference == "nearest" or d.min() < 1e-9:
        w[int(np.argmin(d))] = 1.0
    elif reference == "weighted":
        w = 1.0 / d**2
        w /= w.sum()
    else:
        raise ValueError(f"unknown reference {reference!r}")
    return w


def with_hardware(raw: np.ndarray, hw: HardwareSpec, precisions: Sequence[str]) -> np.ndarray:
    """``raw`` with its hardware columns replaced by ``hw``'s (per row precision for the peak)."""
    out = np.array(raw, dtype=np.float64, copy=True)
    cache: dict[str, tuple[float, ...]] = {}
    for i, p in enumerate(precisions):
        if p not in cache:
            cache[p] = hardware_raw(hw, p)
        out[i, [_R[f] for f in _HW_FIELDS]] = cache[p]
    if "l2_cache_bytes" in _R:
        out[:, _R["l2_cache_bytes"]] = float(hw.l2_cache_bytes or 0.0)
    return out


def transfer_ln(
    predict_ln: Callable[[np.ndarray], np.ndarray],
    raw: np.ndarray,
    *,
    target: HardwareSpec,
    refs: Sequence[HardwareSpec],
    floor_ms: tuple[float, float],
    precisions: Sequence[str] | None = None,
    reference: str = DEFAULT_REFERENCE,
    overhead: str = DEFAULT_OVERHEAD,
) -> Transfer:
    """ln ms quantiles ``[N, 3]`` on ``target`` of the rows ``raw`` (featurised against ``target``).

    ``predict_ln`` maps a full feature matrix ``[N, len(FEATURE_NAMES)]`` to ln ms quantiles ``[N, 3]``;
    ``floor_ms`` = (forward floor, train-step floor); ``overhead`` ``"floor"`` (min(t_ref, floor)) or
    ``"none"`` (pure ratio).
    """
    raw = np.asarray(raw, dtype=np.float64)
    n = raw.shape[0]
    precisions = list(precisions) if precisions is not None else ["fp32"] * n
    w = reference_weights(target, refs, reference)
    roof_t = np.maximum(roofline_ms_from_raw(raw), 1e-12)
    floor = np.where(raw[:, _R["is_train"]] > 0.5, floor_ms[1], floor_ms[0])
    acc = np.zeros((n, 3))
    used: list[str] = []
    for r, wi in zip(refs, w, strict=True):
        if wi <= 0:
            continue
        used.append(r.id)
        raw_r = with_hardware(raw, r, precisions)
        t_ref = np.exp(np.asarray(predict_ln(features_from_raw(raw_r)), dtype=np.float64))
        ratio = (roof_t / np.maximum(roofline_ms_from_raw(raw_r), 1e-12))[:, None]
        o = np.minimum(t_ref, floor[:, None]) if overhead == "floor" else np.zeros_like(t_ref)
        acc += wi * np.log(np.maximum(o + (t_ref - o) * ratio, 1e-12))
    return Transfer(ln_ms=acc, references=tuple(used))


def extrapolates(target: HardwareSpec, refs: Sequence[HardwareSpec], margin: float = EXTRAPOLATION_MARGIN) -> bool:
    """Whether ``target``'s fp32 peak or bandwidth exceeds every reference's by more than ``margin``."""
    if not refs:
        return False
    peak = max(r.peak_for("fp32") for r in refs)
    bw = max(r.memory_bandwidth_bytes_per_s for r in refs)
    return target.peak_for("fp32") > peak * margin or target.memory_bandwidth_bytes_per_s > bw * margin


def served_transfer(
    predict_ln: Callable[[np.ndarray], np.ndarray],
    raw: np.ndarray,
    *,
    target: HardwareSpec,
    refs: Sequence[HardwareSpec],
    floor_ms: tuple[float, float],
    precisions: Sequence[str] | None = None,
) -> Transfer | None:
    """What serving does for a GPU outside the training set: :func:`transfer_ln` with the default variant
    when :func:`extrapolates`, else ``None`` (keep the learned prediction). Intervals are widened by the
    caller (OOD scale)."""
    if not extrapolates(target, refs):
        return None
    return transfer_ln(predict_ln, raw, target=target, refs=refs, floor_ms=floor_ms, precisions=precisions)
