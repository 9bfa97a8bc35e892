"""JSON snapshots of hardware specs stored in predictor metadata (``training_hardware``).

The trainer snapshots the spec of every device it trained on, so serving and evaluation featurise a
device exactly as training did even when its stored row or the local CPU detection changes later.
"""

from __future__ import annotations

from typing import Any

from app.core.hardware import HardwareSpec


def hardware_to_dict(hw: HardwareSpec) -> dict[str, Any]:
    """JSON-ready snapshot of a spec (every field but ``sources``), inverse of :func:`hardware_from_dict`."""
    return {
        "id": hw.id,
        "name": hw.name,
        "vendor": hw.vendor,
        "kind": hw.kind,
        "peak_flops_per_s": dict(hw.peak_flops_per_s),
        "memory_bytes": hw.memory_bytes,
        "memory_bandwidth_bytes_per_s": hw.memory_bandwidth_bytes_per_s,
        "compute_units": hw.compute_units,
        "base_clock_mhz": hw.base_clock_mhz,
        "boost_clock_mhz": hw.boost_clock_mhz,
        "tdp_w": hw.tdp_w,
        "l2_cache_bytes": hw.l2_cache_bytes,
        "vector_width_bits": hw.vector_width_bits,
        "architecture": hw.architecture,
    }


def hardware_from_dict(d: dict[str, Any]) -> HardwareSpec:
    """Rebuild a :class:`HardwareSpec` from :func:`hardware_to_dict`; raises ``KeyError`` if a field is missing."""
    return HardwareSpec(
        id=str(d["id"]),
        name=str(d["name"]),
        vendor=str(d.get("vendor", "")),
        kind=d["kind"],
        peak_flops_per_s={str(k): float(v) for k, v in d["peak_flops_per_s"].items()},
        memory_bytes=float(d["memory_bytes"]),
        memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
        compute_units=int(d["compute_units"]),
        base_clock_mhz=d.get("base_clock_mhz"),
        boost_clock_mhz=d.get("boost_clock_mhz"),
        tdp_w=d.get("tdp_w"),
        l2_cache_bytes=d.get("l2_cache_bytes"),
        vector_width_bits=d.get("vector_width_bits"),
        architecture=d.get("architecture"),
    )
