"""API schemas of the hardware catalog: ``HardwareCreate`` (POST body or inline spec), ``HardwareRead``,
``HardwareList``. Field names and units are those of :class:`app.core.hardware.HardwareSpec`."""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from app.core.collectives import LinkKind
from app.core.hardware import PRECISIONS
from app.hardware.catalog import HARDWARE_ID_PATTERN
from app.schemas import Name, PositiveInt32, Schema, Text

# Physically sane ranges (finite, and wide enough for a microcontroller up to a rack-scale system): a
# denormal peak such as 5e-324 FLOP/s would otherwise turn every roofline time into inf/NaN.
PeakFlops = Annotated[float, Field(ge=1e6, le=1e20, allow_inf_nan=False)]
Bandwidth = Annotated[float, Field(ge=1e6, le=1e17, allow_inf_nan=False)]
Bytes = Annotated[float, Field(ge=1, le=1e18, allow_inf_nan=False)]
Mhz = Annotated[float, Field(gt=0, le=1e5, allow_inf_nan=False)]
Watts = Annotated[float, Field(gt=0, le=1e7, allow_inf_nan=False)]
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
    name: Name = Field(examples=["NVIDIA GeForce RTX 5090"])
    vendor: Name = Field(max_length=100, examples=["NVIDIA"])
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_flops_per_s: dict[Precision, PeakFlops] = Field(examples=[{"fp32": 104.8e12}])
    memory_bytes: Bytes
    memory_bandwidth_bytes_per_s: Bandwidth
    compute_units: PositiveInt32 = Field(description="SMs (NVIDIA), CUs (AMD) or physical cores (CPU)")
    base_clock_mhz: Mhz | None = None
    boost_clock_mhz: Mhz | None = None
    tdp_w: Watts | None = None
    l2_cache_bytes: Bytes | None = None
    vector_width_bits: Annotated[int, Field(strict=True, gt=0, le=65536)] | None = None
    architecture: Name | None = Field(default=None, max_length=100)
    idle_power_w: Watts | None = Field(default=None, description="idle draw (W); default 20 % of TDP")
    price_usd_per_hour: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] | None = Field(
        default=None, description="on-demand list price per device-hour (USD); the source names offer and date")
    interconnect: LinkKind | None = Field(
        default=None, description="what joins several of these devices for data parallel")
    interconnect_bandwidth_bytes_per_s: Bandwidth | None = Field(
        default=None, description="per-direction link bandwidth per device (bytes/s)")
    interconnect_latency_s: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = Field(
        default=None, description="fixed latency of one ring all-reduce step (s)")
    sources: dict[Name, Text] = Field(default_factory=dict)

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

    @model_validator(mode="after")
    def _gpu_features_complete(self) -> HardwareCreate:
        """A GPU needs a clock and its L2 size: the learned predictor's hardware features read both
        (:mod:`app.core.features`), and a missing one would be featurised far outside the training range
        (a custom H100 without ``l2_cache_bytes`` came out 10x slower). Refused rather than guessed."""
        if self.kind == "gpu":
            missing = [name for name, value in (
                ("boost_clock_mhz or base_clock_mhz", self.boost_clock_mhz or self.base_clock_mhz),
                ("l2_cache_bytes", self.l2_cache_bytes),
            ) if value is None]
            if missing:
                raise ValueError(f"a GPU needs {' and '.join(missing)} (datasheet values): the learned predictor "
                                 "reads them")
        return self


class HardwareRead(HardwareCreate):
    """A stored device; ``builtin`` is true for the datasheet catalog and ``local``."""

    builtin: bool
    owner: str | None = Field(default=None, description="id of the API key that added it; null: anonymous or built-in")

    @model_validator(mode="after")
    def _gpu_features_complete(self) -> HardwareRead:
        """Stored rows are read as they are (custom GPUs stored before the rule may lack a field)."""
        return self


class HardwareList(Schema):
    """``GET /v1/hardware``: built-in entries first, then custom ones, each by id."""

    items: list[HardwareRead]
    count: int
