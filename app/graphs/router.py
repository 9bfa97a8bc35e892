"""HTTP routes of the graphs domain: upload (ONNX or JSON layer list), read, per-layer costs."""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query, Request, Response, status
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app.auth import PrincipalDep, get_principal
from app.core.ir import Tensor
from app.deps import SessionDep, SettingsDep, repeated_names
from app.errors import (
    ConflictingName,
    ImportWorkerFailed,
    InvalidGraph,
    InvalidRequest,
    LimitExceeded,
    PayloadTooLarge,
    clean_validation_errors,
    validation_message,
)
from app.graphs import importer, service
from app.graphs.models import StoredGraph
from app.graphs.schemas import GraphLayers, GraphList, GraphRead, GraphSummary, JsonGraphCreate, LayerCostRead
from app.graphs.spool import Spool
from app.schemas import INT32_MAX, MAX_PAGE, ErrorResponse, Name, OffsetQuery, check_name, clean_name

router = APIRouter(prefix="/v1/graphs", tags=["graphs"])

_CHUNK_BYTES = 2**20
_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResponse, "description": "not_owner: the graph belongs to another key"},
    404: {"model": ErrorResponse, "description": "graph_not_found"},
    413: {"model": ErrorResponse, "description": "payload_too_large"},
    422: {
        "model": ErrorResponse,
        "description": "invalid_graph, unbound_dimension, unknown_dimension, validation_error; on upload also "
                       "conflicting_name (?name= and the body's or form's name differ), invalid_request (a multipart "
                       "form field other than file/name, or one twice: detail {unknown, allowed, repeated})",
    },
}

BatchQuery = Annotated[int, Query(gt=0, le=1_000_000, description="batch size the summary is computed at")]
DimsQuery = Annotated[
    str | None,
    Query(description="bindings of symbolic dimensions other than the batch axis: 'seq=128,past=0'"),
]


def parse_dims(raw: str | None) -> dict[str, int]:
    """Parse ``'a=1,b=2'`` into ``{"a": 1, "b": 2}``; raises :class:`InvalidRequest` (422) for bad syntax,
    a name given twice (``seq=8,seq=9``: the last silently won) or a value below 1, and
    :class:`LimitExceeded` (422) for a value over 2³¹−1."""
    if not raw:
        return {}
    out: dict[str, int] = {}
    for part in raw.split(","):
        key, sep, value = part.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            if key.strip() in out:
                raise InvalidRequest(f"dims binds {key.strip()!r} more than once in {raw!r}; bind each name once",
                                     detail={"dims": raw, "repeated": key.strip()})
            out[key.strip()] = int(value)
            if out[key.strip()] < 1:
                raise InvalidRequest(f"dims binds {key.strip()!r} to {value.strip()}; a dimension is at least 1",
                                     detail={"dims": raw, "dimension": key.strip()})
            if out[key.strip()] > INT32_MAX:
                raise LimitExceeded("dimension", out[key.strip()], INT32_MAX,
                                    f"dims binds '{key.strip()}' to {value}; the limit is {INT32_MAX}")
        except ValueError:
            raise InvalidRequest(
                f"dims must look like 'name=value,name=value', got {raw!r}", detail={"dims": raw}
            ) from None
    return out


def _parse_json_graph(raw: bytes) -> JsonGraphCreate:
    """A JSON layer-list upload; raises :class:`InvalidGraph` (422) for bad JSON or a bad document."""
    try:
        return JsonGraphCreate.model_validate(json.loads(raw))
    except ValidationError as exc:  # the document's fields: named in the message, never echoed back
        errors = clean_validation_errors(exc.errors())
        raise InvalidGraph(validation_message("JSON graph is not valid", errors), detail={"errors": errors}) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidGraph(f"JSON graph is not valid: {str(exc).splitlines()[0]}", detail={"errors": []}) from None


def _one_name(query: str | None, given: str | None, *, field: str) -> str | None:
    """The upload's name from the ``?name=`` parameter ``query`` and the name ``given`` in the body (JSON
    ``name``: ``field`` ``name``) or the form (``field`` ``form.name``): either one, or both when equal; raises
    :class:`ConflictingName` (422) when both are given and differ (the parameter used to win silently)."""
    if query is not None and given is not None and query != given:
        where = "the form field 'name'" if field == "form.name" else "the JSON body's name"
        raise ConflictingName(
            f"the upload is named twice: ?name={query!r} and {where} {given!r}; give one name, or the same in both",
            detail={"query": query, "body": given, "field": field})
    return query if query is not None else given


#: The fields of a multipart upload, each at most once (``batch_size``, ``dims`` and ``name`` as query parameters).
FORM_FIELDS = ("file", "name")


