"""Domain errors that carry their HTTP status and a machine-readable code (STYLE.md §6).

One handler (installed by :func:`app.main.create_app`) renders every :class:`LayercastError` as a problem
document ``{"error": {"code": ..., "message": ..., "detail": {...}}}``.
"""

from __future__ import annotations

from typing import Any


class LayercastError(Exception):
    """Base of all errors a client can cause. Subclasses set ``status_code`` and ``code``."""

    status_code: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, *, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail or {}

    def to_problem(self) -> dict[str, Any]:
        """The JSON body sent to the client."""
        return {"error": {"code": self.code, "message": self.message, "detail": self.detail}}


class NotFoundError(LayercastError):
    status_code = 404
    code = "not_found"


class GraphNotFound(NotFoundError):
    code = "graph_not_found"


class HardwareNotFound(NotFoundError):
    code = "hardware_not_found"


class InvalidGraph(LayercastError):
    """The uploaded bytes are not a model graph we can read (ONNX that does not parse, bad JSON), or one whose
    shapes do not chain at the binding asked for (a JSON layer declaring another input size than it gets, ONNX
    operands that do not fit, a Reshape target baked in at other sizes); ``detail`` names the layer or node
    and the field."""

    status_code = 422
    code = "invalid_graph"


class UnboundDimension(LayercastError):
    """The graph has a symbolic dimension that the request does not bind."""

    status_code = 422
    code = "unbound_dimension"


class UnknownDimension(LayercastError):
    """The request binds a dimension name (``dims``) that the graph does not have."""

    status_code = 422
    code = "unknown_dimension"


class BatchAxisInDims(LayercastError):
    """``dims`` names a graph's batch axis, which ``batch_size`` binds (naming it in both would leave the
    answer's ``batch_size`` and the costed batch disagreeing)."""

    status_code = 422
    code = "dims_names_batch_axis"


class InvalidRequest(LayercastError):
    status_code = 422
    code = "invalid_request"


class ConflictingName(LayercastError):
    """A graph upload names itself twice, differently: the ``?name=`` query parameter and the JSON body's
    ``name`` (or the multipart ``name`` field). Neither silently wins; the same name twice is fine.

    ``detail``: ``query`` (the parameter's name), ``body`` (the document's or form field's) and ``field``
    (``name`` for a JSON body, ``form.name`` for multipart).
    """

    status_code = 422
    code = "conflicting_name"


class ConflictingHardware(LayercastError):
    """An inline hardware spec under an id that names a stored device (catalog, ``local`` or custom) says
    something else than the stored entry: neither silently wins, one id never answers for two devices.

    ``detail``: ``hardware_id`` and ``fields`` (the names of the fields that differ, sorted).
    """

    status_code = 422
    code = "conflicting_hardware"


class DuplicateBatchSizes(LayercastError):
    """A batch-size sweep names a batch size more than once (each would be the same row again).

    ``detail``: ``duplicates`` (the repeated sizes, ascending).
    """

    status_code = 422
    code = "duplicate_batch_sizes"


class MalformedJson(LayercastError):
    """A JSON body that ``json.loads`` refuses with something other than a ``JSONDecodeError`` (bytes that are
    not UTF-8/16/32 text, an integer literal over Python's digit limit: :func:`app.core.limits.json_text_problem`),
    answered like every other malformed body: 422 ``validation_error`` with one ``json_invalid`` error (FastAPI
    said 400 ``bad_request`` for these two)."""

    status_code = 422
    code = "validation_error"

    def __init__(self, reason: str, *, offset: int | None) -> None:
        errors = [{"type": "json_invalid", "loc": ["body"] if offset is None else ["body", offset],
                   "msg": "JSON decode error", "ctx": {"error": reason}}]
        super().__init__(validation_message("request validation failed", errors), detail={"errors": errors})


class NoInterconnect(LayercastError):
    """Several devices were asked for on hardware whose spec lists no interconnect."""

    status_code = 422
    code = "no_interconnect"


class TooManyDevicesPerNode(LayercastError):
    """More devices in one node (``device_count / nodes``) than a node holds
    (:data:`app.core.collectives.MAX_DEVICES_PER_NODE`, an 8-GPU DGX/HGX node): never costed as one NVLink
    domain of that many devices.

    ``detail``: ``device_count``, ``nodes``, ``devices_per_node``, ``max_devices_per_node`` and ``nodes_needed``
    (the fewest nodes that hold ``device_count`` in equal shares: :func:`app.core.collectives.nodes_needed`).
    """

    status_code = 422
    code = "too_many_devices_per_node"


class Conflict(LayercastError):
    status_code = 409
    code = "conflict"


class HardwareExists(Conflict):
    code = "hardware_exists"


class HardwareInUse(Conflict):
    """Measurements refer to the device: changing or deleting its spec would change what they mean."""

    code = "hardware_in_use"


