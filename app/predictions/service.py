"""Prediction of per-layer, per-iteration, per-epoch and per-job cost.

Pipeline (DESIGN.md): graph at the per-device batch → analytical costs → predictor per layer (learned where
it applies, roofline otherwise) → :func:`app.core.aggregate.aggregate` (iteration, data-parallel all-reduce,
input pipeline, epoch, job, checkpoints, energy, money). Interval bounds of the iteration are the sums of the
per-layer bounds (errors of layers on one device are strongly correlated, so the comonotonic sum is the
honest bound).
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from app.core.aggregate import (
    Aggregate,
    AggregationInput,
    Checkpointing,
    DataParallel,
    InputPipeline,
    LayerSums,
    LayerTime,
    aggregate,
    layer_sums,
    layer_sums_of,
    with_recompute,
)
from app.core.analysis import GraphAnalysis
from app.core.collectives import (
    BANDWIDTH_EFFICIENCY,
    DEFAULT_NETWORK_BANDWIDTH_BYTES_PER_S,
    DEFAULT_NETWORK_LATENCY_S,
    MAX_DEVICES_PER_NODE,
    Link,
    nodes_needed,
)
from app.core.energy import IDLE_FRACTION_OF_TDP, J_PER_KWH, idle_power_w
from app.core.fusion import rules_for_stack
from app.core.hardware import HardwareSpec, spec_fingerprint
from app.core.ir import EVAL_EXPORT_WARNING
from app.core.memory import (
    HEADROOM,
    PRECISIONS,
    Layout,
    MemoryFootprint,
    device_key,
    fits,
    footprint,
    footprint_key,
    largest_batch_that_fits,
    memory_layout,
)
from app.core.precision import (
    PRECISION_SEMANTICS,
    Precision,
    PrecisionNotSupported,
    check_precision,
    storage_precision,
)
from app.core.vocab import GPU_ONLY_STACKS, SoftwareStack, stack_runs_on
from app.errors import (
    NoCostedLayers,
    NoInterconnect,
    PrecisionNotSupportedError,
    StackNotSupportedError,
    TooManyDevicesPerNode,
)
from app.graphs import service as graphs
from app.graphs.importer import canonical_json
from app.hardware import service as hardware_service
from app.predictions.schemas import (
    EpochPrediction,
    IterationPrediction,
    JobPrediction,
    LayerPrediction,
    LossLayer,
    MemoryPrediction,
    PredictionCreate,
    PredictionRead,
    Totals,
    UnsupportedLayers,
)
from app.predictor.base import BACKWARD_SEMANTICS, LayerTimeEstimate, LayerTimeQuery, Predictor
from app.predictor.table import Estimates, LayerTable, Roofline, Setting, roofline_for


def check_devices_per_node(request: PredictionCreate) -> None:
    """Refuse a request that puts more devices in one node (``device_count / nodes``) than a node holds
    (:data:`app.core.collectives.MAX_DEVICES_PER_NODE`): such a ring would be costed over one intra-node link
    no 8-GPU node has. Hardware-independent, but checked after the device lookup (an unknown id is a 404
    whatever else is wrong) and before the graph import (a refused request costs no analysis).

    Raises :class:`TooManyDevicesPerNode` (422 ``too_many_devices_per_node``; ``detail.nodes_needed``: the
    fewest nodes that hold ``device_count`` evenly, :func:`app.core.collectives.nodes_needed`).
    """
    per_node = request.device_count // max(request.nodes, 1)
    if per_node <= MAX_DEVICES_PER_NODE:
        return
    needed = nodes_needed(request.device_count)
    raise TooManyDevicesPerNode(
        f"{per_node} devices in one node ({request.device_count} over {request.nodes} node(s)) exceed the "
        f"{MAX_DEVICES_PER_NODE} an 8-GPU DGX/HGX node holds: spread device_count {request.device_count} over "
        f"{needed} nodes ({request.device_count // needed} each; device_count must divide evenly over the nodes)",
        detail={"device_count": request.device_count, "nodes": request.nodes, "devices_per_node": per_node,
                "max_devices_per_node": MAX_DEVICES_PER_NODE, "nodes_needed": needed},
    )


def check_interconnect(hw: HardwareSpec, request: PredictionCreate) -> None:
    """Refuse a request that puts several devices of ``hw`` in one node when ``hw`` lists no intra-node
    interconnect. One device per node (``device_count == nodes``) needs none: its ranks meet over the
    network (:class:`app.core.collectives.Topology`).

    Raises :class:`NoInterconnect` (422 ``no_interconnect``).
    """
    per_node = request.device_count // max(request.nodes, 1)
    if per_node > 1 and hw.link() is None:
        raise NoInterconnect(
            f"hardware {hw.id!r} lists no interconnect (interconnect, interconnect_bandwidth_bytes_per_s, "
            f"interconnect_latency_s): {per_node} devices in one node cannot be estimated (one device per "
            "node, over the network, can)",
            detail={"hardware_id": hw.id, "device_count": request.device_count, "nodes": request.nodes},
        )


def aggregation_input(
    request: PredictionCreate, hw: HardwareSpec, times: Sequence[LayerTime], fp: MemoryFootprint, *, training: bool,
    sums: LayerSums | None = None,
) -> AggregationInput:
    """What :func:`app.core.aggregate.aggregate` needs from the request, the device and the footprint
    (``sums``: :func:`app.core.aggregate.layer_sums` of ``times`` when the caller has them). A training step
    with ``activation_checkpointing`` adds the recomputed forward to backward
    (:func:`app.core.aggregate.with_recompute`)."""
    if training and request.activation_checkpointing:
        sums = with_recompute(sums if sums is not None else layer_sums(times))
    n = request.device_count
    dp = None
    if n > 1:
        dp = DataParallel(device_count=n, gradient_bytes=fp.gradients_bytes if training else 0, link=hw.link(),
                          nodes=request.nodes, network=network_link(request))
    ck = None
    if request.checkpoint_every_epochs is not None and request.checkpoint_write_bytes_per_s is not None:
        ck = Checkpointing(checkpoint_bytes=fp.checkpoint_bytes,  # the file: no allocator rounding
                           write_bandwidth_bytes_per_s=request.checkpoint_write_bytes_per_s,
                           every_epochs=request.checkpoint_every_epochs)
    loading = (InputPipeline(samples_per_s=request.loading_samples_per_s, overlapped=request.loading_overlapped)
               if request.loading_samples_per_s is not None else None)
    price, _ = _price(request, hw)
    return AggregationInput(
        layers=times, global_batch_size=request.batch_size, overhead_ms=request.iteration_overhead_ms,
        data_parallel=dp, input_pipeline=loading, dataset_size=request.dataset_size, eval_size=request.eval_size,
        epochs=request.epochs, checkpointing=ck, idle_power_w=idle_power_w(hw) if hw.tdp_w is not None else None,
        price_usd_per_hour=price, grid_gco2_per_kwh=request.grid_gco2_per_kwh, sums=sums,
    )


def network_link(request: PredictionCreate) -> Link | None:
    """The inter-node network of ``request`` (``None`` on one node): its bandwidth and latency, each
    defaulting to :data:`app.core.collectives.DEFAULT_NETWORK_BANDWIDTH_BYTES_PER_S` / ``_LATENCY_S``
    (the answer's warnings say so)."""
    if request.nodes == 1:
        return None
    return Link(kind="network",
                bandwidth_bytes_per_s=request.inter_node_bandwidth_bytes_per_s or DEFAULT_NETWORK_BANDWIDTH_BYTES_PER_S,
                step_latency_s=request.inter_node_latency_s or DEFAULT_NETWORK_LATENCY_S)


def _data_parallel_assumption(request: PredictionCreate, hw: HardwareSpec) -> str:
    if request.device_count == 1:
        return "one device, no communication"
    g = request.device_count // request.nodes
    where = (f"{request.device_count} devices in one node" if request.nodes == 1 else
             f"{request.nodes} nodes x {g} devices")
    intra = (f" over {hw.interconnect} ({(hw.interconnect_bandwidth_bytes_per_s or 0) / 1e9:g} GB/s per direction, "
             f"{(hw.interconnect_latency_s or 0) * 1e6:g} us per step)" if g > 1 else "")
    net = network_link(request)
    between = ("" if net is None else f", nodes joined by a {net.bandwidth_bytes_per_s / 1e9:g} GB/s per node, "
               f"{net.step_latency_s * 1e6:g} us per step network")
    ring = ("ring all-reduce of the fp32 gradients (8.4 us + 2(n-1) x step latency + 2(n-1)/n x bytes / "
            f"({BANDWIDTH_EFFICIENCY} x link bandwidth))" if request.nodes == 1 else
            "hierarchical all-reduce of the fp32 gradients (reduce-scatter in the node, ring all-reduce "
            "between nodes, all-gather in the node; app/core/collectives.py)")
    return (f"{where}{intra}{between}: batch_size is the global batch, {request.per_device_batch_size} per device; "
            f"{ring}; docs/allreduce_validation.md; in 25 MiB DDP buckets overlapped with backward")


def _price(request: PredictionCreate, hw: HardwareSpec) -> tuple[float | None, str | None]:
    """Price per device-hour and where it comes from: the request's override (``"request"``), else the device's
    price and its source: the catalog's dated list price, ``"request.hardware"`` for an inline spec's own
    (:func:`app.hardware.service.resolve_inline`), ``"catalog"`` for a stored price without a source."""
    if request.price_usd_per_hour is not None:
        return request.price_usd_per_hour, "request"
    if hw.price_usd_per_hour is not None:
        return hw.price_usd_per_hour, hw.sources.get("price_usd_per_hour", "catalog")
    return None, None


def predict_tables(predictor: Predictor, items: Sequence[tuple[LayerTable, Setting]]) -> list[Estimates]:
    """Estimates of every row of each ``(table, setting)``: the predictor's vectorised path (``estimate_tables``:
    numpy features, one ``session.run`` for all items) when it has one, else :meth:`Predictor.estimate` over
    the rows as queries (predictors that implement only the protocol). The one path of single, batch,
    job-estimate and comparison predictions."""
    tables = getattr(predictor, "estimate_tables", None)
    if tables is not None:
        return tables([(t, np.arange(len(t)), s) for t, s in items])  # type: ignore[no-any-return]
    out = []
    for table, s in items:
        queries = [LayerTimeQuery(layer=layer, cost=cost, hardware=s.hardware, mode=s.mode, optimizer=s.optimizer,
                                  precision=s.precision, software_stack=s.software_stack)
                   for layer, cost in zip(table.layers, table.costs, strict=True)]
        out.append(Estimates.from_list(predictor.estimate(queries)))
    return out


def layer_powers(table: LayerTable, setting: Setting, est: Estimates) -> tuple[np.ndarray | None, Roofline]:
    """Each row's estimated power ``[N]`` (W; the model of :mod:`app.core.energy`: idle + (TDP - idle) x
    utilisation, vectorised; ``None`` without a TDP) and the rows' roofline
    (:func:`app.predictor.table.roofline_for`)."""
    hw = setting.hardware
    roof = roofline_for(table, hw, setting.precision, training=setting.training)
    if hw.tdp_w is None:
        return None, roof
    t_ms = est.forward_ms + est.backward_ms
    with np.errstate(divide="ignore", invalid="ignore"):
        t = t_ms / 1e3
        u = np.maximum(roof.flops / t / roof.peak_flops_per_s, roof.nbytes / t / hw.memory_bandwidth_bytes_per_s)
    u = np.where(t_ms <= 0, 0.0, np.minimum(np.maximum(u, 0.0), 1.0))
    idle = idle_power_w(hw)
    return idle + (max(hw.tdp_w, idle) - idle) * u, roof


def sums_of(table: LayerTable, setting: Setting, est: Estimates) -> LayerSums:
    """:func:`app.core.aggregate.layer_sums` of a :class:`~app.core.aggregate.LayerTime` per row with its
    :func:`layer_powers` (the same figures, bit for bit, ``tests/estimates/test_scenario_sums.py``) without
    building them: what every prediction aggregates."""
    power, _ = layer_powers(table, setting, est)
    return layer_sums_of(forward_ms=est.forward_ms.tolist(), backward_ms=est.backward_ms.tolist(),
                         update_ms=est.update_ms.tolist(), total_ms_p10=est.total_ms_p10.tolist(),
                         total_ms_p90=est.total_ms_p90.tolist(),
                         power_w=None if power is None else power.tolist())  # fmt: skip


#: Approximate bytes of one row of a memoised :class:`~app.predictor.table.Estimates` (seven float64/bool
#: columns and two list slots; the method and note strings are shared; until the notes are read, ~20 bytes of
#: flags and row indices they are built from, :class:`~app.predictor.table.LazyNotes`), counted against the
#: analysis cache.
ESTIMATE_BYTES_PER_ROW = 100
_ESTIMATE_FIXED_BYTES = 1500  # the Estimates object, its arrays' headers, the LayerSums and the memo key

_TOKENS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_NEXT_TOKEN = itertools.count()


def predictor_key(predictor: Predictor) -> tuple[str, int]:
    """``(version, token)`` of ``predictor``: its version and a number unique to the object for the life of
    the process, so that a predictor swapped in (a new version, or the same version reloaded or wrapped) is
    never answered another predictor's memoised estimates."""
    token = _TOKENS.get(predictor)
    if token is None:
        token = _TOKENS[predictor] = next(_NEXT_TOKEN)
    return predictor.version, token


def estimates_key(predictor: Predictor, setting: Setting, fingerprint: str) -> Hashable:
    """Memo key, on a :class:`~app.graphs.service.BoundGraph` (which fixes graph, binding and software
    stack), of the estimates of ``predictor`` in ``setting`` on the device of ``fingerprint``
    (:func:`spec_fingerprint`)."""
    return ("estimates", *predictor_key(predictor), fingerprint, setting.precision, setting.mode, setting.optimizer,
            setting.software_stack)


def remember_estimates(bound: graphs.BoundGraph, key: Hashable, table: LayerTable, setting: Setting,
                       est: Estimates) -> tuple[Estimates, LayerSums]:
    """Keep ``est`` (the rows of ``table`` in ``setting``) and its :func:`sums_of` on ``bound`` under ``key``
    (:func:`estimates_key`), their bytes counted against the analysis cache's budget; returns what is kept
    (an earlier answer when another thread kept one first)."""
    return bound.memo(key, lambda: (est, sums_of(table, setting, est)),
                      nbytes=_ESTIMATE_FIXED_BYTES + ESTIMATE_BYTES_PER_ROW * len(table))


def memo_estimates(bound: graphs.BoundGraph, predictor: Predictor, setting: Setting, *, key: Hashable
                   ) -> tuple[Estimates, LayerSums]:
    """The estimates of ``bound``'s layer table in ``setting`` and their sums: remembered on the binding under
    ``key`` (:func:`estimates_key`: per predictor object), asked of the predictor (:func:`predict_tables`)
    only the first time. The one memo of predictor answers; the many-scenario endpoints
    (:func:`app.estimates.engine.predict_layers`) fill and read it too. Raises what the predictor raises."""
    found = bound.recall(key)
    if found is not None:
        return found  # type: ignore[no-any-return]
    table = bound.table(setting.hardware, training=setting.training)
    return remember_estimates(bound, key, table, setting, predict_tables(predictor, [(table, setting)])[0])


#: Approximate bytes of one memoised :class:`LayerPrediction` row (a pydantic model of ~25 fields, its
#: name and lists), counted against the analysis cache's budget.
LAYER_ROW_BYTES = 2000


def _layer_stats(analysis: GraphAnalysis, est: Estimates) -> tuple[int, Counter[str]]:
    """How many costed layers of the graph lie outside the learned predictor's data, and the graph's layer
    count per method (the loss row a training table ends with is not a graph layer: ``iteration.loss_ms``)."""
    n_uns = analysis.unsupported_layer_count
    n = len(analysis.costs) - n_uns
    methods = Counter(est.method[:n])
    if n_uns:
        methods["unsupported"] = n_uns
    return int(np.count_nonzero(est.out_of_distribution[:n])), methods


def loss_ms(bound: graphs.BoundGraph, training: bool, est: Estimates) -> float:
    """The loss layer's forward + backward ms (the last row of a training table, :meth:`BoundGraph.table`), 0.0
    when the step has none (inference, or no floating-point output)."""
    if not bound.has_loss_row(training):
        return 0.0
    return float(est.forward_ms[-1] + est.backward_ms[-1] + est.update_ms[-1])


def _loss_row(bound: graphs.BoundGraph, training: bool, est: Estimates) -> LossLayer | None:
    """The answer's :class:`LossLayer` (the analysis's loss layer and its cost, the method of the last row of
    the training table), None when the step has no loss row."""
    loss, cost = bound.analysis.loss, bound.analysis.loss_cost
    if not bound.has_loss_row(training) or loss is None or cost is None:
        return None
    return LossLayer(name=loss.name, op_type=loss.op_type, kind=loss.kind.value, method=str(est.method[-1]),
                     forward_flops=cost.forward_flops, backward_flops=cost.backward_flops,
                     bytes_read=cost.forward_bytes_read + cost.backward_bytes_read,
                     bytes_written=cost.forward_bytes_written + cost.backward_bytes_written)


def loss_quality(bound: graphs.BoundGraph, training: bool, est: Estimates) -> str:
    """How the loss row (the last of a training table) was estimated: ``"; estimated by the <method> method"``
    plus ``", outside the learned predictor's training data (wider interval)"`` when it is; ``""`` when the step
    has no loss row. The loss is not one of the graph's layers (``methods`` and the out-of-data warning count
    those), so the answer's ``assumptions.loss`` says it here."""
    if not bound.has_loss_row(training):
        return ""
    out = f"; estimated by the {est.method[-1]} method"
    if bool(est.out_of_distribution[-1]):
        out += ", outside the learned predictor's training data (wider interval)"
    return out


def _layer_rows(analysis: GraphAnalysis, table: LayerTable, setting: Setting, est: Estimates
                ) -> list[LayerPrediction]:
    """The response rows of ``detail="layers"``, one per layer in graph order (unsupported ones included)."""
    training = setting.training
    rows: list[LayerPrediction] = []
    roof = roofline_for(table, setting.hardware, setting.precision, training=training)
    estimates = iter(est.to_list())
    bounds = iter(zip(roof.time_ms.tolist(), roof.compute_bound.tolist(), strict=True))
    for i, (layer, cost) in enumerate(zip(analysis.graph.layers, analysis.costs, strict=True)):
        common: dict[str, Any] = {
            "name": layer.name,
            "op_type": layer.op_type,
            "kind": layer.kind.value,
            "params": cost.params,
            "forward_macs": cost.forward_macs,
            "forward_flops": cost.forward_flops,
            "backward_flops": cost.backward_flops if training else 0,
            "bytes_read": cost.forward_bytes_read + (cost.backward_bytes_read if training else 0),
            "bytes_written": cost.forward_bytes_written + (cost.backward_bytes_written if training else 0),
            "operational_intensity_flops_per_byte": cost.operational_intensity,
            "fused_from": list(analysis.fused_from[i]) if analysis.fused_from else [],
            "fusion_rule": analysis.fusion_rules[i] if analysis.fusion_rules else None,
        }
        if not cost.supported:
            rows.append(LayerPrediction(
                **common, method="unsupported", bound=None, roofline_ms=None, forward_ms=None, backward_ms=None,
                update_ms=None, total_ms=None, total_ms_p10=None, total_ms_p90=None, out_of_distribution=True,
                physics_floor_ms=None,
            ))
            continue
        e: LayerTimeEstimate = next(estimates)
        roof_ms, compute_bound = next(bounds)
        rows.append(LayerPrediction(
            **common, method=e.method, bound="compute" if compute_bound else "memory", roofline_ms=roof_ms,
            forward_ms=e.forward_ms, backward_ms=e.backward_ms, update_ms=e.update_ms, total_ms=e.total_ms,
            total_ms_p10=e.total_ms_p10, total_ms_p90=e.total_ms_p90, out_of_distribution=e.out_of_distribution,
            physics_floor_ms=e.physics_floor_ms, floor_clamped=e.floor_clamped,
        ))
    return rows


def _totals_read(
    agg: Aggregate, request: PredictionCreate, hw: HardwareSpec, *, gradient_bytes: int, loss_ms: float
) -> tuple[IterationPrediction, EpochPrediction | None, JobPrediction | None]:
    """The aggregation's iteration, epoch and job as response schemas (price and its source added; ``loss_ms``:
    the loss layer's share of ``layers_ms``)."""
    price, price_source = _price(request, hw)
    it = agg.iteration
    iteration = IterationPrediction(
        time_ms=it.time_ms, time_ms_p10=it.time_ms_p10, time_ms_p90=it.time_ms_p90, forward_ms=it.forward_ms,
        backward_ms=it.backward_ms, update_ms=it.update_ms, samples_per_s=it.samples_per_s,
        device_count=it.device_count, nodes=request.nodes, devices_per_node=it.device_count // request.nodes,
        per_device_batch_size=it.per_device_batch_size, layers_ms=it.layers_ms, loss_ms=loss_ms,
        overhead_ms=it.overhead_ms, gradient_bytes=gradient_bytes, allreduce_ms=it.allreduce_ms,
        allreduce_exposed_ms=it.allreduce_exposed_ms, allreduce_buckets=it.allreduce_buckets, input_ms=it.input_ms,
        input_exposed_ms=it.input_exposed_ms, scaling_efficiency=it.scaling_efficiency, energy_j=it.energy_j,
        average_power_w=(it.energy_j / it.device_count / (it.time_ms / 1e3)
                         if it.energy_j is not None and it.time_ms > 0 else None),
    )
    epoch = job = None
    if agg.epoch is not None:
        ep = agg.epoch
        epoch = EpochPrediction(
            dataset_size=ep.dataset_size, iterations_per_epoch=ep.iterations, time_s=ep.time_s,
            time_s_p10=ep.time_s_p10, time_s_p90=ep.time_s_p90, eval_size=ep.eval_size,
            eval_iterations=ep.eval_iterations, eval_s=ep.eval_s, energy_j=ep.energy_j,
            energy_kwh=ep.energy_j / J_PER_KWH if ep.energy_j is not None else None,
        )
    if agg.job is not None:
        jb = agg.job
        job = JobPrediction(
            epochs=jb.epochs, iterations=jb.iterations, time_s=jb.time_s, time_s_p10=jb.time_s_p10,
            time_s_p90=jb.time_s_p90,
            time_h=jb.time_h, checkpoints=jb.checkpoints, checkpoint_bytes=int(jb.checkpoint_bytes),
            checkpoint_s=jb.checkpoint_s, device_hours=jb.device_hours, energy_j=jb.energy_j,
            energy_kwh=jb.energy_kwh, price_usd_per_hour=price, price_source=price_source, cost_usd=jb.cost_usd,
            grid_gco2_per_kwh=request.grid_gco2_per_kwh, co2_kg=jb.co2_kg,
        )
    return iteration, epoch, job


#: What the memory of a data-parallel training answer assumes of DistributedDataParallel (``assumptions.memory``).
DDP_BUCKETS_ASSUMPTION = (
    "DDP gradient buckets, gradient_as_bucket_view=False (PyTorch default): DistributedDataParallel's flat "
    "all-reduce buckets are one more fp32 copy of every gradient beside the .grad tensors, resident for the whole "
    "step (ddp_gradient_buckets_bytes; bucket_cap_mb=25, the first bucket 1 MiB, each bucket one allocation)")


def memory_options(request: PredictionCreate, precision: Precision, hw: HardwareSpec) -> dict[str, Any]:
    """The keyword options of :func:`app.core.memory.footprint` for one device of ``request`` on ``hw`` at
    ``precision`` (checked): its storage precision, and ``data_parallel`` in training on several devices (DDP's
    gradient buckets). What :func:`memo_footprint` and :func:`memo_largest_batch` take, for one prediction and
    for every scenario of the many-scenario endpoints alike."""
    training = request.mode == "training"
    return {"mode": request.mode, "optimizer": request.optimizer if training else "none",
            "precision": storage_precision(precision), "hardware": hw,
            "activation_checkpointing": request.activation_checkpointing,
            "data_parallel": training and request.device_count > 1}


#: The options of :func:`memory_options` but the device, in name order: a memo key lists their values so.
_OPTION_NAMES = ("activation_checkpointing", "data_parallel", "mode", "optimizer", "precision")
_OPTION_KEYS = frozenset({*_OPTION_NAMES, "hardware"})


def _memo_key(what: str, mem_opts: dict[str, Any], *extra: Any) -> tuple[Any, ...]:
    """Memo key of a memory result: the options (every one but the device, in name order), the device by what
    footprints depend on (:func:`app.core.memory.footprint_key`: devices whose runtimes have the same numbers
    share their footprints, every generation of a vendor and across vendors)."""
    device = footprint_key(mem_opts["hardware"])
    if mem_opts.keys() == _OPTION_KEYS:  # what memory_options makes: no sort needed
        return (what, device, *extra, *(mem_opts[k] for k in _OPTION_NAMES))
    return (what, device, *extra, *(v for k, v in sorted(mem_opts.items()) if k != "hardware"))


def _memo_layout(bound: graphs.BoundGraph, mem_opts: dict[str, Any]) -> Layout | None:
    """The :func:`app.core.memory.memory_layout` of a training footprint, memoised on the cache entry by
    precision and device kind (every GPU generation shares it; ``None`` for inference, which needs none)."""
    if mem_opts["mode"] != "training":
        return None
    hw, precision = mem_opts["hardware"], mem_opts["precision"]
    gpu = device_key(hw)[1]
    return bound.memo(("layout", gpu, PRECISIONS[precision]),  # fp32/tf32, fp16/bf16 share one
                      lambda: memory_layout(bound.analysis, precision=precision, hardware=hw),
                      nbytes=graphs.LAYOUT_BYTES_PER_LAYER * len(bound.analysis.graph.layers))


def memo_footprint(bound: graphs.BoundGraph, mem_opts: dict[str, Any], *, batch_size: int | None = None
                   ) -> MemoryFootprint:
    """:func:`app.core.memory.footprint` of ``bound``'s analysis with ``mem_opts`` (at ``batch_size``, default
    the binding's), memoised on the cache entry (a pure function of the analysis, the options and the
    device's :func:`~app.core.memory.footprint_key`); the walk over the layers (its layout) is done once per
    precision and device kind (:func:`_memo_layout`), not per batch or GPU generation. The binding's own batch
    is kept under ``None`` (the same footprint: scale 1.0 either way), so the largest-batch search, which
    starts there, finds the answer's footprint instead of computing it again."""
    if batch_size == bound.analysis.graph.batch_size:
        batch_size = None
    return bound.memo(_memo_key("footprint", mem_opts, batch_size), lambda: footprint(
        bound.analysis, batch_size=batch_size, layout=_memo_layout(bound, mem_opts), **mem_opts))


def memo_largest_batch(bound: graphs.BoundGraph, mem_opts: dict[str, Any]) -> int:
    """:func:`app.core.memory.largest_batch_that_fits` on the options' device (its memory size), memoised
    like :func:`memo_footprint`; the search's footprints are memoised too, so devices of one generation
    share them."""
    hw = mem_opts["hardware"]
    return bound.memo(_memo_key("largest", mem_opts, hw.memory_bytes), lambda: largest_batch_that_fits(
        bound.analysis, memory_bytes=hw.memory_bytes, **mem_opts,
        footprint_at=lambda b: memo_footprint(bound, mem_opts, batch_size=b)))


def checked_precision(hw: HardwareSpec, precision: Precision) -> Precision:
    """``precision`` if ``hw`` can run it; raises :class:`PrecisionNotSupportedError` (422) otherwise."""
    try:
        return check_precision(hw, precision)
    except PrecisionNotSupported as exc:
        raise PrecisionNotSupportedError(
            str(exc),
            detail={"hardware_id": hw.id, "precision": exc.precision.value, "missing_peak": exc.missing_peak,
                    "available_peaks": sorted(hw.peak_flops_per_s)},
        ) from exc


def check_stack(hw: HardwareSpec, software_stack: SoftwareStack) -> None:
    """Raise :class:`StackNotSupportedError` (422 ``stack_not_supported``) when ``software_stack`` cannot run
    on ``hw``'s kind of device: a GPU-only stack (:data:`app.core.vocab.GPU_ONLY_STACKS`: CUDA graphs, CUDA
    libraries) on a CPU. Never answered as another stack."""
    if not stack_runs_on(software_stack, hw.kind):
        raise StackNotSupportedError(
            f"software stack {software_stack.value!r} runs on GPUs only; {hw.id!r} is a {hw.kind.upper()} "
            f"(CPU devices take {', '.join(s.value for s in SoftwareStack if s not in GPU_ONLY_STACKS)})",
            detail={"software_stack": software_stack.value, "hardware_id": hw.id, "hardware_kind": hw.kind,
                    "supported_kinds": ["gpu"]},
        )


def check_costed(analysis: GraphAnalysis, graph_id: str | None) -> None:
    """Raise :class:`NoCostedLayers` (422 ``no_costed_layers``; ``detail.op_types``: the ops without a cost
    formula) when the graph has layers and none of them has a cost formula: its time would be 0 s (in training
    the loss alone), its epoch, job and price 0, which a CI gate, a ranking or a scheduler would take at face
    value. One rule for predictions, batch items, job estimates and comparison rows; ``GET
    /v1/graphs/{id}/layers`` still lists such a graph's layers and why each has no formula."""
    if analysis.layer_count and analysis.unsupported_layer_count == analysis.layer_count:
        ops = sorted({u.op_type for u in analysis.unsupported})
        name = f"graph {graph_id!r}" if graph_id is not None else "the inline graph"
        raise NoCostedLayers(f"no layer of {name} has a cost formula (op types {', '.join(ops)}): its time would "
                             "be 0 s", detail={"graph_id": graph_id, "op_types": ops})


_RULE_TEXT: dict[str, str] = {
    "attention": "the attention core (Q.K^T, scale, mask, softmax, dropout, .V) as one flash / memory-efficient "
                 "SDPA kernel",
    "gelu": "erf-GELU chains as one GELU",
    "bias": "bias adds into their GEMM/conv",
    "activation_epilogue": "activations into their GEMM/conv epilogue",
    "pointwise": "connected element-wise groups as one generated kernel",
}


def fusion_assumption(software_stack: SoftwareStack, hardware_kind: str) -> str:
    """The ``assumptions["fusion"]`` text of an answer under ``software_stack`` on a ``hardware_kind`` device
    (``"gpu"``/``"cpu"``): the rules :func:`app.core.fusion.rules_for_stack` applies there, and on a CPU why the
    attention core is not one of them."""
    rules = rules_for_stack(software_stack, hardware_kind)
    text = (f"layers fused as {software_stack.value} fuses them on a {hardware_kind.upper()}: "
            + ("; ".join(_RULE_TEXT[r] for r in rules) or "nothing")
            + "; a fused layer keeps its members' FLOPs and moves only its external tensors")
    if hardware_kind == "cpu" and "attention" in rules_for_stack(software_stack, "gpu"):
        text += ("; on a CPU the attention core is NOT fused but costed as its separate layers: PyTorch's CPU "
                 "scaled_dot_product_attention runs it so in training with dropout (the math path), and its CPU "
                 "flash kernel (no dropout) measured about as fast as those parts (app/core/fusion.py)")
    return text


def predict(session: Session, predictor: Predictor, *, request: PredictionCreate) -> PredictionRead:
    """Predict the cost of ``request`` (see :class:`PredictionCreate`).

    Raises :class:`GraphNotFound`/:class:`HardwareNotFound` (404) for unknown ids,
    :class:`InvalidGraph`/:class:`UnboundDimension` (422) for graphs that cannot be imported at the
    requested binding, :class:`PrecisionNotSupportedError` (422) for a precision the device lacks,
    :class:`StackNotSupportedError` (422) for a GPU-only software stack on a CPU,
    :class:`TooManyDevicesPerNode` (422) for more than 8 devices in a node, :class:`ConflictingHardware` (422)
    for an inline spec under a stored device's id that differs from it
    (:func:`app.hardware.service.resolve_inline`).
    """
    unchecked = None
    if request.hardware_id is not None:
        hw = hardware_service.get_spec(session, hardware_id=request.hardware_id)
    else:
        assert request.hardware is not None
        hw, unchecked = hardware_service.resolve_inline(session, data=request.hardware)
    # after the device (an unknown id is a 404 whatever else is wrong), before the import: a refused request
    # costs no analysis
    check_devices_per_node(request)
    check_stack(hw, request.software_stack)
    # analysed for the device's kind: what the stack fuses on a GPU and on a CPU differs (app.core.fusion)
    if request.graph_id is not None:
        bound = graphs.bound_graph(session, graph_id=request.graph_id, batch_size=request.per_device_batch_size,
                                   dims=request.dims, software_stack=request.software_stack, hardware_kind=hw.kind)
    else:
        assert request.graph is not None
        content = canonical_json(request.graph.model_dump())
        bound = graphs.bound_inline(content, batch_size=request.per_device_batch_size, dims=request.dims,
                                    software_stack=request.software_stack, hardware_kind=hw.kind)
    check_costed(bound.analysis, bound.graph_id)
    answer = estimate(bound.analysis, hw, predictor, request=request, graph_id=bound.graph_id, bound=bound)
    if unchecked is not None:
        answer.warnings.append(unchecked)
    return answer


def answer_warnings(analysis: GraphAnalysis, hw: HardwareSpec, request: PredictionCreate, *, estimates: Estimates,
                    agg: Aggregate, fp: MemoryFootprint, loss: float) -> list[str]:
    """The ``warnings`` of the answer to ``request`` on ``hw``: the graph's own (an eval-mode export only in
    training), then nothing costable, unsupported layers, out-of-distribution layers (of ``estimates``), an
    assumed inter-node network, no TDP, no price for a job, activation checkpointing's recomputation, and a
    peak ``fp`` over the usable memory. ``agg``: the aggregate of the answer; ``loss``: its loss layer's ms
    (:func:`loss_ms`). Shared by ``POST /v1/predictions`` and the batch summaries, so both say the same."""
    training = request.mode == "training"
    # an eval-mode export (BatchNorm folded or in inference form) only matters when training it
    warnings: list[str] = [
        w for w in analysis.graph.warnings if training or not w.startswith(EVAL_EXPORT_WARNING)
    ]
    it = agg.iteration
    if it.layers_ms - loss <= 0:
        # never a silent zero: a graph with no costable layer is refused before this (check_costed); what
        # reaches here has costed layers of 0 ms only (in training the loss after the graph is always costed,
        # so it alone does not make the graph's time meaningful)
        warnings.append("no layer of this graph could be costed; the iteration time is not meaningful")
    uncosted = unsupported_warning(analysis)
    if uncosted is not None:
        warnings.append(uncosted)
    ood_layers, _ = _layer_stats(analysis, estimates)
    if ood_layers:
        warnings.append(
            f"{ood_layers} layer(s) lie outside the learned predictor's training data (hardware or shape "
            "range); their intervals are wider"
        )
    network = network_warning(request)
    if network is not None:
        warnings.append(network)
    if it.energy_j is None:
        warnings.append(f"hardware {hw.id!r} lists no tdp_w: energy and CO2 are not estimated")
    if agg.job is not None and _price(request, hw)[0] is None:
        warnings.append(f"hardware {hw.id!r} has no list price: give price_usd_per_hour for a cost")
    if request.activation_checkpointing:
        warnings.append(
            f"activation checkpointing recomputes the forward pass in backward: {it.forward_ms:.4g} ms more per "
            "iteration, included in backward_ms and every total (the per-layer rows show one forward each)"
        )
    memory = memory_warning(fp, hw)
    if memory is not None:
        warnings.append(memory)
    return warnings


def unsupported_warning(analysis: GraphAnalysis) -> str | None:
    """The warning of layers without a cost formula (left out of every total: the time is an undercount), None
    when every layer is costed. Predictions, batch summaries and job estimates say it alike."""
    if not analysis.unsupported:
        return None
    return (f"{analysis.unsupported_layer_count} layer(s) of op types "
            f"{', '.join(u.op_type for u in analysis.unsupported)} have no cost formula; totals exclude them")


def network_warning(request: PredictionCreate) -> str | None:
    """The warning of an assumed inter-node network (``nodes`` > 1 without both network fields: the default
    link of :func:`network_link`), None otherwise. Predictions, batch summaries and job estimates say it alike."""
    if request.nodes <= 1 or (request.inter_node_bandwidth_bytes_per_s is not None
                              and request.inter_node_latency_s is not None):
        return None
    net = network_link(request)
    assert net is not None
    return (f"{request.nodes} nodes: inter-node network assumed {net.bandwidth_bytes_per_s / 1e9:.3g} GB/s per "
            f"node and {net.step_latency_s * 1e6:.3g} us per step (default: one InfiniBand HDR 200 Gb/s NIC per "
            "node); give inter_node_bandwidth_bytes_per_s and inter_node_latency_s for yours")


def memory_warning(fp: MemoryFootprint, hw: HardwareSpec) -> str | None:
    """The warning of a peak ``fp`` (one device) over :data:`app.core.memory.HEADROOM` of ``hw``'s memory
    (GiB, one decimal), None when it fits: the one wording of predictions, batch summaries and job actuals."""
    if fits(fp, hw.memory_bytes):
        return None
    return (f"estimated peak {fp.total_bytes / 2**30:.1f} GiB exceeds {HEADROOM:.0%} of the device's "
            f"{hw.memory_bytes / 2**30:.1f} GiB")


def estimate(
    analysis: GraphAnalysis,
    hw: HardwareSpec,
    predictor: Predictor,
    *,
    request: PredictionCreate,
    graph_id: str | None,
    bound: graphs.BoundGraph | None = None,
    estimates: Estimates | None = None,
) -> PredictionRead:
    """Combine analytical costs (``analysis`` at the per-device batch) and per-layer predictions into the
    response (pure, no database).

    ``bound``: the cache entry of ``analysis`` (its layer table and memoised footprints are reused);
    ``estimates``: the supported layers' estimates when the caller predicted them already (the batch
    endpoint), else they come from :func:`memo_estimates` (the predictor is asked on the first request of a
    binding, device, precision, mode and optimizer only).

    Raises :class:`PrecisionNotSupportedError` (422) when ``hw`` lacks the requested precision,
    :class:`StackNotSupportedError` (422) for a GPU-only software stack on a CPU,
    :class:`TooManyDevicesPerNode` (422) for more than 8 devices in a node and
    :class:`NoInterconnect` (422) for several devices on hardware without an interconnect; ``ValueError`` when
    ``analysis`` was fused for another kind of device than ``hw`` (a caller's bug: what is fused depends on it).
    """
    if analysis.fusion_hardware_kind is not None and analysis.fusion_hardware_kind != hw.kind:
        raise ValueError(f"analysis fused for a {analysis.fusion_hardware_kind} answers a {hw.kind} device")
    precision = checked_precision(hw, request.precision)
    check_stack(hw, request.software_stack)
    check_devices_per_node(request)
    check_interconnect(hw, request)
    training = request.mode == "training"
    optimizer = request.optimizer if training else "none"
    if bound is None:
        bound = graphs.BoundGraph(key=None, analysis=analysis, graph_id=graph_id, nbytes=0)
    setting = Setting(hardware=hw, mode=request.mode, optimizer=optimizer, precision=precision,
                      software_stack=request.software_stack)
    table = bound.table(hw, training=training)  # a training step's table ends with the loss layer
    key: Hashable = None
    if estimates is None:
        key = estimates_key(predictor, setting, spec_fingerprint(hw))
        estimates, sums = memo_estimates(bound, predictor, setting, key=key)
    else:
        sums = sums_of(table, setting, estimates)
    _, methods = _layer_stats(analysis, estimates)
    rows: list[LayerPrediction] = []
    if request.detail == "layers":
        est = estimates

        def build_rows() -> list[LayerPrediction]:
            return _layer_rows(analysis, table, setting, est)

        # the rows are a pure function of the memoised estimates: memoised with them (shared, never mutated)
        rows = (build_rows() if key is None else
                bound.memo(("rows", key), build_rows, nbytes=LAYER_ROW_BYTES * len(analysis.graph.layers)))
    mem_opts = memory_options(request, precision, hw)
    fp = memo_footprint(bound, mem_opts)
    agg = aggregate(aggregation_input(request, hw, (), fp, training=training, sums=sums))
    loss = loss_ms(bound, training, estimates)
    gradient_bytes = fp.gradients_bytes if training and request.device_count > 1 else 0
    iteration, epoch, job = _totals_read(agg, request, hw, gradient_bytes=gradient_bytes, loss_ms=loss)
    memory = MemoryPrediction(
        precision=storage_precision(precision),
        activation_checkpointing=request.activation_checkpointing,
        weights_bytes=fp.weights_bytes,
        weight_copies_bytes=fp.weight_copies_bytes,
        gradients_bytes=fp.gradients_bytes,
        optimizer_state_bytes=fp.optimizer_state_bytes,
        activations_bytes=fp.activations_bytes,
        backward_transient_bytes=fp.backward_transient_bytes,
        runtime_bytes=fp.runtime_bytes,
        ddp_gradient_buckets_bytes=fp.ddp_gradient_buckets_bytes,
        total_bytes=fp.total_bytes,
        device_memory_bytes=hw.memory_bytes,
        usable_fraction=HEADROOM,
        fits=fits(fp, hw.memory_bytes),
        largest_batch_size_that_fits=memo_largest_batch(bound, mem_opts),
    )
    warnings = answer_warnings(analysis, hw, request, estimates=estimates, agg=agg, fp=fp, loss=loss)
    n_uns = analysis.unsupported_layer_count
    loss_row = _loss_row(bound, training, estimates)
    return PredictionRead(
        graph_id=graph_id,
        graph_name=analysis.graph.name,
        hardware_id=hw.id,
        hardware_name=hw.name,
        batch_size=request.batch_size,
        mode=request.mode,
        optimizer=optimizer,
        precision=precision,
        precision_semantics=PRECISION_SEMANTICS[precision],
        software_stack=request.software_stack,
        predictor_version=predictor.version,
        methods=dict(methods),
        layers=rows,
        unsupported=[
            UnsupportedLayers(op_type=u.op_type, count=u.count, layers=list(u.layers), reason=u.reason)
            for u in analysis.unsupported
        ],
        totals=Totals(
            layers=len(analysis.graph.layers),
            layers_costed=len(analysis.graph.layers) - n_uns,
            layers_unsupported=n_uns,
            params=analysis.params,
            forward_macs=analysis.forward_macs,
            forward_flops=analysis.forward_flops + (loss_row.forward_flops if loss_row else 0),
            backward_flops=(analysis.backward_flops + (loss_row.backward_flops if loss_row else 0)) if training else 0,
            loss=loss_row,
            totals_exclude_unsupported=n_uns > 0,
        ),
        iteration=iteration,
        epoch=epoch,
        job=job,
        memory=memory,
        warnings=warnings,
        assumptions={
            "iteration": "sum over layers of forward + backward + optimizer update on one device at the "
                         "per-device batch, no inter-layer overlap (in training the loss layer included: "
                         "loss_ms) + iteration_overhead_ms + the exposed "
                         "all-reduce; input loading (when loading_samples_per_s is given) is max'ed with that "
                         "when loading_overlapped, added otherwise (app/core/aggregate.py)",
            "data_parallel": _data_parallel_assumption(request, hw),
            "fusion": fusion_assumption(request.software_stack, hw.kind),
            "interval": "p10/p90 of the iteration are sums of per-layer p10/p90 (errors assumed correlated)",
            "backward": BACKWARD_SEMANTICS,
            "loss": ("training: a cross-entropy loss on the graph's first floating-point output (log-softmax over "
                     "its last axis + NLL, forward and backward), costed as a softmax layer over that tensor and "
                     "added to the layer sum as loss_ms; when the graph ends in its own Softmax/LogSoftmax (or in "
                     "views of its output), that layer is the loss's softmax and only NLL on its output is added "
                     "(no second softmax); the memory counts the same loss"
                     + loss_quality(bound, training, estimates) if training else
                     "inference: no loss computed"),
            "epoch": "ceil(dataset_size / batch_size) iterations (last partial batch counted as full) + "
                     "ceil(eval_size / batch_size) forward-only passes when eval_size is given; job = its whole "
                     "iterations (ceil(dataset_size / batch_size) per whole epoch, ceil(fraction x dataset_size / "
                     "batch_size) for a fraction of one, at least 1) + epochs x the epoch's evaluation + "
                     "floor(epochs / checkpoint_every_epochs) writes of weights + optimizer state at "
                     "checkpoint_write_bytes_per_s while every device waits; for whole epochs, epochs x epoch + "
                     "the writes",
            "energy": "ESTIMATE: per layer P = idle + (TDP - idle) x utilisation, utilisation = max(achieved "
                      "FLOP/s / peak, achieved bytes/s / memory bandwidth) (linear utilisation power model, "
                      "Fan et al. ISCA 2007); idle power for the rest of the step; idle = catalog idle_power_w "
                      f"or {IDLE_FRACTION_OF_TDP:.0%} of TDP; device energy only (no host, network, cooling/PUE)",
            "money": "ESTIMATE: device_hours x price_usd_per_hour, the request's price or the catalog's public "
                     "on-demand LIST price (price_source names offer and date); no discounts, storage or egress",
            "co2": "ESTIMATE: energy_kwh x the caller's grid_gco2_per_kwh (none given: not estimated)",
            "memory": "predicted peak of one step (app/core/memory.py): fp32 weights (in fp16/bf16 inference, "
                      "weights the graph stores in 16 bits at 2 bytes), gradients and optimizer state, "
                      "autocast's 16-bit weight copies under fp16/bf16, the tensors autograd saves per op "
                      "(fused attention keeps Q, K, V, O and the log-sum-exp), a cross-entropy loss on the "
                      "output, gradients in flight during backward, device context and workspace; fits = peak "
                      f"<= {HEADROOM:.0%} of device memory"
                      + ("; activation checkpointing: sqrt(layers) segments recomputed in backward"
                         if request.activation_checkpointing else "")
                      + (f"; {DDP_BUCKETS_ASSUMPTION}" if mem_opts["data_parallel"] else ""),
        },
    )
