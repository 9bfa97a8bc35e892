"""The built-in datasheet catalog: every required id, complete and sourced values, datasheet spot checks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.core.hardware import PRECISIONS, HardwareSpec
from app.hardware.catalog import (
    InvalidHardwareSpec,
    load_catalog,
    parse_catalog,
    spec_from_dict,
    spec_to_dict,
    validate_spec,
)

REQUIRED_IDS = [
    "k40", "k80", "m60", "gtx-1080-ti", "p100", "titan-xp", "v100-sxm2-16gb", "v100-pcie-16gb", "t4",
    "a10", "a100-sxm4-40gb", "a100-pcie-40gb", "a100-sxm4-80gb", "a100-pcie-80gb", "l4", "l40s",
    "h100-sxm", "h100-pcie", "h200", "rtx-3090", "rtx-4090",
]  # fmt: skip
GIB = 2**30
CATALOG = load_catalog()


def test_every_required_id_is_present() -> None:
    assert not set(REQUIRED_IDS) - set(CATALOG)


@pytest.mark.parametrize("hardware_id", sorted(CATALOG))
def test_entry_is_complete_and_sourced(hardware_id: str) -> None:
    spec = CATALOG[hardware_id]
    assert spec.id == hardware_id
    assert spec.kind == "gpu"
    assert spec.peak_flops_per_s["fp32"] > 1e12
    assert spec.memory_bandwidth_bytes_per_s > 1e11
    assert spec.memory_bytes >= 8 * GIB
    assert spec.compute_units >= 13
    assert set(spec.peak_flops_per_s) <= set(PRECISIONS)
    for precision in spec.peak_flops_per_s:
        assert spec.sources[f"peak_flops_per_s.{precision}"].strip()
    for name in ("memory_bytes", "memory_bandwidth_bytes_per_s", "compute_units"):
        assert spec.sources[name].strip()
    for field in dataclasses.fields(HardwareSpec):
        value = getattr(spec, field.name)
        if isinstance(value, int | float) and field.name != "id":
            assert spec.sources.get(field.name), f"{hardware_id}.{field.name} has no source"
    validate_spec(spec)


@pytest.mark.parametrize(
    ("hardware_id", "fp32_tflops", "bandwidth_gb_per_s", "memory_gib", "sms"),
    [
        ("v100-sxm2-16gb", 15.7, 900, 16, 80),
        ("a100-sxm4-40gb", 19.5, 1555, 40, 108),
        ("a100-sxm4-80gb", 19.5, 2039, 80, 108),
        ("h100-sxm", 66.9, 3350, 80, 132),
        ("h100-pcie", 51.2, 2000, 80, 114),
        ("p100", 9.3, 732, 16, 56),  # PCIe 16 GB, the Justus 2018 cloud P100
        ("k80", 4.368, 240, 12, 13),  # one GK210 die, as TensorFlow sees it
        ("m60", 4.825, 160, 8, 16),  # one GM204 die
        ("gtx-1080-ti", 11.34, 484, 11, 28),
        ("t4", 8.1, 320, 16, 40),
    ],
)
def test_datasheet_spot_checks(
    hardware_id: str, fp32_tflops: float, bandwidth_gb_per_s: float, memory_gib: float, sms: int
) -> None:
    spec = CATALOG[hardware_id]
    assert spec.peak_flops_per_s["fp32"] == pytest.approx(fp32_tflops * 1e12, rel=1e-3)
    assert spec.memory_bandwidth_bytes_per_s == pytest.approx(bandwidth_gb_per_s * 1e9)
    assert spec.memory_bytes == memory_gib * GIB
    assert spec.compute_units == sms


def test_tensor_rates_where_the_device_has_them() -> None:
    assert CATALOG["v100-sxm2-16gb"].peak_flops_per_s["fp16"] == pytest.approx(125e12)
    assert "bf16" not in CATALOG["v100-sxm2-16gb"].peak_flops_per_s
    assert CATALOG["a100-sxm4-40gb"].peak_flops_per_s["tf32"] == pytest.approx(156e12)
    assert CATALOG["h100-sxm"].peak_flops_per_s["fp8"] == pytest.approx(1979e12)
    assert "fp16" not in CATALOG["k40"].peak_flops_per_s
    assert CATALOG["k40"].peak_for("fp16") == CATALOG["k40"].peak_flops_per_s["fp32"]


def test_values_are_exact_decimal_conversions() -> None:
    assert CATALOG["v100-sxm2-16gb"].peak_flops_per_s["fp32"] == 15.7e12
    assert CATALOG["mi250x"].memory_bandwidth_bytes_per_s == 1638.4e9


def test_mi250x_is_one_gcd_as_pytorch_sees_it() -> None:
    """ROCm shows an MI250X as two 64 GB devices of 110 CUs; the entry was the whole two-GCD module (128 GB,
    220 CUs, both dies' peaks), so a job that fits one GCD's memory only on paper was costed 2x too fast."""
    gcd = CATALOG["mi250x"]
    assert "one GCD" in gcd.name
    assert gcd.memory_bytes == 64 * 2**30 and gcd.compute_units == 110
    assert gcd.peak_flops_per_s["fp32"] == pytest.approx(95.7e12 / 2)
    assert gcd.peak_flops_per_s["fp16"] == pytest.approx(383e12 / 2)
    assert gcd.memory_bandwidth_bytes_per_s == pytest.approx(3276.8e9 / 2)
    assert gcd.tdp_w == pytest.approx(250) and gcd.l2_cache_bytes == 8 * 2**20
    for key in ("memory_bytes", "memory_bandwidth_bytes_per_s", "compute_units", "peak_flops_per_s.fp32"):
        assert "per GCD" in gcd.sources[key] and "datasheet" in gcd.sources[key]


@pytest.mark.parametrize("hardware_id", ["v100-sxm2-16gb", "h200", "k80"])
def test_round_trip_through_json(hardware_id: str) -> None:
    spec = CATALOG[hardware_id]
    data = json.loads(json.dumps(spec_to_dict(spec)))
    assert spec_from_dict(data) == spec


def test_spec_from_dict_rejects_unknown_and_missing_fields() -> None:
    data = spec_to_dict(CATALOG["t4"])
    with pytest.raises(InvalidHardwareSpec, match="unknown"):
        spec_from_dict({**data, "colour": "green"})
    del data["memory_bytes"]
    with pytest.raises(InvalidHardwareSpec):
        spec_from_dict(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peak_flops_per_s": {"fp16": 1e12}}, "fp32"),
        ({"peak_flops_per_s": {"fp32": -1.0}}, "positive"),
        ({"peak_flops_per_s": {"fp32": 1e12, "fp4": 1e12}}, "unknown precision"),
        ({"memory_bandwidth_bytes_per_s": 0.0}, "memory_bandwidth_bytes_per_s"),
        ({"memory_bytes": float("nan")}, "memory_bytes"),
        ({"compute_units": 0}, "compute_units"),
        ({"kind": "tpu"}, "kind"),
        ({"id": "Bad Id"}, "does not match"),
        ({"base_clock_mhz": 3000.0}, "base_clock_mhz"),
    ],
)
def test_validate_spec_rejects(change: dict, message: str) -> None:
    spec = dataclasses.replace(CATALOG["t4"], **change)
    with pytest.raises(InvalidHardwareSpec, match=message) as info:
        validate_spec(spec)
    assert isinstance(info.value, ValueError)


def test_parse_catalog_requires_a_source_per_value() -> None:
    text = """
[x1]
name = "X"
vendor = "V"
kind = "gpu"
peak_tflops = { fp32 = 1.0 }
memory_gib = 8
memory_bandwidth_gb_per_s = 100
compute_units = 4
[x1.sources]
"peak_flops_per_s.fp32" = "datasheet"
memory_bytes = "datasheet"
compute_units = "datasheet"
"""
    with pytest.raises(InvalidHardwareSpec, match="memory_bandwidth_bytes_per_s"):
        parse_catalog(text)
    fixed = text + 'memory_bandwidth_bytes_per_s = "datasheet"\n'
    spec = parse_catalog(fixed)["x1"]
    assert spec.memory_bytes == 8 * GIB and spec.memory_bandwidth_bytes_per_s == 100e9


def test_parse_catalog_rejects_unknown_keys() -> None:
    with pytest.raises(InvalidHardwareSpec, match="unknown keys"):
        parse_catalog('[x]\nname = "X"\nmemory_gb = 8\n')


def _generation(spec: HardwareSpec) -> str:
    return (spec.architecture or "").split(" (")[0]


@pytest.mark.parametrize("hardware_id", sorted(CATALOG))
def test_tensor_core_peaks_follow_the_architecture_and_are_dense(hardware_id: str) -> None:
    """The precision semantics (app/core/precision.py) read these peaks: a missing one is a 422, a sparsity
    figure would halve every mixed-precision floor."""
    spec = CATALOG[hardware_id]
    peaks = spec.peak_flops_per_s
    gen = _generation(spec)
    fp32 = peaks["fp32"]
    if gen in ("Ampere", "Ada Lovelace", "Hopper", "Blackwell", "CDNA 3"):
        assert {"tf32", "fp16", "bf16"} <= set(peaks)
        assert peaks["fp16"] == pytest.approx(2 * peaks["tf32"], rel=0.02)  # dense: fp16 is twice tf32
    if gen in ("Ada Lovelace", "Hopper", "Blackwell", "CDNA 3"):
        assert peaks["fp8"] == pytest.approx(2 * peaks["fp16"], rel=0.02)
    if gen in ("Volta", "Turing"):
        assert "fp16" in peaks and not {"tf32", "bf16"} & set(peaks)
        # 8x the CUDA-core rate (whitepapers); GeForce Turing accumulates in FP32 at half that rate
        ratio = 4 if "GeForce" in spec.name and gen == "Turing" else 8
        assert peaks["fp16"] == pytest.approx(ratio * fp32, rel=0.02)
    if gen == "Pascal":
        assert not {"tf32", "bf16"} & set(peaks)
        ratio = 2.0 if "GP100" in (spec.architecture or "") else 1 / 64
        assert peaks["fp16"] == pytest.approx(ratio * fp32, rel=0.02)
    if gen in ("Kepler", "Maxwell"):
        assert not {"tf32", "fp16", "bf16"} & set(peaks)
    if "fp16" in peaks and spec.vendor == "NVIDIA":
        assert peaks["fp16"] <= 16.5 * fp32  # A100's 312/19.5 = 16 is the largest dense ratio
