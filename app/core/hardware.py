"""Hardware specification record used by the cost model, the features and the predictor.

The catalog of datasheet entries lives in ``app/hardware/catalog.toml`` and is read by
:mod:`app.hardware.catalog`; this module only defines the record so that the pure analysis core does not
depend on where specs come from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

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


#: Specs whose derived keys (:func:`per_spec`) each memo keeps: a request reads one spec object many times
#: (the memo keys of its estimates, roofline rows, footprints and largest batch), a many-scenario call a few.
SPEC_MEMO_SIZE = 64

_T = TypeVar("_T")


def per_spec(memo: dict[int, tuple[HardwareSpec, Any]], hw: HardwareSpec, compute: Callable[[HardwareSpec], _T]) -> _T:
    """``compute(hw)``, remembered in ``memo`` for this spec object (by identity: a spec is frozen, so what is
    derived from it holds while the object lives) for the last :data:`SPEC_MEMO_SIZE` objects. The entry holds
    the object, so its ``id`` is not reused while the entry exists; a spec equal to a remembered one but
    another object is computed again (the key derived must not depend on which object asks). Safe under
    threads: a race computes the same value twice."""
    found = memo.get(id(hw))
    if found is not None and found[0] is hw:
        return found[1]  # type: ignore[no-any-return]
    value = compute(hw)
    memo[id(hw)] = (hw, value)
    if len(memo) > SPEC_MEMO_SIZE:
        # the oldest entry; another thread may have changed the memo meanwhile
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            del memo[next(iter(memo))]
    return value


_FINGERPRINTS: dict[int, tuple[HardwareSpec, Any]] = {}


def spec_fingerprint(hw: HardwareSpec) -> str:
    """Every field of ``hw`` (its dataclass ``repr``: strings, exact float reprs, mappings in full), so equal
    fingerprints mean equal specs whatever their id (a catalog row edited since is another device); two equal
    specs written differently (``40e9`` and ``40000000000``) only miss a memo keyed by it. ~12 us, computed
    once per spec object (:func:`per_spec`): a prediction's estimates and its roofline rows are keyed by it."""
    return per_spec(_FINGERPRINTS, hw, repr)


# JSON snapshots of specs stored in predictor metadata (``training_hardware``): the trainer snapshots every
# device it trained on, so serving and evaluation featurise a device exactly as training did even when its
# stored row or the local CPU detection changes later.


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
