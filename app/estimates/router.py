"""HTTP routes of the callers' endpoints (thin: parse, call one service function, return)."""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response, status

from app.auth import PrincipalDep
from app.deps import PredictorDep, SessionDep, in_worker
from app.estimates import service
from app.estimates.schemas import (
    BatchPredictionCreate,
    BatchPredictionRead,
    ComparisonCreate,
    ComparisonRead,
    JobActualsCreate,
    JobActualsRead,
    JobEstimatesCreate,
    JobEstimatesRead,
)
from app.observability import record_prediction
from app.schemas import ErrorResponse

router = APIRouter(prefix="/v1")

_ITEMS = "per-item failures (graph_not_found, hardware_not_found, precision_not_supported, stack_not_supported, " \
         "invalid_graph, unbound_dimension, unknown_dimension, invalid_request, no_costed_layers; " \
         "too_many_devices_per_node for jobs and comparison rows) are answered in the item with their code " \
         "and detail, not as the status"
_BATCH_ERRORS: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorResponse, "description": "too_many_items, payload_too_large"},
    422: {"model": ErrorResponse, "description": f"validation_error; {_ITEMS}"},
}
_ACTUALS_ERRORS: dict[int | str, dict[str, Any]] = {
    **_BATCH_ERRORS,
    409: {"model": ErrorResponse, "description": "idempotency_key_reused: the key was sent with another body"},
    422: {"model": ErrorResponse, "description": "validation_error, invalid_idempotency_key; invalid_actuals: "
                                                 "no item can be recorded, nothing stored (detail: the answer a "
                                                 f"201 would have been, every item's error); {_ITEMS}; "
                                                 "implausible_actual (an actual over 100x away from the estimate) "
                                                 "is answered in its item too"},
}
_COMPARE_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "graph_not_found; hardware_not_found for the sweep's device"},
    422: {"model": ErrorResponse, "description": "validation_error, invalid_graph, unbound_dimension, "
                                                 "unknown_dimension, dims_names_batch_axis, invalid_request, "
                                                 "duplicate_batch_sizes (a sweep batch size given twice; "
                                                 "detail.duplicates); for the sweep's device also "
                                                 "precision_not_supported, stack_not_supported, no_costed_layers"},
}


@router.post("/predictions/batch", response_model=BatchPredictionRead, responses=_BATCH_ERRORS,
             tags=["predictions"], summary="Many predictions in one call (NAS loops)")
async def predict_batch(body: BatchPredictionCreate, session: SessionDep, predictor: PredictorDep
                        ) -> BatchPredictionRead:
    """Up to 10,000 (graph, hardware, batch, precision, mode) items; the layers of all items go through one
    batched predictor call. Summaries only unless the body says ``"detail": "layers"`` (a body field, not a
    query parameter)."""

    def work() -> BatchPredictionRead:
        answer = service.predict_batch(session, predictor, request=body)
        methods: Counter[str] = Counter()
        for item in answer.items:
            methods.update(item.prediction.methods if item.prediction is not None else {})
        record_prediction(predictor_version=answer.predictor_version, methods=methods,
                          count=answer.count - answer.failed)
        return answer

    return await in_worker(session, work)


@router.post("/job-estimates", response_model=JobEstimatesRead, responses=_BATCH_ERRORS,
             tags=["job-estimates"], summary="Job durations for a scheduler")
async def estimate_jobs(body: JobEstimatesCreate, session: SessionDep, predictor: PredictorDep) -> JobEstimatesRead:
    """Up to 1,000 jobs: ``p50_s``, ``p90_s``, ``fits``, calibrated by recorded actuals of the same graph,
    hardware, precision, software stack, device count and nodes (each answer's ``calibration_group``)."""

    def work() -> JobEstimatesRead:
        answer = service.estimate_jobs(session, predictor, request=body)
        record_prediction(predictor_version=answer.predictor_version, methods={}, count=answer.count - answer.failed)
        return answer

    return await in_worker(session, work)


@router.post("/job-estimates/actuals", response_model=JobActualsRead, responses=_ACTUALS_ERRORS,
             status_code=status.HTTP_201_CREATED, tags=["job-estimates"], summary="Report measured job durations")
def record_actuals(
    body: JobActualsCreate, session: SessionDep, predictor: PredictorDep, principal: PrincipalDep, response: Response,
    idempotency_key: Annotated[str | None, Header(description="retry-safe, as POST /v1/measurements: same key + "
                                                  "same body = the first answer, nothing stored twice; another "
                                                  "body = 409")] = None,
) -> JobActualsRead:
    """Store measured whole-job durations; later estimates of the same graph, hardware, precision, device count
    and nodes use them."""
    answer = service.record_actuals(session, predictor, request=body, submitter=principal.key_id,
                                    idempotency_key=idempotency_key)
    if answer.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return answer


@router.post("/comparisons", response_model=ComparisonRead, responses=_COMPARE_ERRORS, tags=["comparisons"],
             summary="One job on many devices: time, cost, energy, Pareto front")
async def compare(body: ComparisonCreate, session: SessionDep, predictor: PredictorDep) -> ComparisonRead:
    """One row per device x device count (default: every stored device), devices that cannot run the job in
    ``unavailable`` with their reason; optional batch-size sweep on one device."""

    def work() -> ComparisonRead:
        answer = service.compare(session, predictor, request=body)
        record_prediction(predictor_version=answer.predictor_version, methods={},
                          count=len(answer.rows) + len(answer.sweep or []))
        return answer

    return await in_worker(session, work)
