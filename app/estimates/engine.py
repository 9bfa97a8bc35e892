"""Many predictions in one pass: the shared machinery of the batch, comparison and job-estimate endpoints.

Every scenario of a call is the :class:`~app.predictions.schemas.PredictionCreate` its own
``POST /v1/predictions`` would be, and is answered with the same functions of
:mod:`app.predictions.service` (precision check, roofline and power of a layer, the aggregation input)
and the one aggregation of the core (:func:`app.core.aggregate.aggregate`). What this module adds is doing
it for many scenarios at once:

1. **bind**: a graph is imported and analysed once per ``(graph, per-device batch, dims, software stack)``
   within a call (:class:`GraphCache`; imports are also cached across calls by
   :func:`app.graphs.service.build_graph`);
2. **recall**: a scenario answered before by the same predictor object (same graph content, binding,
   device spec, precision, mode, optimizer) reuses its layer times and footprint (:class:`ScenarioCache`,
   bounded LRU, per predictor: predictions are deterministic for one artifact, and a new artifact is a new
   predictor object), so a scheduler's recurring models cost only the aggregation;
3. **query**: one :class:`~app.predictor.base.LayerTimeQuery` per supported layer (:func:`layer_queries`,
   the queries :func:`app.predictions.service.estimate` builds: supported layers in graph order);
4. **predict**: the queries of every scenario of the call go through **one** ``predictor.estimate`` call
   (:func:`predict_layers`). Queries that differ only in names (the same layer shape on the same device,
   mode, optimizer, precision and stack, e.g. the repeated blocks of a ResNet or the shared cells of a
   NAS space) are predicted once: a prediction depends on the layer's shapes and attributes, never on
   its name;
5. **aggregate**: :func:`scenario_aggregate`.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session

from app.core.aggregate import Aggregate, LayerTime, aggregate
from app.core.analysis import GraphAnalysis, analyze
from app.core.hardware import HardwareSpec
from app.core.ir import Tensor
from app.core.memory import MemoryFootprint, fits, footprint, largest_batch_that_fits
from app.core.precision import Precision, storage_precision
from app.errors import LayercastError
from app.graphs import service as graphs
from app.hardware import service as hardware_service
from app.hardware.catalog import spec_to_dict
from app.predictions.schemas import PredictionCreate
from app.predictions.service import (
    aggregation_input,
    check_interconnect,
    checked_precision,
    layer_power_w,
    layer_roofline,
)
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, Predictor


@dataclass(frozen=True, slots=True)
class Scenario:
    """One single-prediction request bound to its analysis (at the per-device batch), its device and its
    checked precision."""

    request: PredictionCreate
    analysis: GraphAnalysis
    hardware: HardwareSpec
    precision: Precision
    key: Hashable = None  # what the layer times and footprint depend on (ScenarioCache)

    @property
    def training(self) -> bool:
        return self.request.mode == "training"

    @property
    def optimizer(self) -> str:
        return self.request.optimizer if self.training else "none"


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Scenarios remembered per predictor (each holds a layer time and an estimate per layer: ~50 kB for a
#: ResNet-50).
MAX_CACHED_SCENARIOS = 1024


class _Lru(Generic[K, V]):
    """A bounded least-recently-used map."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)


class ScenarioCache:
    """What one predictor answered, by :attr:`Scenario.key`: layer estimates and times, footprints and largest
    batches (each a bounded LRU of :data:`MAX_CACHED_SCENARIOS`)."""

    def __init__(self) -> None:
        self.layers: _Lru[Hashable, tuple[list[LayerTimeEstimate], list[LayerTime]]] = _Lru(MAX_CACHED_SCENARIOS)
        self.footprints: _Lru[Hashable, MemoryFootprint] = _Lru(MAX_CACHED_SCENARIOS)
        self.largest: _Lru[Hashable, int] = _Lru(MAX_CACHED_SCENARIOS)


_CACHES: weakref.WeakKeyDictionary[Any, ScenarioCache] = weakref.WeakKeyDictionary()


def scenario_cache(predictor: Predictor) -> ScenarioCache:
    """The :class:`ScenarioCache` of ``predictor`` (created on first use, dropped with the predictor)."""
    found = _CACHES.get(predictor)
    if found is None:
        found = _CACHES[predictor] = ScenarioCache()
    return found


