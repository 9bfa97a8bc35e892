"""HTTP routes of the predictor registry: list and read versions (scope ``read``); ask for a retrain,
promote and roll back (scope ``admin``: an API key with it, or ``LAYERCAST_ADMIN_KEY``; enforced by
:func:`app.auth.authorize` from :data:`app.auth.POLICY`, documented with 401/403/429 by :mod:`app.main`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, status

from app.deps import SessionDep
from app.predictors import service
from app.predictors.schemas import PredictorVersionList, PredictorVersionRead, RetrainRequestRead
from app.schemas import ErrorResponse

router = APIRouter(prefix="/v1/predictors", tags=["predictors"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "predictor_version_not_found"},
    409: {"model": ErrorResponse, "description": "not_production, no_previous_version, conflict"},
}


@router.get("", response_model=PredictorVersionList, summary="List registered predictor versions")
def list_predictors(session: SessionDep, status: str | None = None) -> PredictorVersionList:
    """Every registered version, newest first (optionally of one ``status``)."""
    rows = service.list_versions(session, status=status)
    prod = service.production(session)
    return PredictorVersionList(items=[PredictorVersionRead(**service.version_summary(r)) for r in rows],
                                production=None if prod is None else prod.version)  # fmt: skip


@router.post("/retrain", response_model=RetrainRequestRead, status_code=status.HTTP_202_ACCEPTED,
             summary="Ask for a retrain run (admin)")  # fmt: skip
def request_retrain(session: SessionDep) -> RetrainRequestRead:
    """Record a retrain request; a ``layercast worker`` runs it (one run at a time across processes)."""
    run = service.request_retrain(session)
    return RetrainRequestRead(id=run.id, status=run.status, trigger=run.trigger, requested_at=run.requested_at)


@router.get("/{version}", response_model=PredictorVersionRead,
            responses={404: _ERRORS[404]}, summary="One predictor version")  # fmt: skip
def get_predictor(version: str, session: SessionDep) -> PredictorVersionRead:
    """Metadata, status and held-out metrics of ``version``."""
    return PredictorVersionRead(**service.version_summary(service.get_version(session, version)))


@router.post("/{version}/promote", response_model=PredictorVersionRead, responses=_ERRORS,
             summary="Make a version production (admin)")  # fmt: skip
def promote(version: str, session: SessionDep) -> PredictorVersionRead:
    """Promote ``version``; the former production version is retired. Served within ``predictor_poll_s``."""
    return PredictorVersionRead(**service.version_summary(service.promote(session, version)))


@router.post("/{version}/rollback", response_model=PredictorVersionRead, responses=_ERRORS,
             summary="Retire the production version, restore the previous one (admin)")  # fmt: skip
def rollback(version: str, session: SessionDep) -> PredictorVersionRead:
    """Retire production ``version``; returns the restored version."""
    return PredictorVersionRead(**service.version_summary(service.rollback(session, version)))
