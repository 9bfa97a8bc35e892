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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from app.core.costs import optimizer_update_cost
from app.core.features import (
    ACTIVATIONS,
    DEFAULT_STACK,
    FEATURE_NAMES,
    FeatureInput,
    features_from_raw,
    floor_ms_from_raw,
    raw_matrix,
    select_features,
)
from app.core.hardware import HardwareSpec, hardware_from_dict
from app.core.ir import ConvAttrs, OpKind
from app.core.roofline import roofline_time_s
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, split_training_step

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
        layer, cost = query.layer, query.cost
        if not cost.supported:
            return "unsupported op"
        scope = self._scope.get(query.hardware.kind)
        if scope is None:
            return f"learned model has no measurements on {query.hardware.kind} devices"
        if layer.kind.value not in scope["op_kinds"]:
            return f"no measurements for op kind {layer.kind.value} on {query.hardware.kind}"
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

    def _ood_notes(self, q: LayerTimeQuery, feats: np.ndarray, seen: bool) -> list[str]:
        notes: list[str] = []
        if not seen:
            notes.append(f"hardware {q.hardware.id!r} ({q.hardware.name}) was not in the training data")
        x = select_features(feats[None, :], self.feature_names)[0]
        rng = self._ranges.get((q.hardware.kind, q.layer.kind.value)) or self._ranges.get((q.hardware.kind, "*"))
        if rng is None:
            notes.append(f"no {q.hardware.kind} training rows of op kind {q.layer.kind.value}")
        else:
            out = np.nonzero((x < rng[0]) | (x > rng[1]))[0]
            if len(out):
                notes.append("features outside the training range: " + ", ".join(self.feature_names[i] for i in out))
        scope = self._scope.get(q.hardware.kind, {})
        if q.software_stack.value not in scope.get("stacks", (DEFAULT_STACK,)):
            notes.append(f"software stack {q.software_stack.value!r} was not measured")
        if q.mode == "training" and q.optimizer not in scope.get("optimizers", ()) and q.cost.params:
            notes.append(f"optimizer {q.optimizer!r} was not measured")
        if str(q.precision) not in scope.get("measured_precision", scope.get("precision", ("fp32",))):
            notes.append(f"precision {str(q.precision)!r} was not measured")
        act = q.layer.activation
        if act not in ACTIVATIONS and act != "none":
            notes.append(f"fused activation {act!r} was not measured")
        if isinstance(q.layer.attrs, ConvAttrs) and any(d != 1 for d in q.layer.attrs.dilations):
            notes.append("dilated convolutions were not measured")
        return notes

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query, all in one ``session.run``.

        Raises ``ValueError`` for a query :meth:`applies` rejects or with an unknown mode.
        """
        rows: list[FeatureInput] = []
        seen_l: list[bool] = []
        for q in queries:
            reason = self.applies(q)
            if reason is not None:
                raise ValueError(f"LearnedPredictor cannot estimate {q.layer.name!r}: {reason}")
            if q.mode not in ("training", "inference"):
                raise ValueError(f"mode must be 'training' or 'inference', got {q.mode!r}")
            hw, seen = self._canonical(q.hardware)
            seen_l.append(seen)
            prec, stack = str(q.precision), q.software_stack.value
            rows.append(FeatureInput(q.layer, q.cost, hw, "forward", "none", prec, stack))
            if q.mode == "training":
                opt = q.optimizer if q.cost.params else "none"
                rows.append(FeatureInput(q.layer, q.cost, hw, "train_step", opt, prec, stack))
        raw = raw_matrix(rows)
        feats = features_from_raw(raw)
        out_ln = self.run_features(feats).astype(np.float64)
        # never below the physics floor (the graph guarantees it up to float32 rounding; this in float64)
        out_ms = np.maximum(np.exp(out_ln), floor_ms_from_raw(raw)[:, None])
        results: list[LayerTimeEstimate] = []
        i = 0
        for q, seen in zip(queries, seen_l, strict=True):
            f_row = i
            fwd = float(out_ms[f_row, 1])
            if q.mode == "inference":
                i += 1
                p10, p90 = float(out_ms[f_row, 0]), float(out_ms[f_row, 2])
                notes = self._ood_notes(q, feats[f_row], seen)
                parts = (fwd, 0.0, 0.0)
            else:
                t_row = i + 1
                i += 2
                total = float(out_ms[t_row, 1])
                p10, p90 = float(out_ms[t_row, 0]), float(out_ms[t_row, 2])
                notes = self._ood_notes(q, feats[t_row], seen)
                notes += [n for n in self._ood_notes(q, feats[f_row], seen) if n not in notes]
                parts = self._split(q, total=total, forward=fwd)
            p10 = min(p10, sum(parts))
            p90 = max(p90, sum(parts))
            results.append(
                LayerTimeEstimate(
                    forward_ms=parts[0],
                    backward_ms=parts[1],
                    update_ms=parts[2],
                    total_ms_p10=p10,
                    total_ms_p90=p90,
                    method="learned",
                    out_of_distribution=bool(notes),
                    notes=tuple(notes),
                )
            )
        return results

    @staticmethod
    def _split(q: LayerTimeQuery, *, total: float, forward: float) -> tuple[float, float, float]:
        hw = q.hardware
        peak = float(hw.peak_for(q.precision))
        bw = float(hw.memory_bandwidth_bytes_per_s)
        c = q.cost
        upd_flops, upd_bytes = optimizer_update_cost(c.params, q.optimizer)
        update = roofline_time_s(upd_flops, upd_bytes, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw) * 1e3
        bwd_min = (
            roofline_time_s(c.backward_flops, c.backward_bytes, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw) * 1e3
        )
        return split_training_step(total_ms=total, forward_ms=forward, update_ms=update, backward_min_ms=bwd_min)


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
