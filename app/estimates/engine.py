"""Many predictions in one pass: the shared machinery of the batch, comparison and job-estimate endpoints.

Every scenario of a call is the :class:`~app.predictions.schemas.PredictionCreate` its own
``POST /v1/predictions`` would be, and is answered with the same functions of
:mod:`app.predictions.service` (precision check, roofline and power of a layer, the aggregation input)
and the one aggregation of the core (:func:`app.core.aggregate.aggregate`). What this module adds is doing
it for many scenarios at once:

1. **bind**: a graph is imported and analysed once per ``(graph, per-device batch, dims, software stack)``
   within a call (:class:`GraphCache`; imports are also cached across calls by
   :func:`app.graphs.service.build_graph`); footprints once per (analysis, device, setting);
2. **query**: one :class:`~app.predictor.base.LayerTimeQuery` per supported layer (:func:`layer_queries`,
   the queries :func:`app.predictions.service.estimate` builds: supported layers in graph order);
3. **predict**: the queries of every scenario of the call go through **one** ``predictor.estimate`` call
   (:func:`predict_layers`). Queries that differ only in names (the same layer shape on the same device,
   mode, optimizer, precision and stack, e.g. the repeated blocks of a ResNet or the shared cells of a
   NAS space) are predicted once: a prediction depends on the layer's shapes and attributes, never on
   its name;
4. **aggregate**: :func:`scenario_aggregate`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from app.core.aggregate import Aggregate, LayerTime, aggregate
from app.core.analysis import GraphAnalysis, analyze
from app.core.hardware import HardwareSpec
from app.core.ir import Tensor
from app.core.memory import MemoryFootprint, fits, footprint, largest_batch_that_fits
from app.core.precision import Precision, storage_precision
from app.errors import LayercastError, NoInterconnect
from app.graphs import service as graphs
from app.hardware import service as hardware_service
from app.predictions.schemas import PredictionCreate
from app.predictions.service import aggregation_input, checked_precision, layer_power_w, layer_roofline
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, Predictor


@dataclass(frozen=True, slots=True)
class Scenario:
    """One single-prediction request bound to its analysis (at the per-device batch), its device and its
    checked precision."""

    request: PredictionCreate
    analysis: GraphAnalysis
    hardware: HardwareSpec
    precision: Precision

    @property
    def training(self) -> bool:
        return self.request.mode == "training"

    @property
    def optimizer(self) -> str:
        return self.request.optimizer if self.training else "none"


@dataclass
class GraphCache:
    """Per-call caches: analyses per ``(graph, batch, dims, stack)``, hardware specs and footprints. Errors
    are cached too, so a bad graph id in 1,000 jobs is looked up once."""

    session: Session
    _analyses: dict[Hashable, GraphAnalysis | LayercastError] = field(default_factory=dict)
    _specs: dict[str, HardwareSpec | LayercastError] = field(default_factory=dict)
    _footprints: dict[Hashable, MemoryFootprint] = field(default_factory=dict)
    _largest: dict[Hashable, int] = field(default_factory=dict)

    def _analysis(self, request: PredictionCreate) -> GraphAnalysis:
        """Raises what :func:`graphs.get_graph` and :func:`graphs.build_graph` raise (404 ``graph_not_found``,
        422 ``invalid_graph``/``unbound_dimension``/``unknown_dimension``)."""
        batch = request.per_device_batch_size
        if request.graph_id is not None:
            key: Hashable = ("id", request.graph_id, batch, tuple(sorted(request.dims.items())),
                             request.software_stack)
        else:
            assert request.graph is not None
            content = graphs.canonical_json(request.graph.model_dump())
            key = ("json", content, batch, tuple(sorted(request.dims.items())), request.software_stack)
        if key not in self._analyses:
            try:
                if request.graph_id is not None:
                    row = graphs.get_graph(self.session, graph_id=request.graph_id)
                    graph = graphs.build_graph(row.content, row.source_format, batch_size=batch, dims=request.dims,
                                               name=row.name)
                else:
                    graph = graphs.build_graph(key[1], "json", batch_size=batch, dims=request.dims)  # type: ignore[index]
                self._analyses[key] = analyze(graph, software_stack=request.software_stack)
            except LayercastError as exc:
                self._analyses[key] = exc
        found = self._analyses[key]
        if isinstance(found, LayercastError):
            raise found
        return found

    def spec(self, hardware_id: str) -> HardwareSpec:
        """Stored spec of ``hardware_id``; raises :class:`app.errors.HardwareNotFound` (404)."""
        if hardware_id not in self._specs:
            try:
                self._specs[hardware_id] = hardware_service.get_spec(self.session, hardware_id=hardware_id)
            except LayercastError as exc:
                self._specs[hardware_id] = exc
        found = self._specs[hardware_id]
        if isinstance(found, LayercastError):
            raise found
        return found

    def scenario(self, request: PredictionCreate) -> Scenario:
        """Bind ``request`` (a ``hardware_id`` request): raises the errors ``POST /v1/predictions`` would
        (404 graph/hardware not found, 422 precision_not_supported, no_interconnect, graph import errors)."""
        assert request.hardware_id is not None
        hw = self.spec(request.hardware_id)
        precision = checked_precision(hw, request.precision)
        if request.device_count > 1 and hw.link() is None:
            raise NoInterconnect(
                f"hardware {hw.id!r} lists no interconnect: device_count {request.device_count} cannot be "
                "estimated", detail={"hardware_id": hw.id, "device_count": request.device_count})
        return Scenario(request=request, analysis=self._analysis(request), hardware=hw, precision=precision)

    def _memory_opts(self, s: Scenario) -> dict[str, Any]:
        return {"mode": s.request.mode, "optimizer": s.optimizer, "precision": storage_precision(s.precision),
                "hardware": s.hardware, "activation_checkpointing": s.request.activation_checkpointing}

    def _memory_key(self, s: Scenario) -> Hashable:
        return (id(s.analysis), id(s.hardware), s.precision, s.request.mode, s.optimizer,
                s.request.activation_checkpointing)

    def footprint(self, s: Scenario) -> MemoryFootprint:
        """Peak memory of one device of ``s`` (:func:`app.core.memory.footprint`), once per setting."""
        key = self._memory_key(s)
        if key not in self._footprints:
            self._footprints[key] = footprint(s.analysis, **self._memory_opts(s))
        return self._footprints[key]

    def largest_batch(self, s: Scenario) -> int:
        """Largest per-device batch whose peak fits (:func:`app.core.memory.largest_batch_that_fits`)."""
        key = self._memory_key(s)
        if key not in self._largest:
            self._largest[key] = largest_batch_that_fits(s.analysis, memory_bytes=s.hardware.memory_bytes,
                                                         **self._memory_opts(s))
        return self._largest[key]

    def fits(self, s: Scenario) -> bool:
        """Whether one device of ``s`` holds its peak (:func:`app.core.memory.fits`)."""
        return fits(self.footprint(s), s.hardware.memory_bytes)


def layer_queries(s: Scenario) -> list[LayerTimeQuery]:
    """The predictor queries of ``s``: one per supported layer, in graph order."""
    return [
        LayerTimeQuery(layer=layer, cost=cost, hardware=s.hardware, mode=s.request.mode, optimizer=s.optimizer,
                       precision=s.precision, software_stack=s.request.software_stack)
        for layer, cost in zip(s.analysis.graph.layers, s.analysis.costs, strict=True)
        if cost.supported
    ]


def _shapes(ts: tuple[Tensor, ...]) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple((t.shape, t.dtype) for t in ts)


def query_key(q: LayerTimeQuery) -> Hashable:
    """What a prediction depends on: the layer without its names, its costs, the device and the setting."""
    layer, c = q.layer, q.cost
    return (
        layer.op_type, layer.kind, _shapes(layer.inputs), _shapes(layer.outputs), _shapes(layer.weights),
        _shapes(layer.buffers), layer.attrs, layer.needs_input_grad,
        c.forward_macs, c.forward_flops, c.backward_input_flops, c.backward_weight_flops, c.params,
        c.forward_bytes_read, c.forward_bytes_written, c.backward_bytes_read, c.backward_bytes_written,
        c.saved_activation_bytes,
        id(q.hardware), q.mode, q.optimizer, q.precision, q.software_stack,
    )


@dataclass(frozen=True, slots=True)
class LayerPredictions:
    """What :func:`predict_layers` returns: per scenario, the estimates and layer times of its queries (in
    query order), and how many queries were asked and actually predicted."""

    estimates: list[list[LayerTimeEstimate]]
    times: list[list[LayerTime]]
    queries: int
    unique_queries: int


def _layer_time(q: LayerTimeQuery, e: LayerTimeEstimate) -> LayerTime:
    """``e`` as the aggregation's :class:`LayerTime`, its power from :func:`app.predictions.service.layer_power_w`."""
    roof = layer_roofline(q.layer, q.cost, q.hardware, q.precision, q.mode == "training")
    return LayerTime(forward_ms=e.forward_ms, backward_ms=e.backward_ms, update_ms=e.update_ms,
                     total_ms_p10=e.total_ms_p10, total_ms_p90=e.total_ms_p90,
                     power_w=layer_power_w(q.hardware, roof, e))


