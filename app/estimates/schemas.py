"""API schemas of the callers' endpoints: batch predictions (NAS), job estimates (schedulers) and their
actuals, hardware comparisons. Compact by default; units in every field name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, Field, model_validator

from app.core.precision import Precision
from app.core.vocab import SoftwareStack
from app.graphs.schemas import JsonGraphCreate
from app.predictions.schemas import (
    EPOCHS_DESCRIPTION,
    Mode,
    Optimizer,
    PredictionRead,
    RunSettings,
    check_checkpointing_trains,
)
from app.schemas import Identifier, JsonObject, Name, PositiveInt32, Schema

#: Largest number of items of one ``POST /v1/predictions/batch`` (413 ``too_many_items`` above).
MAX_BATCH_ITEMS = 10_000
#: Largest number of jobs of one ``POST /v1/job-estimates`` or ``/actuals`` call (413 above).
MAX_JOBS = 1_000

_DeviceCount = Annotated[int, Field(strict=True, ge=1, le=4096)]
_BatchSize = Annotated[int, Field(strict=True, gt=0, le=1_000_000)]
_Price = Annotated[float, Field(strict=True, gt=0, le=1e6, allow_inf_nan=False)]


class ItemError(Schema):
    """Why one item of a batch has no answer: the code, message and detail its own request would have had."""

    code: str
    message: str
    detail: dict[str, Any] = Field(
        default_factory=dict,
        description="the problem document's detail (e.g. nodes_needed of too_many_devices_per_node)")


# ------------------------------------------------------------------------------------- batch predictions


class BatchItem(Schema):
    """One prediction of a batch: a stored graph (``graph_id``) or an inline layer list (``graph``)."""

    graph_id: Identifier | None = None
    graph: JsonGraphCreate | None = None
    hardware_id: Identifier
    batch_size: int = Field(strict=True, gt=0, le=1_000_000)
    mode: Mode = "training"
    optimizer: Optimizer = "sgd"
    precision: Precision = Precision.FP32
    software_stack: SoftwareStack = SoftwareStack.PYTORCH_EAGER
    dims: dict[Name, PositiveInt32] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_graph(self) -> BatchItem:
        if (self.graph_id is None) == (self.graph is None):
            raise ValueError("give exactly one of 'graph_id' or 'graph'")
        return self


class BatchPredictionCreate(Schema):
    """Up to :data:`MAX_BATCH_ITEMS` items; the body field ``"detail": "layers"`` adds each item's full
    prediction."""

    items: list[BatchItem] = Field(min_length=1)
    detail: Literal["summary", "layers"] = Field(
        default="summary", description='a field of this JSON body, not a query parameter: "summary" answers '
        'each item\'s summary only; "layers" adds its full POST /v1/predictions answer (per-layer rows) as '
        "prediction")


class BatchSummary(Schema):
    """One item's iteration (one training step or inference batch) and memory, in brief."""

    iteration_ms: float
    iteration_ms_p10: float
    iteration_ms_p90: float
    forward_ms: float
    backward_ms: float
    update_ms: float
    samples_per_s: float
    peak_memory_bytes: int
    fits: bool
    layers: int
    layers_unsupported: int
    energy_j: float | None = Field(description="estimated device energy of one iteration (null without a TDP)")
    warnings: list[str] = Field(default_factory=list,
                                description="the warnings POST /v1/predictions gives for this item (unsupported or "
                                            "out-of-distribution layers, no TDP, peak over the memory...)")


class BatchItemRead(Schema):
    index: int
    error: ItemError | None = None
    summary: BatchSummary | None = None
    prediction: PredictionRead | None = Field(default=None, description='only with "detail": "layers" in the body')


class BatchPredictionRead(Schema):
    predictor_version: str
    count: int
    failed: int
    layer_queries: int = Field(description="supported layers over all items")
    unique_layer_queries: int = Field(
        description="layers the predictor ran on in this call (one vectorised call); items answered before by "
                    "the same predictor (same graph binding, device, setting) are recalled, not predicted again")
    items: list[BatchItemRead]


# ----------------------------------------------------------------------------------------- job estimates


