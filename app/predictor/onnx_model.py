"""Learned per-layer runtime predictor: the ONNX MLP exported by :mod:`app.training.train`, served with
onnxruntime (no torch).

What it applies to comes from the artifact's metadata (``applies_to``), per hardware kind: for
``layer-time-mlp-3`` on GPUs 2-D ungrouped convolutions, fully connected layers, batched matmuls,
element-wise ops and activations, layer norms, softmax and embeddings (Justus, NeuSight and Vidur data);
on CPUs every op kind of the CPU seed dataset. :meth:`LearnedPredictor.applies` says why not otherwise
and the registry routes such layers to the roofline fallback.

Input columns: the metadata's ``feature_names``, a subset of :data:`app.core.features.FEATURE_NAMES`
picked with :func:`app.core.features.select_features`, so artifacts of older feature schemas keep
loading. Every query is featurised with its precision and software stack (``LayerTimeQuery.software_stack``,
default ``pytorch-eager``): the v3 model's overhead term depends on the stack, so a TF1-session floor
measured in the Justus data never leaks into a PyTorch answer.

CPU hardware: a CPU spec whose identity (name, cores, vector width) equals a CPU in the metadata's
``training_hardware`` is featurised with the stored spec, not with the one detected now, so serving on
the training machine sees exactly the training features. Any other CPU is unseen hardware.

The model predicts ln ms at p10/p50/p90 of either a forward pass or a whole training step (forward +
backward + optimizer update). A training query is featurised twice (forward row and train-step row) and
the step is split with :func:`app.predictor.base.split_training_step`.

Never faster than physics: v3 predicts ``ln(time / floor)`` through a softplus, so each quantile is at
least the physics floor :func:`app.core.features.pass_floor_ms`; the served times are also clamped to it
in float64. Intervals are the model's conformal p10/p90, calibrated on leave-one-GPU-out folds for GPUs
(:mod:`app.training.train`), so they hold on GPUs absent from the training data with no extra widening.
Unseen GPUs are answered by the same smooth model (no gate, no transfer between models).

Out of distribution (flag + note): hardware id not among the training devices; any feature outside the
range of the training rows of the same hardware kind and op kind (a GPU query is compared with GPU rows
of its op kind only), widened by :data:`RANGE_MARGIN` of its span on each side; an optimizer, precision,
software stack or activation that was never measured; dilated convolutions.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from app.core.costs import LayerCost
from app.core.features import (
    ACTIVATIONS,
    DEFAULT_STACK,
    FEATURE_NAMES,
    features_from_raw,
    floor_ms_from_raw,
    select_features,
)
from app.core.hardware import HardwareSpec, hardware_from_dict
from app.core.ir import ConvAttrs, Layer, OpKind
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, split_training_step
from app.predictor.table import Estimates, LayerTable, Setting, raw_for, update_cost

RANGE_MARGIN = 0.05


class LearnedPredictor:
    """onnxruntime session over one exported model plus its metadata (see module docstring).

    ``metadata`` is the JSON written by :mod:`app.training.train`; raises ``ValueError`` when its
    feature list differs from :data:`app.core.features.FEATURE_NAMES` (the artifact was trained with
    another feature function) and ``FileNotFoundError`` when the ONNX file is missing.
    """

    def __init__(self, onnx_path: Path, metadata: Mapping[str, Any], *, threads: int = 1) -> None:
        names = tuple(metadata["feature_names"])
        unknown = [n for n in names if n not in FEATURE_NAMES]
        if unknown:
            raise ValueError(
                f"model {onnx_path.name} reads features app.core.features does not define: {', '.join(unknown)}"
            )
        self.feature_names = names
        if not onnx_path.is_file():
            raise FileNotFoundError(onnx_path)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        self.metadata = metadata
        self.version = f"{metadata['name']}-{metadata['version']}"
        self._ranges = _feature_ranges(metadata)
        train_hw: dict[str, Any] = dict(metadata.get("training_hardware", {}))
        self._train_hw = frozenset(train_hw)
        # stored CPU specs, by identity (name, cores, vector width): serving on the training CPU reuses them
        self._cpu_specs: dict[tuple[str, int, int | None], HardwareSpec] = {}
        for d in train_hw.values():
            if isinstance(d, Mapping) and d.get("kind") == "cpu":
                spec = hardware_from_dict(dict(d))
                self._cpu_specs[_cpu_identity(spec)] = spec
        self._scope = _applies_to(metadata.get("applies_to", {}))

    def applies(self, query: LayerTimeQuery) -> str | None:
        """``None`` when this predictor can serve ``query``, else the reason it cannot."""
        return self.applies_layer(query.layer, query.cost, query.hardware.kind)

    def applies_layer(self, layer: Layer, cost: LayerCost, hardware_kind: str) -> str | None:
        """``None`` when this predictor can serve ``layer`` on a device of ``hardware_kind``, else why not."""
        if not cost.supported:
            return "unsupported op"
        scope = self._scope.get(hardware_kind)
        if scope is None:
            return f"learned model has no measurements on {hardware_kind} devices"
        if layer.kind.value not in scope["op_kinds"]:
            return f"no measurements for op kind {layer.kind.value} on {hardware_kind}"
        if not layer.inputs or not layer.outputs:
            return "layer without shapes"
        if layer.kind is OpKind.CONV:
            if not layer.weights or len(layer.weights[0].shape) - 2 not in scope["conv_spatial_dims"]:
                return "convolution rank was not measured"
            if layer.group != 1 and not scope["grouped_conv"]:
                return "grouped/depthwise convolutions were not measured"
        if layer.kind is OpKind.MATMUL and len(layer.inputs) < 2:
            return "matmul without two operands"
        return None

    def _canonical(self, hw: HardwareSpec) -> tuple[HardwareSpec, bool]:
        """(spec to featurise with, whether the device is in the training data)."""
        if hw.kind == "cpu":
            stored = self._cpu_specs.get(_cpu_identity(hw))
            if stored is None:
                return hw, False
            return dataclasses.replace(stored, id=hw.id, sources=hw.sources), True
        return hw, hw.id in self._train_hw

    def run_features(self, features: np.ndarray) -> np.ndarray:
        """Raw model output, ln ms quantiles ``[N, 3]`` (one session.run), for a full feature matrix
        ``[N, len(FEATURE_NAMES)]`` (the artifact's columns are selected here) or one that already holds
        exactly the artifact's ``feature_names`` columns."""
        if features.shape[1] == len(FEATURE_NAMES):
            x = select_features(features, self.feature_names)
        elif features.shape[1] == len(self.feature_names):
            x = np.ascontiguousarray(features, dtype=np.float32)
        else:
            raise ValueError(f"features must have {len(FEATURE_NAMES)} or {len(self.feature_names)} columns")
        if x.shape[0] == 0:
            return np.zeros((0, 3), dtype=np.float32)
        return self._session.run(None, {self._input: x})[0]

    def _range_notes(self, hw_kind: str, table: LayerTable, idx: np.ndarray, feats: np.ndarray) -> list[str | None]:
        """Per row ``idx`` of ``table`` (features ``feats`` ``[len(idx), len(FEATURE_NAMES)]``): the note on
        features outside the widened training range of its (hardware kind, op kind), or on missing training
        rows of that op kind; ``None`` when inside."""
        x = select_features(feats, self.feature_names)
        notes: list[str | None] = [None] * len(idx)
        kinds = [table.kinds[i] for i in idx.tolist()]
        for kind in set(kinds):
            rows = np.asarray([j for j, k in enumerate(kinds) if k is kind], dtype=np.intp)
            rng = self._ranges.get((hw_kind, kind.value)) or self._ranges.get((hw_kind, "*"))
            if rng is None:
                for j in rows.tolist():
                    notes[j] = f"no {hw_kind} training rows of op kind {kind.value}"
                continue
            out = (x[rows] < rng[0]) | (x[rows] > rng[1])
            hits = np.nonzero(out.any(axis=1))[0]
            for h in hits.tolist():
                notes[int(rows[h])] = "features outside the training range: " + ", ".join(
                    self.feature_names[c] for c in np.nonzero(out[h])[0].tolist())
        return notes

    def _setting_notes(self, s: Setting, seen: bool) -> tuple[list[str], list[str]]:
        """Notes that hold for every row of a setting: (before the range note, after it; the optimizer note
        is added per row with parameters)."""
        hw = s.hardware
        before = [] if seen else [f"hardware {hw.id!r} ({hw.name}) was not in the training data"]
        scope = self._scope.get(hw.kind, {})
        after: list[str] = []
        if s.software_stack.value not in scope.get("stacks", (DEFAULT_STACK,)):
            after.append(f"software stack {s.software_stack.value!r} was not measured")
        return before, after

    def _layer_notes(self, layer: Layer) -> tuple[str, ...]:
        notes: list[str] = []
        act = layer.activation
        if act not in ACTIVATIONS and act != "none":
            notes.append(f"fused activation {act!r} was not measured")
        if isinstance(layer.attrs, ConvAttrs) and any(d != 1 for d in layer.attrs.dilations):
            notes.append("dilated convolutions were not measured")
        return tuple(notes)

    def prepare(self, table: LayerTable, idx: np.ndarray, setting: Setting) -> _Prepared:
        """Feature rows of rows ``idx`` of ``table`` in ``setting``: a forward row per layer and, in training, a
        train-step row (interleaved: forward, train-step). Raises ``ValueError`` for a row :meth:`applies`
        rejects or an unknown mode."""
        s = setting
        if s.mode not in ("training", "inference"):
            raise ValueError(f"mode must be 'training' or 'inference', got {s.mode!r}")
        for i in idx.tolist():
            reason = self.applies_layer(table.layers[i], table.costs[i], s.hardware.kind)
            if reason is not None:
                raise ValueError(f"LearnedPredictor cannot estimate {table.layers[i].name!r}: {reason}")
        hw, seen = self._canonical(s.hardware)
        prec, stack = str(s.precision), s.software_stack.value
        raw_f = raw_for(table, hw, pass_="forward", optimizer="none", precision=prec, stack=stack)[idx]
        if s.mode == "training":
            raw_t = raw_for(table, hw, pass_="train_step", optimizer=s.optimizer, precision=prec, stack=stack,
                            optimizer_per_params=True)[idx]
            raw = np.empty((2 * len(idx), raw_f.shape[1]))
            raw[0::2], raw[1::2] = raw_f, raw_t
        else:
            raw = raw_f
        return _Prepared(table=table, idx=idx, setting=s, seen=seen, raw=raw, features=features_from_raw(raw))

    def finish(self, prep: _Prepared, out_ln: np.ndarray) -> Estimates:
        """Estimates of a :meth:`prepare` from the model's ln-ms quantiles ``out_ln`` ``[rows, 3]`` of its features."""
        s, table, idx = prep.setting, prep.table, prep.idx
        # never below the physics floor (the graph guarantees it up to float32 rounding; this in float64)
        out_ms = np.maximum(np.exp(out_ln.astype(np.float64)), floor_ms_from_raw(prep.raw)[:, None])
        training = s.mode == "training"
        f_rows = out_ms[0::2] if training else out_ms
        fwd = f_rows[:, 1]
        before, after = self._setting_notes(s, prep.seen)
        scope = self._scope.get(s.hardware.kind, {})
        precision_note = ([f"precision {str(s.precision)!r} was not measured"]
                          if str(s.precision) not in scope.get("measured_precision", scope.get("precision", ("fp32",)))
                          else [])
        opt_note = (f"optimizer {s.optimizer!r} was not measured"
                    if training and s.optimizer not in scope.get("optimizers", ()) else None)
        layer_notes = table.memo(("learned-layer-notes", self.version), lambda: [
            self._layer_notes(layer) for layer in table.layers])
        assert isinstance(layer_notes, list)
        f_range = self._range_notes(s.hardware.kind, table, idx, prep.features[0::2] if training else prep.features)
        if training:
            t_rows = out_ms[1::2]
            t_range = self._range_notes(s.hardware.kind, table, idx, prep.features[1::2])
            total = t_rows[:, 1]
            p10, p90 = t_rows[:, 0], t_rows[:, 2]
            fwd_out, bwd_out, upd_out = self._split(table, idx, s, total=total, forward=fwd)
        else:
            t_range = f_range
            p10, p90 = f_rows[:, 0], f_rows[:, 2]
            fwd_out, bwd_out, upd_out = fwd, np.zeros_like(fwd), np.zeros_like(fwd)
        params = table.params[idx]
        notes: list[tuple[str, ...]] = []
        for j, i in enumerate(idx.tolist()):
            row = list(before)
            if t_range[j] is not None:
                row.append(t_range[j])  # type: ignore[arg-type]
            row += after
            if opt_note is not None and params[j] > 0:
                row.append(opt_note)
            row += precision_note
            row += layer_notes[i]
            if training and f_range[j] is not None and f_range[j] not in row:
                row.append(f_range[j])  # type: ignore[arg-type]
            notes.append(tuple(row))
        parts_sum = fwd_out + bwd_out + upd_out
        return Estimates(
            forward_ms=fwd_out, backward_ms=bwd_out, update_ms=upd_out,
            total_ms_p10=np.minimum(p10, parts_sum), total_ms_p90=np.maximum(p90, parts_sum),
            method=["learned"] * len(idx), out_of_distribution=np.asarray([bool(n) for n in notes], dtype=bool),
            notes=notes,
        )

    def estimate_tables(self, items: Sequence[tuple[LayerTable, np.ndarray, Setting]]) -> list[Estimates]:
        """Estimates of rows ``idx`` of each ``(table, idx, setting)``, every item's feature rows through one
        ``session.run``. Raises ``ValueError`` for a row :meth:`applies` rejects or an unknown mode."""
        preps = [self.prepare(t, idx, s) for t, idx, s in items]
        if not preps:
            return []
        feats = np.concatenate([p.features for p in preps]) if len(preps) > 1 else preps[0].features
        out = self.run_features(feats)
        results, start = [], 0
        for p in preps:
            stop = start + len(p.features)
            results.append(self.finish(p, out[start:stop]))
            start = stop
        return results

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query (:meth:`estimate_tables` over the queries grouped by setting).

        Raises ``ValueError`` for a query :meth:`applies` rejects or with an unknown mode.
        """
        return estimate_queries(queries, self.estimate_tables)

    def _split(self, table: LayerTable, idx: np.ndarray, s: Setting, *, total: np.ndarray,
               forward: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, backward, update) of each train-step row: :func:`split_training_step` with the update's and
        the backward's roofline times at the device's peak for the precision."""
        hw = s.hardware
        peak = float(hw.peak_for(s.precision))
        bw = float(hw.memory_bandwidth_bytes_per_s)
        upd_flops, upd_bytes = update_cost(table.params[idx], s.optimizer)
        update = np.maximum(upd_flops / peak, upd_bytes / bw) * 1e3
        bwd_min = np.maximum(table.backward_flops[idx] / peak, table.backward_bytes[idx] / bw) * 1e3
        parts = [split_training_step(total_ms=t, forward_ms=f, update_ms=u, backward_min_ms=b)
                 for t, f, u, b in zip(total.tolist(), forward.tolist(), update.tolist(), bwd_min.tolist(),
                                       strict=True)]
        arr = np.asarray(parts, dtype=np.float64).reshape(len(parts), 3)
        return arr[:, 0], arr[:, 1], arr[:, 2]


@dataclass(frozen=True, slots=True)
class _Prepared:
    """Feature rows of one table item (:meth:`LearnedPredictor.prepare`)."""

    table: LayerTable
    idx: np.ndarray
    setting: Setting
    seen: bool
    raw: np.ndarray
    features: np.ndarray


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


def _cpu_identity(hw: HardwareSpec) -> tuple[str, int, int | None]:
    return (hw.name, int(hw.compute_units), hw.vector_width_bits)


def _applies_to(applies: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Scope per hardware kind from the metadata's ``applies_to`` (v2: keyed by kind; v1: one flat GPU scope)."""
    if "op_kinds" in applies:  # v1 schema
        applies = {str(applies.get("hardware_kind", "gpu")): applies}
    out: dict[str, dict[str, Any]] = {}
    for kind, a in applies.items():
        dims = a.get("conv_spatial_dims", [2])
        out[str(kind)] = {
            "op_kinds": frozenset(a.get("op_kinds", ())),
            "conv_spatial_dims": frozenset(dims if isinstance(dims, list) else [dims]),
            "grouped_conv": bool(a.get("grouped_conv", False)),
            "optimizers": frozenset(a.get("optimizers", ())),
            "precision": frozenset(a.get("precision", ("fp32",))),
            "measured_precision": frozenset(a.get("measured_precision", a.get("precision", ("fp32",)))),
            "stacks": frozenset(a.get("stacks", (DEFAULT_STACK,))),
        }
    return out


def _feature_ranges(metadata: Mapping[str, Any]) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """Widened (lo, hi) feature bounds per (hardware kind, op kind) from ``feature_ranges`` (v3), or one pooled
    range ``(kind, "*")`` for every kind from ``feature_min``/``feature_max`` (v1/v2 artifacts)."""
    out: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    def widen(lo: Sequence[float], hi: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        fmin, fmax = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        span = np.maximum(fmax - fmin, 1e-6)
        return fmin - RANGE_MARGIN * span, fmax + RANGE_MARGIN * span

    ranges = metadata.get("feature_ranges")
    if isinstance(ranges, Mapping):
        for hw_kind, per_op in ranges.items():
            for op_kind, r in per_op.items():
                out[(str(hw_kind), str(op_kind))] = widen(r["min"], r["max"])
        return out
    pooled = widen(metadata["feature_min"], metadata["feature_max"])
    return {("gpu", "*"): pooled, ("cpu", "*"): pooled}


def read_metadata(path: Path) -> dict[str, Any]:
    """Parse a model metadata JSON file; raises ``FileNotFoundError``/``json.JSONDecodeError``."""
    return json.loads(Path(path).read_text())
