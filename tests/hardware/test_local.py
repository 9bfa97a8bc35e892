"""Detection of the local CPU: positive values, a source for each, graceful degradation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.hardware import local
from app.hardware.catalog import validate_spec
from app.main import create_app
from app.migrate import upgrade


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


def _no_measurement(**_: object) -> local.BandwidthMeasurement:
    raise AssertionError("memory bandwidth was measured again")


def test_stored_measurement_is_reused_on_the_same_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    first = local.detect_local_cpu()
    monkeypatch.setattr(local, "measure_memory_bandwidth", _no_measurement)
    monkeypatch.setattr(local, "_measure_matmul_flops", _no_measurement)
    again = local.local_cpu_spec(first)
    assert again.memory_bandwidth_bytes_per_s == first.memory_bandwidth_bytes_per_s
    assert again.peak_flops_per_s == first.peak_flops_per_s
    assert again.sources["memory_bandwidth_bytes_per_s"] == first.sources["memory_bandwidth_bytes_per_s"]
    assert "measured at " in again.sources["memory_bandwidth_bytes_per_s"]


def test_another_machine_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first = local.detect_local_cpu()
    other = dataclasses.replace(first, compute_units=first.compute_units + 7, memory_bandwidth_bytes_per_s=1.0)
    monkeypatch.setattr(local, "measure_memory_bandwidth", _fake_bandwidth)
    spec = local.local_cpu_spec(other)
    assert spec.memory_bandwidth_bytes_per_s == 1e10  # the fresh (fake) measurement, not the stored 1.0
    assert local.local_cpu_spec(None) is local.detect_local_cpu()


def test_local_bandwidth_survives_a_restart(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two starts of the service on one database, with a measurement in between that would differ:
    ``local`` and a prediction on it stay the same."""
    upgrade(settings.database_url)
    graph = {"input_shape": [64], "layers": [{"op": "linear", "out_features": 64}]}
    request = {"graph": graph, "hardware_id": "local", "batch_size": 8}
    with TestClient(create_app(settings)) as client:
        before = client.get("/v1/hardware/local").json()
        predicted = client.post("/v1/predictions", json=request).json()
    local.detect_local_cpu.cache_clear()  # a new process
    monkeypatch.setattr(local, "measure_memory_bandwidth", _fake_bandwidth)  # would give 1e10
    try:
        with TestClient(create_app(settings)) as client:
            after = client.get("/v1/hardware/local").json()
            predicted_again = client.post("/v1/predictions", json=request).json()
    finally:
        local.detect_local_cpu.cache_clear()
    assert before["memory_bandwidth_bytes_per_s"] != 1e10
    assert after["memory_bandwidth_bytes_per_s"] == before["memory_bandwidth_bytes_per_s"]
    assert after["sources"] == before["sources"]
    assert predicted_again == predicted


def test_a_drifting_current_clock_does_not_change_the_stored_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no max frequency is readable the clock is the current ``cpu MHz``, which drifts between
    reads; with a stored spec from the same machine, clock, peak and bandwidth stay as stored."""
    source = f"{local._CURRENT_CLOCK_SOURCE} (current clock; max unavailable)"
    monkeypatch.setattr(local, "_frequencies_mhz", lambda _info: (2500.0, source, None, ""))
    monkeypatch.setattr(local, "measure_memory_bandwidth", _fake_bandwidth)
    first = local._detect(stored=None)
    monkeypatch.setattr(local, "_frequencies_mhz", lambda _info: (2611.7, source, None, ""))
    monkeypatch.setattr(local, "measure_memory_bandwidth", _no_measurement)
    again = local.local_cpu_spec(first)
    assert again.boost_clock_mhz == 2500.0
    assert again.peak_flops_per_s == first.peak_flops_per_s
    assert again.memory_bandwidth_bytes_per_s == first.memory_bandwidth_bytes_per_s == 1e10
