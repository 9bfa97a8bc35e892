"""HTTP routes of measurements: report one measured time, list stored ones (thin: parse, call, return)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, status

from app.auth import PrincipalDep
from app.deps import SessionDep
from app.measurements import service
from app.measurements.schemas import MeasurementCreate, MeasurementList, MeasurementRead
from app.observability import record_measurement
from app.schemas import ErrorResponse, OffsetQuery

router = APIRouter(prefix="/v1/measurements", tags=["measurements"])

_CREATE_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "hardware_not_found: hardware_id is not stored"},
    422: {"model": ErrorResponse, "description": "validation_error (e.g. time_ms_median <= 0), invalid_request, "
          "implausible_measurement (below 100 ns, above the bound of its granularity, or below half the layer's "
          "roofline floor)"},
}
_LIST_ERRORS: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorResponse, "description": "validation_error: bad limit/offset"},
}


@router.post(
    "",
    response_model=MeasurementRead,
    status_code=status.HTTP_201_CREATED,
    responses=_CREATE_ERRORS,
    summary="Report a measured time (profiler, CI job, cluster scheduler)",
)
def create_measurement(data: MeasurementCreate, session: SessionDep, principal: PrincipalDep) -> MeasurementRead:
    """Store one measured time (ms) on a stored device, with what ran (``config``) and how (``context``);
    the API key that sent it is recorded as its submitter."""
    measurement = service.create_measurement(session, data=data, submitter=principal.key_id)
    record_measurement(source=data.source)
    return measurement


@router.get("", response_model=MeasurementList, responses=_LIST_ERRORS, summary="List measurements")
def list_measurements(
    session: SessionDep,
    hardware_id: str | None = None,
    source: str | None = None,
    op_kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_PAGE)] = 100,
    offset: OffsetQuery = 0,
) -> MeasurementList:
    """Measurements by ascending id, filtered by device, source (``justus2018``, ``deepbench``,
    ``reported``...) and op kind; ``total`` counts every match."""
    return service.list_measurements(
        session, hardware_id=hardware_id, source=source, op_kind=op_kind, limit=limit, offset=offset
    )
