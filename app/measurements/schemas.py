"""API schemas of measurements: ``MeasurementCreate`` (a reported time), ``MeasurementBatchCreate`` /
``MeasurementBatchRead`` (what ``POST /v1/measurements`` takes and answers), ``RowError`` (a bad row of a
batch), ``MeasurementRead``, ``MeasurementList`` (one page) and ``ImportReport`` (what an import read,
stored and skipped).

Units are in the names: milliseconds (``_ms``), samples (``batch_size``). The JSON field of the pass is
``pass`` (``pass_`` in Python, a keyword otherwise).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import AwareDatetime, ConfigDict, Field

from app.core.precision import Precision as PrecisionMode
from app.core.vocab import Granularity, Pass, SoftwareStack
from app.hardware.catalog import HARDWARE_ID_PATTERN
from app.hardware.schemas import Precision
from app.schemas import JsonObject, PositiveInt32, Schema

Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")]
PositiveMs = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]


class MeasurementCreate(Schema):
    """A measured time reported by a client (a profiler run, a CI job, a cluster scheduler).

    ``time_ms_median`` must be positive (ms); ``hardware_id`` must name a stored device (otherwise the batch
    is refused: 422 ``invalid_measurements`` with row code ``hardware_not_found``); an iteration or job row's
    ``config.graph_id``, when given, must name a stored graph (row code ``graph_not_found``).
    ``config`` describes what ran: a layer (``{"input_shape": [...], "layer": {"op": ...}}`` in the JSON
    layer vocabulary), a model, or a whole job. ``context`` holds the measurement conditions (framework
    and version, driver, threads, clocks, host): a measurement without its context cannot be trusted.
    ``software_stack`` (what launched the work: ``pytorch-eager``, ``tf1-session``...) and ``granularity``
    (``kernel``, ``layer`` or ``iteration``) are required: they decide which fixed overheads the time
    contains. ``source`` names the reporter; the import sources (``justus2018``, ``deepbench``,
    ``neusight``, ``vidur``, ``profiler``) are reserved.
    """

    hardware_id: str = Field(pattern=HARDWARE_ID_PATTERN, examples=["a100-sxm4-40gb"])
    source: Name = Field(default="reported", max_length=64, examples=["ci", "scheduler", "profiler"])
    op_kind: Name = Field(max_length=32, examples=["conv", "gemm", "iteration"],
                          description="cost family (app.core.ir.OpKind values), 'iteration'/'job' or a "
                                      "collective ('allreduce', 'send_recv')")
    pass_: Pass = Field(alias="pass", examples=["forward"])
    optimizer: Name = Field(default="none", max_length=16, examples=["none", "sgd", "adam"])
    precision: PrecisionMode | Precision = Field(
        default="fp32", description="a precision mode (app.core.precision: fp32, fp32-strict, tf32, fp16, bf16) "
        "or a storage format of the catalog (fp64, fp8, int8)")
    software_stack: SoftwareStack = Field(examples=["pytorch-eager"])
    granularity: Granularity = Field(examples=["layer"])
    batch_size: PositiveInt32 = Field(description="samples per batch")
    config: JsonObject = Field(min_length=1, description="what was measured (layer, model or job)")
    time_ms_median: PositiveMs
    time_ms_std: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)] | None = Field(
        default=None, description="sample std of the repetitions (ms); at most what repetitions within the "
        "granularity's time bound can spread, 0 from one repetition (else implausible_measurement)")
    repetitions: PositiveInt32 | None = None
    context: JsonObject = Field(default_factory=dict, description="framework, driver, threads, clocks, ...")
    measured_at: AwareDatetime | None = Field(
        default=None, description="when it was measured, with its zone; at most 1 day past the server's clock")


#: Most measurements one ``POST /v1/measurements`` accepts (a profiler shard is uploaded in chunks of this).
MAX_BATCH = 5000


class MeasurementBatchCreate(Schema):
    """``POST /v1/measurements``: 1 to :data:`MAX_BATCH` measurements, stored all or none."""

    measurements: list[MeasurementCreate] = Field(  # the count is checked by the service: 413 too_many_items
        min_length=1, description=f"1 to {MAX_BATCH} rows (more: 413 too_many_items, as every batch endpoint)")


class MeasurementBatchRead(Schema):
    """What a stored batch answers: ``ids`` of the new rows in batch order (``count`` of them).

    ``replayed`` is true when the ``Idempotency-Key`` was seen before with the same body: the answer is the
    first one's, nothing was stored again.
    """

    count: int
    ids: list[int]
    idempotency_key: str | None = None
    replayed: bool = False


class RowError(Schema):
    """One bad row of a batch (``detail.errors`` of 422 ``invalid_measurements``): its 0-based ``index``
    in ``measurements``, a machine-readable ``code`` (``hardware_not_found``, ``graph_not_found``,
    ``reserved_source``, ``implausible_measurement``, ``invalid_layer_config``, ``precision_not_supported``,
    ``stack_not_supported``), the ``field`` at fault and a message."""

    index: int
    code: str
    field: str
    message: str


class MeasurementRead(Schema):
    """A stored measurement (imported or reported)."""

    model_config = ConfigDict(from_attributes=True, populate_by_name=True)

    id: int
    hardware_id: str
    source: str
    op_kind: str
    pass_: str = Field(alias="pass")
    optimizer: str
    precision: str
    software_stack: str | None
    granularity: str | None
    batch_size: int
    config: dict[str, Any]
    time_ms_median: float
    time_ms_std: float | None
    repetitions: int | None
    context: dict[str, Any]
    measured_at: datetime | None
    submitter: str | None = Field(default=None, description="id of the API key that reported it; null: "
                                  "imported, anonymous or stored before keys existed")
    created_at: datetime


class MeasurementList(Schema):
    """``GET /v1/measurements``: one page by ascending id; ``total`` matches the filters.

    ``next_cursor``: pass it as ``cursor`` for the next page (None on the last page); ``offset`` is 0
    when the page was asked for by cursor.
    """

    items: list[MeasurementRead]
    count: int
    total: int
    limit: int
    offset: int
    next_cursor: int | None = None


class ImportReport(Schema):
    """What an import did. Counts are measurements (a DeepBench conv row holds up to three), except
    ``rows_read`` (data rows of the files).

    ``replaced``: rows of earlier imports of the same files deleted before inserting (re-import);
    ``skipped_by_device``: the file's own device name → reason → count (``hardware_not_in_catalog``,
    ``unknown_device``, ``missing_time``, ``non_positive_time``, ``unknown_precision``): rows the parser
    could not turn into a record. ``refused``: records the per-row checks of ``POST /v1/measurements``
    refuse (:func:`app.measurements.validation.field_problems`), not stored; ``refused_by_reason``:
    ``code/field`` of a record's first problem → count (``implausible_measurement/time_ms_median``...);
    ``refused_examples``: that reason → the first such record (``<file> row <n>: <message>``).
    """

    source_files: list[str] = Field(default_factory=list)
    rows_read: int = 0
    imported: int = 0
    replaced: int = 0
    skipped: int = 0
    imported_by_hardware: dict[str, int] = Field(default_factory=dict)
    skipped_by_reason: dict[str, int] = Field(default_factory=dict)
    skipped_by_device: dict[str, dict[str, int]] = Field(default_factory=dict)
    refused: int = 0
    refused_by_reason: dict[str, int] = Field(default_factory=dict)
    refused_examples: dict[str, str] = Field(default_factory=dict)

    def merge(self, other: ImportReport) -> ImportReport:
        """A new report adding ``other``'s counts to these."""

        def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}

        devices = sorted(set(self.skipped_by_device) | set(other.skipped_by_device))
        return ImportReport(
            source_files=[*self.source_files, *(f for f in other.source_files if f not in self.source_files)],
            rows_read=self.rows_read + other.rows_read,
            imported=self.imported + other.imported,
            replaced=self.replaced + other.replaced,
            skipped=self.skipped + other.skipped,
            imported_by_hardware=add(self.imported_by_hardware, other.imported_by_hardware),
            skipped_by_reason=add(self.skipped_by_reason, other.skipped_by_reason),
            skipped_by_device={
                d: add(self.skipped_by_device.get(d, {}), other.skipped_by_device.get(d, {})) for d in devices
            },
            refused=self.refused + other.refused,
            refused_by_reason=add(self.refused_by_reason, other.refused_by_reason),
            refused_examples=dict(sorted({**other.refused_examples, **self.refused_examples}.items())),
        )
