"""HTTP route of cost predictions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.deps import PredictorDep, SessionDep, in_worker
from app.observability import record_prediction
from app.predictions import service
from app.predictions.schemas import PredictionCreate, PredictionRead
from app.schemas import ErrorResponse

router = APIRouter(prefix="/v1/predictions", tags=["predictions"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "graph_not_found, hardware_not_found"},
    422: {
        "model": ErrorResponse,
        "description": "validation_error, invalid_graph, unbound_dimension, unknown_dimension, "
                       "dims_names_batch_axis, limit_exceeded, precision_not_supported, stack_not_supported, "
                       "no_interconnect, too_many_devices_per_node (more than 8 devices in a node; "
                       "detail.nodes_needed), conflicting_hardware (inline hardware under a stored device's id "
                       "that differs from it; detail.fields), no_costed_layers (no layer of the graph has a cost "
                       "formula; detail.op_types)",
    },
}


@router.post("", response_model=PredictionRead, responses=_ERRORS)
async def create_prediction(body: PredictionCreate, session: SessionDep, predictor: PredictorDep) -> PredictionRead:
    """Per-layer, per-iteration, per-epoch and per-job cost of a graph on one piece of hardware."""

    def work() -> PredictionRead:
        prediction = service.predict(session, predictor, request=body)
        record_prediction(predictor_version=prediction.predictor_version, methods=prediction.methods)
        return prediction

    return await in_worker(session, work)
