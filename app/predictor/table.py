"""Vectorised per-layer quantities: the numpy side of every layer prediction (single, batch, jobs, comparisons).

A :class:`LayerTable` holds, for a sequence of supported layers (an analysed graph's, or any query list's),
everything that depends on the layer alone, computed once with the scalar definitions of
:mod:`app.core.features` and :mod:`app.core.precision` (so there is still one definition of every quantity):

* the layer-only columns of :data:`app.core.features.RAW_FIELDS` (geometry, kind flags, FLOPs, bytes at the
  graph's dtypes, GEMM view), taken from :func:`app.core.features.raw_quantities` itself, at the reference
  device and the default stack; a pointwise convolution's geometry both ways, as a convolution and as the GEMM
  it is (:func:`app.core.features.geometry_fields`), which :func:`raw_for` picks by device kind and stack;
* per storage precision, the DRAM bytes of the forward and backward passes at that precision
  (:func:`app.core.precision.cost_at_precision`) and the cheapest algorithm's FLOPs
  (:func:`app.core.precision.min_algorithm_flops_factor`).

Everything that depends on the device, the precision, the pass or the optimizer is then numpy over all rows
at once: :func:`raw_for` (the predictor's raw feature matrix, equal to
:func:`app.core.features.raw_matrix` of the same rows), :func:`floors_for` (the per-pass physics floors,
equal to :func:`app.core.precision.floors_by_pass_ms`), :func:`op_peaks` (equal to
:func:`app.core.precision.op_precision` per row) and :func:`roofline_for` (the response's roofline column).
Tests pin each equality on real graphs (``tests/predictor/test_table.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from app.core.costs import OPTIMIZERS, LayerCost
from app.core.features import (
    GEOMETRY_FIELDS,
    HALF_PRECISIONS,
    NO_LAUNCH_GAP_STACKS,
    OPTIMIZER_ALIASES,
    RAW_FIELDS,
    TRAINED_OPTIMIZERS,
    gemm_view_applies,
    geometry_fields,
    hardware_raw,
    is_pointwise_conv,
    precision_spec,
    raw_index,
    raw_quantities,
)
from app.core.hardware import HardwareSpec
from app.core.ir import Layer, OpKind, Tensor
from app.core.precision import (
    CUDNN_KINDS,
    TENSOR_CORE_KINDS,
    UPDATE_BYTES_PER_PARAM,
    Precision,
    activation_bytes_per_element,
    autocast_cast_bytes,
    check_precision,
    cost_at_precision,
    min_algorithm_flops_factor,
)
from app.core.vocab import SoftwareStack
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery

#: RAW_FIELDS columns that depend on the device, precision, pass, optimizer or stack (recomputed per setting
#: by :func:`raw_for`); every other column depends on the layer alone and is read from the table, except the
#: :data:`~app.core.features.GEOMETRY_FIELDS` of pointwise convolutions (the GEMM view depends on the device kind
#: and the stack: :func:`app.core.features.gemm_view_applies`).
SETTING_FIELDS: tuple[str, ...] = (
    "pass_flops", "pass_bytes", "update_bytes", "is_train", *(f"opt_{o}" for o in TRAINED_OPTIMIZERS),
    "peak_flops_per_s", "bandwidth_bytes_per_s", "memory_bytes", "compute_units", "clock_mhz", "is_half",
    "is_cpu", "l2_cache_bytes", "op_peak_flops_per_s", "floor_ms", "stack_tf1_session", "stack_kernel_time",
    "fp32_peak_flops_per_s",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Rescaled:
    """Per storage precision: forward / backward DRAM bytes at that precision and the cheapest algorithm's
    forward / backward FLOPs (``[N]`` float64 each), and each row's cost at that precision
    (:func:`app.core.precision.cost_at_precision`, what the roofline fallback reads)."""

    costs: tuple[LayerCost, ...]
    forward_bytes: np.ndarray
    backward_bytes: np.ndarray
    forward_flops_min: np.ndarray
    backward_flops_min: np.ndarray


#: Every field of a :class:`~app.core.costs.LayerCost` but its name, as a tuple (rows equal but for names).
COST_FIELDS = operator.attrgetter(*(f.name for f in fields(LayerCost) if f.name != "name"))

#: Approximate CPython bytes of one row's :class:`~app.core.costs.LayerCost` at a precision (tracemalloc
#: around :meth:`LayerTable.rescaled` on the model-zoo ResNet-50, DenseNet-121 and Inception-v2: 304-439 B
#: per layer beyond the arrays).
RESCALED_COST_BYTES = 450


def _rescaled_nbytes(r: _Rescaled) -> int:
    """Bytes a precision's rescaled entry holds: its four ``[N]`` arrays and ``N`` costs."""
    arrays = (r.forward_bytes, r.backward_bytes, r.forward_flops_min, r.backward_flops_min)
    return int(sum(a.nbytes for a in arrays)) + RESCALED_COST_BYTES * len(r.costs)