def predict_layers(predictor: Predictor, per_scenario: Sequence[Sequence[LayerTimeQuery]]) -> LayerPredictions:
    """Estimates of every query of every scenario through one ``predictor.estimate`` call, each distinct
    :func:`query_key` predicted once. Raises what the predictor raises."""
    unique: dict[Hashable, int] = {}
    todo: list[LayerTimeQuery] = []
    index: list[list[int]] = []
    for queries in per_scenario:
        row = []
        for q in queries:
            key = query_key(q)
            slot = unique.get(key)
            if slot is None:
                slot = unique[key] = len(todo)
                todo.append(q)
            row.append(slot)
        index.append(row)
    found = predictor.estimate(todo) if todo else []
    times = [_layer_time(q, e) for q, e in zip(todo, found, strict=True)]
    return LayerPredictions(
        estimates=[[found[i] for i in row] for row in index],
        times=[[times[i] for i in row] for row in index],
        queries=sum(len(r) for r in index),
        unique_queries=len(todo),
    )


def scenario_aggregate(cache: GraphCache, s: Scenario, times: Sequence[LayerTime]) -> Aggregate:
    """Iteration, epoch and job of ``s`` from its layer times: :func:`app.core.aggregate.aggregate` of
    :func:`app.predictions.service.aggregation_input`, exactly as ``POST /v1/predictions`` computes them."""
    fp = cache.footprint(s)
    return aggregate(aggregation_input(s.request, s.hardware, list(times), fp, training=s.training))
