"""Roofline model: the lower bound on a kernel's run time from peak compute and peak memory bandwidth.

Williams, Waterman & Patterson (2009), "Roofline: An Insightful Visual Performance Model for Multicore
Architectures", Communications of the ACM 52(4): attainable FLOP/s = min(peak FLOP/s, operational
intensity × bandwidth). Equivalently the time of a kernel is at least ``max(flops / peak,
bytes / bandwidth)``; the *ridge point* ``peak / bandwidth`` (FLOPs per byte) separates memory-bound
kernels (intensity below it) from compute-bound ones (above it).

Pure functions, no I/O; units are in the names (FLOPs = 2 × MACs, bytes of DRAM traffic, seconds).
"""

from __future__ import annotations

from typing import Literal


def _check(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> None:
    if not peak_flops_per_s > 0 or not bandwidth_bytes_per_s > 0:
        raise ValueError(
            f"peak_flops_per_s and bandwidth_bytes_per_s must be > 0, got {peak_flops_per_s!r}, "
            f"{bandwidth_bytes_per_s!r}"
        )


def roofline_time_s(flops: float, bytes_: float, *, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """Roofline lower bound on run time in seconds: ``max(flops / peak, bytes / bandwidth)``.

    ``flops`` and ``bytes_`` are totals (≥ 0) for the kernel; ``peak_flops_per_s`` and
    ``bandwidth_bytes_per_s`` are the device's datasheet peaks (> 0). Returns 0.0 for a kernel with no
    work. Raises ``ValueError`` for a non-positive peak or bandwidth or negative work.
    Source: Williams et al. 2009 (CACM 52(4)).
    """
    _check(peak_flops_per_s, bandwidth_bytes_per_s)
    if flops < 0 or bytes_ < 0:
        raise ValueError(f"flops and bytes_ must be >= 0, got {flops!r}, {bytes_!r}")
    return max(flops / peak_flops_per_s, bytes_ / bandwidth_bytes_per_s)


def ridge_point_flops_per_byte(*, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """Operational intensity (FLOPs per byte) at which the compute and memory roofs meet.

    Raises ``ValueError`` for a non-positive peak or bandwidth. Source: Williams et al. 2009.
    """
    _check(peak_flops_per_s, bandwidth_bytes_per_s)
    return peak_flops_per_s / bandwidth_bytes_per_s


def bound(
    flops: float, bytes_: float, *, peak_flops_per_s: float, bandwidth_bytes_per_s: float
) -> Literal["compute", "memory"]:
    """Which roof limits the kernel: ``"compute"`` if ``flops / peak ≥ bytes / bandwidth`` else ``"memory"``.

    A kernel exactly on the ridge counts as compute-bound; a kernel with no work at all as memory-bound.
    Raises ``ValueError`` like :func:`roofline_time_s`. Source: Williams et al. 2009.
    """
    _check(peak_flops_per_s, bandwidth_bytes_per_s)
    if flops <= 0:
        return "memory"
    return "compute" if flops / peak_flops_per_s >= bytes_ / bandwidth_bytes_per_s else "memory"
