"""Learned per-layer runtime predictor: the ONNX MLP exported by :mod:`app.training.train`, served with
onnxruntime (no torch).

What it applies to comes from the artifact's metadata (``applies_to``), per hardware kind: for
``layer-time-mlp-2`` on GPUs 2-D ungrouped convolutions and fully connected layers (Justus et al. 2018
data), on CPUs every op kind of the CPU seed dataset (convolutions 1-D/2-D incl. grouped and depthwise,
linear, batched matmul, LSTM/GRU, norms, pooling, activations, softmax, dropout, embedding).
:meth:`LearnedPredictor.applies` says why not otherwise and the registry routes such layers to the
roofline fallback. (Artifacts of the v1 schema: conv/gemm on GPUs only.)

Input columns: the metadata's ``feature_names``, a subset of :data:`app.core.features.FEATURE_NAMES`
picked with :func:`app.core.features.select_features`, so artifacts of older feature schemas keep
loading.

CPU hardware: a CPU spec whose identity (name, cores, vector width) equals a CPU in the metadata's
``training_hardware`` is featurised with the stored spec, not with the one detected now, so serving on
the training machine sees exactly the training features (the measured bandwidth of
:func:`app.hardware.local.detect_local_cpu` varies between runs). Any other CPU is unseen hardware.

The model predicts ln ms at p10/p50/p90 of either a forward pass or a whole training step (forward +
backward + optimizer update), the two things the Justus et al. 2018 data measure. A training query is
therefore featurised twice (forward row and train-step row) and the step is split with
:func:`app.predictor.base.split_training_step`: ``update_ms`` = pure roofline (memory-bound) time of
:func:`app.core.costs.optimizer_update_cost`, ``backward_ms`` = step − forward − update, at least the
backward pass's own roofline time.

Intervals are the model's calibrated p10/p90; on hardware absent from the training data their ln-space
offsets from p50 are widened by ``metadata["ood_hardware_interval_scale"]`` (calibrated by
leave-one-GPU-out in :mod:`app.training.train`).

GPUs outside the training set that are faster than all of them (fp32 peak or bandwidth more than
:data:`app.predictor.transfer.EXTRAPOLATION_MARGIN` above every training GPU's: V100, A100, H100...): the
learned model extrapolates badly there, so each row is predicted on the training GPUs (in distribution)
and scaled by the ratio of roofline times, overhead floor unscaled (:func:`app.predictor.transfer.served_transfer`,
Habitat-style wave scaling; note "transferred from ... by roofline ratio"). Other unseen GPUs keep the
learned model's own prediction. Chosen leave-one-GPU-out (:mod:`app.training.evaluate`).

Out of distribution (flag + note): hardware id not among the training GPUs, any feature outside the
training range widened by :data:`RANGE_MARGIN` of its span on each side, an optimizer, precision or
activation that was never measured, or dilated convolutions.
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
    FEATURE_NAMES,
    FeatureInput,
    features_from_raw,
    raw_matrix,
    select_features,
)
from app.core.hardware import HardwareSpec
from app.core.ir import ConvAttrs, OpKind
from app.core.roofline import roofline_time_s
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, split_training_step
from app.predictor.transfer import served_transfer

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
        fmin = np.asarray(metadata["feature_min"], dtype=np.float64)
        fmax = np.asarray(metadata["feature_max"], dtype=np.float64)
        span = np.maximum(fmax - fmin, 1e-6)
        self._lo = fmin - RANGE_MARGIN * span
        self._hi = fmax + RANGE_MARGIN * span
        train_hw: dict[str, Any] = dict(metadata.get("training_hardware", {}))
        self._train_hw = frozenset(train_hw)
        # stored CPU specs, by identity (name, cores, vector width): serving on the training CPU reuses them
        self._cpu_specs: dict[tuple[str, int, int | None], HardwareSpec] = {}
        for hw_id, d in train_hw.items():
            if isinstance(d, Mapping) and d.get("kind") == "cpu":
                spec = _spec_from_snapshot(hw_id, d)
                self._cpu_specs[_cpu_identity(spec)] = spec
        self._scope = _applies_to(metadata.get("applies_to", {}))
        self._ood_scale = tuple(float(v) for v in metadata.get("ood_hardware_interval_scale", (1.0, 1.0)))
        self._gpu_refs = [
            _spec_from_snapshot(hw_id, d)
            for hw_id, d in train_hw.items()
            if isinstance(d, Mapping) and d.get("kind", "gpu") == "gpu"
        ]
        roof = metadata.get("roofline") or {}
        self._floor_ms = (float(roof.get("floor_forward_ms", 0.0)), float(roof.get("floor_train_step_ms", 0.0)))

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
        out = np.nonzero((x < self._lo) | (x > self._hi))[0]
        if len(out):
            notes.append("features outside the training range: " + ", ".join(self.feature_names[i] for i in out))
        scope = self._scope.get(q.hardware.kind, {})
        if q.mode == "training" and q.optimizer not in scope.get("optimizers", ()) and q.cost.params:
            notes.append(f"optimizer {q.optimizer!r} was not measured")
        if q.precision not in scope.get("precision", ("fp32",)):
            notes.append(f"precision {q.precision!r} was not measured")
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
            rows.append(FeatureInput(q.layer, q.cost, hw, "forward", "none", q.precision))
            if q.mode == "training":
                opt = q.optimizer if q.cost.params else "none"
                rows.append(FeatureInput(q.layer, q.cost, hw, "train_step", opt, q.precision))
        raw = raw_matrix(rows)
        feats = features_from_raw(raw)
        out_ln = self.run_features(feats).astype(np.float64)
        row_q = np.array([k for k, q in enumerate(queries) for _ in range(1 if q.mode == "inference" else 2)])
        transfer_notes = self._transfer(queries, seen_l, rows, raw, row_q, out_ln)
        # Unseen hardware: widen the ln-space interval offsets by the leave-one-GPU-out scale.
        unseen = np.array([not s for q, s in zip(queries, seen_l, strict=True) for _ in range(
            1 if q.mode == "inference" else 2)], dtype=bool)  # fmt: skip
        if unseen.any():
            p50 = out_ln[unseen, 1]
            out_ln[unseen, 0] = p50 - (p50 - out_ln[unseen, 0]) * self._ood_scale[0]
            out_ln[unseen, 2] = p50 + (out_ln[unseen, 2] - p50) * self._ood_scale[1]
        out_ms = np.exp(out_ln)
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
            if q.hardware.id in transfer_notes:
                notes.append(transfer_notes[q.hardware.id])
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

    def _transfer(
        self,
        queries: Sequence[LayerTimeQuery],
        seen_l: Sequence[bool],
        rows: Sequence[FeatureInput],
        raw: np.ndarray,
        row_q: np.ndarray,
        out_ln: np.ndarray,
    ) -> dict[str, str]:
        """Rows on a GPU outside the training set that extrapolates beyond it: replace ``out_ln`` (in
        place) by the roofline-ratio transfer from the training GPUs (:mod:`app.predictor.transfer`).
        Returns a note per transferred hardware id."""
        notes: dict[str, str] = {}
        if not len(raw) or not self._gpu_refs:
            return notes
        by_hw: dict[str, list[int]] = {}
        for k, (q, seen) in enumerate(zip(queries, seen_l, strict=True)):
            if not seen and q.hardware.kind == "gpu":
                by_hw.setdefault(q.hardware.id, []).append(k)
        for hw_id, ks in by_hw.items():
            idx = np.nonzero(np.isin(row_q, ks))[0]
            t = served_transfer(
                lambda x: self.run_features(x).astype(np.float64),
                raw[idx],
                target=queries[ks[0]].hardware,
                refs=self._gpu_refs,
                floor_ms=self._floor_ms,
                precisions=[rows[int(i)].precision for i in idx],
            )
            if t is not None:
                out_ln[idx] = t.ln_ms
                notes[hw_id] = f"transferred from {', '.join(t.references)} by roofline ratio"
        return notes

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


def _spec_from_snapshot(hw_id: str, d: Mapping[str, Any]) -> HardwareSpec:
    """A :class:`HardwareSpec` from a ``training_hardware`` snapshot (``app.training.snapshot.hardware_to_dict``)."""
    return HardwareSpec(
        id=str(d.get("id", hw_id)),
        name=str(d.get("name", hw_id)),
        vendor=str(d.get("vendor", "")),
        kind=d.get("kind", "gpu"),
        peak_flops_per_s={str(k): float(v) for k, v in d.get("peak_flops_per_s", {}).items()},
        memory_bytes=float(d.get("memory_bytes", 0.0)),
        memory_bandwidth_bytes_per_s=float(d.get("memory_bandwidth_bytes_per_s", 0.0)),
        compute_units=int(d.get("compute_units", 1)),
        base_clock_mhz=d.get("base_clock_mhz"),
        boost_clock_mhz=d.get("boost_clock_mhz"),
        tdp_w=d.get("tdp_w"),
        l2_cache_bytes=d.get("l2_cache_bytes"),
        vector_width_bits=d.get("vector_width_bits"),
        architecture=d.get("architecture"),
    )


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
        }
    return out


def read_metadata(path: Path) -> dict[str, Any]:
    """Parse a model metadata JSON file; raises ``FileNotFoundError``/``json.JSONDecodeError``."""
    return json.loads(Path(path).read_text())
