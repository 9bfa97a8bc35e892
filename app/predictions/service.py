"""Prediction of per-layer, per-iteration, per-epoch and per-job cost.

Pipeline (DESIGN.md): graph → analytical costs → predictor per layer (learned where it applies, roofline
otherwise) → iteration = Σ layers (forward + backward + optimizer update); epoch = ⌈dataset/batch⌉ ×
iteration; job = epochs × epoch. Interval bounds of the iteration are the sums of the per-layer bounds
(errors of layers on one device are strongly correlated, so the comonotonic sum is the honest bound).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from sqlalchemy.orm import Session

from app.core.analysis import GraphAnalysis, analyze
from app.core.costs import LayerCost
from app.core.hardware import HardwareSpec
from app.core.ir import Layer
from app.core.memory import HEADROOM, fits, footprint, largest_batch_that_fits
from app.core.onnx_import import EVAL_EXPORT_WARNING
from app.core.precision import (
    PRECISION_SEMANTICS,
    Precision,
    PrecisionNotSupported,
    check_precision,
    cost_at_precision,
    op_precision,
    storage_precision,
)
from app.errors import PrecisionNotSupportedError
from app.graphs import service as graphs
from app.hardware import service as hardware_service
from app.predictions.schemas import (
    EpochPrediction,
    IterationPrediction,
    JobPrediction,
    LayerPrediction,
    MemoryPrediction,
    PredictionCreate,
    PredictionRead,
    Totals,
    UnsupportedLayers,
)
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, Predictor


def _roofline(
    layer: Layer, cost: LayerCost, hw: HardwareSpec, precision: Precision, training: bool
) -> tuple[float, str]:
    """Roofline time (ms) of the layer's forward (+ backward in training) at ``precision`` (the peak the op
    may use, bytes at the precision's storage types, direct-algorithm FLOPs) and what bounds it."""
    op = op_precision(hw, precision, layer.kind)
    c = cost_at_precision(layer, cost, precision)
    flops = c.forward_flops + (c.backward_flops if training else 0)
    nbytes = c.forward_bytes + (c.backward_bytes if training else 0)
    t_compute = flops / op.peak_flops_per_s
    t_memory = nbytes / hw.memory_bandwidth_bytes_per_s
    return max(t_compute, t_memory) * 1e3, ("compute" if t_compute >= t_memory else "memory")


def _checked_precision(hw: HardwareSpec, precision: Precision) -> Precision:
    """``precision`` if ``hw`` can run it; raises :class:`PrecisionNotSupportedError` (422) otherwise."""
    try:
        return check_precision(hw, precision)
    except PrecisionNotSupported as exc:
        raise PrecisionNotSupportedError(
            str(exc),
            detail={"hardware_id": hw.id, "precision": exc.precision.value, "missing_peak": exc.missing_peak,
                    "available_peaks": sorted(hw.peak_flops_per_s)},
        ) from exc


def predict(session: Session, predictor: Predictor, *, request: PredictionCreate) -> PredictionRead:
    """Predict the cost of ``request`` (see :class:`PredictionCreate`).

    Raises :class:`GraphNotFound`/:class:`HardwareNotFound` (404) for unknown ids,
    :class:`InvalidGraph`/:class:`UnboundDimension` (422) for graphs that cannot be imported at the
    requested binding, :class:`PrecisionNotSupportedError` (422) for a precision the device lacks.
    """
    if request.graph_id is not None:
        row = graphs.get_graph(session, graph_id=request.graph_id)
        graph = graphs.build_graph(
            row.content, row.source_format, batch_size=request.batch_size, dims=request.dims, name=row.name
        )
        graph_id: str | None = row.id
    else:
        assert request.graph is not None
        content = graphs.canonical_json(request.graph.model_dump())
        graph = graphs.build_graph(content, "json", batch_size=request.batch_size, dims=request.dims)
        graph_id = None
    if request.hardware_id is not None:
        hw = hardware_service.get_spec(session, hardware_id=request.hardware_id)
    else:
        assert request.hardware is not None
        hw = hardware_service.spec_from_inline(request.hardware)
    analysis = analyze(graph, software_stack=request.software_stack)
    return estimate(analysis, hw, predictor, request=request, graph_id=graph_id)