def _check_form_fields(keys: list[str]) -> None:
    """Raise :class:`InvalidRequest` (422, detail ``{unknown, allowed, repeated}``, names sorted) when the
    multipart form's field names ``keys`` (one per part, in order) hold a field not in :data:`FORM_FIELDS`
    or one twice: such parts used to be ignored (the first ``file`` won), so the client got a graph other
    than the one it asked for."""
    unknown = sorted({k for k in keys if k not in FORM_FIELDS})
    repeated = [k for k in repeated_names(keys) if k in FORM_FIELDS]
    if unknown or repeated:
        problems = [f"unknown field(s) {', '.join(map(repr, unknown))}"] if unknown else []
        problems += [f"field(s) {', '.join(map(repr, repeated))} given more than once"] if repeated else []
        raise InvalidRequest(
            f"multipart upload: {'; '.join(problems)}; send one 'file' part and at most one 'name' "
            "(batch_size and dims are query parameters)",
            detail={"unknown": unknown, "allowed": list(FORM_FIELDS), "repeated": repeated})


def _read(row: StoredGraph, *, notices: list[str] | None = None) -> GraphRead:
    return GraphRead.model_validate(
        {
            "id": row.id,
            "name": row.name,
            "source_format": row.source_format,
            "size_bytes": row.size_bytes,
            "created_at": row.created_at,
            "storage": {
                "weights_stored": row.weights_stored,
                "stored_bytes": row.stored_bytes,
                "stripped_weight_bytes": row.stripped_weight_bytes,
                "structure_sha256": row.structure_sha256,
            },
            "summary": row.summary,
            "owner": row.owner,
            "notices": notices or [],
        }
    )


