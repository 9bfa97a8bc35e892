"""The built-in hardware catalog (``catalog.toml`` next to this module) and the JSON form of a spec.

The TOML file stores datasheet units (TFLOPS, GiB, GB/s, MiB, see its header); :func:`load_catalog`
converts them to the SI units of :class:`app.core.hardware.HardwareSpec` (FLOP/s, bytes, bytes/s).
:func:`spec_to_dict` / :func:`spec_from_dict` give the JSON-safe form stored in ``hardware.spec`` and
returned by the API; :func:`validate_spec` is the one place that says what a usable spec is.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from app.core.collectives import LINK_KINDS
from app.core.hardware import PRECISIONS, HardwareSpec

CATALOG_RESOURCE = "catalog.toml"
HARDWARE_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_ID_RE = re.compile(HARDWARE_ID_PATTERN)
KINDS: tuple[str, ...] = ("gpu", "cpu")

GB = 1e9  # bandwidth: decimal GB/s, as on datasheets
GIB = 2**30  # DRAM capacity: vendors' "GB" of memory are binary
MIB = 2**20

# TOML key -> (HardwareSpec field, factor)
_SCALED_KEYS: dict[str, tuple[str, float]] = {
    "memory_gib": ("memory_bytes", GIB),
    "memory_bandwidth_gb_per_s": ("memory_bandwidth_bytes_per_s", GB),
    "l2_cache_mib": ("l2_cache_bytes", MIB),
    "interconnect_bandwidth_gb_per_s": ("interconnect_bandwidth_bytes_per_s", GB),
    "interconnect_latency_us": ("interconnect_latency_s", 1e-6),
}
_PLAIN_KEYS = frozenset(
    {
        "name",
        "vendor",
        "kind",
        "architecture",
        "compute_units",
        "base_clock_mhz",
        "boost_clock_mhz",
        "tdp_w",
        "vector_width_bits",
        "idle_power_w",
        "price_usd_per_hour",
        "interconnect",
        "sources",
    }
)
_NUMERIC_FIELDS: tuple[str, ...] = (
    "memory_bytes",
    "memory_bandwidth_bytes_per_s",
    "compute_units",
    "base_clock_mhz",
    "boost_clock_mhz",
    "tdp_w",
    "l2_cache_bytes",
    "vector_width_bits",
    "idle_power_w",
    "price_usd_per_hour",
    "interconnect_bandwidth_bytes_per_s",
    "interconnect_latency_s",
)
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(HardwareSpec))


class InvalidHardwareSpec(ValueError):
    """A hardware spec (catalog entry, stored JSON, or inline spec) is missing or has a wrong value."""


def _is_positive_number(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def validate_spec(spec: HardwareSpec) -> HardwareSpec:
    """Check that ``spec`` is usable by the cost model and return it unchanged.

    Rules: ``id`` matches :data:`HARDWARE_ID_PATTERN`; ``kind`` is ``gpu`` or ``cpu``; ``name`` and
    ``vendor`` are not empty; ``peak_flops_per_s`` has an ``fp32`` entry, only keys from
    :data:`app.core.hardware.PRECISIONS`, and every rate positive and finite; ``memory_bytes``,
    ``memory_bandwidth_bytes_per_s`` and ``compute_units`` are positive; optional numbers, when given,
    are positive; ``base_clock_mhz <= boost_clock_mhz`` when both are given.

    Raises :class:`InvalidHardwareSpec` naming the device and the offending field.
    """

    def fail(msg: str) -> InvalidHardwareSpec:
        return InvalidHardwareSpec(f"hardware {spec.id!r}: {msg}")

    if not isinstance(spec.id, str) or not _ID_RE.match(spec.id):
        raise InvalidHardwareSpec(f"hardware id {spec.id!r} does not match {HARDWARE_ID_PATTERN}")
    if spec.kind not in KINDS:
        raise fail(f"kind must be one of {KINDS}, got {spec.kind!r}")
    if not spec.name or not spec.vendor:
        raise fail("name and vendor must not be empty")
    peaks = spec.peak_flops_per_s
    if "fp32" not in peaks:
        raise fail("peak_flops_per_s must contain 'fp32'")
    for precision, rate in peaks.items():
        if precision not in PRECISIONS:
            raise fail(f"unknown precision {precision!r} in peak_flops_per_s (known: {PRECISIONS})")
        if not _is_positive_number(rate):
            raise fail(f"peak_flops_per_s[{precision!r}] must be a positive number, got {rate!r}")
    for name in ("memory_bytes", "memory_bandwidth_bytes_per_s", "compute_units"):
        if not _is_positive_number(getattr(spec, name)):
            raise fail(f"{name} must be a positive number, got {getattr(spec, name)!r}")
    if not isinstance(spec.compute_units, int):
        raise fail(f"compute_units must be an integer, got {spec.compute_units!r}")
    for name in _NUMERIC_FIELDS:
        value = getattr(spec, name)
        if value is not None and not _is_positive_number(value):
            raise fail(f"{name} must be a positive number when given, got {value!r}")
    if spec.interconnect is not None and spec.interconnect not in LINK_KINDS:
        raise fail(f"interconnect must be one of {LINK_KINDS}, got {spec.interconnect!r}")
    link_fields = (spec.interconnect, spec.interconnect_bandwidth_bytes_per_s, spec.interconnect_latency_s)
    if any(v is None for v in link_fields) and any(v is not None for v in link_fields):
        raise fail("interconnect, interconnect_bandwidth_bytes_per_s and interconnect_latency_s go together")
    if spec.idle_power_w is not None and spec.tdp_w is not None and spec.idle_power_w > spec.tdp_w:
        raise fail(f"idle_power_w {spec.idle_power_w} exceeds tdp_w {spec.tdp_w}")
    if (
        spec.base_clock_mhz is not None
        and spec.boost_clock_mhz is not None
        and spec.base_clock_mhz > spec.boost_clock_mhz
    ):
        raise fail(f"base_clock_mhz {spec.base_clock_mhz} exceeds boost_clock_mhz {spec.boost_clock_mhz}")
    return spec


def spec_to_dict(spec: HardwareSpec) -> dict[str, Any]:
    """JSON-safe dict of ``spec``: the dataclass field names (units in the names), plain dicts for
    ``peak_flops_per_s`` (FLOP/s) and ``sources``, ``None`` for unknown optional values."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out


