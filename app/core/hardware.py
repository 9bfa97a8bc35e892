"""Hardware specification record used by the cost model, the features and the predictor.

The catalog of datasheet entries lives in ``app/hardware/catalog.toml`` and is read by
:mod:`app.hardware.catalog`; this module only defines the record so that the pure analysis core does not
depend on where specs come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from app.core.collectives import Link, LinkKind

PRECISIONS: tuple[str, ...] = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """Datasheet figures of one device.

    Units are in the names. ``peak_flops_per_s`` maps a precision (see :data:`PRECISIONS`) to the dense
    peak in FLOP/s (FLOPs = 2 × MACs), tensor-core rates for ``tf32``/``fp16``/``bf16``/``fp8``/``int8``
    where the device has them. ``compute_units`` is the SM count (NVIDIA), CU count (AMD) or physical
    core count (CPU). ``sources`` maps a field name to where its value comes from (datasheet, whitepaper,
    measurement).

    Data parallel and money: ``interconnect`` is what joins several of these devices in a typical
    multi-device node (NVLink, AMD Infinity Fabric ``xgmi``, PCIe, or the ``network``),
    ``interconnect_bandwidth_bytes_per_s`` its per-direction bandwidth per device and
    ``interconnect_latency_s`` the fixed latency of one ring step (:mod:`app.core.collectives`).
    ``idle_power_w`` is the idle draw (W); ``price_usd_per_hour`` a public on-demand list price per
    device-hour (the source gives the offer and the date).
    """

    id: str
    name: str
    vendor: str
    kind: Literal["gpu", "cpu"]
    peak_flops_per_s: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    compute_units: int
    base_clock_mhz: float | None = None
    boost_clock_mhz: float | None = None
    tdp_w: float | None = None
    l2_cache_bytes: float | None = None
    vector_width_bits: int | None = None
    architecture: str | None = None
    idle_power_w: float | None = None
    price_usd_per_hour: float | None = None
    interconnect: LinkKind | None = None
    interconnect_bandwidth_bytes_per_s: float | None = None
    interconnect_latency_s: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def link(self) -> Link | None:
        """The interconnect as a :class:`~app.core.collectives.Link`, ``None`` when the spec lacks any of
        its three fields."""
        if (self.interconnect is None or self.interconnect_bandwidth_bytes_per_s is None
                or self.interconnect_latency_s is None):
            return None
        return Link(kind=self.interconnect, bandwidth_bytes_per_s=self.interconnect_bandwidth_bytes_per_s,
                    step_latency_s=self.interconnect_latency_s)

    def peak_for(self, precision: str) -> float:
        """Peak FLOP/s for ``precision``, falling back to the fp32 rate when the device lists none.

        Raises ``KeyError`` if the device lists neither the precision nor fp32.
        """
        if precision in self.peak_flops_per_s:
            return self.peak_flops_per_s[precision]
        return self.peak_flops_per_s["fp32"]
