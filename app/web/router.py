"""The web page: ``GET /`` (form, totals, per-layer chart, roofline, memory and, with a dataset size and
epochs, the hardware comparison with its Pareto front), ``GET /ui/layers.csv``, ``GET /ui/comparison.csv``
and ``POST /ui/graphs`` (upload from the page). Server-rendered HTML with inline SVG (:mod:`app.web.render`):
no request to any outside host; the one inline script only shows progress while a form's request runs.

The page takes the parameters of ``POST /v1/predictions`` as query parameters; a bad one is shown on the
page with its problem code (and the response carries the matching 4xx status).
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, BackgroundTasks, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import Field, ValidationError

from app.deps import PredictorDep, SessionDep, SettingsDep, refuse_repeated_query
from app.errors import InvalidRequest, LayercastError, clean_validation_errors, validation_message
from app.estimates import service as estimates
from app.estimates.schemas import ComparisonCreate, ComparisonRead
from app.graphs import router as graphs_router
from app.graphs import service as graphs
from app.hardware import service as hardware_service
from app.observability import record_prediction
from app.predictions import service as predictions
from app.predictions.schemas import PredictionCreate, PredictionRead
from app.schemas import Schema
from app.web import render

router = APIRouter(tags=["web"], include_in_schema=False)


#: The query parameters of the page and its CSV downloads: the fields of ``POST /v1/predictions`` that the page
#: offers (``dims`` as ``name=value,...`` text, as ``GET /v1/graphs/{id}/layers`` takes it) plus the job's
#: ``dataset_size`` and ``epochs``. Any other name (a typo such as ``precison``) is refused, never ignored.
PAGE_PARAMETERS: frozenset[str] = frozenset({
    "graph_id", "hardware_id", "batch_size", "mode", "precision", "optimizer", "software_stack", "dims",
    "device_count", "nodes", "dataset_size", "epochs"})


def _refuse_unknown(request: Request, allowed: frozenset[str] = PAGE_PARAMETERS) -> None:
    """Raises :class:`InvalidRequest` (422 ``invalid_request``, ``detail.unknown``) when the query string has
    a parameter the page does not take, ``detail.repeated`` when it has one twice."""
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise InvalidRequest(
            f"unknown query parameter(s) {', '.join(repr(u) for u in unknown)}; the page takes "
            f"{', '.join(sorted(allowed))}", detail={"unknown": unknown})
    refuse_repeated_query(request)


def _query(
    graph_id: str | None, hardware_id: str | None, batch_size: int, mode: str, precision: str, device_count: int,
    dataset_size: int | None, epochs: float | None, *, optimizer: str = "sgd",
    software_stack: str = "pytorch-eager", dims: str | None = None, nodes: int = 1,
) -> dict[str, Any]:
    """The page's request as the API's fields; ``dims`` stays the typed ``name=value,...`` text (parsed by
    :func:`_api_fields`)."""
    return {"graph_id": graph_id or None, "hardware_id": hardware_id or None, "batch_size": batch_size, "mode": mode,
            "precision": precision, "optimizer": optimizer, "software_stack": software_stack, "dims": dims or None,
            "device_count": device_count, "nodes": nodes, "dataset_size": dataset_size, "epochs": epochs}


def _api_fields(query: dict[str, Any]) -> dict[str, Any]:
    """``query`` without its unset fields, ``dims`` parsed (raises :class:`LayercastError` 422 for bad text)."""
    fields = {k: v for k, v in query.items() if v is not None}
    if "dims" in fields:
        fields["dims"] = graphs_router.parse_dims(fields["dims"])
    return fields


def _link_params(query: dict[str, Any]) -> str:
    """``query``'s set fields as a URL query string (for the CSV links; HTML-escape it in an attribute)."""
    return urlencode({k: v for k, v in query.items() if v is not None})


def _predict(session: Any, predictor: Any, query: dict[str, Any]) -> PredictionRead:
    """Raises :class:`LayercastError` or ``ValidationError`` for a bad request."""
    prediction = predictions.predict(session, predictor, request=PredictionCreate.model_validate(_api_fields(query)))
    record_prediction(predictor_version=prediction.predictor_version, methods=prediction.methods)
    return prediction


