"""The predictor interface: per-layer time queries, estimates, and the :class:`Predictor` protocol.

Implementations: :class:`app.predictor.onnx_model.LearnedPredictor` (ONNX MLP trained on measured
layers), :class:`app.predictor.roofline.RooflinePredictor` (physics fallback) and the routing composite
of :mod:`app.predictor.registry`. No torch anywhere under ``app/predictor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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


def split_training_step(
    *, total_ms: float, forward_ms: float, update_ms: float, backward_min_ms: float
) -> tuple[float, float, float]:
    """Split a whole training-step time into (forward, backward, update) ms that sum to ``total_ms``.

    Measured data (Justus et al. 2018) time the forward pass and the whole step, not the backward pass,
    so ``backward = total − forward − update``, where ``update_ms`` is the optimizer step's (memory-bound)
    roofline time. When that leaves less than ``backward_min_ms`` (the two predictions disagree, e.g. on
    tiny layers), backward is set to ``backward_min_ms`` and forward and update are scaled down by the
    same factor so the sum is still ``total_ms``. ``backward_min_ms`` is capped at half the total.
    Every component stays ≥ 0, and > 0 when its input (and ``backward_min_ms``) is > 0.
    Raises ``ValueError`` if ``total_ms`` is not positive.
    """
    if not total_ms > 0:
        raise ValueError(f"total_ms must be > 0, got {total_ms!r}")
    forward_ms = max(forward_ms, 0.0)
    update_ms = max(update_ms, 0.0)
    bmin = min(max(backward_min_ms, 0.0), 0.5 * total_ms)
    rest = total_ms - forward_ms - update_ms
    if rest >= bmin:
        return forward_ms, rest, update_ms
    denom = forward_ms + update_ms
    scale = (total_ms - bmin) / denom if denom > 0 else 0.0
    return forward_ms * scale, total_ms - (forward_ms + update_ms) * scale, update_ms * scale