class LayerTable:
    """Layer-only quantities of ``layers`` (each with its supported ``costs``), as numpy columns ``[N]``.

    Build once per analysed graph (the analysis cache of :mod:`app.graphs.service` keeps it with the
    analysis) and reuse for every device and setting. Raises ``ValueError`` for an unsupported cost.
    """

    def __init__(self, layers: Sequence[Layer], costs: Sequence[LayerCost], *, reference: HardwareSpec,
                 on_grow: Callable[[int], None] | None = None) -> None:
        """``on_grow(nbytes)`` is told about what the table adds later (a precision's rescaled columns and
        costs), so that an owner with a byte budget (the analysis cache) counts them."""
        self.layers = tuple(layers)
        self._on_grow = on_grow
        self.costs = tuple(costs)
        if len(self.layers) != len(self.costs):
            raise ValueError("layers and costs differ in length")
        for c in self.costs:
            if not c.supported:
                raise ValueError(f"layer {c.name!r} ({c.op_type}) is unsupported; it has no table row")
        n = len(self.layers)
        # the layer-only RAW_FIELDS columns, by the one scalar definition (the setting columns are replaced later)
        rows = [raw_quantities(layer=layer, cost=cost, hardware=reference, pass_="forward", optimizer="none",
                               precision="fp32") for layer, cost in zip(self.layers, self.costs, strict=True)]
        self.base = np.asarray(rows, dtype=np.float64).reshape(n, len(RAW_FIELDS))
        # pointwise convolutions: their geometry as a convolution and as the GEMM view (raw_for picks per setting)
        self.pointwise = np.asarray([is_pointwise_conv(layer) for layer in self.layers], dtype=bool).reshape(n)
        pw = np.nonzero(self.pointwise)[0]
        self.pointwise_geometry: tuple[np.ndarray, ...] = tuple(
            np.asarray([geometry_fields(self.layers[i], gemm_view=view) for i in pw.tolist()],
                       dtype=np.float64).reshape(len(pw), len(GEOMETRY_FIELDS)) for view in (False, True))
        f64 = np.float64

        def col(values: list[float] | list[int] | list[bool]) -> np.ndarray:
            return np.asarray(values, dtype=f64).reshape(n)

        self.forward_flops = col([c.forward_flops for c in self.costs])
        self.backward_flops = col([c.backward_flops for c in self.costs])
        self.forward_bytes = col([c.forward_bytes for c in self.costs])
        self.backward_bytes = col([c.backward_bytes for c in self.costs])
        self.params = col([c.params for c in self.costs])
        self.forward_macs = col([c.forward_macs for c in self.costs])
        self.winograd = col([min_algorithm_flops_factor(layer) for layer in self.layers])
        self.kinds = tuple(layer.kind for layer in self.layers)
        self.tensor_core = np.asarray([k in TENSOR_CORE_KINDS for k in self.kinds], dtype=bool).reshape(n)
        self.cudnn = np.asarray([k in CUDNN_KINDS for k in self.kinds], dtype=bool).reshape(n)
        self.dropout = np.asarray([k is OpKind.DROPOUT for k in self.kinds], dtype=bool).reshape(n)
        self._rescaled: dict[int, _Rescaled] = {}
        self._memo: dict[object, object] = {}

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's arrays (for the analysis cache's byte budget)."""
        arrays = [self.base, self.forward_flops, self.backward_flops, self.forward_bytes, self.backward_bytes,
                  self.params, self.forward_macs, self.winograd, self.tensor_core, self.cudnn,
                  self.dropout, self.pointwise, *self.pointwise_geometry]
        return int(sum(a.nbytes for a in arrays)) + sum(_rescaled_nbytes(r) for r in self._rescaled.values())

    def _costs_at(self, precision: Precision | str) -> tuple[LayerCost, ...]:
        """:func:`app.core.precision.cost_at_precision` of every row, computed once per group of rows equal
        in everything but their names (:meth:`twins`; names are never read by it but the one it copies):
        a repeated row is its group's answer with its own cost's name and counts."""
        twins = self.twins()
        first: dict[int, LayerCost] = {}
        out = []
        for i, (layer, cost) in enumerate(zip(self.layers, self.costs, strict=True)):
            j = twins[i]
            if j == i:
                out.append(first.setdefault(i, cost_at_precision(layer, cost, precision)))
                continue
            at = first[j]
            if at is self.costs[j]:  # nothing changes at this precision
                out.append(cost)
            else:
                out.append(replace(cost, forward_bytes_read=at.forward_bytes_read,
                                   forward_bytes_written=at.forward_bytes_written,
                                   backward_bytes_read=at.backward_bytes_read,
                                   backward_bytes_written=at.backward_bytes_written,
                                   saved_activation_bytes=at.saved_activation_bytes))
        return tuple(out)

    def twins(self) -> list[int]:
        """For each row, the first row whose layer (op, kind, attributes, tensors' shapes and dtypes) and cost
        equal its own but for names (built once): rows that every estimate of a setting answers alike."""
        found = self._memo.get("twins")
        if found is None:

            def tensors(ts: Sequence[Tensor]) -> tuple[tuple[tuple[int, ...], str], ...]:
                return tuple((t.shape, t.dtype) for t in ts)

            seen: dict[tuple[object, ...], int] = {}
            found = [seen.setdefault((la.op_type, la.kind, tensors(la.inputs), tensors(la.outputs), tensors(la.weights),
                                      tensors(la.buffers), repr(la.attrs), la.needs_input_grad,
                                      COST_FIELDS(c)), i)
                     for i, (la, c) in enumerate(zip(self.layers, self.costs, strict=True))]  # fmt: skip
            self._memo["twins"] = found
        return found  # type: ignore[return-value]

    def memo(self, key: object, build: object) -> object:
        """A per-table memo (e.g. the learned predictor's routing of these layers per device kind):
        ``build()`` once per ``key``."""
        if key not in self._memo:
            self._memo[key] = build()  # type: ignore[operator]
        return self._memo[key]

    def cast_bytes(self, precision: str, *, training: bool) -> np.ndarray:
        """:func:`app.core.precision.autocast_cast_bytes` of every row ``[N]`` (float64), once per precision and
        mode."""

        def build() -> np.ndarray:
            return np.asarray([autocast_cast_bytes(layer, precision, training=training) for layer in self.layers],
                              dtype=np.float64).reshape(len(self.layers))

        found = self.memo(("cast-bytes", str(precision), training), build)
        assert isinstance(found, np.ndarray)
        return found

    def rescaled(self, precision: Precision | str) -> _Rescaled:
        """Bytes at the storage types of ``precision`` (:func:`app.core.precision.cost_at_precision`) and the
        cheapest algorithm's FLOPs (as :func:`app.core.precision.pass_work` computes them)."""
        width = activation_bytes_per_element(precision)
        key = width if width == 4 else (2 if Precision(precision) is Precision.FP16 else 3)
        found = self._rescaled.get(key)
        if found is None:
            costs = self._costs_at(precision)
            fb, bb = [c.forward_bytes for c in costs], [c.backward_bytes for c in costs]
            mac = 2.0 * self.forward_macs
            built = _Rescaled(
                costs=costs,
                forward_bytes=np.asarray(fb, dtype=np.float64).reshape(len(self)),
                backward_bytes=np.asarray(bb, dtype=np.float64).reshape(len(self)),
                forward_flops_min=np.maximum(mac / self.winograd + (self.forward_flops - mac), 0.0),
                backward_flops_min=self.backward_flops / self.winograd,
            )
            # two threads may build it at once: the one stored is counted, once
            found = self._rescaled.setdefault(key, built)
            if found is built and self._on_grow is not None:
                self._on_grow(_rescaled_nbytes(found))
        return found


def op_peaks(table: LayerTable, hw: HardwareSpec, precision: Precision | str) -> np.ndarray:
    """Peak FLOP/s each row's op may use under ``precision`` on ``hw``, ``[N]``: the per-row value of
    :func:`app.core.precision.op_precision` (its rules, vectorised over the op kinds). Raises
    :class:`~app.core.precision.PrecisionNotSupported` like it."""
    p = check_precision(hw, precision)
    peaks = hw.peak_flops_per_s
    fp32 = float(peaks["fp32"])

    def rate(math: str) -> float:
        r = float(peaks[math]) if math != "fp32" else fp32
        return fp32 if r < fp32 else r

    tc_math = "tf32" if p is Precision.TF32 else (p.value if p in (Precision.FP16, Precision.BF16) else "fp32")
    cudnn_math = "tf32" if p is Precision.FP32 and "tf32" in peaks else tc_math
    return np.where(table.tensor_core, np.where(table.cudnn, rate(cudnn_math), rate(tc_math)), fp32)


def update_cost(params: np.ndarray, optimizer: str) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs and bytes of the optimizer step over ``params`` ``[N]`` (fp32 master weights):
    :func:`app.core.costs.optimizer_update_cost`, vectorised. Raises ``KeyError`` for an unknown optimizer."""
    flops_per, states = OPTIMIZERS[optimizer]
    if optimizer == "none":
        return np.zeros_like(params), np.zeros_like(params)
    b = UPDATE_BYTES_PER_PARAM
    return flops_per * params, params * b * (2 + states) + params * b * (1 + states)


@dataclass(frozen=True, slots=True)
class Floors:
    """Physics floors (ms, ``[N]`` each) of the passes of a setting (:func:`app.core.precision.physics_floor_ms`):
    ``forward`` (inference; dropout is the identity), ``train_forward``, ``backward``, ``update``."""

    forward: np.ndarray
    train_forward: np.ndarray
    backward: np.ndarray
    update: np.ndarray

    def by_pass(self, *, training: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(forward, backward, update)`` as :func:`app.core.precision.floors_by_pass_ms` returns them."""
        if not training:
            zero = np.zeros_like(self.forward)
            return self.forward, zero, zero
        return self.train_forward, self.backward, self.update

    @property
    def train_step(self) -> np.ndarray:
        """Floor of a whole training step: the three passes one after the other."""
        return self.train_forward + self.backward + self.update


def floors_for(
    table: LayerTable, hw: HardwareSpec, precision: Precision | str,
    optimizer: str | tuple[np.ndarray, np.ndarray],
) -> Floors:
    """Per-pass physics floors of every row on ``hw`` at ``precision``: ``max(FLOPs_min / op peak,
    bytes at the precision / bandwidth)`` (Williams et al. 2009), exactly as
    :func:`app.core.precision.pass_work` defines each pass. ``optimizer``: one key of
    :data:`app.core.costs.OPTIMIZERS` for every row, or the per-row update (FLOPs, bytes) arrays.
    Raises :class:`~app.core.precision.PrecisionNotSupported`."""
    peak = op_peaks(table, hw, precision)
    r = table.rescaled(precision)
    bw = hw.memory_bandwidth_bytes_per_s
    fp32 = float(hw.peak_flops_per_s["fp32"])
    train_fwd = np.maximum(r.forward_flops_min / peak, r.forward_bytes / bw) * 1e3
    bwd = np.maximum(r.backward_flops_min / peak, r.backward_bytes / bw) * 1e3
    upd_flops, upd_bytes = update_cost(table.params, optimizer) if isinstance(optimizer, str) else optimizer
    upd = np.maximum(upd_flops / fp32, upd_bytes / bw) * 1e3
    fwd = np.where(table.dropout, 0.0, train_fwd)
    return Floors(forward=fwd, train_forward=train_fwd, backward=bwd, update=upd)


def raw_for(
    table: LayerTable, hw: HardwareSpec, *, pass_: str, optimizer: str, precision: str, stack: str,
    optimizer_per_params: bool = False,
) -> np.ndarray:
    """Raw feature quantities ``[N, len(RAW_FIELDS)]`` of every row in one setting: row i equals
    :func:`app.core.features.raw_quantities` of layer i with the same arguments (``launch_gaps`` True).

    ``optimizer_per_params``: rows without parameters take optimizer ``"none"`` (what the learned
    predictor does for a train-step row). Raises ``ValueError`` for an unknown pass or stack and
    ``KeyError`` for an unknown optimizer, like :func:`raw_quantities`.
    """
    if pass_ not in ("forward", "train_step"):
        raise ValueError(f"pass_ must be 'forward' or 'train_step', got {pass_!r}")
    SoftwareStack(stack)
    train = pass_ == "train_step"
    opt = optimizer if train else "none"
    OPTIMIZERS[opt]  # KeyError for an unknown optimizer, like raw_quantities
    raw = table.base.copy()
    n = len(table)
    has_params = table.params > 0 if optimizer_per_params else np.ones(n, dtype=bool)
    upd_flops, upd_bytes = update_cost(table.params, opt)  # 0 for rows without parameters anyway

    def put(name: str, value: float | np.ndarray) -> None:
        raw[:, raw_index(name)] = value

    if train:
        put("pass_flops", table.forward_flops + (table.backward_flops + upd_flops))
        put("pass_bytes", table.forward_bytes + (table.backward_bytes + upd_bytes))
        put("update_bytes", upd_bytes)
    else:
        put("pass_flops", table.forward_flops)
        put("pass_bytes", table.forward_bytes)
        put("update_bytes", 0.0)
    put("is_train", float(train))
    opt_key = OPTIMIZER_ALIASES.get(opt, opt)
    for o in TRAINED_OPTIMIZERS:
        put(f"opt_{o}", np.where(has_params, float(opt_key == o), 0.0))
    peak, bw, mem, units, clock = hardware_raw(hw, precision)
    put("peak_flops_per_s", peak)
    put("bandwidth_bytes_per_s", bw)
    put("memory_bytes", mem)
    put("compute_units", units)
    put("clock_mhz", clock)
    put("is_half", float(precision in HALF_PRECISIONS))
    put("is_cpu", float(hw.kind == "cpu"))
    put("l2_cache_bytes", float(hw.l2_cache_bytes or 0.0))
    spec = precision_spec(hw, precision)
    put("op_peak_flops_per_s", op_peaks(table, spec, precision))
    floors = floors_for(table, spec, precision, (upd_flops, upd_bytes))
    put("floor_ms", floors.train_step if train else floors.forward)
    put("stack_tf1_session", float(stack == SoftwareStack.TF1_SESSION))
    put("stack_kernel_time", float(stack in NO_LAUNCH_GAP_STACKS))
    put("fp32_peak_flops_per_s", float(hw.peak_flops_per_s["fp32"]))
    if table.pointwise.any():
        geometry = table.pointwise_geometry[int(gemm_view_applies(hw.kind, stack))]
        raw[np.ix_(np.nonzero(table.pointwise)[0], _GEOMETRY_COLUMNS)] = geometry
    return raw


_GEOMETRY_COLUMNS = np.asarray([raw_index(name) for name in GEOMETRY_FIELDS], dtype=np.intp)


@dataclass(frozen=True, slots=True)
class Roofline:
    """Roofline of each row's forward (+ backward in training) at a precision (``[N]`` each): time (ms),
    compute-bound flag, FLOPs, bytes and the peak they were computed from."""

    time_ms: np.ndarray
    compute_bound: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    peak_flops_per_s: np.ndarray


def roofline_for(table: LayerTable, hw: HardwareSpec, precision: Precision, *, training: bool) -> Roofline:
    """Roofline of every row's forward (+ backward in training) at ``precision`` (direct-algorithm FLOPs,
    bytes at the precision's storage types, the op's peak: :func:`op_peaks`), Williams et al. 2009; what a
    response's ``roofline_ms``/``bound`` and the power model's utilisation read."""
    r = table.rescaled(precision)
    peak = op_peaks(table, hw, precision)
    flops = table.forward_flops + (table.backward_flops if training else 0.0)
    nbytes = r.forward_bytes + (r.backward_bytes if training else 0.0)
    t_compute = flops / peak
    t_memory = nbytes / hw.memory_bandwidth_bytes_per_s
    return Roofline(time_ms=np.maximum(t_compute, t_memory) * 1e3, compute_bound=t_compute >= t_memory,
                    flops=flops, nbytes=nbytes, peak_flops_per_s=peak)


@dataclass(frozen=True, slots=True)
class Setting:
    """Everything of a prediction besides the layers: device, mode (``training``/``inference``), optimizer
    (``"none"`` in inference), precision (checked against the device) and software stack."""

    hardware: HardwareSpec
    mode: str
    optimizer: str
    precision: Precision
    software_stack: SoftwareStack = SoftwareStack.PYTORCH_EAGER

    @property
    def training(self) -> bool:
        return self.mode == "training"


class LazyNotes(Sequence[tuple[str, ...]]):
    """Per-row notes built by ``build`` on their first read, then kept (``build`` and what it holds released):
    what :class:`Estimates` carries when making the note strings is the only work of a row's notes and a
    caller may never read them (a summary answer reads the methods and the out-of-distribution flags, not
    the notes). Reads as the list ``build`` returns (``len``, index, iteration, ``==`` with any sequence);
    two threads reading first may both build it (``build`` is pure: the same list either way)."""

    __slots__ = ("_build", "_rows")

    def __init__(self, build: Callable[[], list[tuple[str, ...]]]) -> None:
        self._build: Callable[[], list[tuple[str, ...]]] | None = build
        self._rows: list[tuple[str, ...]] | None = None

    def rows(self) -> list[tuple[str, ...]]:
        """The notes as a list (built on the first call)."""
        rows = self._rows
        if rows is None:
            build = self._build
            if build is None:  # another thread built them between the two reads (it sets _rows first)
                rows = self._rows
                assert rows is not None
                return rows
            rows = self._rows = build()
            self._build = None
        return rows

    def __len__(self) -> int:
        return len(self.rows())

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self.rows()[i]

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyNotes):
            other = other.rows()
        return isinstance(other, Sequence) and self.rows() == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LazyNotes({self.rows()!r})"


@dataclass(slots=True)
class Estimates:
    """Predicted times of rows of a table in one setting (ms, ``[N]`` each), as
    :class:`app.predictor.base.LayerTimeEstimate` has them: ``method`` per row, ``out_of_distribution``,
    ``notes`` per row (a list, or :class:`LazyNotes` built on first read), and after the serving clamp
    ``physics_floor_ms`` / ``floor_clamped``."""

    forward_ms: np.ndarray
    backward_ms: np.ndarray
    update_ms: np.ndarray
    total_ms_p10: np.ndarray
    total_ms_p90: np.ndarray
    method: list[str]
    out_of_distribution: np.ndarray
    notes: Sequence[tuple[str, ...]]
    physics_floor_ms: np.ndarray | None = None
    floor_clamped: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.forward_ms)

    def to_list(self) -> list[LayerTimeEstimate]:
        """One :class:`LayerTimeEstimate` per row, in row order."""
        n = len(self)
        floors = self.physics_floor_ms.tolist() if self.physics_floor_ms is not None else [None] * n
        clamped = self.floor_clamped.tolist() if self.floor_clamped is not None else [False] * n
        return [
            LayerTimeEstimate(forward_ms=f, backward_ms=b, update_ms=u, total_ms_p10=lo, total_ms_p90=hi, method=m,
                              out_of_distribution=o, notes=nt, physics_floor_ms=fl, floor_clamped=cl)
            for f, b, u, lo, hi, m, o, nt, fl, cl in zip(
                self.forward_ms.tolist(), self.backward_ms.tolist(), self.update_ms.tolist(),
                self.total_ms_p10.tolist(), self.total_ms_p90.tolist(), self.method,
                self.out_of_distribution.tolist(), self.notes, floors, clamped, strict=True)
        ]

    @staticmethod
    def empty() -> Estimates:
        z = np.zeros(0)
        return Estimates(z, z, z, z, z, [], np.zeros(0, dtype=bool), [], z, np.zeros(0, dtype=bool))

    @staticmethod
    def from_list(estimates: Sequence[LayerTimeEstimate]) -> Estimates:
        """Rows from scalar estimates (the roofline fallback's): one ``[N, 5]`` float64 matrix of their times
        read row by row (an attribute getter per estimate, not a ``getattr`` per field and estimate)."""
        n = len(estimates)
        times = np.asarray(list(map(_TIMES, estimates)), dtype=np.float64).reshape(n, 5)
        f, b, u, lo, hi = np.ascontiguousarray(times.T)
        return Estimates(f, b, u, lo, hi,
                         [e.method for e in estimates],
                         np.asarray([e.out_of_distribution for e in estimates], dtype=bool).reshape(n),
                         [e.notes for e in estimates])

    def take(self, idx: np.ndarray) -> Estimates:
        """The rows ``idx`` (their notes taken on first read)."""
        il = idx.tolist()
        notes = self.notes
        return Estimates(self.forward_ms[idx], self.backward_ms[idx], self.update_ms[idx], self.total_ms_p10[idx],
                         self.total_ms_p90[idx], [self.method[i] for i in il], self.out_of_distribution[idx],
                         LazyNotes(lambda: [notes[i] for i in il]),
                         None if self.physics_floor_ms is None else self.physics_floor_ms[idx],
                         None if self.floor_clamped is None else self.floor_clamped[idx])


