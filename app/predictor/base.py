"""The predictor interface: per-layer time queries, estimates, and the :class:`Predictor` protocol.

Implementations: :class:`app.predictor.onnx_model.LearnedPredictor` (ONNX MLP trained on measured
layers), :class:`app.predictor.roofline.RooflinePredictor` (physics fallback) and the routing composite
of :mod:`app.predictor.registry`. No torch anywhere under ``app/predictor``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import numpy as np

from app.core.costs import LayerCost
from app.core.hardware import HardwareSpec
from app.core.ir import Layer
from app.core.precision import Precision
from app.core.vocab import SoftwareStack

MODES: tuple[str, ...] = ("training", "inference")


@dataclass(frozen=True, slots=True)
class LayerTimeQuery:
    """One layer to time on one device.

    ``mode`` is ``"training"`` (forward + backward + optimizer update) or ``"inference"`` (forward only);
    ``optimizer`` a key of :data:`app.core.costs.OPTIMIZERS` (``"none"`` for inference); ``precision`` a
    :class:`app.core.precision.Precision` (its semantics, not a dtype: see that module), already checked
    against the device (:func:`app.core.precision.check_precision`). ``cost`` must be ``layer_cost(layer)``
    and supported (bytes at the graph's dtypes; predictors rescale them to the precision).
    ``software_stack`` is the stack the layer runs under (it sets the fixed per-kernel and per-layer
    overheads); the default is current PyTorch eager.
    """

    layer: Layer
    cost: LayerCost
    hardware: HardwareSpec
    mode: str  # "training" | "inference"
    optimizer: str  # key of app.core.costs.OPTIMIZERS ("none" for inference)
    precision: Precision = Precision.FP32
    software_stack: SoftwareStack = SoftwareStack.PYTORCH_EAGER


@dataclass(frozen=True, slots=True)
class LayerTimeEstimate:
    """Predicted time of one layer, milliseconds.

    ``forward_ms + backward_ms + update_ms`` is the point estimate (p50) of the whole step;
    ``total_ms_p10``/``total_ms_p90`` bound it (80 % interval). ``method`` says which predictor produced
    it; ``out_of_distribution`` is True when the input lies outside what that predictor was fitted on.
    ``physics_floor_ms`` is the sum of the per-pass floors (:func:`app.core.precision.physics_floor_ms`)
    once the serving clamp has applied them (None before); ``floor_clamped`` says whether any pass was
    raised to its floor.
    """

    forward_ms: float
    backward_ms: float  # 0 in inference mode
    update_ms: float  # optimizer step for this layer's params; 0 in inference or if no params
    total_ms_p10: float  # interval of forward+backward+update (or forward only in inference)
    total_ms_p90: float
    method: str  # "learned" | "roofline"
    out_of_distribution: bool
    notes: tuple[str, ...] = ()
    physics_floor_ms: float | None = None
    floor_clamped: bool = False

    @property
    def total_ms(self) -> float:
        """Point estimate of the whole step: forward + backward + update."""
        return self.forward_ms + self.backward_ms + self.update_ms


class Predictor(Protocol):
    """Anything that turns layer queries into estimates, in query order, one estimate per query."""

    version: str

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]: ...


@overload
def split_training_step(
    *, total_ms: float, forward_ms: float, update_ms: float, backward_min_ms: float
) -> tuple[float, float, float]: ...


@overload
def split_training_step(
    *, total_ms: np.ndarray, forward_ms: np.ndarray, update_ms: np.ndarray, backward_min_ms: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def split_training_step(
    *, total_ms: Any, forward_ms: Any, update_ms: Any, backward_min_ms: Any
) -> tuple[Any, Any, Any]:
    """Split a whole training-step time into (forward, backward, update) ms that sum to ``total_ms``.

    Measured data (Justus et al. 2018) time the forward pass and the whole step, not the backward pass,
    so ``backward = total − forward − update``, where ``update_ms`` is the optimizer step's (memory-bound)
    roofline time. When that leaves less than ``backward_min_ms`` (the two predictions disagree, e.g. on
    tiny layers), backward is set to ``backward_min_ms`` and forward and update are scaled down by the
    same factor so the sum is still ``total_ms``. ``backward_min_ms`` is capped at half the total.
    Every component stays ≥ 0, and > 0 when its input (and ``backward_min_ms``) is > 0.
    Floats give floats; arrays (``[N]`` each, elementwise, the learned predictor's table rows) give arrays.
    Raises ``ValueError`` if a ``total_ms`` is not positive.
    """
    total = np.asarray(total_ms, dtype=np.float64)
    if not np.all(total > 0):
        raise ValueError(f"total_ms must be > 0, got {total_ms!r}")
    fwd = np.maximum(np.asarray(forward_ms, dtype=np.float64), 0.0)
    upd = np.maximum(np.asarray(update_ms, dtype=np.float64), 0.0)
    bmin = np.minimum(np.maximum(np.asarray(backward_min_ms, dtype=np.float64), 0.0), 0.5 * total)
    rest = total - fwd - upd
    denom = fwd + upd
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(denom > 0, (total - bmin) / np.where(denom > 0, denom, 1.0), 0.0)
    keep = rest >= bmin
    out = (np.where(keep, fwd, fwd * scale), np.where(keep, rest, total - denom * scale),
           np.where(keep, upd, upd * scale))
    if total.ndim == 0:
        return float(out[0]), float(out[1]), float(out[2])
    return out


# ----------------------------------------------------------------------------------------- whole-model assembly

#: How the served backward and precision of a layer were obtained (the ``backward`` entry of a prediction's
#: ``assumptions``): the rules of :mod:`app.predictor.onnx_model` and :mod:`app.predictor.roofline`.
BACKWARD_SEMANTICS = (
    "learned GPU layers under PyTorch stacks: backward = the forward's work x (backward / forward physics "
    "floor) x the family's measured backward excess (convolutions: the DeepBench (bwd_data + bwd_filter) / fwd "
    "median in the serving artifact's backward_forward_ratio metadata over its FLOP ratio 2; other families "
    "1.0) + the stack's per-kernel cost per backward kernel; "
    "tf1-session requests and CPU layers: measured training steps minus the forward; ops never measured on "
    "tensor cores: predicted in strict fp32 and carried to the precision by the physics floors; roofline "
    "fallback layers: bytes and FLOPs of each pass at their peak (app/predictor/onnx_model.py, roofline.py)"
)

#: Baidu DeepBench's convolution training rows time ``bwd_data`` and ``bwd_filter`` of the same configuration
#: as ``fwd``; with the direct algorithm each backward product has the forward's MACs, so their FLOP (and
#: physics-floor) ratio is 2 and a measured time ratio ``r`` means the backward runs ``r / 2`` times less
#: efficiently than the forward.
DEEPBENCH_CONV_FLOP_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class BackwardExcess:
    """How much slower than its forward, per unit of physics floor, a family's backward runs: the median
    measured backward/forward time ratio divided by the family's floor ratio (1.0 = the backward reaches the
    forward's efficiency); ``source`` says where the ratio was measured (or that none was)."""

    median: float
    source: str


#: No paired measurement: the backward kernels (input and weight gradient GEMMs, or the element-wise
#: backward) run at their forward's efficiency.
PHYSICS_EXCESS = BackwardExcess(1.0, "no paired measurement: the backward runs at its forward's efficiency")


def backward_excess_from_ratios(ratios: Mapping[str, Any] | None) -> BackwardExcess | None:
    """The convolution :class:`BackwardExcess` from an artifact's ``backward_forward_ratio`` metadata
    (``{"conv": {"median", "q25", "q75", "n"}, "source": ...}``, written by the trainer from DeepBench): the
    median over :data:`DEEPBENCH_CONV_FLOP_RATIO`; ``None`` when the artifact has no convolution ratio.
    Raises ``ValueError`` for a median that is not a positive finite number."""
    ratios = ratios or {}
    conv = ratios.get("conv")
    if not isinstance(conv, Mapping):
        return None
    median = float(conv.get("median", math.nan))
    if not (math.isfinite(median) and median > 0):
        raise ValueError(f"backward_forward_ratio.conv.median must be a positive finite ratio, got {dict(conv)!r}")
    src = (f"{ratios.get('source', 'artifact metadata')}: conv (bwd_data + bwd_filter) / fwd median {median:.3g}, "
           f"n={conv.get('n')}")
    return BackwardExcess(median / DEEPBENCH_CONV_FLOP_RATIO, src)


def backward_from_forward_ms(
    *, forward_ms: Any, floor_forward_ms: Any, floor_backward_ms: Any, kernels: Any, kernel_ms: float,
    excess: Any,
) -> Any:
    """Backward time (ms) of a layer from its forward time: per-kernel overhead plus scaled forward work.

    ``kernels × kernel_ms + max(forward_ms − kernel_ms, 0) × excess × floor_backward_ms / floor_forward_ms``:
    the forward's work above its one launch, scaled by how much more physics the backward has (its floor over
    the forward's, at the same precision: 2 for a convolution or GEMM with both gradients, 1 without the input
    gradient, the byte ratio for memory-bound ops) and by the family's measured ``excess``
    (:class:`BackwardExcess`); each backward kernel (``kernels``: input and weight gradients, or one) pays the
    stack's fixed cost ``kernel_ms``. When the forward floor is 0 (no work), the backward is its floor plus its
    launches; with neither a backward floor nor kernels it is 0. Floats or ``[N]`` arrays (elementwise, the
    learned predictor's table rows); returns an array (0-d for floats). Raises ``ValueError`` for a negative
    input.
    """
    f, ff, fb, n, ex = (np.asarray(v, dtype=np.float64) for v in
                        (forward_ms, floor_forward_ms, floor_backward_ms, kernels, excess))
    if min(float(np.min(a)) if a.size else 0.0 for a in (f, ff, fb, n, ex)) < 0 or kernel_ms < 0:
        raise ValueError("backward_from_forward_ms takes non-negative times, counts and ratios")
    launches = n * kernel_ms
    with np.errstate(divide="ignore", invalid="ignore"):
        work = np.maximum(f - kernel_ms, 0.0) * ex * fb / np.where(ff > 0, ff, 1.0)
    return np.where((fb == 0) & (n == 0), 0.0, np.where(ff <= 0, launches + fb, launches + work))


def transfer_precision_ms(*, time_ms: Any, floor_from_ms: Any, floor_to_ms: Any, overhead_ms: Any) -> Any:
    """A time measured (or predicted) at one precision carried to another at the same efficiency (ms).

    ``overhead_ms + max(time_ms − overhead_ms, 0) × floor_to_ms / floor_from_ms``, never below ``floor_to_ms``:
    the fixed launch cost stays, the work above it scales with the physics floor (peak at the precision, bytes
    at its storage type). Floats or broadcastable arrays (the learned predictor passes ``[N, 3]`` quantiles
    with ``[N, 1]`` floors); returns an array (0-d for floats). ``floor_from_ms`` must be > 0. Raises
    ``ValueError`` otherwise or for a negative input.
    """
    t, f_from, f_to, over = (np.asarray(v, dtype=np.float64) for v in
                             (time_ms, floor_from_ms, floor_to_ms, overhead_ms))
    if f_from.size and not np.all(f_from > 0):
        raise ValueError(f"floor_from_ms must be > 0, got {floor_from_ms!r}")
    if min(float(np.min(a)) if a.size else 0.0 for a in (t, f_to, over)) < 0:
        raise ValueError("transfer_precision_ms takes non-negative times")
    return np.maximum(over + np.maximum(t - over, 0.0) * f_to / f_from, f_to)
