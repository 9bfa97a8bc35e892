"""Power of a device running one layer: an estimate from the layer's utilisation (pure).

Linear utilisation model (Fan, Weber & Barroso, "Power provisioning for a warehouse-sized computer",
ISCA 2007, used for GPUs e.g. by the ML CO2 / Green Algorithms calculators):

    P = P_idle + (P_TDP − P_idle) × u

with ``u`` the layer's utilisation of the resource that bounds it: the larger of achieved FLOP/s / peak
FLOP/s and achieved bytes/s / memory bandwidth (the roofline's two axes), clipped to [0, 1]. This is an
estimate: real boards throttle, draw differently for tensor-core and memory traffic, and rarely reach TDP.
Time that no layer occupies (per-iteration overhead, exposed communication, input stalls, checkpoint writes)
is charged at idle power. Device energy only: host CPUs, networking and cooling (PUE) are not included.

``idle_power_w``: the catalog's value where it lists one, else :data:`IDLE_FRACTION_OF_TDP` × TDP.
"""

from __future__ import annotations

from app.core.hardware import HardwareSpec

#: Idle draw as a share of TDP when the catalog lists none: an estimate (``nvidia-smi`` shows roughly 50–70 W
#: idle for 300–700 W data-centre boards, i.e. 10–25 %; Green Algorithms assumes the TDP throughout).
IDLE_FRACTION_OF_TDP = 0.2


class NoPowerFigure(ValueError):
    """The device has neither a TDP nor an idle power: no energy can be estimated."""


def idle_power_w(hw: HardwareSpec) -> float:
    """Idle power (W) of ``hw``: ``hw.idle_power_w`` or :data:`IDLE_FRACTION_OF_TDP` × ``hw.tdp_w``.

    Raises :class:`NoPowerFigure` when the spec has no TDP.
    """
    if hw.tdp_w is None:
        raise NoPowerFigure(f"hardware {hw.id!r} has no tdp_w: energy cannot be estimated")
    return hw.idle_power_w if hw.idle_power_w is not None else IDLE_FRACTION_OF_TDP * hw.tdp_w


def utilisation(*, flops: float, nbytes: float, time_ms: float, peak_flops_per_s: float,
                bandwidth_bytes_per_s: float) -> float:
    """max(achieved FLOP/s / peak, achieved bytes/s / bandwidth) of ``flops`` FLOPs and ``nbytes`` bytes of
    memory traffic done in ``time_ms``, clipped to [0, 1]; 0 for a zero time."""
    if time_ms <= 0:
        return 0.0
    t = time_ms / 1e3
    u = max(flops / t / peak_flops_per_s, nbytes / t / bandwidth_bytes_per_s)
    return min(max(u, 0.0), 1.0)


def power_w(hw: HardwareSpec, u: float) -> float:
    """Power (W) of ``hw`` at utilisation ``u`` ∈ [0, 1]: idle + (TDP − idle) × u (module docstring).

    Raises :class:`NoPowerFigure` without a TDP and ``ValueError`` for ``u`` outside [0, 1].
    """
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"utilisation must lie in [0, 1], got {u}")
    idle = idle_power_w(hw)
    assert hw.tdp_w is not None  # idle_power_w checked it
    return idle + (max(hw.tdp_w, idle) - idle) * u


J_PER_KWH = 3.6e6