def _compare(session: Any, predictor: Any, query: dict[str, Any]) -> ComparisonRead:
    """The whole catalog's comparison of the page's job at its device count (``POST /v1/comparisons``).
    Raises :class:`LayercastError` or ``ValidationError`` (e.g. without ``dataset_size`` or ``epochs``)."""
    fields = _api_fields(query)
    request = ComparisonCreate.model_validate({
        "graph_id": query["graph_id"], "batch_size": query["batch_size"], "dataset_size": query["dataset_size"],
        "epochs": query["epochs"], "mode": query["mode"], "precision": query["precision"],
        "optimizer": query["optimizer"], "software_stack": query["software_stack"], "dims": fields.get("dims", {}),
        "device_counts": [query["device_count"]],
        # over several nodes the comparison spreads the count over nodes of devices_per_node (as the prediction)
        **({"devices_per_node": query["device_count"] // query["nodes"]} if query["nodes"] > 1 else {})})
    answer = estimates.compare(session, predictor, request=request)
    record_prediction(predictor_version=answer.predictor_version, methods={}, count=len(answer.rows))
    return answer


def _problem(exc: Exception) -> tuple[int, str, str]:
    if isinstance(exc, LayercastError):
        return exc.status_code, exc.code, exc.message
    assert isinstance(exc, ValidationError)
    return 422, "validation_error", validation_message("", clean_validation_errors(exc.errors()))


Int = Annotated[int, Query(ge=1, le=1_000_000)]


class _PageNumbers(Schema):
    """The page's typed number fields, parsed from text, with the bounds of :class:`PredictionCreate`'s fields
    (so that every out-of-range number is named ``query.<field>`` here, not ``<field>`` by the request model
    after parsing; ``inf``/``nan`` epochs are refused as there)."""

    batch_size: int = Field(32, ge=1, le=1_000_000)
    device_count: int = Field(1, ge=1, le=4096)
    nodes: int = Field(1, ge=1, le=4096)
    dataset_size: int | None = Field(None, ge=1, le=10**15)
    epochs: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)


def _page_numbers(typed: dict[str, str | None]) -> tuple[dict[str, Any], tuple[int, str, str] | None]:
    """The form's number fields as typed (an empty field, which a form submits as ``""``, is not given: its
    default) parsed by :class:`_PageNumbers`: ``(values, None)``, or ``(the typed text, problem)`` where a
    value does not parse, the problem a 422 ``validation_error`` whose message names ``query.<field>`` as the
    API's does, so that the page shows it next to the form still holding what was typed."""
    given = {k: v for k, v in typed.items() if v not in (None, "")}
    try:
        return _PageNumbers.model_validate(given).model_dump(), None
    except ValidationError as exc:
        errors = clean_validation_errors([{**e, "loc": ("query", *e["loc"])} for e in exc.errors()])
        return {**dict.fromkeys(typed), **given}, (422, "validation_error", validation_message("", errors))


@router.get("/", response_class=HTMLResponse)
def index(
    request: Request, session: SessionDep, predictor: PredictorDep, graph_id: str | None = None,
    hardware_id: str | None = None, batch_size: str | None = None, mode: str = "training", precision: str = "fp32",
    optimizer: str = "sgd", software_stack: str = "pytorch-eager", dims: str | None = None,
    device_count: str | None = None, nodes: str | None = None, dataset_size: str | None = None,
    epochs: str | None = None,
) -> HTMLResponse:
    """The page; with ``graph_id`` and ``hardware_id`` it also shows the prediction. The number fields come
    as text and are parsed here (:func:`_page_numbers`), so that a bad one is the page's message, not the
    API's JSON problem document; an unknown query parameter is the page's 422 ``invalid_request``."""
    numbers, problem = _page_numbers({"batch_size": batch_size, "device_count": device_count, "nodes": nodes,
                                      "dataset_size": dataset_size, "epochs": epochs})
    query = _query(graph_id, hardware_id, numbers["batch_size"], mode, precision, numbers["device_count"],
                   numbers["dataset_size"], numbers["epochs"], optimizer=optimizer, software_stack=software_stack,
                   dims=dims, nodes=numbers["nodes"])
    try:
        _refuse_unknown(request)
    except InvalidRequest as exc:
        problem = problem or _problem(exc)
    rows, _count = graphs.list_graphs(session, limit=200)
    catalog = hardware_service.list_hardware(session).items
    query["hardware_id"] = query["hardware_id"] or (catalog[0].id if catalog else None)
    body = render.form([(r.id, f"{r.name} ({r.id[:8]})") for r in rows], catalog, query)
    status = 200
    if problem is not None:
        status, code, message = problem
        body += render.error(code, message)
    elif query["graph_id"] and query["hardware_id"]:
        try:
            prediction = _predict(session, predictor, query)
        except (LayercastError, ValidationError) as exc:
            status, code, message = _problem(exc)
            body += render.error(code, message)
        else:
            device = next(h for h in catalog if h.id == prediction.hardware_id)
            params = escape(_link_params(query))
            body += (render.totals(prediction) + f'<p><a id="csv" href="/ui/layers.csv?{params}">layers as CSV</a></p>'
                     + render.layer_bars(prediction.layers)
                     + render.roofline(prediction.layers, device, prediction.precision.value,
                                       training=prediction.mode == "training")
                     + render.memory(prediction) + _comparison_section(session, predictor, query, params))
    return HTMLResponse(render.page(body), status_code=status)


def _comparison_section(session: Any, predictor: Any, query: dict[str, Any], params: str) -> str:
    if query["dataset_size"] is None or query["epochs"] is None:
        return '<p id="comparison-hint">Give dataset_size and epochs to compare every device.</p>'
    try:
        read = _compare(session, predictor, query)
    except (LayercastError, ValidationError) as exc:
        _status, code, message = _problem(exc)
        return render.error(code, message).replace('id="error"', 'id="comparison-error"')
    return (render.comparison(read)
            + f'<p><a id="comparison-csv" href="/ui/comparison.csv?{params}">comparison as CSV</a></p>')


def _csv(build: Callable[[], str], filename: str) -> Response:
    """``build()``'s CSV text as a download named ``filename``. A request the API refuses answers the API's
    problem document: a :class:`LayercastError` through the app's handler, a value the request schema
    refuses (``mode=train``) here as the 422 ``validation_error`` a query parameter gets, ``loc``
    ``["query", <field>]``."""
    try:
        text = build()
    except ValidationError as exc:  # answered by the app's validation handler, as a refused query parameter
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in exc.errors()]) from None
    return Response(text, media_type="text/csv", headers={"content-disposition": f'attachment; filename="{filename}"'})


@router.get("/ui/layers.csv")
def layers_csv(
    request: Request, session: SessionDep, predictor: PredictorDep, graph_id: str, hardware_id: str,
    batch_size: Int = 32, mode: str = "training", precision: str = "fp32", optimizer: str = "sgd",
    software_stack: str = "pytorch-eager", dims: str | None = None, device_count: Int = 1, nodes: Int = 1,
    dataset_size: Annotated[int | None, Query(ge=1)] = None, epochs: Annotated[float | None, Query(gt=0)] = None,
) -> Response:
    """The per-layer table of the page's prediction as CSV (errors: the API's problem documents; an unknown
    query parameter is a 422 ``invalid_request``)."""
    _refuse_unknown(request)
    query = _query(graph_id, hardware_id, batch_size, mode, precision, device_count, dataset_size, epochs,
                   optimizer=optimizer, software_stack=software_stack, dims=dims, nodes=nodes)
    return _csv(lambda: render.layers_csv(_predict(session, predictor, query)), "layers.csv")


@router.get("/ui/comparison.csv")
def comparison_csv(
    request: Request, session: SessionDep, predictor: PredictorDep, graph_id: str,
    dataset_size: Annotated[int, Query(ge=1)], epochs: Annotated[float, Query(gt=0)], hardware_id: str | None = None,
    batch_size: Int = 32, mode: str = "training", precision: str = "fp32", optimizer: str = "sgd",
    software_stack: str = "pytorch-eager", dims: str | None = None, device_count: Int = 1, nodes: Int = 1,
) -> Response:
    """The page's hardware comparison as CSV, one row per device (errors: the API's problem documents; an
    unknown query parameter is a 422 ``invalid_request``)."""
    _refuse_unknown(request)
    query = _query(graph_id, hardware_id, batch_size, mode, precision, device_count, dataset_size, epochs,
                   optimizer=optimizer, software_stack=software_stack, dims=dims, nodes=nodes)
    return _csv(lambda: render.comparison_csv(_compare(session, predictor, query)), "comparison.csv")


@router.post("/ui/graphs", response_class=HTMLResponse)
async def upload(request: Request, session: SessionDep, settings: SettingsDep, background: BackgroundTasks) -> Response:
    """Upload from the page (multipart ``file``) through ``POST /v1/graphs``, then show the graph (303)."""
    try:
        graph = await graphs_router.create_graph(request, Response(), session, settings, background)
    except LayercastError as exc:
        return HTMLResponse(render.page(render.error(exc.code, exc.message)), status_code=exc.status_code)
    return RedirectResponse(f"/?graph_id={graph.id}", status_code=303, background=background)