@dataclass
class GraphCache:
    """Per-call caches (analyses per ``(graph, batch, dims, stack)``, hardware specs) in front of the
    predictor's :class:`ScenarioCache`. Errors are cached too, so a bad graph id in 1,000 jobs is looked up
    once."""

    session: Session
    predictor: Predictor
    _analyses: dict[Hashable, GraphAnalysis | LayercastError] = field(default_factory=dict)
    _specs: dict[str, HardwareSpec | LayercastError] = field(default_factory=dict)
    _fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def store(self) -> ScenarioCache:
        return scenario_cache(self.predictor)

    @staticmethod
    def _graph_key(request: PredictionCreate) -> Hashable:
        if request.graph_id is not None:
            return ("id", request.graph_id)
        assert request.graph is not None
        return ("json", graphs.canonical_json(request.graph.model_dump()))

    def _analysis(self, request: PredictionCreate) -> GraphAnalysis:
        """Raises what :func:`graphs.get_graph` and :func:`graphs.build_graph` raise (404 ``graph_not_found``,
        422 ``invalid_graph``/``unbound_dimension``/``unknown_dimension``)."""
        batch = request.per_device_batch_size
        graph_key = self._graph_key(request)
        key = (graph_key, batch, tuple(sorted(request.dims.items())), request.software_stack)
        if key not in self._analyses:
            try:
                if request.graph_id is not None:
                    row = graphs.get_graph(self.session, graph_id=request.graph_id)
                    graph = graphs.build_graph(row.content, row.source_format, batch_size=batch, dims=request.dims,
                                               name=row.name)
                else:
                    content = graph_key[1]  # type: ignore[index]
                    graph = graphs.build_graph(content, "json", batch_size=batch, dims=request.dims)
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
                spec = self._specs[hardware_id] = hardware_service.get_spec(self.session, hardware_id=hardware_id)
                self._fingerprints[hardware_id] = json.dumps(spec_to_dict(spec), sort_keys=True, default=str)
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
        check_interconnect(hw, request)
        r = request
        key = (self._graph_key(r), r.per_device_batch_size, tuple(sorted(r.dims.items())), r.software_stack,
               self._fingerprints[hw.id], precision, r.mode, r.optimizer if r.mode == "training" else "none",
               r.activation_checkpointing)
        return Scenario(request=r, analysis=self._analysis(r), hardware=hw, precision=precision, key=key)

    def _memory_opts(self, s: Scenario) -> dict[str, Any]:
        return {"mode": s.request.mode, "optimizer": s.optimizer, "precision": storage_precision(s.precision),
                "hardware": s.hardware, "activation_checkpointing": s.request.activation_checkpointing}

    def footprint(self, s: Scenario) -> MemoryFootprint:
        """Peak memory of one device of ``s`` (:func:`app.core.memory.footprint`), once per scenario key."""
        found = self.store.footprints.get(s.key)
        if found is None:
            found = footprint(s.analysis, **self._memory_opts(s))
            self.store.footprints.put(s.key, found)
        return found

    def largest_batch(self, s: Scenario) -> int:
        """Largest per-device batch whose peak fits (:func:`app.core.memory.largest_batch_that_fits`)."""
        found = self.store.largest.get(s.key)
        if found is None:
            found = largest_batch_that_fits(s.analysis, memory_bytes=s.hardware.memory_bytes,
                                            **self._memory_opts(s))
            self.store.largest.put(s.key, found)
        return found

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


def predict_layers(cache: GraphCache, scenarios: Sequence[Scenario]) -> LayerPredictions:
    """Estimates of every layer of every scenario: remembered scenarios from the cache, the others through one
    ``predictor.estimate`` call, each distinct :func:`query_key` predicted once. Raises what the predictor
    raises."""
    unique: dict[Hashable, int] = {}
    todo: list[LayerTimeQuery] = []
    index: list[list[int] | None] = []
    queries_total = 0
    recalled = [cache.store.layers.get(s.key) for s in scenarios]
    for s, hit in zip(scenarios, recalled, strict=True):
        if hit is not None:
            index.append(None)
            queries_total += len(hit[0])
            continue
        row = []
        for q in layer_queries(s):
            key = query_key(q)
            slot = unique.get(key)
            if slot is None:
                slot = unique[key] = len(todo)
                todo.append(q)
            row.append(slot)
        index.append(row)
        queries_total += len(row)
    found = cache.predictor.estimate(todo) if todo else []
    times = [_layer_time(q, e) for q, e in zip(todo, found, strict=True)]
    estimates: list[list[LayerTimeEstimate]] = []
    layer_times: list[list[LayerTime]] = []
    for s, hit, slots in zip(scenarios, recalled, index, strict=True):
        if hit is None:
            assert slots is not None
            hit = ([found[i] for i in slots], [times[i] for i in slots])
            cache.store.layers.put(s.key, hit)
        estimates.append(hit[0])
        layer_times.append(hit[1])
    return LayerPredictions(estimates=estimates, times=layer_times, queries=queries_total,
                            unique_queries=len(todo))


def scenario_aggregate(cache: GraphCache, s: Scenario, times: Sequence[LayerTime]) -> Aggregate:
    """Iteration, epoch and job of ``s`` from its layer times: :func:`app.core.aggregate.aggregate` of
    :func:`app.predictions.service.aggregation_input`, exactly as ``POST /v1/predictions`` computes them."""
    fp = cache.footprint(s)
    return aggregate(aggregation_input(s.request, s.hardware, list(times), fp, training=s.training))
