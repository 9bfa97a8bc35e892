"""HTTP routes of the hardware catalog: list, read, add, replace and delete custom devices (thin: parse,
call, return). Writes need the ``hardware`` scope (:data:`app.auth.POLICY`); a custom device can be
changed by the key that added it or an admin; built-in entries never."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Response, status

from app.auth import PrincipalDep
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
def create_hardware(data: HardwareCreate, session: SessionDep, principal: PrincipalDep) -> HardwareRead:
    """Store a new device (units in the field names: FLOP/s, bytes, bytes/s); never overwrites one.
    Catalog ids and ``local`` are reserved even before they are seeded."""
    return service.create_custom(session, data=data, owner=principal.key_id)


_CHANGE_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResponse, "description": "builtin_hardware, not_owner"},
    404: _NOT_FOUND[404],
    409: {"model": ErrorResponse, "description": "hardware_in_use: measurements refer to the device"},
    422: {"model": ErrorResponse, "description": "validation_error, invalid_request (body id differs)"},
}


@router.put("/{hardware_id}", response_model=HardwareRead, responses=_CHANGE_ERRORS,
            summary="Replace a custom device's spec (its owner or an admin)")  # fmt: skip
def update_hardware(
    hardware_id: str, data: HardwareCreate, session: SessionDep, principal: PrincipalDep
) -> HardwareRead:
    """Replace the whole spec of a custom device that no measurement refers to yet."""
    return service.update_custom(session, hardware_id=hardware_id, data=data, principal=principal)


@router.delete("/{hardware_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               responses={k: v for k, v in _CHANGE_ERRORS.items() if k != 422},
               summary="Delete a custom device (its owner or an admin)")  # fmt: skip
def delete_hardware(hardware_id: str, session: SessionDep, principal: PrincipalDep) -> Response:
    """Delete a custom device that no measurement refers to (204)."""
    service.delete_custom(session, hardware_id=hardware_id, principal=principal)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