@router.post(
    "",
    response_model=GraphRead,
    status_code=status.HTTP_201_CREATED,
    responses={200: {"model": GraphRead, "description": "already stored (same content hash)"}, **_ERRORS,
               503: {"model": ErrorResponse, "description": "import_worker_failed: the process importing a large "
                     "upload died (nothing stored; send it again); database_unavailable"}},
    openapi_extra={
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"file": {"type": "string", "format": "binary"}, "name": {"type": "string"}},
                        "required": ["file"],
                        "additionalProperties": False,
                    }
                },
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": JsonGraphCreate.model_json_schema()},
            },
            "required": True,
        }
    },
)
async def create_graph(
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    background: BackgroundTasks,
    batch_size: BatchQuery = 1,
    dims: DimsQuery = None,
    name: Annotated[Name | None, Query()] = None,
) -> GraphRead:
    """Upload an ONNX file (multipart field ``file``, or the raw bytes as ``application/octet-stream``)
    or a JSON layer list (``application/json``).

    A multipart form holds one ``file`` part and at most one ``name``: another field, or one of them twice,
    is a 422 ``invalid_request`` with ``detail`` ``{unknown, allowed, repeated}`` and nothing is stored.

    ONNX bodies are streamed to a spooled temporary file (in memory up to 8 MiB, on disk above) while
    being hashed, never held whole as a request body; the file is read once, to parse it. External-data
    references in the model are never opened. Stored by the sha256 of the upload, without weight data;
    the same content twice returns the stored graph with 200 and ``notices`` saying what was done with
    this request's ``name``, ``batch_size`` and ``dims``; a new upload with ``dims`` returns 201 with a notice
    that they bound its summary only (the graph keeps its symbolic dimensions: every prediction and layer table
    passes its own, else 422 ``unbound_dimension`` with the upload's value). The graph's ``owner`` is the API
    key of its first upload (null: anonymous); only the owner or an admin may delete it.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"upload larger than {limit} bytes", detail={"max_upload_bytes": limit})
    binding = parse_dims(dims)
    workers = getattr(request.app.state, "import_workers", None)
    if workers is not None and ctype != "application/json" and declared and declared.isdigit() \
            and workers.wants(int(declared)):
        with contextlib.suppress(ImportWorkerFailed):  # raised again by the import if it needs the worker
            await run_in_threadpool(workers.start)  # its start-up overlaps the transfer
    spool = Spool()
    try:
        if ctype == "multipart/form-data":
            form = await request.form()
            _check_form_fields([key for key, _ in form.multi_items()])
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise InvalidRequest("multipart upload needs a file field named 'file'",
                                     detail={"field": "file", "expected": "a file part"})
            if not isinstance(form.get("name", ""), str):
                raise InvalidRequest("multipart field 'name' must be a text field, not a file",
                                     detail={"field": "name", "expected": "a text field"})
            # Starlette spooled the part to an unnamed temporary file: copied to ours while hashed, so that a
            # large one has a path the import worker process can open
            while chunk := await upload.read(_CHUNK_BYTES):
                await spool.add(chunk)
            form_name = form.get("name")
            if isinstance(form_name, str) and form_name:
                try:
                    checked = check_name(form_name[:200])
                except ValueError as exc:
                    raise InvalidRequest(f"form field 'name': {exc}", detail={"field": "name"}) from None
                name = _one_name(name, checked, field="form.name")
            name = name or clean_name(upload.filename or "")
            fmt = "onnx"
        elif ctype == "application/json":
            parsed = await run_in_threadpool(_parse_json_graph, await request.body())
            await spool.add(await run_in_threadpool(importer.canonical_json, parsed.model_dump()))
            name = _one_name(name, parsed.name if "name" in parsed.model_fields_set else None,
                             field="name") or parsed.name
            fmt = "json"
        elif ctype in ("application/octet-stream", "application/onnx", ""):
            async for chunk in request.stream():
                await spool.add(chunk)
                if spool.size > limit:
                    raise PayloadTooLarge(f"upload larger than {limit} bytes", detail={"max_upload_bytes": limit})
            fmt = "onnx"
        else:
            raise InvalidRequest(
                f"unsupported content type {ctype!r}; send multipart/form-data, application/octet-stream "
                "or application/json",
                detail={"content_type": ctype},
            )
        if spool.size > limit:
            raise PayloadTooLarge(f"upload larger than {limit} bytes", detail={"max_upload_bytes": limit})
        if not spool.size:
            raise InvalidGraph("empty upload")
        source = await spool.finish()
        # looked up by the hash first (a stored upload is never parsed again); CPU (parse, import, analyse) off
        # the event loop, in the import worker process for an upload spooled to disk (app.graphs.importer), and
        # the database work in a worker thread; the import's own deadline (app.core.limits, import_timeout_s)
        # bounds how long the import runs.
        result = await run_in_threadpool(
            service.create_graph,
            session,
            content=source,
            source_format=fmt,
            name=name or "",
            batch_size=batch_size,
            dims=binding,
            upload_sha256=spool.digest.hexdigest(),
            owner=get_principal(request).key_id,
            content_path=spool.path,
            workers=workers,
        )
    except BaseException:
        await spool.close()
        raise
    background.add_task(spool.close)  # after the response: unlinking a 438 MB spool takes 35 ms
    if not result.created:
        response.status_code = status.HTTP_200_OK
    return _read(result.row, notices=result.notices)


@router.delete(
    "/{graph_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
    responses={k: _ERRORS[k] for k in (403, 404)},
)
def delete_graph(graph_id: str, session: SessionDep, principal: PrincipalDep) -> Response:
    """Delete a stored graph (204); 404 ``graph_not_found`` if there is none with this id, 403
    ``not_owner`` when another key uploaded it (admins may delete any)."""
    service.delete_graph(session, graph_id=graph_id, principal=principal)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("", response_model=GraphList, responses={422: {"model": ErrorResponse, "description": "validation_error: "
            "limit not in 1-1000 or a negative offset"}})  # fmt: skip
def list_graphs(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    offset: OffsetQuery = 0,
) -> GraphList:
    """Stored graphs, newest first (ties by id), paged by ``limit``/``offset``: ``count`` items in this page,
    ``total`` stored."""
    rows, total = service.list_graphs(session, limit=limit, offset=offset)
    items = [_read(r) for r in rows]
    return GraphList(items=items, count=len(items), total=total, limit=limit, offset=offset)


@router.get("/{graph_id}", response_model=GraphRead, responses={404: _ERRORS[404]})
def get_graph(graph_id: str, session: SessionDep) -> GraphRead:
    """One stored graph and its summary at the batch size it was uploaded with."""
    return _read(service.get_graph(session, graph_id=graph_id))


def _shapes(ts: tuple[Tensor, ...]) -> list[list[int]]:
    return [list(t.shape) for t in ts]


@router.get("/{graph_id}/layers", response_model=GraphLayers, responses=_ERRORS)
def graph_layers(graph_id: str, session: SessionDep, batch_size: BatchQuery = 1, dims: DimsQuery = None) -> GraphLayers:
    """Per-layer analytical costs (no hardware needed) at ``batch_size``."""
    row, analysis = service.graph_layers(session, graph_id=graph_id, batch_size=batch_size, dims=parse_dims(dims))
    layers = [
        LayerCostRead(
            name=c.name,
            op_type=c.op_type,
            kind=c.kind.value,
            supported=c.supported,
            input_shapes=_shapes(layer.inputs),
            output_shapes=_shapes(layer.outputs),
            params=c.params,
            forward_macs=c.forward_macs,
            forward_flops=c.forward_flops,
            backward_flops=c.backward_flops,
            forward_bytes_read=c.forward_bytes_read,
            forward_bytes_written=c.forward_bytes_written,
            backward_bytes=c.backward_bytes,
            operational_intensity_flops_per_byte=c.operational_intensity,
        )
        for layer, c in zip(analysis.graph.layers, analysis.costs, strict=True)
    ]
    summary = GraphSummary.model_validate(importer.summarize(analysis))
    return GraphLayers(graph_id=row.id, batch_size=batch_size, layers=layers, summary=summary)