class JobSpec(RunSettings):
    """A training job as a scheduler sees it. ``batch_size`` is the global batch, split evenly over
    ``device_count`` devices (data parallel). The :class:`app.predictions.schemas.RunSettings` fields
    (activation checkpointing, iteration overhead, input pipeline, evaluation set, checkpoint writes) mean what
    they mean in ``POST /v1/predictions``: its ``p50_s`` and ``fits`` are that prediction's job time and fit."""

    graph_id: Identifier
    hardware_id: Identifier
    device_count: int = Field(default=1, strict=True, ge=1, le=4096,
                              description="at most 8 per node (error too_many_devices_per_node above)")
    nodes: int = Field(default=1, strict=True, ge=1, le=4096,
                       description="nodes the devices sit on (as in POST /v1/predictions)")
    inter_node_bandwidth_bytes_per_s: float | None = Field(default=None, strict=True, gt=0, le=1e15,
                                                           allow_inf_nan=False)
    inter_node_latency_s: float | None = Field(default=None, strict=True, gt=0, le=1, allow_inf_nan=False)
    batch_size: int = Field(strict=True, gt=0, le=1_000_000)
    dataset_size: int = Field(strict=True, gt=0, le=10**15)
    epochs: float = Field(strict=True, gt=0, le=1e6, allow_inf_nan=False, description=EPOCHS_DESCRIPTION)
    precision: Precision = Precision.FP32
    optimizer: Optimizer = "sgd"
    software_stack: SoftwareStack = SoftwareStack.PYTORCH_EAGER
    dims: dict[Name, PositiveInt32] = Field(default_factory=dict)


class JobEstimatesCreate(Schema):
    jobs: list[JobSpec] = Field(min_length=1)


class CalibrationGroupRead(Schema):
    """The setting whose recorded actuals calibrate a job: only actuals of the same graph, hardware, precision,
    software stack, device count and node count (any batch size, dataset size, epochs or optimizer) calibrate
    it."""

    graph_id: str
    hardware_id: str
    precision: Precision
    software_stack: SoftwareStack
    device_count: int
    nodes: int


class JobEstimateRead(Schema):
    """``p50_s``/``p90_s``: median and 90th percentile of the job's wall time (s); calibrated by the
    recorded actuals of its ``calibration_group`` (same graph, hardware, precision, stack, device count, nodes)
    when there are any (``actuals`` > 0)."""

    index: int
    p50_s: float | None = None
    p90_s: float | None = None
    fits: bool | None = None
    actuals: int = Field(default=0, description="actuals of the calibration group the estimate rests on")
    calibration_factor: float = Field(default=1.0, description="applied to the model's p50 (actual/predicted)")
    calibration_group: CalibrationGroupRead | None = Field(
        default=None, description="the setting whose actuals calibrate this job (null with an error)")
    warnings: list[str] = Field(
        default_factory=list, description="what the estimate assumed or left out, as POST /v1/predictions says "
                                          "it: an assumed inter-node network, layers without a cost formula "
                                          "(an undercount); empty when neither")
    error: ItemError | None = None


class JobEstimatesRead(Schema):
    predictor_version: str
    count: int
    failed: int
    estimates: list[JobEstimateRead]


class JobActual(JobSpec):
    """A job that ran: its parameters and the measured wall time (s). Stored as a whole-job measurement, so
    the checks of ``POST /v1/measurements`` job rows apply (``app.measurements.validation.field_problems``:
    at most a year, ``measured_at`` at most a day ahead; item code ``implausible_measurement``)."""

    measured_s: float = Field(strict=True, gt=0, allow_inf_nan=False,
                              description="wall time of the whole job (s); at most 365 days")
    context: JsonObject = Field(default_factory=dict, description="scheduler, job id, cluster, ...")
    measured_at: AwareDatetime | None = Field(
        default=None, description="when it ran, with its zone (stored in UTC, as a measurement's: the measured_from/"
                                  "measured_to filters of GET /v1/measurements find it); at most 1 day past the "
                                  "server's clock")


class JobActualsCreate(Schema):
    actuals: list[JobActual] = Field(min_length=1)


class JobActualRead(Schema):
    index: int
    measurement_id: int | None = None
    predicted_s: float | None = Field(default=None, description="uncalibrated model p50 the actual is compared to")
    ratio: float | None = Field(default=None, description="measured_s / predicted_s")
    actuals: int = Field(default=0, description="actuals of this job's calibration group now stored")
    calibration_factor: float = 1.0
    warnings: list[str] = Field(
        default_factory=list,
        description="what the model disagrees with in a recorded actual: a job whose estimated peak memory is over "
                    "the device's (fits: false in its estimate) that ran all the same is stored and calibrates "
                    "later estimates, and says so here (the estimated peak against the device memory)")
    calibration_group: CalibrationGroupRead | None = Field(
        default=None, description="the setting this actual calibrates (null when its job cannot be predicted)")
    error: ItemError | None = None


class JobActualsRead(Schema):
    """What a report answers. ``replayed`` is true when the ``Idempotency-Key`` was seen before with the same
    body: the answer is the first one's (its figures as they were then), nothing was stored again."""

    predictor_version: str
    recorded: int
    failed: int
    actuals: list[JobActualRead]
    idempotency_key: str | None = None
    replayed: bool = False