#: The five times of a :class:`~app.predictor.base.LayerTimeEstimate`, in :meth:`Estimates.from_list`'s order.
_TIMES = operator.attrgetter("forward_ms", "backward_ms", "update_ms", "total_ms_p10", "total_ms_p90")


def scatter(n: int, parts: Sequence[tuple[np.ndarray, Estimates]]) -> Estimates:
    """One :class:`Estimates` of ``n`` rows from disjoint ``(row indices, estimates of those rows)`` parts
    covering every row (the notes scattered on first read)."""
    f = np.zeros(n)
    b, u, lo, hi = f.copy(), f.copy(), f.copy(), f.copy()
    ood = np.zeros(n, dtype=bool)
    method: list[str] = [""] * n
    for idx, e in parts:
        f[idx], b[idx], u[idx], lo[idx], hi[idx] = e.forward_ms, e.backward_ms, e.update_ms, e.total_ms_p10, \
            e.total_ms_p90
        ood[idx] = e.out_of_distribution
        for i, m in zip(idx.tolist(), e.method, strict=True):
            method[i] = m
    kept = [(idx, e.notes) for idx, e in parts]

    def notes() -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = [()] * n
        for idx, nts in kept:
            for i, nt in zip(idx.tolist(), nts, strict=True):
                out[i] = nt
        return out

    return Estimates(f, b, u, lo, hi, method, ood, LazyNotes(notes))


