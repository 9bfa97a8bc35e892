"""Learned per-layer runtime predictor: the ONNX MLP exported by :mod:`app.training.train`, served with
onnxruntime (no torch).

Applies to 2-D, ungrouped convolutions (:attr:`OpKind.CONV` with a 4-D weight) and fully connected
layers (:attr:`OpKind.GEMM`) on GPU devices; :meth:`LearnedPredictor.applies` says why not otherwise and
the registry routes such layers to the roofline fallback.

The model predicts ln ms at p10/p50/p90 of either a forward pass or a whole training step (forward +
backward + optimizer update), the two things the Justus et al. 2018 data measure. A training query is
therefore featurised twice (forward row and train-step row) and the step is split with
:func:`app.predictor.base.split_training_step`: ``update_ms`` = pure roofline (memory-bound) time of
:func:`app.core.costs.optimizer_update_cost`, ``backward_ms`` = step − forward − update, at least the
backward pass's own roofline time.

Intervals are the model's calibrated p10/p90; on hardware absent from the training data their ln-space
offsets from p50 are widened by ``metadata["ood_hardware_interval_scale"]`` (calibrated by
leave-one-GPU-out in :mod:`app.training.train`).

Out of distribution (flag + note): hardware id not among the training GPUs, any feature outside the
training range widened by :data:`RANGE_MARGIN` of its span on each side, an optimizer, precision or
activation that was never measured, or dilated convolutions.
"""

from __future__ import annotations

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
    layer_features_batch,
)
from app.core.ir import OpKind
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
        if tuple(metadata["feature_names"]) != FEATURE_NAMES:
            raise ValueError(
                f"model {onnx_path.name} was trained on other features than app.core.features.FEATURE_NAMES"
            )
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
        self._train_hw = frozenset(metadata.get("training_hardware", {}))
        applies = metadata.get("applies_to", {})
        self._optimizers = frozenset(applies.get("optimizers", ()))
        self._precisions = frozenset(applies.get("precision", ("fp32",)))
        self._ood_scale = tuple(float(v) for v in metadata.get("ood_hardware_interval_scale", (1.0, 1.0)))

    @staticmethod
    def applies(query: LayerTimeQuery) -> str | None:
        """``None`` when this predictor can serve ``query``, else the reason it cannot."""
        layer, cost = query.layer, query.cost
        if not cost.supported:
            return "unsupported op"
        if query.hardware.kind != "gpu":
            return "learned model covers GPUs only"
        if layer.kind is OpKind.GEMM:
            return None if layer.inputs and layer.outputs else "gemm without shapes"
        if layer.kind is OpKind.CONV:
            if not layer.weights or len(layer.weights[0].shape) != 4:
                return "learned model covers 2-D convolutions only"
            if int(layer.attrs.get("group", 1)) != 1:
                return "grouped/depthwise convolutions were not measured"
            return None
        return f"no measurements for op kind {layer.kind.value}"

    def run_features(self, features: np.ndarray) -> np.ndarray:
        """Raw model output for a feature matrix ``[N, F]``: ln ms quantiles ``[N, 3]`` (one session.run)."""
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.shape[0] == 0:
            return np.zeros((0, 3), dtype=np.float32)
        return self._session.run(None, {self._input: x})[0]

    def _ood_notes(self, q: LayerTimeQuery, feats: np.ndarray) -> list[str]:
        notes: list[str] = []
        if q.hardware.id not in self._train_hw:
            notes.append(f"hardware {q.hardware.id!r} was not in the training data")
        out = np.nonzero((feats < self._lo) | (feats > self._hi))[0]
        if len(out):
            notes.append("features outside the training range: " + ", ".join(FEATURE_NAMES[i] for i in out))
        if q.mode == "training" and q.optimizer not in self._optimizers:
            notes.append(f"optimizer {q.optimizer!r} was not measured")
        if q.precision not in self._precisions:
            notes.append(f"precision {q.precision!r} was not measured")
        act = str(q.layer.attrs.get("activation", "none")).lower()
        if act not in ACTIVATIONS and act != "none":
            notes.append(f"fused activation {act!r} was not measured")
        if any(int(d) != 1 for d in q.layer.attrs.get("dilations", ()) or ()):
            notes.append("dilated convolutions were not measured")
        return notes

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query, all in one ``session.run``.

        Raises ``ValueError`` for a query :meth:`applies` rejects or with an unknown mode.
        """
        rows: list[FeatureInput] = []
        for q in queries:
            reason = self.applies(q)
            if reason is not None:
                raise ValueError(f"LearnedPredictor cannot estimate {q.layer.name!r}: {reason}")
            if q.mode not in ("training", "inference"):
                raise ValueError(f"mode must be 'training' or 'inference', got {q.mode!r}")
            rows.append(FeatureInput(q.layer, q.cost, q.hardware, "forward", "none", q.precision))
            if q.mode == "training":
                rows.append(FeatureInput(q.layer, q.cost, q.hardware, "train_step", q.optimizer, q.precision))
        feats = layer_features_batch(rows)
        out_ln = self.run_features(feats).astype(np.float64)
        # Unseen hardware: widen the ln-space interval offsets by the leave-one-GPU-out scale.
        unseen = np.array([q.hardware.id not in self._train_hw for q in queries for _ in range(
            1 if q.mode == "inference" else 2)], dtype=bool)  # fmt: skip
        if unseen.any():
            p50 = out_ln[unseen, 1]
            out_ln[unseen, 0] = p50 - (p50 - out_ln[unseen, 0]) * self._ood_scale[0]
            out_ln[unseen, 2] = p50 + (out_ln[unseen, 2] - p50) * self._ood_scale[1]
        out_ms = np.exp(out_ln)
        results: list[LayerTimeEstimate] = []
        i = 0
        for q in queries:
            f_row = i
            fwd = float(out_ms[f_row, 1])
            if q.mode == "inference":
                i += 1
                p10, p90 = float(out_ms[f_row, 0]), float(out_ms[f_row, 2])
                notes = self._ood_notes(q, feats[f_row])
                parts = (fwd, 0.0, 0.0)
            else:
                t_row = i + 1
                i += 2
                total = float(out_ms[t_row, 1])
                p10, p90 = float(out_ms[t_row, 0]), float(out_ms[t_row, 2])
                notes = self._ood_notes(q, feats[t_row])
                notes += [n for n in self._ood_notes(q, feats[f_row]) if n not in notes]
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


def read_metadata(path: Path) -> dict[str, Any]:
    """Parse a model metadata JSON file; raises ``FileNotFoundError``/``json.JSONDecodeError``."""
    return json.loads(Path(path).read_text())