# ------------------------------------------------------------------------------------------ comparisons

SortKey = Literal["job_s", "epoch_s", "iteration_ms", "cost_usd", "energy_j", "hardware_id"]


class BatchSweep(Schema):
    """Time per sample and memory fit against the batch size on one device."""

    hardware_id: Identifier
    batch_sizes: list[_BatchSize] = Field(
        min_length=1, max_length=64,
        description="each once (a size given twice is a 422 duplicate_batch_sizes); answered in ascending order")


class ComparisonCreate(RunSettings):
    """One graph and one job on many devices. ``hardware_ids`` default to every stored device;
    ``batch_size`` is the global batch of every row (split over ``device_counts``); the
    :class:`app.predictions.schemas.RunSettings` fields apply to every row as in ``POST /v1/predictions``."""

    graph_id: Identifier
    batch_size: int = Field(strict=True, gt=0, le=1_000_000)
    dataset_size: int = Field(strict=True, gt=0, le=10**15)
    epochs: float = Field(strict=True, gt=0, le=1e6, allow_inf_nan=False, description=EPOCHS_DESCRIPTION)
    mode: Mode = "training"
    optimizer: Optimizer = "sgd"
    precision: Precision = Precision.FP32
    software_stack: SoftwareStack = SoftwareStack.PYTORCH_EAGER
    dims: dict[Name, PositiveInt32] = Field(default_factory=dict)
    hardware_ids: list[Identifier] | None = Field(
        default=None, min_length=1, max_length=256,
        description="devices to compare; omitted = every stored device (an empty list is a 422, not 'all')")
    device_counts: list[_DeviceCount] = Field(default_factory=lambda: [1], min_length=1, max_length=16)
    devices_per_node: _DeviceCount | None = Field(
        default=None, description="devices per node: a count above it spreads evenly over "
                                  "ceil(count / devices_per_node) nodes (hierarchical all-reduce; a count that "
                                  "does not spread evenly is unavailable); none = every count in one node. A row "
                                  "with more than 8 devices in a node (an 8-GPU DGX/HGX node) is unavailable "
                                  "with code too_many_devices_per_node and detail.nodes_needed")
    inter_node_bandwidth_bytes_per_s: float | None = Field(default=None, strict=True, gt=0, le=1e15,
                                                           allow_inf_nan=False,
                                                           description="per node (rows over several nodes)")
    inter_node_latency_s: float | None = Field(default=None, strict=True, gt=0, le=1, allow_inf_nan=False)
    price_usd_per_hour: dict[Identifier, _Price] = Field(default_factory=dict,
                                                 description="per-device-hour price overrides by hardware id")
    grid_gco2_per_kwh: float | None = Field(default=None, strict=True, gt=0, le=1e5, allow_inf_nan=False,
                                            description="grid carbon intensity for co2_kg")
    sort_by: SortKey = "job_s"
    sweep: BatchSweep | None = None

    @model_validator(mode="after")
    def _checkpointing_trains(self) -> ComparisonCreate:
        check_checkpointing_trains(self.activation_checkpointing, self.mode)
        return self


class ComparisonRow(Schema):
    hardware_id: str
    device_count: int
    nodes: int = Field(default=1, description="nodes the devices sit on")
    per_device_batch_size: int
    iteration_ms: float
    iteration_ms_p90: float
    samples_per_s: float
    scaling_efficiency: float
    allreduce_exposed_ms: float
    epoch_s: float
    job_s: float
    job_s_p90: float
    cost_usd: float | None = Field(description="device-hours × price (null without a price)")
    energy_j: float | None = Field(description="all devices, estimate (null without a TDP)")
    co2_kg: float | None
    peak_memory_bytes: int = Field(description="one device")
    fits: bool
    largest_batch_size_that_fits: int = Field(description="per device")
    pareto: bool = Field(description="no other fitting row is at least as good in job time, cost and energy "
                                     "and better in one (unknown cost or energy counts as worst)")


class Unavailable(Schema):
    hardware_id: str
    device_count: int
    code: str
    reason: str
    detail: dict[str, Any] = Field(
        default_factory=dict, description="the problem document's detail of that prediction (e.g. nodes_needed)")


class SweepRow(Schema):
    batch_size: int
    iteration_ms: float
    time_per_sample_ms: float
    peak_memory_bytes: int
    fits: bool


class ComparisonRead(Schema):
    graph_id: str
    predictor_version: str
    sort_by: SortKey
    rows: list[ComparisonRow]
    unavailable: list[Unavailable]
    sweep: list[SweepRow] | None = Field(description="one row per sweep batch size, ascending")
    assumptions: dict[str, str]