def estimate(
    analysis: GraphAnalysis,
    hw: HardwareSpec,
    predictor: Predictor,
    *,
    request: PredictionCreate,
    graph_id: str | None,
) -> PredictionRead:
    """Combine analytical costs and per-layer predictions into the response (pure, no database).

    Raises :class:`PrecisionNotSupportedError` (422) when ``hw`` lacks the requested precision.
    """
    precision = _checked_precision(hw, request.precision)
    training = request.mode == "training"
    optimizer = request.optimizer if training else "none"
    # an eval-mode export (BatchNorm folded or in inference form) only matters when training it
    warnings: list[str] = [
        w for w in analysis.graph.warnings if training or not w.startswith(EVAL_EXPORT_WARNING)
    ]
    layers = analysis.graph.layers
    queries = [
        LayerTimeQuery(layer=layer, cost=cost, hardware=hw, mode=request.mode, optimizer=optimizer,
                       precision=precision, software_stack=request.software_stack)
        for layer, cost in zip(layers, analysis.costs, strict=True)
        if cost.supported
    ]
    estimates = iter(predictor.estimate(queries))

    rows: list[LayerPrediction] = []
    fwd = bwd = upd = p10 = p90 = 0.0
    ood_layers = 0
    for i, (layer, cost) in enumerate(zip(layers, analysis.costs, strict=True)):
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
        roof_ms, bound = _roofline(layer, cost, hw, precision, training)
        total = e.forward_ms + e.backward_ms + e.update_ms
        fwd += e.forward_ms
        bwd += e.backward_ms
        upd += e.update_ms
        p10 += e.total_ms_p10
        p90 += e.total_ms_p90
        ood_layers += int(e.out_of_distribution)
        rows.append(LayerPrediction(
            **common, method=e.method, bound=bound, roofline_ms=roof_ms, forward_ms=e.forward_ms,
            backward_ms=e.backward_ms, update_ms=e.update_ms, total_ms=total, total_ms_p10=e.total_ms_p10,
            total_ms_p90=e.total_ms_p90, out_of_distribution=e.out_of_distribution,
            physics_floor_ms=e.physics_floor_ms, floor_clamped=e.floor_clamped,
        ))
    iteration_ms = fwd + bwd + upd
    if iteration_ms <= 0:
        # never a silent zero: a graph with nothing costable is an error the caller must see
        warnings.append("no layer of this graph could be costed; the iteration time is not meaningful")
    if analysis.unsupported:
        warnings.append(
            f"{analysis.unsupported_layer_count} layer(s) of op types "
            f"{', '.join(u.op_type for u in analysis.unsupported)} have no cost formula; totals exclude them"
        )
    if ood_layers:
        warnings.append(
            f"{ood_layers} layer(s) lie outside the learned predictor's training data (hardware or shape "
            "range); their intervals are wider"
        )
    methods = Counter(r.method for r in rows)
    iteration = IterationPrediction(
        time_ms=iteration_ms,
        time_ms_p10=p10,
        time_ms_p90=p90,
        forward_ms=fwd,
        backward_ms=bwd,
        update_ms=upd,
        samples_per_s=(request.batch_size / (iteration_ms / 1e3)) if iteration_ms > 0 else 0.0,
    )
    epoch = job = None
    if request.dataset_size is not None:
        iters = math.ceil(request.dataset_size / request.batch_size)
        epoch = EpochPrediction(
            dataset_size=request.dataset_size,
            iterations_per_epoch=iters,
            time_s=iters * iteration_ms / 1e3,
            time_s_p10=iters * p10 / 1e3,
            time_s_p90=iters * p90 / 1e3,
        )
        if request.epochs is not None:
            job = JobPrediction(
                epochs=request.epochs,
                time_s=request.epochs * epoch.time_s,
                time_s_p10=request.epochs * epoch.time_s_p10,
                time_s_p90=request.epochs * epoch.time_s_p90,
                time_h=request.epochs * epoch.time_s / 3600,
            )
    mem_opts: dict[str, Any] = {"mode": request.mode, "optimizer": optimizer,
                                "precision": storage_precision(precision), "hardware": hw,
                                "activation_checkpointing": request.activation_checkpointing}
    fp = footprint(analysis, **mem_opts)
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
        total_bytes=fp.total_bytes,
        device_memory_bytes=hw.memory_bytes,
        usable_fraction=HEADROOM,
        fits=fits(fp, hw.memory_bytes),
        largest_batch_size_that_fits=largest_batch_that_fits(analysis, memory_bytes=hw.memory_bytes, **mem_opts),
    )
    if request.activation_checkpointing:
        warnings.append(
            f"activation checkpointing recomputes the forward pass in backward: about {fwd:.1f} ms more per "
            "iteration, not included in the times above"
        )
    if not memory.fits:
        warnings.append(
            f"estimated peak {fp.total_bytes / 2**30:.1f} GiB exceeds {HEADROOM:.0%} of the device's "
            f"{hw.memory_bytes / 2**30:.1f} GiB"
        )
    n_uns = analysis.unsupported_layer_count
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
            layers=len(layers),
            layers_costed=len(layers) - n_uns,
            layers_unsupported=n_uns,
            params=analysis.params,
            forward_macs=analysis.forward_macs,
            forward_flops=analysis.forward_flops,
            backward_flops=analysis.backward_flops if training else 0,
            totals_exclude_unsupported=n_uns > 0,
        ),
        iteration=iteration,
        epoch=epoch,
        job=job,
        memory=memory,
        warnings=warnings,
        assumptions={
            "iteration": "sum over layers of forward + backward + optimizer update; no data loading, no "
                         "inter-layer overlap, single device",
            "fusion": "layers fused as the software stack fuses them (attention core, erf-GELU chains, bias "
                      "adds, and activation epilogues under compiled graphs); a fused layer keeps its members' "
                      "FLOPs and moves only its external tensors",
            "interval": "p10/p90 of the iteration are sums of per-layer p10/p90 (errors assumed correlated)",
            "epoch": "ceil(dataset_size / batch_size) iterations (last partial batch counted as full)",
            "memory": "predicted peak of one step (app/core/memory.py): fp32 weights, gradients and optimizer "
                      "state, autocast's 16-bit weight copies under fp16/bf16, the tensors autograd saves per op "
                      "(fused attention keeps Q, K, V, O and the log-sum-exp), a cross-entropy loss on the "
                      "output, gradients in flight during backward, device context and workspace; fits = peak "
                      f"<= {HEADROOM:.0%} of device memory"
                      + ("; activation checkpointing: sqrt(layers) segments recomputed in backward"
                         if request.activation_checkpointing else ""),
        },
    )
