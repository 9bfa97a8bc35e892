"""API schemas of the hardware catalog: ``HardwareCreate`` (POST body or inline spec), ``HardwareRead``,
``HardwareList``. Field names and units are those of :class:`app.core.hardware.HardwareSpec`."""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from app.core.collectives import LinkKind
from app.core.hardware import PRECISIONS
from app.hardware.catalog import HARDWARE_ID_PATTERN
from app.schemas import Schema

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Precision = Literal["fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8"]
if set(get_args(Precision)) != set(PRECISIONS):  # pragma: no cover - keeps the two lists in step
    raise RuntimeError("app.hardware.schemas.Precision differs from app.core.hardware.PRECISIONS")


class HardwareCreate(Schema):
    """A device described by its datasheet (``POST /v1/hardware``, or inline in a prediction request).

    Units are in the names: FLOP/s (dense, FLOPs = 2 × MACs), bytes, bytes/s, MHz, W.
    ``peak_flops_per_s`` must contain ``fp32``; ``sources`` maps a field name (``memory_bytes``,
    ``peak_flops_per_s.fp16``...) to where its value comes from.
    """

    id: str = Field(pattern=HARDWARE_ID_PATTERN, examples=["rtx-5090"])
    name: str = Field(min_length=1, max_length=200, examples=["NVIDIA GeForce RTX 5090"])
    vendor: str = Field(min_length=1, max_length=100, examples=["NVIDIA"])
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_flops_per_s: dict[Precision, PositiveFloat] = Field(examples=[{"fp32": 104.8e12}])
    memory_bytes: PositiveFloat
    memory_bandwidth_bytes_per_s: PositiveFloat
    compute_units: int = Field(gt=0, description="SMs (NVIDIA), CUs (AMD) or physical cores (CPU)")
    base_clock_mhz: PositiveFloat | None = None
    boost_clock_mhz: PositiveFloat | None = None
    tdp_w: PositiveFloat | None = None
    l2_cache_bytes: PositiveFloat | None = None
    vector_width_bits: int | None = Field(default=None, gt=0)
    architecture: str | None = Field(default=None, max_length=100)
    idle_power_w: PositiveFloat | None = Field(default=None, description="idle draw (W); default 20 % of TDP")
    price_usd_per_hour: PositiveFloat | None = Field(
        default=None, description="on-demand list price per device-hour (USD); the source names offer and date")
    interconnect: LinkKind | None = Field(
        default=None, description="what joins several of these devices for data parallel")
    interconnect_bandwidth_bytes_per_s: PositiveFloat | None = Field(
        default=None, description="per-direction link bandwidth per device (bytes/s)")
    interconnect_latency_s: PositiveFloat | None = Field(
        default=None, description="fixed latency of one ring all-reduce step (s)")
    sources: dict[str, str] = Field(default_factory=dict)

    @field_validator("peak_flops_per_s")
    @classmethod
    def _has_fp32(cls, value: dict[str, float]) -> dict[str, float]:
        if "fp32" not in value:
            raise ValueError("peak_flops_per_s must contain 'fp32'")
        if not all(math.isfinite(v) for v in value.values()):
            raise ValueError("peak_flops_per_s values must be finite")
        return value

    @model_validator(mode="after")
    def _clocks_ordered(self) -> HardwareCreate:
        if (
            self.base_clock_mhz is not None
            and self.boost_clock_mhz is not None
            and self.base_clock_mhz > self.boost_clock_mhz
        ):
            raise ValueError("base_clock_mhz must not exceed boost_clock_mhz")
        link = (self.interconnect, self.interconnect_bandwidth_bytes_per_s, self.interconnect_latency_s)
        if any(v is None for v in link) and any(v is not None for v in link):
            raise ValueError("give interconnect, interconnect_bandwidth_bytes_per_s and interconnect_latency_s "
                             "together")
        if self.idle_power_w is not None and self.tdp_w is not None and self.idle_power_w > self.tdp_w:
            raise ValueError("idle_power_w must not exceed tdp_w")
        return self


class HardwareRead(HardwareCreate):
    """A stored device; ``builtin`` is true for the datasheet catalog and ``local``."""

    builtin: bool


class HardwareList(Schema):
    """``GET /v1/hardware``: built-in entries first, then custom ones, each by id."""

    items: list[HardwareRead]
    count: int
