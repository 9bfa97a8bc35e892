"""HTTP routes of measurements: ingest a batch, list stored ones, stream them as CSV (thin: parse, call,
return)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Response, status
from fastapi.responses import StreamingResponse
from pydantic import AwareDatetime

from app.auth import PrincipalDep
from app.core.precision import Precision as PrecisionMode
from app.core.vocab import Granularity, Pass
from app.deps import SessionDep, SessionFactoryDep
from app.hardware.schemas import Precision
from app.measurements import service
from app.measurements.repository import MeasurementFilter
from app.measurements.schemas import MeasurementBatchCreate, MeasurementBatchRead, MeasurementList
from app.observability import record_measurement
from app.schemas import MAX_PAGE, ErrorResponse, OffsetQuery

router = APIRouter(prefix="/v1/measurements", tags=["measurements"])

_CREATE_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorResponse, "description": "idempotency_key_reused: the key was sent with another body"},
    413: {"model": ErrorResponse, "description": "too_many_items (more than 5,000 rows), payload_too_large"},
    422: {"model": ErrorResponse, "description": "validation_error (detail.errors[].loc names the row index), "
          "invalid_measurements (detail.errors[]: index, code hardware_not_found | graph_not_found (an iteration or "
          "job row's config.graph_id) | invalid_layer_config (a config.layer that is not the op_kind it "
          "claims, or that no layer of that kind can be) | reserved_source (an "
          "import's source; a job row of source scheduler: POST /v1/job-estimates/actuals) | "
          "precision_not_supported | stack_not_supported (a configuration the device cannot run; a CPU runs bf16 "
          "and fp16 autocast in software) | "
          "implausible_measurement (below 100 ns, above the bound of its granularity, below 0.2x the layer's "
          "roofline floor; time_ms_std above what repetitions within that bound can spread, or above 0 from 1 "
          "repetition; measured_at more than 1 day in the future), field), "
          "invalid_idempotency_key"},
}
_LIST_ERRORS: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorResponse, "description": "validation_error: bad limit/offset/cursor, time or precision; "
          "invalid_request: cursor with offset, empty time window"},
}


def measurement_filter(
    hardware_id: str | None = None,
    source: str | None = None,
    op_kind: str | None = None,
    precision: Annotated[PrecisionMode | Precision | None, Query(
        description="a precision mode (fp32, fp32-strict, tf32, fp16, bf16) or a storage format (fp64, fp8, int8); "
                    "any other value is a 422, never an empty page")] = None,
    pass_: Annotated[Pass | None, Query(alias="pass")] = None,
    granularity: Granularity | None = None,
    measured_from: Annotated[AwareDatetime | None, Query(description="measured_at >= this (inclusive)")] = None,
    measured_to: Annotated[AwareDatetime | None, Query(description="measured_at < this (exclusive)")] = None,
) -> MeasurementFilter:
    """The filters of a listing or export (every one optional; a time window drops rows without ``measured_at``)."""
    return MeasurementFilter(hardware_id=hardware_id, source=source, op_kind=op_kind,
                             precision=getattr(precision, "value", precision),
                             pass_=None if pass_ is None else pass_.value,
                             granularity=None if granularity is None else granularity.value,
                             measured_from=measured_from, measured_to=measured_to)  # fmt: skip


FilterDep = Annotated[MeasurementFilter, Depends(measurement_filter)]


@router.post(
    "",
    response_model=MeasurementBatchRead,
    status_code=status.HTTP_201_CREATED,
    responses=_CREATE_ERRORS,
    summary="Report a batch of measured times (profiler, CI job, cluster scheduler), all or none",
)
def create_measurements(
    data: MeasurementBatchCreate,
    session: SessionDep,
    response: Response,
    principal: PrincipalDep,
    idempotency_key: Annotated[str | None, Header(description="retry-safe: same key + same body = same "
                                                  "answer, nothing stored twice; another body = 409")] = None,
) -> MeasurementBatchRead:
    """Store 1-5000 measured times (ms) atomically; answers their ids in batch order."""
    result = service.create_measurements(session, data=data, idempotency_key=idempotency_key,
                                         submitter=principal.key_id)
    if result.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        for source in {m.source for m in data.measurements}:
            record_measurement(source=source, n=sum(m.source == source for m in data.measurements))
    return result


@router.get("", response_model=MeasurementList, responses=_LIST_ERRORS, summary="List measurements")
def list_measurements(
    session: SessionDep,
    filters: FilterDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    offset: OffsetQuery = 0,
    cursor: Annotated[int | None, Query(ge=0, le=2**63 - 1, description="next_cursor of the previous page")] = None,
) -> MeasurementList:
    """Measurements by ascending id, filtered; page with ``cursor`` (``next_cursor`` of the last page) or
    ``offset``; ``total`` counts every match."""
    return service.list_measurements(session, filters=filters, limit=limit, offset=offset, cursor=cursor)


@router.get(".csv", response_class=StreamingResponse, responses={**_LIST_ERRORS, 200: {"content": {"text/csv": {}}}},
            summary="Export measurements as CSV (streamed)")  # fmt: skip
def export_measurements(factory: SessionFactoryDep, filters: FilterDep) -> StreamingResponse:
    """Every measurement matching the filters as CSV (``config``/``context`` as JSON), streamed by id."""
    return StreamingResponse(service.export_csv(factory, filters=service.checked_filters(filters)),
                             media_type="text/csv; charset=utf-8",
                             headers={"Content-Disposition": 'attachment; filename="measurements.csv"'})
