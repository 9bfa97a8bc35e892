"""Observability: Prometheus metrics, request ids, JSON logs, liveness and readiness.

* ``GET /metrics``: the Prometheus text format (``prometheus_client``), from :data:`REGISTRY` plus, at
  scrape time, the stored measurement counts of this app's database.
* ``GET /healthz``: alive (200 while the process answers; touches nothing else, so it stays cheap).
* ``GET /readyz``: ready to serve predictions: the database answers ``SELECT 1`` and a predictor is
  loaded; otherwise 503 ``not_ready`` with ``detail.database`` / ``detail.predictor``.
* :class:`RequestContext`: ASGI middleware that reads ``X-Request-ID`` (or makes one), echoes it on the
  response, makes it visible to every log record of the request, times the request into
  :data:`REQUEST_LATENCY` by *route template* (``/v1/graphs/{graph_id}``, never the raw path, so the
  series count stays bounded) and writes one access log line.
* :class:`JsonFormatter` / :func:`configure_logging`: one JSON object per log line.

Metrics live in one process-wide registry (not ``prometheus_client``'s global one, so importing other
libraries cannot clash with it); several apps in one process (the tests) share the counters.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.engine import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import LayercastError

logger = logging.getLogger("layercast")
access_logger = logging.getLogger("layercast.access")

#: The registry served at ``/metrics``.
REGISTRY = CollectorRegistry(auto_describe=True)

#: Request latency (s) by method, route template (``unmatched`` for unknown paths) and status code.
#: Buckets: 5 ms to 60 s, uploads of large ONNX files being the slow end.
REQUEST_LATENCY = Histogram(
    "layercast_http_request_duration_seconds",
    "HTTP request latency by route template and status code",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
#: Predictions served, by predictor version.
PREDICTIONS = Counter(
    "layercast_predictions_total", "Predictions served, by predictor version", ["predictor_version"],
    registry=REGISTRY,
)
#: Layers predicted, by predictor version and method (``learned``, ``roofline``, ``unsupported``).
PREDICTED_LAYERS = Counter(
    "layercast_predicted_layers_total",
    "Layers predicted, by predictor version and method (learned, roofline, unsupported)",
    ["predictor_version", "method"],
    registry=REGISTRY,
)
#: Measurements reported through ``POST /v1/measurements``, by source.
MEASUREMENTS_REPORTED = Counter(
    "layercast_measurements_reported_total", "Measurements reported through the API, by source", ["source"],
    registry=REGISTRY,
)
#: Retraining runs by outcome; incremented with :func:`record_retrain`.
RETRAIN_RUNS = Counter(
    "layercast_retrain_runs_total",
    "Retraining runs by outcome (promoted, rejected, failed, skipped)",
    ["outcome"],
    registry=REGISTRY,
)

RetrainOutcome = Literal["promoted", "rejected", "failed", "skipped"]

#: The id of the request being served (``None`` outside a request).
REQUEST_ID: ContextVar[str | None] = ContextVar("layercast_request_id", default=None)

#: Accepted incoming ``X-Request-ID`` values; anything else is replaced by a fresh id (log injection).
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


# --------------------------------------------------------------------------------------------- metrics


def record_prediction(*, predictor_version: str, methods: Mapping[str, int], count: int = 1) -> None:
    """Count ``count`` served predictions (a batch item, a job estimate and a comparison row are one each)
    and their layers per method (``PredictionRead.methods``; empty where a compact answer has no split)."""
    if count:
        PREDICTIONS.labels(predictor_version=predictor_version).inc(count)
    for method, layers in methods.items():
        if layers:
            PREDICTED_LAYERS.labels(predictor_version=predictor_version, method=method).inc(layers)


def record_measurement(*, source: str, n: int = 1) -> None:
    """Count ``n`` measurements of ``source`` reported through the API."""
    MEASUREMENTS_REPORTED.labels(source=source).inc(n)


def record_retrain(outcome: RetrainOutcome) -> None:
    """Count one retraining run. A worker process serves its own registry, e.g.
    ``prometheus_client.start_http_server(9100, registry=REGISTRY)``."""
    RETRAIN_RUNS.labels(outcome=outcome).inc()


class StoredMeasurementsCollector(Collector):
    """``layercast_measurements_stored{source}``: rows in the measurements table, counted at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        from sqlalchemy.orm import Session

        from app.measurements.repository import MeasurementRepository

        gauge = GaugeMetricFamily(
            "layercast_measurements_stored", "Measurements stored in the database, by source", labels=["source"]
        )
        with Session(self.engine) as session:
            for source, count in sorted(MeasurementRepository(session).count_by_source().items()):
                gauge.add_metric([source], count)
        yield gauge