def clamp_to_floors(table: LayerTable, idx: np.ndarray, setting: Setting, est: Estimates) -> Estimates:
    """``est`` (of rows ``idx`` of ``table``) with each pass raised to at least its physics floor (ms), the
    floor recorded (:func:`floors_for` on the setting's device; backward and update only in training).
    The interval moves with the point estimate: ``p10 >= Σ floors`` and ``p90 >= total``; a raised pass is
    named in the notes. DESIGN.md "Never faster than physics". Raises
    :class:`~app.core.precision.PrecisionNotSupported`."""
    floors = floors_for(table, setting.hardware, setting.precision, setting.optimizer)
    f_floor, b_floor, u_floor = (a[idx] for a in floors.by_pass(training=setting.training))
    floor_sum = f_floor + b_floor + u_floor
    raised_f, raised_b, raised_u = est.forward_ms < f_floor, est.backward_ms < b_floor, est.update_ms < u_floor
    fwd = np.maximum(est.forward_ms, f_floor)
    bwd = np.maximum(est.backward_ms, b_floor)
    upd = np.maximum(est.update_ms, u_floor)
    total = fwd + bwd + upd
    clamped = raised_f | raised_b | raised_u
    rows = np.nonzero(clamped)[0]
    # only the clamped rows' flags and floors are kept for the notes, which are built on first read
    raised = [(name, r[rows].tolist()) for name, r in (("forward", raised_f), ("backward", raised_b),
                                                        ("update", raised_u))]
    sums, before = floor_sum[rows].tolist(), est.notes

    def notes() -> list[tuple[str, ...]]:
        out = list(before)
        for j, i in enumerate(rows.tolist()):
            names = [name for name, r in raised if r[j]]
            out[i] = (*out[i], f"raised to the physics floor ({', '.join(names)}): {float(sums[j]):.4g} ms in all")
        return out

    return Estimates(
        forward_ms=fwd, backward_ms=bwd, update_ms=upd,
        total_ms_p10=np.minimum(np.maximum(est.total_ms_p10, floor_sum), total),
        total_ms_p90=np.maximum(est.total_ms_p90, total),
        method=est.method, out_of_distribution=est.out_of_distribution, notes=LazyNotes(notes),
        physics_floor_ms=floor_sum, floor_clamped=clamped,
    )