class BuiltinHardware(LayercastError):
    """The datasheet catalog and ``local`` are maintained by the service, not through the API."""

    status_code = 403
    code = "builtin_hardware"


class PayloadTooLarge(LayercastError):
    status_code = 413
    code = "payload_too_large"


class TooManyItems(PayloadTooLarge):
    """More items than one call accepts (413; ``detail``: ``count`` and ``limit``): batch predictions, job
    estimates and actuals, measurement batches."""

    code = "too_many_items"


class PrecisionNotSupportedError(LayercastError):
    """The device lacks the arithmetic the requested precision needs (bf16 before Ampere, tf32 before
    Ampere, fp16 on Kepler/Maxwell): never answered silently in fp32."""

    status_code = 422
    code = "precision_not_supported"


class StackNotSupportedError(LayercastError):
    """The software stack cannot run on the device's kind (a CUDA graph or a CUDA library on a CPU:
    :data:`app.core.vocab.GPU_ONLY_STACKS`): never answered silently as another stack.

    ``detail``: ``software_stack``, ``hardware_id``, ``hardware_kind`` and ``supported_kinds``.
    """

    status_code = 422
    code = "stack_not_supported"


class NoCostedLayers(LayercastError):
    """No layer of the graph has a cost formula (every op unsupported): a job or comparison row of it would be
    0 s and $0, which a scheduler or a ranking would take at face value (422)."""

    status_code = 422
    code = "no_costed_layers"


class InvalidActuals(LayercastError):
    """No actual of a ``POST /v1/job-estimates/actuals`` report can be recorded (every item failed): nothing is
    stored, as a measurement batch with bad rows stores nothing (422 ``invalid_measurements``), instead of a 201
    that a caller checking the status takes as stored.

    ``detail``: the answer a 201 would have been (``predictor_version``, ``recorded`` 0, ``failed``, ``actuals``:
    every item with its ``error`` code, message and detail; a refused actual's ``ratio`` and the calibration its
    graph and hardware have).
    """

    status_code = 422
    code = "invalid_actuals"


class LimitExceeded(LayercastError):
    """A request or an upload crosses one of the configured bounds of :class:`app.core.limits.Limits`.

    ``detail``: ``limit`` (its name: ``dimension``, ``tensor_rank``, ``tensor_elements``,
    ``json_depth``, ``import_seconds``...), ``value`` (what the input has, or a lower bound of it) and
    ``max`` (the configured bound).
    """

    status_code = 422
    code = "limit_exceeded"

    def __init__(self, limit: str, value: int | float, maximum: int | float, message: str | None = None) -> None:
        super().__init__(
            message or f"{limit} of {value} exceeds the limit of {maximum}",
            detail={"limit": limit, "value": value, "max": maximum},
        )


class GraphTooLarge(LimitExceeded):
    """The graph has more nodes (or layers), or deeper subgraph nesting, than the import accepts."""

    status_code = 413
    code = "graph_too_large"


class ImportWorkerFailed(LayercastError):
    """The worker process importing a large upload ended before answering (killed, out of memory):
    nothing was stored, and the upload may be sent again (:mod:`app.graphs.importer`)."""

    status_code = 503
    code = "import_worker_failed"


class UnsupportedOpset(LayercastError):
    """The ONNX model imports a default-domain opset newer than the installed onnx knows."""

    status_code = 422
    code = "unsupported_opset"


def clean_validation_errors(errors: Any) -> list[dict[str, Any]]:
    """Pydantic errors made JSON-safe: ``type``, ``loc``, ``msg`` and a stringified ``ctx``.

    The offending ``input`` is left out on purpose: it can be a whole uploaded model or layer list (binary,
    up to ``max_json_bytes``), which a problem document must not echo back.
    """
    cleaned: list[dict[str, Any]] = []
    for err in errors:
        item: dict[str, Any] = {
            "type": str(err.get("type", "")),
            "loc": [p if isinstance(p, int) else str(p) for p in err.get("loc", ())],
            "msg": str(err.get("msg", "")),
        }
        if isinstance(err.get("ctx"), dict):
            item["ctx"] = {
                str(k): v if isinstance(v, (int, float, bool, str)) or v is None else str(v)
                for k, v in err["ctx"].items()
            }
        cleaned.append(item)
    return cleaned


def validation_message(prefix: str, errors: list[dict[str, Any]]) -> str:
    """``prefix`` followed by the first cleaned error's dotted ``loc`` and ``msg``
    (``"request validation failed: body.batch_size: Input should be greater than 0"``), so that the message
    alone says what to fix; ``prefix`` alone when there is none, no prefix when it is empty."""
    if not errors:
        return prefix
    first = errors[0]
    where = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return f"{prefix}: {where}" if prefix else where
