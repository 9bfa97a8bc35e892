"""Physical plausibility of a reported measurement: what a client says it measured must be a time the
device could have taken, or it would poison retraining (issue 11: 1e-12 ms and 1e300 ms were accepted).

Three bounds; :func:`check_plausible` raises :class:`ImplausibleMeasurement` (``detail.reason`` names the
bound), which ``POST /v1/measurements`` reports as row code ``implausible_measurement`` of its 422
``invalid_measurements`` (nothing of the batch is stored):

* ``below_minimum``: under :data:`MIN_TIME_MS` (100 ns). No timed piece of device work completes faster:
  a CUDA kernel launch alone costs ~2-5 µs, a CPU timer call tens of ns.
* ``above_maximum``: over :data:`MAX_TIME_MS` of its granularity (a kernel or layer over an hour, an
  iteration over a day, a job over a year): no benchmark or scheduler reports such a thing by design,
  while an overflowed or unit-confused value does.
* ``below_physics_floor``: a layer in the JSON layer vocabulary (``config`` ``{"input_shape", "layer"}``) or
  an importers' shape record (:data:`SHAPE_RECORD_KINDS`, rebuilt by
  :func:`app.core.shape_records.shape_record_layer`), granularity ``kernel`` or ``layer``, timed under
  :data:`FLOOR_TOLERANCE` × its roofline floor on the device (:func:`app.core.precision.physics_floor_ms`:
  the cheapest algorithm's FLOPs at the peak of the precision, or its DRAM bytes at the datasheet bandwidth,
  whichever is slower). The tolerance is 0.2,
  not 1, because real measurements do beat that floor: its byte term counts DRAM traffic while a working
  set that fits in L2 (40 MB on an A100) is read at 2-3x DRAM bandwidth, boost clocks run above the
  datasheet clock, and cuDNN's FFT convolutions do fewer FLOPs than the cheapest algorithm the cost model
  knows. Measured on every row of the public data sets with a floor (``../shared/data``, 2026-12-03: all
  250,000 Justus rows, 95,868 NeuSight, 102,270 Vidur, 779 DeepBench): the smallest time/floor ratios were
  0.219 and 0.220, two 7x7 Justus forward convolutions on a P100 (2.25 ms for a 10.3 ms floor, an FFT
  algorithm), then 0.258 and 0.271 (also 7x7 P100 convolutions); no other source went under 0.56. The first
  tolerance, 0.25, was set from 19,400 of these rows (smallest 0.32) and refused those two. A factor of 5
  below the floor is refused; the issue's poisoned model was 18x too fast. The shape records' own smallest
  ratios (every public row, 2026-12-03): Vidur element-wise 0.56 and RoPE 0.67 (A40, L2-resident tensors),
  DeepBench GEMM 0.94 (GTX 1080 Ti), NeuSight batched matmul 1.09 and element-wise 1.17 (A100 PCIe).
  A CPU without 16-bit arithmetic that runs bf16/fp16 autocast in software is held to the fp32 floor.
  Configs in other vocabularies (the profiler's ``graph``/``shapes``, whole models, jobs) and precisions or
  passes without a floor (``fp8``, ``backward_input``) get only the first two bounds.

Two more checks of the same code (:func:`check_spread`, :func:`check_measured_at`), on the fields around
the time (issue: ``time_ms_std`` 1e300 and ``measured_at`` in the year 2999 were stored):

* ``spread_above_maximum`` (field ``time_ms_std``): every repetition is itself a time of the row's
  granularity, so none is above :data:`MAX_TIME_MS` ``M``; the sample standard deviation of ``n`` values in
  ``[0, M]`` is at most ``(M / 2) * sqrt(n / (n - 1))`` (Popoviciu's bound on the variance, ``(M - 0)² / 4``,
  times Bessel's ``n / (n - 1)``), ``M / sqrt(2)`` at worst (``n = 2``, used when ``repetitions`` is not
  given). A bound relative to the median is not used: real profiler rows have a std up to 328x their median
  (one preempted repetition of 11 at a few ms over a 4 µs median; ``/work/coord/m.db``, 2026-12-02).
* ``spread_of_one_sample`` (field ``time_ms_std``): a std above 0 from ``repetitions`` 1.
* ``measured_in_future`` (field ``measured_at``): later than the server's clock plus :data:`MAX_CLOCK_SKEW`.

One rule set: :func:`field_problems` runs every check of a row, these and the device's (a precision it has no
arithmetic for, a GPU-only stack on a CPU) and the graph's (an iteration or job row's ``config.graph_id``),
and is what ``POST /v1/measurements``, ``layercast import`` and ``POST /v1/job-estimates/actuals`` (whose
actuals are stored as job rows) apply to each row.

Before any bound, :func:`check_layer_config` refuses (:class:`InvalidLayerConfig`, row code
``invalid_layer_config``) a row that claims to be a layer it cannot be: an ``op_kind`` that is no cost
family (:class:`app.core.ir.OpKind`) nor ``iteration``/``job`` nor a collective (``allreduce``,
``send_recv``); a shape record of the importers (:data:`SHAPE_RECORD_KINDS`: DeepBench's bare GEMM,
NeuSight's batched matmul, Vidur's element-wise ops, RoPE and collectives, a ``layer`` without
``input_shape``) labelled with another ``op_kind``; or a JSON-vocabulary config (any other ``layer``) that
does not import into a layer (``"op": "linearr"``, ``"out_features": -3``, no ``input_shape``; a declared
input size such as ``in_features``/``in_channels`` that disagrees with its ``input_shape`` is the importer's
own refusal, :data:`app.core.json_import.DECLARED_INPUT_SIZES`, reported under field ``config.layer.<field>``),
or whose kind is not its ``op_kind``. Such rows used to skip the floor (no layer, no floor) and be stored,
feeding retraining with times of layers that do not exist.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from app.core.costs import layer_cost
from app.core.hardware import HardwareSpec
from app.core.ir import Layer, OpKind
from app.core.json_import import DECLARED_SIZE_FIELDS, import_json
from app.core.limits import Limits, current_limits
from app.core.precision import Precision, PrecisionNotSupported, check_precision, physics_floor_ms
from app.core.shape_records import COLLECTIVE_OPS, shape_record_layer
from app.core.vocab import Granularity, stack_runs_on
from app.errors import InvalidGraph, LayercastError
from app.measurements.importers import MeasurementRecord

#: Shortest time accepted, ms (100 ns; module doc).
MIN_TIME_MS = 1e-4
#: Longest time accepted per granularity, ms: 1 h for a kernel or a layer, 1 day for an iteration,
#: 365 days for a job.
MAX_TIME_MS: dict[Granularity, float] = {
    Granularity.KERNEL: 3.6e6,
    Granularity.LAYER: 3.6e6,
    Granularity.ITERATION: 8.64e7,
    Granularity.JOB: 3.1536e10,
}
#: A layer time under this fraction of its roofline floor is refused (module doc).
FLOOR_TOLERANCE = 0.2
#: How far past the server's clock a reported ``measured_at`` may be: a client's clock that drifts, or a
#: batch uploaded while its last rows were being timed; a later date is a wrong date (2999, a swapped
#: day and month), not skew. The aware datetime carries its zone, so zones need no allowance.
MAX_CLOCK_SKEW = timedelta(days=1)
#: The earliest ``measured_at`` taken: no GPU kernel was timed by a deep-learning framework before CUDA (2007);
#: an earlier date is a default left in (1970-01-01, the Unix epoch), not a measurement's date.
EARLIEST_MEASURED_AT = datetime(2000, 1, 1, tzinfo=UTC)

_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}


class ImplausibleMeasurement(LayercastError):
    """A reported time the device cannot have taken (module doc); ``detail.reason`` says which bound."""

    status_code = 422
    code = "implausible_measurement"


class InvalidLayerConfig(LayercastError):
    """A measurement row's ``op_kind`` or JSON-vocabulary ``config`` is not a layer (module doc);
    ``detail.field`` names the field at fault (``op_kind``, ``config.layer``, ``config.layer.in_features``...)."""

    status_code = 422
    code = "invalid_layer_config"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, detail={"field": field})
        self.field = field


#: ``op_kind`` values a measurement may carry besides the cost families of :class:`OpKind`: whole models, and
#: the collectives the importers store (DeepBench's and Vidur's NCCL all-reduce, Vidur's send/receive), which
#: are no layer but are timed as kernels.
WHOLE_KINDS = frozenset({"iteration", "job"})
COLLECTIVE_KINDS = frozenset({"allreduce", "send_recv"})
#: The cost families of :class:`OpKind` (every kind but ``unsupported``).
LAYER_KINDS = frozenset(k.value for k in OpKind if k is not OpKind.UNSUPPORTED)
#: The importers' shape records (``app.measurements.importers`` module doc): ``{"layer": {"op": ...}}`` without
#: ``input_shape``, for work the JSON layer vocabulary does not express (DeepBench's bare GEMM ``m``/``n``/``k``,
#: NeuSight's batched ``matmul`` ``a``/``b``, Vidur's ``elementwise`` and ``rope``, the collectives), by op →
#: the ``op_kind`` values each may carry. Rebuilt with :func:`app.core.shape_records.shape_record_layer`: a
#: record no layer can be is refused, the others get the physics floor (collectives only the time bounds).
SHAPE_RECORD_KINDS: dict[str, frozenset[str]] = {
    "matmul": frozenset({"gemm", "matmul"}),
    "elementwise": frozenset({"elementwise"}),
    "rope": frozenset({"elementwise"}),
    "allreduce": frozenset({"allreduce"}),
    "send_recv": frozenset({"send_recv"}),
}


def check_granularity(*, op_kind: str, granularity: Granularity | str) -> None:
    """Raise :class:`InvalidLayerConfig` (422, field ``granularity``) when ``granularity`` contradicts
    ``op_kind``: a cost family is timed as a ``kernel`` or a ``layer``, ``iteration`` as an iteration, ``job``
    as a job. A ``gemm`` row sent as granularity ``job`` took a job's bound (a year) instead of a layer's
    (an hour), and an ``iteration`` row sent as ``layer`` was trained on as a layer."""
    value = Granularity(granularity).value
    expected = {"iteration": {"iteration"}, "job": {"job"}}.get(op_kind, {"kernel", "layer"})
    if value not in expected:
        raise InvalidLayerConfig(
            f"granularity {value!r} contradicts op_kind {op_kind!r}, which is timed as "
            f"{' or '.join(repr(e) for e in sorted(expected))}", field="granularity")


def check_layer_config(*, op_kind: str, config: dict[str, Any], batch_size: int) -> None:
    """Raise :class:`InvalidLayerConfig` (422) when ``op_kind`` is no cost family nor one of
    :data:`WHOLE_KINDS`/:data:`COLLECTIVE_KINDS`, when ``config`` is a shape record
    (:data:`SHAPE_RECORD_KINDS`) of another kind than ``op_kind``, or when ``config`` is in the JSON layer
    vocabulary (any other ``layer``) but does not import into a layer of kind ``op_kind``: field
    ``config.layer.<field>`` when the importer refuses a declared input size
    (:data:`app.core.json_import.DECLARED_SIZE_FIELDS`: ``in_features``, ``in_channels``... that disagree with
    ``input_shape``), else ``config.layer``. Configs of other vocabularies (no ``layer``) are not checked here."""
    if op_kind not in LAYER_KINDS and op_kind not in WHOLE_KINDS and op_kind not in COLLECTIVE_KINDS:
        raise InvalidLayerConfig(
            f"op_kind {op_kind!r} is not a cost family ({', '.join(sorted(LAYER_KINDS))}) nor one of "
            f"{', '.join(sorted(WHOLE_KINDS | COLLECTIVE_KINDS))}", field="op_kind")
    if "layer" not in config:
        return
    layer_spec = config["layer"]
    if not isinstance(layer_spec, dict):
        raise InvalidLayerConfig("config.layer must be an object in the JSON layer vocabulary", field="config.layer")
    op = layer_spec.get("op")
    shape_kinds = SHAPE_RECORD_KINDS.get(op) if isinstance(op, str) and "input_shape" not in config else None
    if shape_kinds is not None:
        if op_kind not in shape_kinds:
            raise InvalidLayerConfig(
                f"op_kind {op_kind!r} is not the kind of a {op!r} shape record "
                f"({' or '.join(sorted(shape_kinds))})", field="op_kind")
        try:
            built = shape_record_layer(layer_spec, "float32")
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidLayerConfig(f"config.layer is no {op!r} shape record: {exc}", field="config.layer") from exc
        if built is None and op not in COLLECTIVE_OPS:
            raise InvalidLayerConfig(f"config.layer is no {op!r} shape record this service can cost "
                                     f"(fn {layer_spec.get('fn')!r})", field="config.layer")
        return
    if "input_shape" not in config:
        raise InvalidLayerConfig("config.layer needs config.input_shape (one sample, no batch axis)",
                                 field="config.input_shape")
    try:
        layers = _rebuilt_layers(config, batch_size=batch_size)
    except (LayercastError, KeyError, TypeError, ValueError) as exc:
        message = exc.message if isinstance(exc, LayercastError) else str(exc)
        bad = exc.detail.get("field") if isinstance(exc, InvalidGraph) else None
        field = f"config.layer.{bad}" if bad in DECLARED_SIZE_FIELDS else "config.layer"
        raise InvalidLayerConfig(f"config does not import as a layer: {message}", field=field) from exc
    if not layers:
        raise InvalidLayerConfig("config.layer imports as no layer", field="config.layer")
    first = layers[0]
    if op_kind not in WHOLE_KINDS and all(layer.kind.value != op_kind for layer in layers):
        raise InvalidLayerConfig(f"op_kind {op_kind!r} is not the kind of config.layer ({first.kind.value})",
                                 field="op_kind")


#: Rebuilt measurement layers remembered per process: a source repeats each configuration for every device,
#: pass and optimizer, and every row is rebuilt twice (:func:`check_layer_config`, then :func:`floor_ms`).
REBUILT_CACHE_SIZE = 4096


def _rebuilt_layers(config: dict[str, Any], *, batch_size: int, dtype: str = "float32") -> list[Layer]:
    """The layers of a JSON-vocabulary measurement ``config`` (``input_shape`` + one ``layer``) at ``batch_size``
    with ``dtype`` inputs; raises what :func:`app.core.json_import.import_json` raises for one that is no layer.

    Remembered (the last :data:`REBUILT_CACHE_SIZE` successful rebuilds) per (config, batch, dtype and the
    active :class:`app.core.limits.Limits`): layers are frozen, and a config refused under one set of limits
    is rebuilt, and refused, again under any other. A config that is not JSON-serialisable is rebuilt uncached.
    """
    try:
        text = json.dumps([config["input_shape"], config["layer"]], sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return _rebuild(config, batch_size, dtype)
    return list(_rebuilt_cached(text, batch_size, dtype, current_limits()))


@functools.lru_cache(maxsize=REBUILT_CACHE_SIZE)
def _rebuilt_cached(text: str, batch_size: int, dtype: str, limits: Limits) -> tuple[Layer, ...]:
    input_shape, layer = json.loads(text)
    return tuple(_rebuild({"input_shape": input_shape, "layer": layer}, batch_size, dtype))


def _rebuild(config: dict[str, Any], batch_size: int, dtype: str) -> list[Layer]:
    doc = {"input_shape": config["input_shape"], "input_dtype": dtype, "layers": [config["layer"]]}
    return list(import_json(doc, batch_size=batch_size).layers)


def floor_ms(*, config: dict[str, Any], batch_size: int, spec: HardwareSpec, precision: str, pass_: str,
             optimizer: str = "none") -> float | None:  # fmt: skip
    """The roofline floor (ms) of a JSON-vocabulary layer ``config`` on ``spec``, or None when the config
    does not rebuild into exactly one layer or the precision/pass has no floor."""
    if not isinstance(config.get("layer"), dict):
        return None
    if spec.kind == "cpu" and precision in CPU_AUTOCAST_MODES and precision not in spec.peak_flops_per_s:
        # autocast in software on a CPU without 16-bit arithmetic: no faster than the fp32 arithmetic, and at
        # least half the fp32 bytes, which FLOOR_TOLERANCE's factor 5 leaves room for (it had no floor at all)
        precision = Precision.FP32.value
    try:
        dtype = _DTYPE.get(precision, "float32")
        if "input_shape" in config:
            layers = _rebuilt_layers(config, batch_size=batch_size, dtype=dtype)
        else:  # a shape record (its shapes are absolute: no batch axis to bind)
            built = shape_record_layer(config["layer"], dtype)
            layers = [] if built is None else [built]
        if len(layers) != 1:
            return None
        return physics_floor_ms(layers[0], layer_cost(layers[0]), spec, precision, pass_, optimizer=optimizer)
    except (LayercastError, KeyError, TypeError, ValueError):  # not a layer we can cost: no floor
        return None


def check_plausible(*, time_ms: float, granularity: Granularity | str, config: dict[str, Any], batch_size: int,
                    spec: HardwareSpec, precision: str, pass_: str, optimizer: str = "none") -> None:  # fmt: skip
    """Raise :class:`ImplausibleMeasurement` (422) when ``time_ms`` breaks a bound of the module doc."""
    gran = Granularity(granularity)
    detail: dict[str, Any] = {"time_ms": time_ms, "hardware_id": spec.id}
    if time_ms < MIN_TIME_MS:
        raise ImplausibleMeasurement(
            f"time_ms_median {time_ms:g} ms is below {MIN_TIME_MS:g} ms: no timed device work is that short",
            detail={**detail, "reason": "below_minimum", "min_ms": MIN_TIME_MS})
    if time_ms > MAX_TIME_MS[gran]:
        raise ImplausibleMeasurement(
            f"time_ms_median {time_ms:g} ms is above {MAX_TIME_MS[gran]:g} ms, the bound for a {gran.value}",
            detail={**detail, "reason": "above_maximum", "max_ms": MAX_TIME_MS[gran]})
    if gran not in (Granularity.KERNEL, Granularity.LAYER):
        return
    floor = floor_ms(config=config, batch_size=batch_size, spec=spec, precision=precision, pass_=pass_,
                     optimizer=optimizer)  # fmt: skip
    if floor is not None and time_ms < FLOOR_TOLERANCE * floor:
        raise ImplausibleMeasurement(
            f"time_ms_median {time_ms:g} ms is below the roofline floor of this layer on {spec.id} "
            f"({floor:.4g} ms; at most a factor {1 / FLOOR_TOLERANCE:g} below it is accepted)",
            detail={**detail, "reason": "below_physics_floor", "floor_ms": floor, "tolerance": FLOOR_TOLERANCE})


def max_std_ms(*, granularity: Granularity | str, repetitions: int | None) -> float:
    """Largest sample standard deviation (ms) of ``repetitions`` times of ``granularity`` that are each
    within :data:`MAX_TIME_MS` (module doc: Popoviciu's bound with Bessel's correction; ``n = 2`` when
    ``repetitions`` is unknown)."""
    n = repetitions if repetitions is not None and repetitions >= 2 else 2
    return MAX_TIME_MS[Granularity(granularity)] / 2 * math.sqrt(n / (n - 1))


def check_spread(*, time_ms_std: float | None, granularity: Granularity | str, repetitions: int | None) -> None:
    """Raise :class:`ImplausibleMeasurement` (422) when ``time_ms_std`` (ms, finite and ≥ 0 by the schema)
    is a spread no repetitions of the row could have: above :func:`max_std_ms`, or above 0 from one
    repetition (module doc)."""
    if time_ms_std is None:
        return
    detail: dict[str, Any] = {"time_ms_std": time_ms_std, "repetitions": repetitions}
    if repetitions == 1 and time_ms_std > 0:
        raise ImplausibleMeasurement(
            f"time_ms_std {time_ms_std:g} ms from 1 repetition: one time has no spread",
            detail={**detail, "reason": "spread_of_one_sample"})
    bound = max_std_ms(granularity=granularity, repetitions=repetitions)
    if time_ms_std > bound:
        raise ImplausibleMeasurement(
            f"time_ms_std {time_ms_std:g} ms is above {bound:.6g} ms, the most that repetitions each within "
            f"{MAX_TIME_MS[Granularity(granularity)]:g} ms (the bound for a {Granularity(granularity).value}) "
            "can spread",
            detail={**detail, "reason": "spread_above_maximum", "max_ms": bound})


def check_measured_at(*, measured_at: datetime | None, now: datetime) -> None:
    """Raise :class:`ImplausibleMeasurement` (422) when the aware ``measured_at`` is later than the aware
    ``now`` (the server's clock) plus :data:`MAX_CLOCK_SKEW` (a measurement cannot come from the future) or
    earlier than :data:`EARLIEST_MEASURED_AT` (a default date left in, such as the Unix epoch)."""
    if measured_at is not None and measured_at < EARLIEST_MEASURED_AT:
        raise ImplausibleMeasurement(
            f"measured_at {measured_at.isoformat()} is before {EARLIEST_MEASURED_AT.date().isoformat()}: a default "
            "date left in (1970-01-01 is the Unix epoch), not when a layer was timed",
            detail={"measured_at": measured_at.isoformat(), "reason": "measured_before_earliest",
                    "earliest": EARLIEST_MEASURED_AT.isoformat()})
    if measured_at is None or measured_at <= now + MAX_CLOCK_SKEW:
        return
    raise ImplausibleMeasurement(
        f"measured_at {measured_at.isoformat()} is in the future (server time {now.isoformat(timespec='seconds')},"
        f" {MAX_CLOCK_SKEW.days} day of clock skew allowed)",
        detail={"measured_at": measured_at.isoformat(), "now": now.isoformat(), "reason": "measured_in_future",
                "max_skew_s": MAX_CLOCK_SKEW.total_seconds()})


#: Precision modes (:class:`app.core.precision.Precision`) a device must have the arithmetic for. Of a row's
#: storage formats (``int8``, ``fp64``, ``fp8``) only ``fp8`` is: no device runs fp8 without fp8 arithmetic
#: (Ada, Hopper, CDNA 3), while every GPU and CPU runs fp64, and int8 runs on DP4A or vector units of devices
#: whose datasheet lists no int8 peak (V100, GP102, CPUs), so those two are not checked against the device.
PRECISION_MODES = frozenset(p.value for p in Precision)
DEVICE_FORMATS = frozenset({"fp8"})
#: Precision modes a CPU runs without the arithmetic for them: ``torch.autocast("cpu")`` converts bf16/fp16
#: in software where the ISA has none, so the time is real (the seed profiler shard has 5,128 bf16 rows of a
#: CPU without bf16 arithmetic). ``tf32`` is a CUDA mode only: refused on a CPU like on a GPU without it.
CPU_AUTOCAST_MODES = frozenset({Precision.BF16.value, Precision.FP16.value})
#: Granularities that time a whole model, so that a ``config.graph_id`` of theirs names a stored graph.
WHOLE_MODEL = frozenset({Granularity.ITERATION, Granularity.JOB})


@dataclass(frozen=True, slots=True)
class RowProblem:
    """Why a measurement row cannot be stored: ``code`` (a row code of 422 ``invalid_measurements``:
    ``implausible_measurement``, ``invalid_layer_config``, ``graph_not_found``, ``hardware_not_found``,
    ``stack_not_supported``, ``precision_not_supported``), the ``field`` at fault, a message for humans."""

    code: str
    field: str
    message: str


def field_problems(row: MeasurementRecord, *, spec: HardwareSpec | None, graph_exists: Callable[[str], bool],
                   now: datetime) -> list[RowProblem]:  # fmt: skip
    """Every problem of ``row`` (empty: it may be stored), the one rule set of ``POST /v1/measurements``,
    ``layercast import`` and ``POST /v1/job-estimates/actuals``, in this order: a spread no repetitions have
    (:func:`check_spread`) and a date in the future (:func:`check_measured_at`); an ``op_kind``,
    ``granularity`` or layer config that is no layer (:func:`check_layer_config`, :func:`check_granularity`:
    nothing further is checked of such a row); an iteration or job row whose ``config.graph_id`` is not a
    stored graph (``graph_not_found``); a device that is not stored (``spec`` None: ``hardware_not_found``), a
    GPU-only stack on a CPU (``stack_not_supported``) or a precision mode the device has no arithmetic for
    (``precision_not_supported``; on a CPU only ``tf32``: :data:`CPU_AUTOCAST_MODES`; of the storage formats
    only ``fp8``: :data:`DEVICE_FORMATS`), each ending the checks;
    last a time the device cannot have taken (:func:`check_plausible`).

    ``spec``: the stored device ``row.hardware_id`` names, or None; ``graph_exists``: whether a graph id is
    stored; ``now``: the server's aware clock. Raises nothing: every refusal is a :class:`RowProblem`."""
    problems: list[RowProblem] = []

    def add(exc: LayercastError, field: str) -> None:
        problems.append(RowProblem(exc.code, field, exc.message))

    try:
        check_spread(time_ms_std=row.time_ms_std, granularity=row.granularity, repetitions=row.repetitions)
    except ImplausibleMeasurement as exc:
        add(exc, "time_ms_std")
    try:
        check_measured_at(measured_at=row.measured_at, now=now)
    except ImplausibleMeasurement as exc:
        add(exc, "measured_at")
    try:
        check_layer_config(op_kind=row.op_kind, config=row.config, batch_size=row.batch_size)
        check_granularity(op_kind=row.op_kind, granularity=row.granularity)
    except InvalidLayerConfig as exc:  # no layer, no floor: it must not be stored unchecked
        add(exc, exc.field)
        return problems
    if row.granularity in WHOLE_MODEL and "graph_id" in row.config:
        graph_id = row.config["graph_id"]
        if not isinstance(graph_id, str) or not graph_exists(graph_id):
            problems.append(RowProblem("graph_not_found", "config.graph_id",
                                       f"no graph with id {graph_id!r}: upload it first (POST /v1/graphs)"))
    if spec is None:
        problems.append(RowProblem("hardware_not_found", "hardware_id",
                                   f"unknown hardware id {row.hardware_id!r}: register it first"))
        return problems
    if not stack_runs_on(row.software_stack, spec.kind):
        problems.append(RowProblem("stack_not_supported", "software_stack",
                                   f"software stack {row.software_stack.value!r} runs on GPUs only; {spec.id!r} is "
                                   f"a {spec.kind.upper()}"))
        return problems
    if row.precision in PRECISION_MODES and not (  # a mode, not a storage format such as int8 or fp64
            spec.kind == "cpu" and row.precision in CPU_AUTOCAST_MODES):
        try:
            check_precision(spec, row.precision)
        except PrecisionNotSupported as exc:
            problems.append(RowProblem(exc.code, "precision", str(exc)))
            return problems
    if row.precision in DEVICE_FORMATS and row.precision not in spec.peak_flops_per_s:
        problems.append(RowProblem("precision_not_supported", "precision",
                                   f"hardware {spec.id!r} has no {row.precision} arithmetic (no '{row.precision}' "
                                   "peak in its spec), so no time was measured in it"))
        return problems
    try:
        check_plausible(time_ms=row.time_ms_median, granularity=row.granularity, config=row.config,
                        batch_size=row.batch_size, spec=spec, precision=row.precision, pass_=row.pass_,
                        optimizer=row.optimizer)  # fmt: skip
    except ImplausibleMeasurement as exc:
        add(exc, "time_ms_median")
    return problems
