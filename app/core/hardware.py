"""Hardware specification record used by the cost model, the features and the predictor.

The catalog of datasheet entries lives in ``app/hardware/catalog.toml`` and is read by
:mod:`app.hardware.catalog`; this module only defines the record so that the pure analysis core does not
depend on where specs come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

PRECISIONS: tuple[str, ...] = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """Datasheet figures of one device.

    Units are in the names. ``peak_flops_per_s`` maps a precision (see :data:`PRECISIONS`) to the dense
    peak in FLOP/s (FLOPs = 2 × MACs), tensor-core rates for ``tf32``/``fp16``/``bf16``/``fp8``/``int8``
    where the device has them. ``compute_units`` is the SM count (NVIDIA), CU count (AMD) or physical
    core count (CPU). ``sources`` maps a field name to where its value comes from (datasheet, whitepaper,
    measurement).
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
    sources: Mapping[str, str] = field(default_factory=dict)

    def peak_for(self, precision: str) -> float:
        """Peak FLOP/s for ``precision``, falling back to the fp32 rate when the device lists none.

        Raises ``KeyError`` if the device lists neither the precision nor fp32.
        """
        if precision in self.peak_flops_per_s:
            return self.peak_flops_per_s[precision]
        return self.peak_flops_per_s["fp32"]
