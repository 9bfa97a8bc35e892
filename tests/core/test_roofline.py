"""Tests of the roofline bound (Williams et al. 2009)."""

from __future__ import annotations

import pytest

from app.core.roofline import bound, ridge_point_flops_per_byte, roofline_time_s

PEAK = 10e12  # FLOP/s
BW = 1e12  # B/s


def test_compute_bound_time_is_flops_over_peak() -> None:
    assert roofline_time_s(1e12, 1e9, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == pytest.approx(0.1)
    assert bound(1e12, 1e9, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == "compute"


def test_memory_bound_time_is_bytes_over_bandwidth() -> None:
    assert roofline_time_s(1e9, 1e12, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == pytest.approx(1.0)
    assert bound(1e9, 1e12, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == "memory"


def test_ridge_point_separates_the_two_regimes() -> None:
    ridge = ridge_point_flops_per_byte(peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW)
    assert ridge == pytest.approx(10.0)
    assert bound(ridge * 1e6 * 1.01, 1e6, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == "compute"
    assert bound(ridge * 1e6 * 0.99, 1e6, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == "memory"


def test_no_work_takes_no_time() -> None:
    assert roofline_time_s(0, 0, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == 0.0
    assert bound(0, 0, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW) == "memory"


@pytest.mark.parametrize(("peak", "bw"), [(0.0, BW), (PEAK, 0.0), (-1.0, BW)])
def test_rejects_non_positive_peaks(peak: float, bw: float) -> None:
    with pytest.raises(ValueError):
        roofline_time_s(1, 1, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw)


def test_rejects_negative_work() -> None:
    with pytest.raises(ValueError):
        roofline_time_s(-1, 1, peak_flops_per_s=PEAK, bandwidth_bytes_per_s=BW)
