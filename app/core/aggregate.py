"""From per-layer times to iteration, epoch and job time, energy and money: the one aggregation (pure).

Used by the prediction API, the comparison and job-estimate endpoints, the CLI and ``evaluate``. Times are
those of one device running its share of the global batch; every device runs the same step (data parallel).

Iteration (one training step or one inference batch)::

    compute  = Σ layers (forward + backward + update) + overhead_ms + exposed all-reduce
    input    = global_batch / loading rate                     (only when a loading rate is given)
    step     = max(compute, input)   if the input pipeline overlaps compute (DataLoader prefetch)
             = compute + input       otherwise

The all-reduce is a ring over ``device_count`` devices (hierarchical when they sit on several nodes), in
DDP buckets overlapped with backward (:mod:`app.core.collectives`). Scaling efficiency = step without
communication / step (weak scaling: the same per-device batch on one device needs no all-reduce).

Epoch = ⌈dataset / global batch⌉ steps (the last partial batch counted as full) + ⌈eval set / global
batch⌉ forward-only passes when an evaluation set is given (their loading is not counted). Job = its whole
training steps (:func:`job_iterations`: ⌈dataset / global batch⌉ per whole epoch, ⌈fraction × dataset /
global batch⌉ for a fraction of an epoch, at least one: a step that starts runs to its end) + epochs × the
epoch's evaluation + checkpoint writes (⌊epochs / every⌋ checkpoints of weights + optimizer state written at
a given bandwidth while the other devices wait); for whole epochs that is epochs × epoch. p10/p90 carry the
layers' p10/p90 sums through the same arithmetic.

Energy: Σ layer power × layer time + idle power × the rest of the step (:mod:`app.core.energy`), on every
device. Money: device-hours × a price per device-hour. CO2: kWh × a grid intensity. All are estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from app.core.collectives import DDP_BUCKET_BYTES, Link, Topology, bucketed_allreduce
from app.core.energy import J_PER_KWH


class InvalidAggregation(ValueError):
    """Inputs the aggregation cannot combine (e.g. a global batch not divisible by the device count)."""


@dataclass(frozen=True, slots=True)
class LayerTime:
    """One costed layer on one device at the per-device batch: predicted ms per pass, the layer's
    total p10/p90 (ms), and its estimated power (W; ``None`` when the device has no power figure)."""

    forward_ms: float
    backward_ms: float
    update_ms: float
    total_ms_p10: float
    total_ms_p90: float
    power_w: float | None = None

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.update_ms


@dataclass(frozen=True, slots=True)
class DataParallel:
    """``device_count`` devices, ``nodes`` nodes of ``device_count / nodes`` each: the devices of a node
    joined by ``link``, the nodes by ``network``; each device all-reduces ``gradient_bytes`` per step in
    buckets of ``bucket_bytes`` (DDP's 25 MiB by default; hierarchical over nodes,
    :mod:`app.core.collectives`)."""

    device_count: int
    gradient_bytes: float
    link: Link | None
    bucket_bytes: float = DDP_BUCKET_BYTES
    nodes: int = 1
    network: Link | None = None

    @property
    def devices_per_node(self) -> int:
        return self.device_count // self.nodes


@dataclass(frozen=True, slots=True)
class InputPipeline:
    """Data loading: ``samples_per_s`` the loader delivers in total (all devices together); ``overlapped``
    when it prefetches while the devices compute (PyTorch DataLoader with workers)."""

    samples_per_s: float
    overlapped: bool = True


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """A checkpoint of ``checkpoint_bytes`` (weights + optimizer state) every ``every_epochs`` epochs,
    written at ``write_bandwidth_bytes_per_s``."""

    checkpoint_bytes: float
    write_bandwidth_bytes_per_s: float
    every_epochs: float = 1.0


@dataclass(frozen=True, slots=True)
class LayerSums:
    """The layer sums of one step on one device (:func:`layer_sums`): forward, backward, update and the
    p10/p90 totals in ms; Σ power × time of the whole step and of the forward passes in J (``None`` when a
    layer has no power figure). They depend on the layer times only, so callers that aggregate many jobs
    of one scenario (same graph, per-device batch, device, precision, mode, optimizer, stack) compute them
    once and pass them in :attr:`AggregationInput.sums`."""

    forward_ms: float
    backward_ms: float
    update_ms: float
    total_ms_p10: float
    total_ms_p90: float
    energy_j: float | None
    forward_energy_j: float | None


def layer_sums(layers: Sequence[LayerTime]) -> LayerSums:
    """Sums of ``layers`` (in their order, so any caller gets bit-identical figures): :func:`layer_sums_of`
    of their columns."""
    powered = not any(layer.power_w is None for layer in layers)
    return layer_sums_of(
        forward_ms=[layer.forward_ms for layer in layers], backward_ms=[layer.backward_ms for layer in layers],
        update_ms=[layer.update_ms for layer in layers], total_ms_p10=[layer.total_ms_p10 for layer in layers],
        total_ms_p90=[layer.total_ms_p90 for layer in layers],
        power_w=[layer.power_w for layer in layers] if powered else None)  # type: ignore[misc]  # fmt: skip


def layer_sums_of(
    *,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    update_ms: Sequence[float],
    total_ms_p10: Sequence[float],
    total_ms_p90: Sequence[float],
    power_w: Sequence[float] | None,
) -> LayerSums:
    """:class:`LayerSums` of layer columns (``[N]`` each: ms per pass, p10/p90 totals in ms, power in W or
    ``None`` when a layer has none), without a :class:`LayerTime` per layer: each column summed left to
    right as Python floats (``sum``), energy as Σ power × (forward + backward + update) / 1e3 J, so the
    figures are those of summing the layers one by one, bit for bit (the per-layer energies are float64 numpy
    element-wise, the same IEEE operations in the same order as Python floats; ``ValueError`` when the columns
    differ in length)."""
    energy_j = forward_energy_j = None
    if power_w is not None:
        p, f, b, u = (np.asarray(c, dtype=np.float64) for c in (power_w, forward_ms, backward_ms, update_ms))
        if not len(p) == len(f) == len(b) == len(u):
            raise ValueError("power_w, forward_ms, backward_ms and update_ms differ in length")
        energy_j = sum((p * ((f + b) + u) / 1e3).tolist())
        forward_energy_j = sum((p * f / 1e3).tolist())
    return LayerSums(forward_ms=sum(forward_ms), backward_ms=sum(backward_ms), update_ms=sum(update_ms),
                     total_ms_p10=sum(total_ms_p10), total_ms_p90=sum(total_ms_p90), energy_j=energy_j,
                     forward_energy_j=forward_energy_j)  # fmt: skip


def with_recompute(sums: LayerSums) -> LayerSums:
    """``sums`` of a training step under activation checkpointing (torch.utils.checkpoint): backward runs
    every segment's forward again before its own backward, so ``backward_ms`` gains ``forward_ms``, the step's
    p10/p90 grow in proportion to its total, and the energy gains the forward's (``forward_energy_j``, kept as
    one forward: evaluation passes are not recomputed)."""
    total = sums.forward_ms + sums.backward_ms + sums.update_ms
    scale = (total + sums.forward_ms) / total if total > 0 else 1.0
    energy = (None if sums.energy_j is None or sums.forward_energy_j is None
              else sums.energy_j + sums.forward_energy_j)
    return replace(sums, backward_ms=sums.backward_ms + sums.forward_ms, total_ms_p10=sums.total_ms_p10 * scale,
                   total_ms_p90=sums.total_ms_p90 * scale, energy_j=energy)


@dataclass(frozen=True, slots=True)
class AggregationInput:
    """Everything the aggregation needs. ``global_batch_size`` is split evenly over the devices
    (``layers`` are timed at the per-device batch). ``dataset_size``/``eval_size`` in samples; ``epochs``
    needs ``dataset_size``. ``idle_power_w`` (W per device) is needed for energy; ``price_usd_per_hour``
    (per device-hour) for money; ``grid_gco2_per_kwh`` for CO2."""

    layers: Sequence[LayerTime]
    global_batch_size: int
    overhead_ms: float = 0.0
    data_parallel: DataParallel | None = None
    input_pipeline: InputPipeline | None = None
    dataset_size: int | None = None
    eval_size: int | None = None
    epochs: float | None = None
    checkpointing: Checkpointing | None = None
    idle_power_w: float | None = None
    price_usd_per_hour: float | None = None
    grid_gco2_per_kwh: float | None = None
    sums: LayerSums | None = None


@dataclass(frozen=True, slots=True)
class IterationEstimate:
    """One step on every device. ``compute_ms`` = layers + overhead + exposed all-reduce; ``time_ms`` adds
    the input stall; ``energy_j`` is summed over all devices (``None`` without power figures)."""

    device_count: int
    per_device_batch_size: int
    forward_ms: float
    backward_ms: float
    update_ms: float
    layers_ms: float
    overhead_ms: float
    allreduce_ms: float
    allreduce_exposed_ms: float
    allreduce_buckets: int
    input_ms: float
    input_exposed_ms: float
    time_ms: float
    time_ms_p10: float
    time_ms_p90: float
    samples_per_s: float
    scaling_efficiency: float
    energy_j: float | None


@dataclass(frozen=True, slots=True)
class EpochEstimate:
    dataset_size: int
    iterations: int
    train_s: float
    eval_size: int | None
    eval_iterations: int
    eval_s: float
    time_s: float
    time_s_p10: float
    time_s_p90: float
    energy_j: float | None
    eval_energy_j: float | None = None  # the evaluation's share of energy_j


@dataclass(frozen=True, slots=True)
class JobEstimate:
    epochs: float
    iterations: int  # training steps of the whole job (job_iterations)
    checkpoints: int
    checkpoint_bytes: float
    checkpoint_s: float
    time_s: float
    time_s_p10: float
    time_s_p90: float
    time_h: float
    device_hours: float
    energy_j: float | None
    energy_kwh: float | None
    cost_usd: float | None
    co2_kg: float | None


@dataclass(frozen=True, slots=True)
class Aggregate:
    iteration: IterationEstimate
    epoch: EpochEstimate | None
    job: JobEstimate | None


def per_device_batch(global_batch_size: int, device_count: int) -> int:
    """``global_batch_size / device_count``; raises :class:`InvalidAggregation` unless it divides evenly."""
    if device_count < 1:
        raise InvalidAggregation(f"device_count must be at least 1, got {device_count}")
    if global_batch_size % device_count:
        raise InvalidAggregation(
            f"global batch {global_batch_size} does not divide evenly over {device_count} devices"
        )
    return global_batch_size // device_count


def _check(inp: AggregationInput) -> None:
    if inp.epochs is not None and inp.dataset_size is None:
        raise InvalidAggregation("epochs need a dataset_size")
    if inp.eval_size is not None and inp.dataset_size is None:
        raise InvalidAggregation("an eval_size needs a dataset_size")
    dp = inp.data_parallel
    if dp is not None:
        if dp.nodes < 1 or dp.device_count % dp.nodes:
            raise InvalidAggregation(f"{dp.device_count} devices do not spread evenly over {dp.nodes} node(s)")
        if dp.devices_per_node > 1 and dp.link is None:
            raise InvalidAggregation(f"{dp.devices_per_node} devices in a node need an interconnect (link "
                                     "bandwidth and latency)")
        if dp.nodes > 1 and dp.network is None:
            raise InvalidAggregation(f"{dp.nodes} nodes need a network (bandwidth and latency)")
    for name in ("overhead_ms",):
        if getattr(inp, name) < 0:
            raise InvalidAggregation(f"{name} must not be negative")


def aggregate(inp: AggregationInput) -> Aggregate:
    """Iteration, epoch and job estimates of ``inp`` (module docstring for the formulas).

    Raises :class:`InvalidAggregation` for a global batch not divisible by the device count, several
    devices without a link, epochs or an eval set without a dataset size, a negative overhead.
    """
    _check(inp)
    n = inp.data_parallel.device_count if inp.data_parallel is not None else 1
    local_batch = per_device_batch(inp.global_batch_size, n)
    sums = inp.sums if inp.sums is not None else layer_sums(inp.layers)
    fwd, bwd, upd = sums.forward_ms, sums.backward_ms, sums.update_ms
    layers_ms = fwd + bwd + upd
    p10, p90 = sums.total_ms_p10, sums.total_ms_p90

    dp = inp.data_parallel
    if dp is not None and n > 1:
        topology = Topology(nodes=dp.nodes, devices_per_node=dp.devices_per_node, intra=dp.link, network=dp.network)
        ar = bucketed_allreduce(dp.gradient_bytes, topology, backward_ms=bwd, bucket_bytes=dp.bucket_bytes)
        ar_total, ar_exposed, buckets = ar.total_ms, ar.exposed_ms, ar.buckets
    else:
        ar_total = ar_exposed = 0.0
        buckets = 0
    input_ms = (inp.global_batch_size / inp.input_pipeline.samples_per_s * 1e3
                if inp.input_pipeline is not None else 0.0)
    overlapped = inp.input_pipeline is None or inp.input_pipeline.overlapped

    def step(layers_total_ms: float) -> float:
        compute = layers_total_ms + inp.overhead_ms + ar_exposed
        return max(compute, input_ms) if overlapped else compute + input_ms

    time_ms = step(layers_ms)
    no_comm_ms = time_ms - ar_exposed if not overlapped else max(layers_ms + inp.overhead_ms, input_ms)
    energy_layers = sums.energy_j
    energy_j = None
    if energy_layers is not None and inp.idle_power_w is not None:
        energy_j = n * (energy_layers + inp.idle_power_w * max(time_ms - layers_ms, 0.0) / 1e3)
    iteration = IterationEstimate(
        device_count=n, per_device_batch_size=local_batch, forward_ms=fwd, backward_ms=bwd, update_ms=upd,
        layers_ms=layers_ms, overhead_ms=inp.overhead_ms, allreduce_ms=ar_total, allreduce_exposed_ms=ar_exposed,
        allreduce_buckets=buckets, input_ms=input_ms, input_exposed_ms=time_ms - (layers_ms + inp.overhead_ms
                                                                                 + ar_exposed),
        time_ms=time_ms, time_ms_p10=step(p10), time_ms_p90=step(p90),
        samples_per_s=inp.global_batch_size / (time_ms / 1e3) if time_ms > 0 else 0.0,
        scaling_efficiency=no_comm_ms / time_ms if time_ms > 0 else 1.0,
        energy_j=energy_j,
    )
    epoch = _epoch(inp, iteration, n, sums.forward_energy_j)
    job = _job(inp, iteration, epoch, n) if epoch is not None and inp.epochs is not None else None
    return Aggregate(iteration=iteration, epoch=epoch, job=job)


def _epoch(inp: AggregationInput, it: IterationEstimate, n: int, fwd_energy: float | None) -> EpochEstimate | None:
    if inp.dataset_size is None:
        return None
    iters = math.ceil(inp.dataset_size / inp.global_batch_size)
    eval_iters = math.ceil(inp.eval_size / inp.global_batch_size) if inp.eval_size else 0
    eval_pass_ms = it.forward_ms + inp.overhead_ms
    eval_s = eval_iters * eval_pass_ms / 1e3
    energy = eval_energy_j = None
    if it.energy_j is not None and fwd_energy is not None and inp.idle_power_w is not None:
        eval_energy_j = eval_iters * n * (fwd_energy + inp.idle_power_w * inp.overhead_ms / 1e3)
        energy = iters * it.energy_j + eval_energy_j
    return EpochEstimate(
        dataset_size=inp.dataset_size, iterations=iters, train_s=iters * it.time_ms / 1e3, eval_size=inp.eval_size,
        eval_iterations=eval_iters, eval_s=eval_s, time_s=iters * it.time_ms / 1e3 + eval_s,
        time_s_p10=iters * it.time_ms_p10 / 1e3 + eval_s, time_s_p90=iters * it.time_ms_p90 / 1e3 + eval_s,
        energy_j=energy, eval_energy_j=eval_energy_j,
    )


#: Relative slack of :func:`job_iterations`' rounding up: ``epochs × dataset / batch`` within this of a whole
#: number is that number (1.01 epochs of 100 samples in batches of 1 are 101 steps, not the 102 that the float
#: 0.01 × 100 = 1.0000000000000009 would round up to).
_WHOLE_SLACK = 1e-9


def job_iterations(*, epochs: float, dataset_size: int, global_batch_size: int) -> int:
    """Training steps of a job of ``epochs`` (> 0) over ``dataset_size`` samples in batches of
    ``global_batch_size``: ⌈dataset / batch⌉ per whole epoch (the epoch's count: its last, partial batch is a
    step) plus ⌈fraction × dataset / batch⌉ for the fraction of an epoch left (its last partial step runs
    too), at least 1: a job never runs less than the one step it starts. Whole epochs keep ``epochs ×
    ⌈dataset / batch⌉``; a quantity within :data:`_WHOLE_SLACK` (relative) of a whole number is not rounded up
    past it."""
    whole = math.floor(epochs)
    part = (epochs - whole) * dataset_size / global_batch_size
    nearest = round(part)
    slack = _WHOLE_SLACK * max(1.0, epochs * dataset_size / global_batch_size)
    rest = nearest if abs(part - nearest) <= slack else math.ceil(part)
    return max(1, whole * math.ceil(dataset_size / global_batch_size) + rest)


def _job(inp: AggregationInput, it: IterationEstimate, ep: EpochEstimate, n: int) -> JobEstimate:
    assert inp.epochs is not None
    ck = inp.checkpointing
    count = math.floor(inp.epochs / ck.every_epochs + 1e-9) if ck is not None else 0
    ck_bytes = ck.checkpoint_bytes if ck is not None else 0.0
    ck_s = count * ck_bytes / ck.write_bandwidth_bytes_per_s if ck is not None else 0.0
    steps = job_iterations(epochs=inp.epochs, dataset_size=ep.dataset_size, global_batch_size=inp.global_batch_size)
    eval_s = inp.epochs * ep.eval_s  # evaluation per epoch, in proportion to the epochs

    def total_s(step_ms: float) -> float:
        return steps * step_ms / 1e3 + eval_s + ck_s

    time_s = total_s(it.time_ms)
    energy = None
    if it.energy_j is not None and ep.eval_energy_j is not None and inp.idle_power_w is not None:
        energy = steps * it.energy_j + inp.epochs * ep.eval_energy_j + n * inp.idle_power_w * ck_s
    device_hours = n * time_s / 3600
    return JobEstimate(
        epochs=inp.epochs, iterations=steps, checkpoints=count, checkpoint_bytes=ck_bytes, checkpoint_s=ck_s,
        time_s=time_s, time_s_p10=total_s(it.time_ms_p10), time_s_p90=total_s(it.time_ms_p90),
        time_h=time_s / 3600, device_hours=device_hours, energy_j=energy,
        energy_kwh=energy / J_PER_KWH if energy is not None else None,
        cost_usd=device_hours * inp.price_usd_per_hour if inp.price_usd_per_hour is not None else None,
        co2_kg=(energy / J_PER_KWH * inp.grid_gco2_per_kwh / 1e3
                if energy is not None and inp.grid_gco2_per_kwh is not None else None),
    )
