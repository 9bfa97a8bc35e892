"""Imports every ORM model so that ``Base.metadata`` is complete (used by Alembic and tests)."""

from app.auth import ApiKey
from app.graphs.models import StoredGraph
from app.hardware.models import Hardware
from app.measurements.models import Measurement, MeasurementBatch, PredictorVersion
from app.predictors.models import LeaseLock, RetrainRun

__all__ = ["ApiKey", "Hardware", "LeaseLock", "Measurement", "MeasurementBatch", "PredictorVersion", "RetrainRun",
           "StoredGraph"]
