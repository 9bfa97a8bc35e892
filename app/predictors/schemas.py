"""API schemas of the predictor registry."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from app.schemas import Schema


class PredictorVersionRead(Schema):
    """One registered version. ``metrics``: held-out metrics per split (overall, by source, hardware and
    precision; MAPE etc. from :func:`app.training.metrics.metrics`); ``watermark``: the newest
    measurement it could have trained on."""

    version: str
    status: str = Field(description="candidate | production | retired")
    sha256: str
    artifact_path: str
    schema_version: int
    watermark_measurement_id: int | None
    created_at: datetime
    promoted_at: datetime | None
    feature_names: list[str]
    hyperparameters: dict[str, Any]
    metrics: dict[str, Any]
    watermark: dict[str, Any]


class PredictorVersionList(Schema):
    """Registered versions, newest first; ``production`` names the one being served."""

    items: list[PredictorVersionRead]
    production: str | None


class RetrainRequestRead(Schema):
    """A recorded retrain request (``status`` ``requested`` until a worker takes it)."""

    id: int
    status: str
    trigger: str
    requested_at: datetime