def estimate_queries(
    queries: Sequence[LayerTimeQuery],
    estimate_tables: Callable[[Sequence[tuple[LayerTable, np.ndarray, Setting]]], list[Estimates]],
) -> list[LayerTimeEstimate]:
    """Scalar queries through a table estimator (one path for every caller): grouped by setting (device
    object, mode, optimizer, precision, stack) into one table each, all groups in one ``estimate_tables`` call,
    answered in query order."""
    groups: dict[tuple[int, str, str, str, str], list[int]] = {}
    for i, q in enumerate(queries):
        groups.setdefault((id(q.hardware), q.mode, q.optimizer, str(q.precision), str(q.software_stack)), []).append(i)
    items = []
    for rows in groups.values():
        q0 = queries[rows[0]]
        table = LayerTable([queries[i].layer for i in rows], [queries[i].cost for i in rows], reference=q0.hardware)
        items.append((table, np.arange(len(rows)), Setting(q0.hardware, q0.mode, q0.optimizer, q0.precision,
                                                           q0.software_stack)))
    out: list[LayerTimeEstimate | None] = [None] * len(queries)
    for rows, est in zip(groups.values(), estimate_tables(items), strict=True):
        for i, e in zip(rows, est.to_list(), strict=True):
            out[i] = e
    return [e for e in out if e is not None]

