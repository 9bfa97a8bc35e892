"""Detection of the local CPU: positive values, a source for each, graceful degradation."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.hardware import local
from app.hardware.catalog import validate_spec


def test_detect_local_cpu_is_positive_and_sourced() -> None:
    spec = local.detect_local_cpu()
    assert spec.id == "local" and spec.kind == "cpu"
    assert spec.compute_units >= 1
    assert spec.peak_flops_per_s["fp32"] > 0
    assert spec.memory_bandwidth_bytes_per_s > 1e8
    assert spec.memory_bytes > 0
    assert spec.vector_width_bits is not None and spec.vector_width_bits % 128 == 0
    validate_spec(spec)
    for key in (
        "compute_units",
        "peak_flops_per_s.fp32",
        "memory_bytes",
        "memory_bandwidth_bytes_per_s",
        "vector_width_bits",
    ):
        assert spec.sources[key]
    assert spec.sources["memory_bandwidth_bytes_per_s"].startswith("measured:")


def test_detect_local_cpu_is_cached() -> None:
    assert local.detect_local_cpu() is local.detect_local_cpu()


def test_bandwidth_measurement_stays_in_budget() -> None:
    result = local.measure_memory_bandwidth(threads=1, llc_bytes=2**20, budget_s=0.1)
    assert result.bytes_per_s > 0 and result.repetitions >= 2


@pytest.mark.parametrize(
    ("flags", "bits", "ports"),
    [
        ({"avx512f", "avx2", "fma"}, 512, 2),
        ({"avx2", "fma"}, 256, 2),
        ({"avx"}, 256, 1),
        ({"sse2"}, 128, 1),
        (set(), 128, 1),
    ],
)
def test_vector_width_from_x86_flags(flags: set[str], bits: int, ports: int) -> None:
    assert local._vector_width("x86_64", flags)[:2] == (bits, ports)


def test_degrades_without_proc_and_sys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(local, "_CPUINFO", tmp_path / "missing_cpuinfo")
    monkeypatch.setattr(local, "_SYS_CPU", tmp_path / "missing_sys")
    monkeypatch.setattr(local.psutil, "cpu_freq", lambda: None)
    monkeypatch.setattr(local, "measure_memory_bandwidth", _fake_bandwidth)
    spec = local.detect_local_cpu.__wrapped__()
    validate_spec(spec)
    assert spec.boost_clock_mhz is None and spec.l2_cache_bytes is None
    assert spec.sources["peak_flops_per_s.fp32"].startswith("measured:")


def _fake_bandwidth(*, threads: int, llc_bytes: int | None = None) -> local.BandwidthMeasurement:
    return local.BandwidthMeasurement(bytes_per_s=1e10, array_bytes=2**25, threads=threads, repetitions=2)


def test_cache_size_parsing() -> None:
    assert local._parse_cache_size("1024K") == 2**20
    assert local._parse_cache_size("32M\n") == 32 * 2**20
    assert local._parse_cache_size("weird") is None
