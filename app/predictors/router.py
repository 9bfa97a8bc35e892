"""HTTP routes of the predictor registry: list and read versions (public); promote and roll back
(admin key: ``Authorization: Bearer $LAYERCAST_ADMIN_KEY``; 403 ``admin_key_not_configured`` when unset)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, status

from app.deps import SessionDep, SettingsDep
from app.predictors import service
from app.predictors.schemas import PredictorVersionList, PredictorVersionRead, RetrainRequestRead
from app.schemas import ErrorResponse

router = APIRouter(prefix="/v1/predictors", tags=["predictors"])

_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "admin_key_invalid"},
    403: {"model": ErrorResponse, "description": "admin_key_not_configured"},
    404: {"model": ErrorResponse, "description": "predictor_version_not_found"},
    409: {"model": ErrorResponse, "description": "not_production, no_previous_version, conflict"},
}


def require_admin(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Raise unless the request carries the configured admin key as a bearer token."""
    configured = settings.admin_key.get_secret_value() if settings.admin_key is not None else None
    given = None
    if authorization is not None and authorization.lower().startswith("bearer "):
        given = authorization[len("bearer "):].strip()
    service.check_admin_key(configured, given)


AdminDep = Annotated[None, Depends(require_admin)]


@router.get("", response_model=PredictorVersionList, summary="List registered predictor versions")
def list_predictors(session: SessionDep, status: str | None = None) -> PredictorVersionList:
    """Every registered version, newest first (optionally of one ``status``)."""
    rows = service.list_versions(session, status=status)
    prod = service.production(session)
    return PredictorVersionList(items=[PredictorVersionRead(**service.version_summary(r)) for r in rows],
                                production=None if prod is None else prod.version)  # fmt: skip


@router.post("/retrain", response_model=RetrainRequestRead, status_code=status.HTTP_202_ACCEPTED,
             responses={k: _ADMIN_ERRORS[k] for k in (401, 403)}, summary="Ask for a retrain run (admin)")  # fmt: skip
def request_retrain(session: SessionDep, _admin: AdminDep) -> RetrainRequestRead:
    """Record a retrain request; a ``layercast worker`` runs it (one run at a time across processes)."""
    run = service.request_retrain(session)
    return RetrainRequestRead(id=run.id, status=run.status, trigger=run.trigger, requested_at=run.requested_at)


@router.get("/{version}", response_model=PredictorVersionRead,
            responses={404: _ADMIN_ERRORS[404]}, summary="One predictor version")  # fmt: skip
def get_predictor(version: str, session: SessionDep) -> PredictorVersionRead:
    """Metadata, status and held-out metrics of ``version``."""
    return PredictorVersionRead(**service.version_summary(service.get_version(session, version)))


@router.post("/{version}/promote", response_model=PredictorVersionRead, responses=_ADMIN_ERRORS,
             summary="Make a version production (admin)")  # fmt: skip
def promote(version: str, session: SessionDep, _admin: AdminDep) -> PredictorVersionRead:
    """Promote ``version``; the former production version is retired. Served within ``predictor_poll_s``."""
    return PredictorVersionRead(**service.version_summary(service.promote(session, version)))


@router.post("/{version}/rollback", response_model=PredictorVersionRead, responses=_ADMIN_ERRORS,
             summary="Retire the production version, restore the previous one (admin)")  # fmt: skip
def rollback(version: str, session: SessionDep, _admin: AdminDep) -> PredictorVersionRead:
    """Retire production ``version``; returns the restored version."""
    return PredictorVersionRead(**service.version_summary(service.rollback(session, version)))
