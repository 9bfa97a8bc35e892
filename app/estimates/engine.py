"""Many predictions in one pass: the shared machinery of the batch, comparison and job-estimate endpoints.

Stages (each a function below):

1. **bind**: a stored graph is imported and analysed once per ``(graph, batch, dims, software stack)``
   within a call (:class:`GraphCache`; imports are also cached across calls by
   :func:`app.graphs.service.build_graph`);
2. **query**: one :class:`~app.predictor.base.LayerTimeQuery` per supported layer (:func:`layer_queries`,
   the queries :func:`app.predictions.service.estimate` builds: supported layers in graph order);
3. **predict**: the queries of every scenario of the call go through **one** ``predictor.estimate`` call
   (:func:`predict_layers`). Queries that differ only in names (the same layer shape on the same device,
   mode, optimizer, precision and stack, e.g. the repeated blocks of a ResNet or the shared cells of a
   NAS space) are predicted once: a prediction depends on the layer's shapes and attributes, never on
   its name;
4. **aggregate**: each scenario's layer times (with their power, :mod:`app.core.energy`) are combined by the
   one aggregation of the core (:func:`app.core.aggregate.aggregate`) into iteration, epoch and job time,
   energy and money (:func:`scenario_aggregate`).

No arithmetic of its own beyond the power of a layer (utilisation of its roofline bound, the model of
:mod:`app.core.energy`) and the per-device batch/gradient bytes fed to the aggregation.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from app.core.aggregate import Aggregate, AggregationInput, DataParallel, InvalidAggregation, LayerTime, aggregate
from app.core.analysis import GraphAnalysis, analyze
from app.core.energy import NoPowerFigure, idle_power_w, power_w, utilisation
from app.core.hardware import HardwareSpec
from app.core.ir import Tensor
from app.core.memory import fits, footprint, largest_batch_that_fits
from app.core.precision import (
    Precision,
    PrecisionNotSupported,
    check_precision,
    cost_at_precision,
    op_precision,
    storage_precision,
)
from app.core.vocab import SoftwareStack
from app.errors import InvalidRequest, LayercastError, PrecisionNotSupportedError
from app.graphs import service as graphs
from app.hardware import service as hardware_service
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, Predictor

#: Gradient bytes per parameter all-reduced by data parallel: DDP reduces the fp32 gradients (fp32 master
#: weights under autocast too).
GRADIENT_BYTES_PER_PARAM = 4


@dataclass
class GraphCache:
    """Per-call caches: stored graph rows, their analyses per ``(graph, batch, dims, stack)`` and hardware
    specs. Errors are cached too, so a bad graph id in 1,000 jobs is looked up once."""

    session: Session
    _analyses: dict[Hashable, GraphAnalysis | LayercastError] = field(default_factory=dict)
    _specs: dict[str, HardwareSpec | LayercastError] = field(default_factory=dict)

    def analysis(self, *, graph_id: str, batch_size: int, dims: Mapping[str, int],
                 software_stack: SoftwareStack) -> GraphAnalysis:
        """Analysis of stored graph ``graph_id`` at ``batch_size``; raises what :func:`graphs.get_graph` and
        :func:`graphs.build_graph` raise (404 ``graph_not_found``, 422 ``invalid_graph``/``unbound_dimension``)."""
        key = (graph_id, batch_size, tuple(sorted(dims.items())), software_stack)
        if key not in self._analyses:
            try:
                row = graphs.get_graph(self.session, graph_id=graph_id)
                graph = graphs.build_graph(row.content, row.source_format, batch_size=batch_size, dims=dims,
                                           name=row.name)
                self._analyses[key] = analyze(graph, software_stack=software_stack)
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


@dataclass(frozen=True, slots=True)
class Scenario:
    """One graph on one kind of device: the analysis is at the per-device batch; ``device_count`` devices
    run data parallel on ``global_batch_size`` samples per step."""

    analysis: GraphAnalysis
    hardware: HardwareSpec
    mode: str
    optimizer: str
    precision: Precision
    software_stack: SoftwareStack
    global_batch_size: int
    device_count: int = 1
    dataset_size: int | None = None
    epochs: float | None = None
    price_usd_per_hour: float | None = None
    grid_gco2_per_kwh: float | None = None


def layer_queries(s: Scenario) -> list[LayerTimeQuery]:
    """The predictor queries of ``s``: one per supported layer, in graph order."""
    return [
        LayerTimeQuery(layer=layer, cost=cost, hardware=s.hardware, mode=s.mode, optimizer=s.optimizer,
                       precision=s.precision, software_stack=s.software_stack)
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
    """``e`` as the aggregation's :class:`LayerTime`, with the layer's power (:mod:`app.core.energy`): its
    utilisation is that of the FLOPs and bytes it moves (forward + backward in training, at the precision,
    against the peak the op may use) over the predicted time; ``None`` power without a TDP."""
    try:
        c = cost_at_precision(q.layer, q.cost, q.precision)
        training = q.mode == "training"
        u = utilisation(
            flops=c.forward_flops + (c.backward_flops if training else 0),
            nbytes=c.forward_bytes + (c.backward_bytes if training else 0),
            time_ms=e.total_ms,
            peak_flops_per_s=op_precision(q.hardware, q.precision, q.layer.kind).peak_flops_per_s,
            bandwidth_bytes_per_s=q.hardware.memory_bandwidth_bytes_per_s,
        )
        watts: float | None = power_w(q.hardware, u)
    except NoPowerFigure:
        watts = None
    return LayerTime(forward_ms=e.forward_ms, backward_ms=e.backward_ms, update_ms=e.update_ms,
                     total_ms_p10=e.total_ms_p10, total_ms_p90=e.total_ms_p90, power_w=watts)


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


def scenario_aggregate(s: Scenario, times: Sequence[LayerTime]) -> Aggregate:
    """Iteration, epoch and job of ``s`` from its layer times (:func:`app.core.aggregate.aggregate`), with
    the device's idle power and price (``s.price_usd_per_hour`` overrides the catalog's).

    Raises :class:`app.errors.InvalidRequest` (422) for what the aggregation refuses (several devices
    without an interconnect in the catalog, a batch that does not divide over the devices).
    """
    hw = s.hardware
    try:
        idle: float | None = idle_power_w(hw)
    except NoPowerFigure:
        idle = None
    dp = None
    if s.device_count > 1:
        dp = DataParallel(device_count=s.device_count, link=hw.link(),
                          gradient_bytes=s.analysis.params * GRADIENT_BYTES_PER_PARAM if s.mode == "training"
                          else 0.0)
    try:
        return aggregate(AggregationInput(
            layers=times, global_batch_size=s.global_batch_size, data_parallel=dp, dataset_size=s.dataset_size,
            epochs=s.epochs, idle_power_w=idle,
            price_usd_per_hour=s.price_usd_per_hour if s.price_usd_per_hour is not None else hw.price_usd_per_hour,
            grid_gco2_per_kwh=s.grid_gco2_per_kwh,
        ))
    except InvalidAggregation as exc:
        raise InvalidRequest(str(exc), detail={"hardware_id": hw.id, "device_count": s.device_count}) from exc


def memory_fit(s: Scenario, *, largest: bool = False) -> tuple[int, bool, int | None]:
    """``(peak_bytes, fits, largest_batch_per_device)`` of one device of ``s`` (:mod:`app.core.memory`);
    the largest batch (a binary search over footprints) only when ``largest``."""
    opts: dict[str, Any] = {"mode": s.mode, "optimizer": s.optimizer, "precision": storage_precision(s.precision),
            "hardware": s.hardware}
    fp = footprint(s.analysis, **opts)
    best = largest_batch_that_fits(s.analysis, memory_bytes=s.hardware.memory_bytes, **opts) if largest else None
    return fp.total_bytes, fits(fp, s.hardware.memory_bytes), best


def checked_precision(hw: HardwareSpec, precision: Precision) -> Precision:
    """``precision`` if ``hw`` can run it; raises :class:`app.errors.PrecisionNotSupportedError` (422)."""
    try:
        return check_precision(hw, precision)
    except PrecisionNotSupported as exc:
        raise PrecisionNotSupportedError(
            str(exc), detail={"hardware_id": hw.id, "precision": exc.precision.value,
                              "missing_peak": exc.missing_peak, "available_peaks": sorted(hw.peak_flops_per_s)},
        ) from exc