# ------------------------------------------------------------------------------------------ middleware


def _route_template(scope: Scope) -> str:
    """The matched route's path template, ``unmatched`` when no route matched (404s of random paths)."""
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return str(path) if path else "unmatched"


class RequestContext:
    """ASGI middleware: request id in and out, latency histogram by route template, one access log line.

    The incoming ``X-Request-ID`` is kept when it matches ``[A-Za-z0-9._:-]{1,128}``; otherwise a new
    uuid4 hex is used. A request that raises is recorded with status 500 and re-raised.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID_RE.match(incoming) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        status = 500
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed_s = time.perf_counter() - start
            route = _route_template(scope)
            REQUEST_LATENCY.labels(method=scope["method"], route=route, status=str(status)).observe(elapsed_s)
            access_logger.info(
                "%s %s %d", scope["method"], scope["path"], status,
                extra={"request_id": request_id, "method": scope["method"], "path": scope["path"],
                       "route": route, "status": status, "duration_ms": round(elapsed_s * 1000.0, 3)},
            )
            REQUEST_ID.reset(token)


# --------------------------------------------------------------------------------------------- logging

#: Attributes every ``LogRecord`` has; anything else on a record came from ``extra=`` and is emitted.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC ISO 8601), ``level``, ``logger``, ``message``,
    ``request_id`` (when inside a request), the ``extra=`` fields, and ``exc_info`` as text."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            body["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in body:
                body[key] = value
        if record.exc_info:
            body["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def configure_logging(level: str, fmt: Literal["json", "text"] = "json") -> None:
    """Root logging for ``layercast serve``: JSON lines (default) or plain text, at ``level``."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn's own handlers would print a second, plain copy
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


# --------------------------------------------------------------------------------------------- routes


class NotReady(LayercastError):
    """The service cannot serve predictions yet (database unreachable or no predictor loaded)."""

    status_code = 503
    code = "not_ready"


def get_engine(request: Request) -> Engine:
    """The app's SQLAlchemy engine (overridable in tests)."""
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]

router = APIRouter(tags=["ops"])


def _loaded_predictor(request: Request) -> Any:
    """The predictor loaded now (None before the first load), without polling the registry."""
    holder = getattr(request.app.state, "predictors", None)
    return None if holder is None else holder.loaded


@router.get("/healthz", summary="Liveness")
def healthz(request: Request) -> dict[str, Any]:
    """Alive: ``status`` ``ok``, the service version and the loaded predictor's version (null if none).
    Checks nothing else; readiness is ``/readyz``."""
    predictor = _loaded_predictor(request)
    return {"status": "ok", "version": request.app.version, "predictor_version": getattr(predictor, "version", None)}


@router.get(
    "/readyz",
    summary="Readiness: database reachable and a predictor loaded",
    responses={503: {"description": "not_ready: detail.database / detail.predictor say what is missing"}},
)
def readyz(request: Request, engine: EngineDep) -> dict[str, Any]:
    """200 ``{"status": "ready", "database": "ok", "predictor_version": ..., "predictor_problem": null}``,
    ``status`` ``degraded`` with ``predictor_problem`` saying why when the served version is not the
    production one (it failed to load: the last good one serves), or 503 ``not_ready``."""
    database = "ok"
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any failure means "not ready"
        logger.exception("readyz: database check failed")
        database = "unreachable"
    predictor = _loaded_predictor(request)
    predictor_state = "loaded" if predictor is not None else "missing"
    if database != "ok" or predictor is None:
        raise NotReady(
            f"not ready: database {database}, predictor {predictor_state}",
            detail={"database": database, "predictor": predictor_state},
        )
    holder = request.app.state.predictors
    problem = getattr(holder, "problem", None)
    return {"status": "degraded" if problem else "ready", "database": database,
            "predictor_version": getattr(predictor, "version", None), "predictor_problem": problem}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(engine: EngineDep) -> Response:
    """Prometheus text exposition: :data:`REGISTRY` plus ``layercast_measurements_stored`` of this app."""
    stored = CollectorRegistry(auto_describe=False)
    stored.register(StoredMeasurementsCollector(engine))
    try:
        stored_text = generate_latest(stored)
    except Exception:  # noqa: BLE001 - an unreachable database must not hide the other metrics
        logger.exception("metrics: counting stored measurements failed")
        stored_text = b""
    return Response(generate_latest(REGISTRY) + stored_text, media_type=CONTENT_TYPE_LATEST)
