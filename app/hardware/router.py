"""HTTP routes of the hardware catalog: list, read, add a custom device (thin: parse, call, return)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, status

from app.deps import SessionDep
from app.hardware import service
from app.hardware.schemas import HardwareCreate, HardwareList, HardwareRead
from app.schemas import ErrorResponse

router = APIRouter(prefix="/v1/hardware", tags=["hardware"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "hardware_not_found"},
}
_CREATE_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorResponse, "description": "hardware_exists: the id is taken (stored or built-in)"},
    422: {"model": ErrorResponse, "description": "validation_error, invalid_request"},
}


@router.get("", response_model=HardwareList, summary="List hardware (built-in catalog, local CPU, custom)")
def list_hardware(session: SessionDep, kind: Literal["gpu", "cpu"] | None = None) -> HardwareList:
    """Every stored device, built-in first; ``kind`` filters GPUs or CPUs."""
    return service.list_hardware(session, kind=kind)


@router.get("/{hardware_id}", response_model=HardwareRead, responses=_NOT_FOUND, summary="Read one device")
def get_hardware(hardware_id: str, session: SessionDep) -> HardwareRead:
    """One device by id (``a100-sxm4-40gb``, ``local``, or a custom id)."""
    return service.get_hardware(session, hardware_id=hardware_id)


@router.post(
    "",
    response_model=HardwareRead,
    status_code=status.HTTP_201_CREATED,
    responses=_CREATE_ERRORS,
    summary="Add a custom device from its datasheet",
)
def create_hardware(data: HardwareCreate, session: SessionDep) -> HardwareRead:
    """Store a new device (units in the field names: FLOP/s, bytes, bytes/s); never overwrites one."""
    return service.create_custom(session, data=data)