def spec_from_dict(data: Mapping[str, Any]) -> HardwareSpec:
    """Inverse of :func:`spec_to_dict`; validates the result (:func:`validate_spec`).

    Missing optional keys take the dataclass defaults. Raises :class:`InvalidHardwareSpec` on unknown
    keys, missing required keys or invalid values.
    """
    unknown = set(data) - _FIELD_NAMES
    if unknown:
        raise InvalidHardwareSpec(f"unknown hardware spec fields: {sorted(unknown)}")
    kwargs = dict(data)
    for key in ("peak_flops_per_s", "sources"):
        if key in kwargs and kwargs[key] is not None:
            kwargs[key] = dict(kwargs[key])
    if kwargs.get("sources") is None:
        kwargs.pop("sources", None)
    if isinstance(kwargs.get("peak_flops_per_s"), dict):
        kwargs["peak_flops_per_s"] = {k: float(v) for k, v in kwargs["peak_flops_per_s"].items()}
    try:
        spec = HardwareSpec(**kwargs)
    except TypeError as exc:  # missing required fields
        raise InvalidHardwareSpec(f"incomplete hardware spec {data.get('id')!r}: {exc}") from exc
    return validate_spec(spec)


def _scale_decimal(value: Any, exponent: str) -> float:
    """``value`` × 10**exponent without binary rounding noise (15.7 TFLOPS -> exactly 15.7e12)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidHardwareSpec(f"expected a number, got {value!r}")
    return float(f"{value!r}{exponent}")


def _entry_to_spec(hardware_id: str, entry: Mapping[str, Any]) -> HardwareSpec:
    """Convert one TOML table (datasheet units) to a validated :class:`HardwareSpec`."""
    unknown = set(entry) - _PLAIN_KEYS - set(_SCALED_KEYS) - {"peak_tflops"}
    if unknown:
        raise InvalidHardwareSpec(f"catalog entry {hardware_id!r}: unknown keys {sorted(unknown)}")
    kwargs: dict[str, Any] = {"id": hardware_id}
    for key, value in entry.items():
        if key == "peak_tflops":
            kwargs["peak_flops_per_s"] = {p: _scale_decimal(v, "e12") for p, v in value.items()}
        elif key in _SCALED_KEYS:
            field_name, factor = _SCALED_KEYS[key]
            if factor == GB:
                kwargs[field_name] = _scale_decimal(value, "e9")
            elif factor == 1e-6:
                kwargs[field_name] = _scale_decimal(value, "e-6")
            else:
                kwargs[field_name] = float(value) * factor
        elif key in ("base_clock_mhz", "boost_clock_mhz", "tdp_w", "idle_power_w", "price_usd_per_hour"):
            kwargs[key] = float(value)
        else:
            kwargs[key] = value
    try:
        spec = HardwareSpec(**kwargs)
    except TypeError as exc:
        raise InvalidHardwareSpec(f"catalog entry {hardware_id!r}: {exc}") from exc
    validate_spec(spec)
    _check_sources(spec)
    return spec


def _check_sources(spec: HardwareSpec) -> None:
    """Every value of a catalog entry must say where it comes from (data/README.md)."""
    needed = {f"peak_flops_per_s.{p}" for p in spec.peak_flops_per_s}
    needed |= {name for name in _NUMERIC_FIELDS if getattr(spec, name) is not None}
    missing = needed - set(spec.sources)
    if missing:
        raise InvalidHardwareSpec(f"catalog entry {spec.id!r}: no source for {sorted(missing)}")
    extra = set(spec.sources) - needed
    if extra:
        raise InvalidHardwareSpec(f"catalog entry {spec.id!r}: sources for absent values {sorted(extra)}")


def parse_catalog(text: str) -> dict[str, HardwareSpec]:
    """Parse catalog TOML ``text`` (format in ``catalog.toml``'s header) into specs keyed by id.

    Raises :class:`InvalidHardwareSpec` for a bad entry and ``tomllib.TOMLDecodeError`` for bad TOML.
    """
    raw = tomllib.loads(text)
    catalog: dict[str, HardwareSpec] = {}
    for hardware_id, entry in raw.items():
        if not isinstance(entry, dict):
            raise InvalidHardwareSpec(f"catalog: top-level key {hardware_id!r} is not a table")
        catalog[hardware_id] = _entry_to_spec(hardware_id, entry)
    return catalog


@cache
def _load_catalog_cached() -> dict[str, HardwareSpec]:
    text = resources.files(__package__).joinpath(CATALOG_RESOURCE).read_text(encoding="utf-8")
    return parse_catalog(text)


def load_catalog() -> dict[str, HardwareSpec]:
    """The built-in datasheet catalog, keyed by hardware id, in file order (read once per process).

    Does not include ``local`` (see :func:`app.hardware.local.detect_local_cpu`). Returns a new dict
    each call (the specs themselves are frozen). Raises :class:`InvalidHardwareSpec` if the shipped
    file is broken.
    """
    return dict(_load_catalog_cached())
