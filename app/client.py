"""Python client of the layercast REST API (``from app.client import Client``), sync and async.

The package is ``app`` (the distribution is ``layercast``), so the client is ``app.client``. It is typed
with the API's own pydantic schemas (the ``schemas`` modules import neither FastAPI routes, a database nor
torch): requests accept the ``...Create`` model or a plain ``dict`` of its fields, responses are the
``...Read`` models. Any non-2xx answer raises :class:`LayercastAPIError` carrying the problem document's
``code`` (``graph_not_found``, ``validation_error``...). Requests are validated as strictly as the server
does (an unknown field fails before sending); responses are read with unknown fields ignored, so a client
keeps working against a newer server that added a field (a field it needs that the server lacks still fails).

A training script asks for its own cost in two lines::

    from app.client import Client
    cost = Client("http://127.0.0.1:8000").predict_module(model, (x,), hardware_id="a100-sxm4-40gb", batch_size=64)

:func:`describe_module` (torch imported inside it only) exports the module to ONNX in memory; the rest
of this module never imports torch.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel

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
from app.graphs.schemas import GraphLayers, GraphList, GraphRead, JsonGraphCreate
from app.hardware.schemas import HardwareCreate, HardwareList, HardwareRead
from app.measurements.schemas import MeasurementBatchRead, MeasurementCreate, MeasurementList
from app.predictions.schemas import PredictionCreate, PredictionRead

T = TypeVar("T", bound=BaseModel)
M = TypeVar("M", bound=BaseModel)

#: Export settings of :func:`describe_module`, the ones the profiler uses (``app.profiler.e2e``): the
#: TorchScript exporter at opset 17, no constant folding (batch norm stays a layer), batch axis symbolic.
ONNX_EXPORT_KWARGS: dict[str, Any] = {"dynamo": False, "opset_version": 17, "do_constant_folding": False}


class LayercastAPIError(Exception):
    """A non-2xx answer: ``status_code``, the problem document's ``code``, ``message`` and ``detail``.

    A body that is not a problem document (a proxy's HTML page) gets ``code`` ``http_<status>``.
    """

    def __init__(self, status_code: int, code: str, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.detail = detail or {}

    @classmethod
    def from_response(cls, response: httpx.Response) -> LayercastAPIError:
        """Build the error from a failed response (reads the problem document when there is one)."""
        try:
            error = response.json()["error"]
            return cls(response.status_code, str(error["code"]), str(error.get("message", "")),
                       dict(error.get("detail") or {}))
        except (ValueError, KeyError, TypeError):
            return cls(response.status_code, f"http_{response.status_code}", response.text[:500])


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One HTTP call, built once and sent by either client: parsed into ``model`` (None: no body)."""

    method: str
    path: str
    model: type[T] | None
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def parse(self, response: httpx.Response) -> T | None:
        if response.status_code >= 400:
            raise LayercastAPIError.from_response(response)
        # extra="ignore" (pydantic >= 2.12, recursive): a newer server's added fields are no error here
        return None if self.model is None else self.model.model_validate(response.json(), extra="ignore")


def _body(model: type[M], data: M | Mapping[str, Any]) -> Any:
    """``data`` validated as ``model`` (locally: a bad field fails before any request) and dumped as JSON,
    by alias (``pass``), leaving out the fields not given so that the server's defaults apply."""
    obj = data if isinstance(data, model) else model.model_validate(dict(data))
    return obj.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _params(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _dims(dims: Mapping[str, int] | None) -> str | None:
    """``{"seq": 128}`` as the API's ``dims`` query (``seq=128``)."""
    return ",".join(f"{k}={v}" for k, v in dims.items()) if dims else None


def _onnx_bytes(model: bytes | str | PathLike[str]) -> tuple[bytes, str | None]:
    """Bytes of an ONNX model given as bytes or a path, and the file name (None for bytes)."""
    if isinstance(model, bytes | bytearray):
        return bytes(model), None
    path = Path(model)
    return path.read_bytes(), path.name


class _Calls:
    """The calls of every endpoint (shared by :class:`Client` and :class:`AsyncClient`)."""

    @staticmethod
    def upload_onnx(model: bytes | str | PathLike[str], *, name: str | None, batch_size: int | None,
                    dims: Mapping[str, int] | None) -> _Call[GraphRead]:
        content, filename = _onnx_bytes(model)
        return _Call("POST", "/v1/graphs", GraphRead, content=content,
                     headers={"content-type": "application/octet-stream"},
                     params=_params(name=name or filename, batch_size=batch_size, dims=_dims(dims)))

    @staticmethod
    def upload_json(graph: JsonGraphCreate | Mapping[str, Any], *, batch_size: int | None) -> _Call[GraphRead]:
        return _Call("POST", "/v1/graphs", GraphRead, json=_body(JsonGraphCreate, graph),
                     params=_params(batch_size=batch_size))

    @staticmethod
    def list_graphs(limit: int, offset: int) -> _Call[GraphList]:
        return _Call("GET", "/v1/graphs", GraphList, params={"limit": limit, "offset": offset})

    @staticmethod
    def get_graph(graph_id: str) -> _Call[GraphRead]:
        return _Call("GET", f"/v1/graphs/{graph_id}", GraphRead)

    @staticmethod
    def graph_layers(graph_id: str, batch_size: int, dims: Mapping[str, int] | None) -> _Call[GraphLayers]:
        return _Call("GET", f"/v1/graphs/{graph_id}/layers", GraphLayers,
                     params=_params(batch_size=batch_size, dims=_dims(dims)))

    @staticmethod
    def delete_graph(graph_id: str) -> _Call[BaseModel]:
        return _Call("DELETE", f"/v1/graphs/{graph_id}", None)

    @staticmethod
    def list_hardware(kind: str | None) -> _Call[HardwareList]:
        return _Call("GET", "/v1/hardware", HardwareList, params=_params(kind=kind))

    @staticmethod
    def get_hardware(hardware_id: str) -> _Call[HardwareRead]:
        return _Call("GET", f"/v1/hardware/{hardware_id}", HardwareRead)

    @staticmethod
    def create_hardware(data: HardwareCreate | Mapping[str, Any]) -> _Call[HardwareRead]:
        return _Call("POST", "/v1/hardware", HardwareRead, json=_body(HardwareCreate, data))

    @staticmethod
    def predict(data: PredictionCreate | Mapping[str, Any]) -> _Call[PredictionRead]:
        return _Call("POST", "/v1/predictions", PredictionRead, json=_body(PredictionCreate, data))

    @staticmethod
    def predict_batch(data: BatchPredictionCreate | Mapping[str, Any]) -> _Call[BatchPredictionRead]:
        return _Call("POST", "/v1/predictions/batch", BatchPredictionRead, json=_body(BatchPredictionCreate, data))

    @staticmethod
    def estimate_jobs(data: JobEstimatesCreate | Mapping[str, Any]) -> _Call[JobEstimatesRead]:
        return _Call("POST", "/v1/job-estimates", JobEstimatesRead, json=_body(JobEstimatesCreate, data))

    @staticmethod
    def report_job_actuals(data: JobActualsCreate | Mapping[str, Any], *,
                           idempotency_key: str | None) -> _Call[JobActualsRead]:  # fmt: skip
        return _Call("POST", "/v1/job-estimates/actuals", JobActualsRead, json=_body(JobActualsCreate, data),
                     headers={"Idempotency-Key": idempotency_key} if idempotency_key is not None else {})  # fmt: skip

    @staticmethod
    def compare(data: ComparisonCreate | Mapping[str, Any]) -> _Call[ComparisonRead]:
        return _Call("POST", "/v1/comparisons", ComparisonRead, json=_body(ComparisonCreate, data))

    @staticmethod
    def report_measurements(measurements: Sequence[MeasurementCreate | Mapping[str, Any]], *,
                            idempotency_key: str | None) -> _Call[MeasurementBatchRead]:  # fmt: skip
        body = {"measurements": [_body(MeasurementCreate, m) for m in measurements]}
        return _Call("POST", "/v1/measurements", MeasurementBatchRead, json=body,
                     headers={"Idempotency-Key": idempotency_key} if idempotency_key is not None else {})  # fmt: skip

    @staticmethod
    def list_measurements(*, limit: int, offset: int, cursor: int | None, **filters: Any) -> _Call[MeasurementList]:
        return _Call("GET", "/v1/measurements", MeasurementList,
                     params=_params(**filters, limit=limit, offset=offset or None, cursor=cursor))  # fmt: skip


def _merged(data: BaseModel | Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A request (prediction, comparison) from a model or dict, overridden by keyword ``fields``."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return {**dict(data or {}), **fields}


def _trains(fields: Mapping[str, Any]) -> bool:
    """Whether a prediction with ``fields`` is of a training step (``mode``, default that of
    :class:`PredictionCreate`)."""
    return bool(fields.get("mode", PredictionCreate.model_fields["mode"].default) == "training")


def _must(value: T | None) -> T:
    assert value is not None  # only delete_graph has no body
    return value


class Client:
    """Synchronous client. ``Client(base_url)`` or ``Client(http=httpx.Client(...))`` (any transport: an
    ``httpx.ASGITransport`` or ``WSGITransport`` for tests). Use as a context manager or call :meth:`close`.

    Every method raises :class:`LayercastAPIError` on a non-2xx answer, ``pydantic.ValidationError``
    for a request body that fails the schema (before sending), and ``httpx.HTTPError`` for transport
    failures. ``timeout_s``: per request (uploads and large predictions can take tens of seconds).
    ``api_key`` (default ``$LAYERCAST_API_KEY``) is sent as ``Authorization: Bearer`` on every request.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, timeout_s: float = 120.0,
                 http: httpx.Client | None = None, api_key: str | None = None) -> None:
        self.http = http or httpx.Client(base_url=base_url, timeout=timeout_s)
        self.http.headers.update(auth_headers(api_key))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying HTTP connections."""
        self.http.close()

    def _send(self, call: _Call[T]) -> T | None:
        response = self.http.request(call.method, call.path, params=call.params, json=call.json,
                                     content=call.content, headers=call.headers)
        return call.parse(response)

    # graphs
    def upload_onnx(self, model: bytes | str | PathLike[str], *, name: str | None = None,
                    batch_size: int | None = None, dims: Mapping[str, int] | None = None) -> GraphRead:
        """Upload an ONNX model (bytes or a file path); returns the stored graph (new or already stored)."""
        return _must(self._send(_Calls.upload_onnx(model, name=name, batch_size=batch_size, dims=dims)))

    def upload_json(self, graph: JsonGraphCreate | Mapping[str, Any], *, batch_size: int | None = None) -> GraphRead:
        """Upload a JSON layer list."""
        return _must(self._send(_Calls.upload_json(graph, batch_size=batch_size)))

    def list_graphs(self, *, limit: int = 100, offset: int = 0) -> GraphList:
        """Stored graphs, newest first."""
        return _must(self._send(_Calls.list_graphs(limit, offset)))

    def get_graph(self, graph_id: str) -> GraphRead:
        """One stored graph (``graph_not_found``)."""
        return _must(self._send(_Calls.get_graph(graph_id)))

    def graph_layers(self, graph_id: str, *, batch_size: int = 1, dims: Mapping[str, int] | None = None) -> GraphLayers:
        """Per-layer analytical costs at ``batch_size``."""
        return _must(self._send(_Calls.graph_layers(graph_id, batch_size, dims)))

    def delete_graph(self, graph_id: str) -> None:
        """Delete a stored graph (``graph_not_found``)."""
        self._send(_Calls.delete_graph(graph_id))

    # hardware
    def list_hardware(self, *, kind: str | None = None) -> HardwareList:
        """The hardware catalog (``kind``: ``gpu`` or ``cpu``)."""
        return _must(self._send(_Calls.list_hardware(kind)))

    def get_hardware(self, hardware_id: str) -> HardwareRead:
        """One device (``hardware_not_found``)."""
        return _must(self._send(_Calls.get_hardware(hardware_id)))

    def create_hardware(self, data: HardwareCreate | Mapping[str, Any]) -> HardwareRead:
        """Add a custom device from its datasheet (``hardware_exists``)."""
        return _must(self._send(_Calls.create_hardware(data)))

    # predictions and estimates
    def predict(self, data: PredictionCreate | Mapping[str, Any] | None = None, **fields: Any) -> PredictionRead:
        """``POST /v1/predictions`` from a :class:`PredictionCreate`, a dict, or its fields as keywords."""
        return _must(self._send(_Calls.predict(_merged(data, fields))))

    def predict_module(self, module: Any, example_inputs: Any, **fields: Any) -> PredictionRead:
        """Cost of a ``torch.nn.Module``: exported by :func:`describe_module` in the prediction's mode (training
        mode for ``mode="training"``, the default, eval mode for inference; the module's mode and BatchNorm
        statistics are left as they were), uploaded, predicted with ``fields`` (``hardware_id``,
        ``batch_size``, ``mode``...)."""
        onnx_bytes = describe_module(module, example_inputs, training=_trains(fields))
        graph = self.upload_onnx(onnx_bytes, name=type(module).__name__)
        return self.predict(graph_id=graph.id, **fields)

    def predict_batch(self, data: BatchPredictionCreate | Mapping[str, Any]) -> BatchPredictionRead:
        """Many predictions in one call."""
        return _must(self._send(_Calls.predict_batch(data)))

    def estimate_jobs(self, data: JobEstimatesCreate | Mapping[str, Any]) -> JobEstimatesRead:
        """Job durations for a scheduler."""
        return _must(self._send(_Calls.estimate_jobs(data)))

    def report_job_actuals(self, data: JobActualsCreate | Mapping[str, Any], *,
                           idempotency_key: str | None = None) -> JobActualsRead:  # fmt: skip
        """Report measured job durations (``POST /v1/job-estimates/actuals``); with ``idempotency_key`` a retry of
        the same report stores nothing twice (``replayed`` in the answer)."""
        return _must(self._send(_Calls.report_job_actuals(data, idempotency_key=idempotency_key)))

    def compare(self, data: ComparisonCreate | Mapping[str, Any] | None = None, **fields: Any) -> ComparisonRead:
        """``POST /v1/comparisons`` (one job on many devices) from a :class:`ComparisonCreate`, a dict, or its
        fields as keywords, as :meth:`predict` takes them."""
        return _must(self._send(_Calls.compare(_merged(data, fields))))

    # measurements
    def report_measurements(self, measurements: Sequence[MeasurementCreate | Mapping[str, Any]], *,
                            idempotency_key: str | None = None) -> MeasurementBatchRead:  # fmt: skip
        """Store a batch of measured times, all or none (``POST /v1/measurements``); with
        ``idempotency_key`` a retry of the same batch stores nothing twice (``replayed`` in the answer)."""
        return _must(self._send(_Calls.report_measurements(measurements, idempotency_key=idempotency_key)))

    def list_measurements(self, *, limit: int = 100, offset: int = 0, cursor: int | None = None,
                          **filters: Any) -> MeasurementList:  # fmt: skip
        """Stored measurements by ascending id; ``filters`` are the query filters of ``GET /v1/measurements``
        (``hardware_id``, ``source``, ``op_kind``, ``precision``, ``pass``, ``granularity``,
        ``measured_from``, ``measured_to``)."""
        return _must(self._send(_Calls.list_measurements(limit=limit, offset=offset, cursor=cursor, **filters)))


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` for ``api_key``, else for ``$LAYERCAST_API_KEY``; none when neither is set
    (the server's open scopes apply: see ``app.auth``)."""
    key = api_key if api_key is not None else os.environ.get("LAYERCAST_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class AsyncClient:
    """Asynchronous twin of :class:`Client` (same methods, awaited; ``http``: an ``httpx.AsyncClient``)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, timeout_s: float = 120.0,
                 http: httpx.AsyncClient | None = None, api_key: str | None = None) -> None:
        self.http = http or httpx.AsyncClient(base_url=base_url, timeout=timeout_s)
        self.http.headers.update(auth_headers(api_key))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the underlying HTTP connections."""
        await self.http.aclose()

    async def _send(self, call: _Call[T]) -> T | None:
        response = await self.http.request(call.method, call.path, params=call.params, json=call.json,
                                           content=call.content, headers=call.headers)
        return call.parse(response)

    async def upload_onnx(self, model: bytes | str | PathLike[str], *, name: str | None = None,
                          batch_size: int | None = None, dims: Mapping[str, int] | None = None) -> GraphRead:
        """See :meth:`Client.upload_onnx`."""
        return _must(await self._send(_Calls.upload_onnx(model, name=name, batch_size=batch_size, dims=dims)))

    async def upload_json(self, graph: JsonGraphCreate | Mapping[str, Any], *,
                          batch_size: int | None = None) -> GraphRead:
        """See :meth:`Client.upload_json`."""
        return _must(await self._send(_Calls.upload_json(graph, batch_size=batch_size)))

    async def list_graphs(self, *, limit: int = 100, offset: int = 0) -> GraphList:
        """See :meth:`Client.list_graphs`."""
        return _must(await self._send(_Calls.list_graphs(limit, offset)))

    async def get_graph(self, graph_id: str) -> GraphRead:
        """See :meth:`Client.get_graph`."""
        return _must(await self._send(_Calls.get_graph(graph_id)))

    async def graph_layers(self, graph_id: str, *, batch_size: int = 1,
                           dims: Mapping[str, int] | None = None) -> GraphLayers:
        """See :meth:`Client.graph_layers`."""
        return _must(await self._send(_Calls.graph_layers(graph_id, batch_size, dims)))

    async def delete_graph(self, graph_id: str) -> None:
        """See :meth:`Client.delete_graph`."""
        await self._send(_Calls.delete_graph(graph_id))

    async def list_hardware(self, *, kind: str | None = None) -> HardwareList:
        """See :meth:`Client.list_hardware`."""
        return _must(await self._send(_Calls.list_hardware(kind)))

    async def get_hardware(self, hardware_id: str) -> HardwareRead:
        """See :meth:`Client.get_hardware`."""
        return _must(await self._send(_Calls.get_hardware(hardware_id)))

    async def create_hardware(self, data: HardwareCreate | Mapping[str, Any]) -> HardwareRead:
        """See :meth:`Client.create_hardware`."""
        return _must(await self._send(_Calls.create_hardware(data)))

    async def predict(self, data: PredictionCreate | Mapping[str, Any] | None = None,
                      **fields: Any) -> PredictionRead:
        """See :meth:`Client.predict`."""
        return _must(await self._send(_Calls.predict(_merged(data, fields))))

    async def predict_module(self, module: Any, example_inputs: Any, **fields: Any) -> PredictionRead:
        """See :meth:`Client.predict_module` (the export runs in this thread: it is CPU work)."""
        onnx_bytes = describe_module(module, example_inputs, training=_trains(fields))
        graph = await self.upload_onnx(onnx_bytes, name=type(module).__name__)
        return await self.predict(graph_id=graph.id, **fields)

    async def predict_batch(self, data: BatchPredictionCreate | Mapping[str, Any]) -> BatchPredictionRead:
        """See :meth:`Client.predict_batch`."""
        return _must(await self._send(_Calls.predict_batch(data)))

    async def estimate_jobs(self, data: JobEstimatesCreate | Mapping[str, Any]) -> JobEstimatesRead:
        """See :meth:`Client.estimate_jobs`."""
        return _must(await self._send(_Calls.estimate_jobs(data)))

    async def report_job_actuals(self, data: JobActualsCreate | Mapping[str, Any], *,
                                 idempotency_key: str | None = None) -> JobActualsRead:  # fmt: skip
        """See :meth:`Client.report_job_actuals`."""
        return _must(await self._send(_Calls.report_job_actuals(data, idempotency_key=idempotency_key)))

    async def compare(self, data: ComparisonCreate | Mapping[str, Any] | None = None,
                      **fields: Any) -> ComparisonRead:
        """See :meth:`Client.compare`."""
        return _must(await self._send(_Calls.compare(_merged(data, fields))))

    async def report_measurements(self, measurements: Sequence[MeasurementCreate | Mapping[str, Any]], *,
                                  idempotency_key: str | None = None) -> MeasurementBatchRead:  # fmt: skip
        """See :meth:`Client.report_measurements`."""
        return _must(await self._send(_Calls.report_measurements(measurements, idempotency_key=idempotency_key)))

    async def list_measurements(self, *, limit: int = 100, offset: int = 0, cursor: int | None = None,
                                **filters: Any) -> MeasurementList:  # fmt: skip
        """See :meth:`Client.list_measurements`."""
        return _must(await self._send(_Calls.list_measurements(limit=limit, offset=offset, cursor=cursor,
                                                               **filters)))  # fmt: skip


def describe_module(module: Any, example_inputs: Any, *, input_names: list[str] | None = None,
                    training: bool = False) -> bytes:
    """ONNX bytes of a ``torch.nn.Module`` run on ``example_inputs`` (a tensor or a tuple of tensors).

    Exported in memory with :data:`ONNX_EXPORT_KWARGS`, with the weights (the service reads their shapes and
    drops their data) and axis 0 of every input symbolic (``batch``), so the prediction's ``batch_size``
    applies. ``training``: in training mode (``torch.onnx.TrainingMode.TRAINING``: BatchNorm as its training
    form, with the batch statistics, what a training prediction costs without the service's eval-mode
    export warning), else in eval mode (what an inference prediction costs). The export runs the forward once;
    the module's buffers (BatchNorm's running mean, variance and batch count) and its own mode are restored
    afterwards, so the module is as it was. A training export of batch-1 inputs traces them repeated to batch 2
    (BatchNorm cannot train on one value per channel; axis 0 is symbolic either way). torch is imported here
    only. Raises whatever ``torch.onnx.export`` raises for a module it cannot export.
    """
    import torch

    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if training and any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 1 for x in inputs):
        # BatchNorm refuses to train on one value per channel; axis 0 is symbolic, so trace at batch 2
        inputs = tuple(torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 1
                       else x for x in inputs)
    names = input_names or [f"input_{i}" for i in range(len(inputs))]
    was_training = module.training
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    module.train(training)
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    buf = io.BytesIO()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
            # a training-mode trace of BatchNorm: its batch-size check and its num_batches_tracked update are
            # not part of the graph, as intended (the buffers are restored below)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message="ONNX Preprocess - Removing mutation", category=UserWarning)
            torch.onnx.export(module, inputs, buf, input_names=names, training=mode,  # type: ignore[arg-type]
                              dynamic_axes={n: {0: "batch"} for n in names}, **ONNX_EXPORT_KWARGS)
    finally:
        module.train(was_training)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    return buf.getvalue()
