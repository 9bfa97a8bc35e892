"""Many predictions in one pass: the shared machinery of the batch, comparison and job-estimate endpoints.

Every scenario of a call is the :class:`~app.predictions.schemas.PredictionCreate` its own
``POST /v1/predictions`` would be, and is answered with the same functions of
:mod:`app.predictions.service` (precision check, roofline and power of a layer, the aggregation input)
and the one aggregation of the core (:func:`app.core.aggregate.aggregate`). What this module adds is doing
it for many scenarios at once:

1. **bind**: a graph is imported and analysed once per ``(graph, per-device batch, dims, software stack,
   hardware kind)``
   (:func:`app.graphs.service.bound_graph`: the process-wide analysis cache, byte-bounded, with the
   layer table and memoised footprints of each binding);
2. **recall**: a scenario answered before by the same predictor object (same graph content, binding,
   device spec, precision, mode, optimizer) reuses its layer estimates and their sums, memoised on the
   binding's analysis-cache entry (:func:`app.predictions.service.memo_estimates`, the memo
   ``POST /v1/predictions`` uses too: bounded by the analysis cache's byte budget, keyed by the predictor's
   version and object, so a swapped predictor never gets another's answers), so a scheduler's recurring
   models cost only the aggregation;
3. **predict**: the layer tables of every other scenario of the call go through **one**
   ``estimate_tables`` call of the predictor (:func:`predict_layers`: numpy features for all their layers,
   one ``session.run``), the path :func:`app.predictions.service.estimate` takes for a single prediction;
4. **aggregate**: :func:`scenario_aggregate`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from app.core.aggregate import Aggregate, LayerSums, aggregate
from app.core.analysis import GraphAnalysis
from app.core.hardware import HardwareSpec, spec_fingerprint
from app.core.memory import MemoryFootprint, fits
from app.core.precision import Precision
from app.errors import LayercastError
from app.graphs import service as graphs
from app.graphs.importer import canonical_json
from app.hardware import service as hardware_service
from app.predictions.schemas import PredictionCreate
from app.predictions.service import (
    aggregation_input,
    check_devices_per_node,
    check_interconnect,
    check_stack,
    checked_precision,
    estimates_key,
    memo_footprint,
    memo_largest_batch,
    memory_options,
    predict_tables,
    remember_estimates,
    sums_of,
)
from app.predictor.base import Predictor
from app.predictor.table import Estimates, Setting


@dataclass(frozen=True, slots=True)
class Scenario:
    """One single-prediction request bound to its analysis (at the per-device batch), its device and its
    checked precision."""

    request: PredictionCreate
    bound: graphs.BoundGraph
    hardware: HardwareSpec
    precision: Precision
    key: Hashable = None  # what the layer times and the footprint depend on (deduplication within a call)
    estimates_key: Hashable = None  # the memo key of its estimates on ``bound`` (predictions.service)

    @property
    def analysis(self) -> GraphAnalysis:
        return self.bound.analysis

    @property
    def setting(self) -> Setting:
        return Setting(hardware=self.hardware, mode=self.request.mode, optimizer=self.optimizer,
                       precision=self.precision, software_stack=self.request.software_stack)

    @property
    def training(self) -> bool:
        return self.request.mode == "training"

    @property
    def table(self) -> Any:
        """The :class:`~app.predictor.table.LayerTable` one step of this scenario runs (a training step's ends
        with the loss layer: :meth:`app.graphs.service.BoundGraph.table`)."""
        return self.bound.table(self.hardware, training=self.training)

    @property
    def optimizer(self) -> str:
        return self.request.optimizer if self.training else "none"


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _remembered(memo: dict[K, V | LayercastError], key: K, compute: Callable[[], V]) -> V:
    """``memo[key]``, computed by ``compute()`` on first use; a :class:`~app.errors.LayercastError` it
    raises is remembered too and raised again for every later use of ``key`` within the call (a missing
    graph or device fails each job that names it, without another database lookup or import)."""
    if key not in memo:
        try:
            memo[key] = compute()
        except LayercastError as exc:
            memo[key] = exc
    found = memo[key]
    if isinstance(found, LayercastError):
        raise found
    return found


@dataclass
class GraphCache:
    """Per-call caches (analyses per ``(graph, batch, dims, stack)``, hardware specs) in front of the
    analysis cache and its memoised estimates. Errors are cached too, so a bad graph id in 1,000 jobs is looked up
    once."""

    session: Session
    predictor: Predictor
    _analyses: dict[Hashable, graphs.BoundGraph | LayercastError] = field(default_factory=dict)
    _specs: dict[str, HardwareSpec | LayercastError] = field(default_factory=dict)
    _fingerprints: dict[str, str] = field(default_factory=dict)
    _footprints: dict[Hashable, MemoryFootprint] = field(default_factory=dict)  # by (Scenario.key, DDP), this call

    @staticmethod
    def _graph_key(request: PredictionCreate) -> Hashable:
        if request.graph_id is not None:
            return ("id", request.graph_id)
        assert request.graph is not None
        return ("json", canonical_json(request.graph.model_dump()))

    def _bound(self, request: PredictionCreate, hardware_kind: str) -> graphs.BoundGraph:
        """The binding of ``request`` analysed for a ``hardware_kind`` device (what its stack fuses there).
        Raises what :func:`graphs.bound_graph` raises (404 ``graph_not_found``, 422
        ``invalid_graph``/``unbound_dimension``/``unknown_dimension``)."""
        batch = request.per_device_batch_size
        graph_key = self._graph_key(request)
        key = (graph_key, batch, tuple(sorted(request.dims.items())), request.software_stack, hardware_kind)

        def bind() -> graphs.BoundGraph:
            if request.graph_id is not None:
                return graphs.bound_graph(self.session, graph_id=request.graph_id, batch_size=batch,
                                          dims=request.dims, software_stack=request.software_stack,
                                          hardware_kind=hardware_kind)
            content = graph_key[1]  # type: ignore[index]
            return graphs.bound_inline(content, batch_size=batch, dims=request.dims,
                                       software_stack=request.software_stack, hardware_kind=hardware_kind)

        return _remembered(self._analyses, key, bind)

    def check_binding(self, request: PredictionCreate) -> None:
        """Bind ``request``'s graph at its batch and ``dims`` for a GPU, as its first GPU row would (the binding
        is kept for them): raises what :meth:`_bound` raises (404 ``graph_not_found``; 422 ``invalid_graph``,
        ``unbound_dimension``, ``unknown_dimension``, ``dims_names_batch_axis``), none of which depends on the
        device. A comparison checks this once before its rows, so that dims that cannot bind the graph are a
        422 even when every row would fail earlier on its own device."""
        self._bound(request, "gpu")

    def preload_hardware(self, hardware_ids: set[str]) -> None:
        """Load the specs of ``hardware_ids`` in one query (1,000 jobs name a few dozen devices), so that
        :meth:`spec` of each needs no query of its own; unknown ids are left to :meth:`spec` to refuse."""
        found = hardware_service.get_specs(self.session, hardware_ids=hardware_ids - set(self._specs))
        for hardware_id, spec in found.items():
            self._remember_spec(hardware_id, spec)

    def _remember_spec(self, hardware_id: str, spec: HardwareSpec) -> HardwareSpec:
        self._specs[hardware_id] = spec
        self._fingerprints[hardware_id] = spec_fingerprint(spec)
        return spec

    def spec(self, hardware_id: str) -> HardwareSpec:
        """Stored spec of ``hardware_id``; raises :class:`app.errors.HardwareNotFound` (404)."""

        def load() -> HardwareSpec:
            return self._remember_spec(hardware_id, hardware_service.get_spec(self.session, hardware_id=hardware_id))

        return _remembered(self._specs, hardware_id, load)

    def scenario(self, request: PredictionCreate) -> Scenario:
        """Bind ``request`` (a ``hardware_id`` request): raises the errors ``POST /v1/predictions`` would
        (404 graph/hardware not found, 422 too_many_devices_per_node, precision_not_supported, stack_not_supported,
        no_interconnect, graph import errors)."""
        assert request.hardware_id is not None
        hw = self.spec(request.hardware_id)  # an unknown id is hardware_not_found whatever else is wrong
        check_devices_per_node(request)
        precision = checked_precision(hw, request.precision)
        check_stack(hw, request.software_stack)
        check_interconnect(hw, request)
        r = request
        key = (self._graph_key(r), r.per_device_batch_size, tuple(sorted(r.dims.items())), r.software_stack,
               self._fingerprints[hw.id], precision, r.mode, r.optimizer if r.mode == "training" else "none",
               r.activation_checkpointing)
        s = Scenario(request=r, bound=self._bound(r, hw.kind), hardware=hw, precision=precision, key=key)
        return replace(s, estimates_key=estimates_key(self.predictor, s.setting, self._fingerprints[hw.id]))

    def footprint(self, s: Scenario) -> MemoryFootprint:
        """Peak memory of one device of ``s`` (:func:`app.core.memory.footprint`, memoised on the binding, and
        by :attr:`Scenario.key` and whether it is data parallel for this call: the jobs of one scenario look it
        up once; a job on several devices keeps DDP's gradient buckets that the same per-device step on one
        device does not)."""
        opts = memory_options(s.request, s.precision, s.hardware)
        if s.key is None:  # no scenario identity: nothing to share it with
            return memo_footprint(s.bound, opts)
        key = (s.key, opts["data_parallel"])
        found = self._footprints.get(key)
        if found is None:
            found = self._footprints[key] = memo_footprint(s.bound, opts)
        return found

    def largest_batch(self, s: Scenario) -> int:
        """Largest per-device batch whose peak fits (:func:`app.core.memory.largest_batch_that_fits`)."""
        return memo_largest_batch(s.bound, memory_options(s.request, s.precision, s.hardware))

    def fits(self, s: Scenario) -> bool:
        """Whether one device of ``s`` holds its peak (:func:`app.core.memory.fits`)."""
        return fits(self.footprint(s), s.hardware.memory_bytes)


@dataclass(frozen=True, slots=True)
class LayerPredictions:
    """What :func:`predict_layers` returns: per scenario, the estimates of its supported layers (graph order)
    and the sums of their layer times (:func:`app.predictions.service.sums_of`, computed once per scenario and
    shared by every job of it), and how many layer predictions were answered and how many computed now."""

    estimates: list[Estimates]
    sums: list[LayerSums]
    queries: int
    unique_queries: int


def predict_layers(cache: GraphCache, scenarios: Sequence[Scenario]) -> LayerPredictions:
    """Estimates of every supported layer of every scenario: remembered scenarios from the cache, the others'
    layer tables through one vectorised predictor call (:func:`app.predictions.service.predict_tables`).
    A scenario that recurs within the call is predicted once (its first occurrence) and shares that answer.
    Raises what the predictor raises."""
    recalled = [s.bound.recall(s.estimates_key) if s.estimates_key is not None else None for s in scenarios]
    todo: list[Scenario] = []
    seen: set[Hashable] = set()
    for s, hit in zip(scenarios, recalled, strict=True):
        if hit is None and (s.key is None or s.key not in seen):
            todo.append(s)
            if s.key is not None:
                seen.add(s.key)
    items = [(s.table, s.setting) for s in todo]
    found = iter(predict_tables(cache.predictor, items) if items else [])
    fresh: dict[Hashable, tuple[Estimates, LayerSums]] = {}
    estimates: list[Estimates] = []
    sums: list[LayerSums] = []
    queries = computed = 0
    for s, hit in zip(scenarios, recalled, strict=True):
        if hit is None and s.key is not None:
            hit = fresh.get(s.key)
        if hit is None:
            est = next(found)
            table = s.table
            hit = (remember_estimates(s.bound, s.estimates_key, table, s.setting, est)
                   if s.estimates_key is not None else (est, sums_of(table, s.setting, est)))
            if s.key is not None:
                fresh[s.key] = hit
            computed += len(est)
        estimates.append(hit[0])
        sums.append(hit[1])
        queries += len(hit[0])
    return LayerPredictions(estimates=estimates, sums=sums, queries=queries,
                            unique_queries=computed)


def scenario_aggregate(cache: GraphCache, s: Scenario, sums: LayerSums) -> Aggregate:
    """Iteration, epoch and job of ``s`` from the sums of its layer times (:attr:`LayerPredictions.sums`):
    :func:`app.core.aggregate.aggregate` of :func:`app.predictions.service.aggregation_input`, the numbers
    ``POST /v1/predictions`` computes; only the job-level terms are computed per call."""
    fp = cache.footprint(s)
    return aggregate(aggregation_input(s.request, s.hardware, (), fp, training=s.training, sums=sums))
