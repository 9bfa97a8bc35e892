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
backward + optimizer update). Whole-model assembly (issue 8 item 5) of a training query:

* where the training data timed whole training steps under the query's stack (``train_step_stacks`` of the
  artifact's scope, else :data:`DEFAULT_TRAIN_STEP_STACKS`: TF1 sessions on GPUs, the Justus data; PyTorch
  eager on CPUs, the profiler), a forward row and a train-step row, the step split with
  :func:`app.predictor.base.split_training_step`;
* elsewhere (every PyTorch answer on a GPU) the backward comes from the forward prediction:
  :func:`app.predictor.base.backward_from_forward_ms` scales the forward's work by the backward's physics
  floor over the forward's (2 for a convolution or GEMM with both gradients, 1 for the first layer, the byte
  ratio of memory-bound ops) times the family's measured excess (:class:`~app.predictor.base.BackwardExcess`:
  convolutions 2.62 / 2 from the DeepBench ratios stored in the artifact's ``backward_forward_ratio``; other
  families 1.0), plus the stack's per-kernel cost for each backward kernel; the optimizer step is the foreach
  streaming update of :func:`app.predictor.roofline.streaming_update_ms`. A TF1 session's train steps (the
  Justus backward at ~4x its forward, session overhead included) never reach a PyTorch answer.

Precision transfer: an op kind that the training rows never showed on tensor cores (the artifact's feature
range of ``uses_tensor_cores`` for that hardware and op kind is 0, e.g. GPU convolutions, which NeuSight and
Justus measured in strict fp32) but that runs on them under the query's precision (TF32 convolutions under
``fp32`` on Ampere and newer, autocast fp16/bf16) is predicted at :data:`REFERENCE_PRECISION` and carried over
by :func:`app.predictor.base.transfer_precision_ms`: the launch cost stays, the work above it scales with
the physics floor at the requested precision (tensor-core peak, 16-bit bytes). It assumes the tensor-core
kernel reaches the strict-fp32 kernel's fraction of its floor; GEMMs measured both ways (NeuSight fp32,
Vidur fp16) reach 0.6-0.75 of it, so the transfer leans fast for large compute-bound convolutions (the floor
clamp still bounds it). Such layers are flagged out of distribution with a note.

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
from dataclasses import dataclass
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
    pass_floor_ms,
    precision_spec,
    raw_matrix,
    select_features,
)
from app.core.hardware import HardwareSpec, hardware_from_dict
from app.core.ir import ConvAttrs, OpKind
from app.core.precision import TENSOR_CORE_KINDS, Precision, floors_by_pass_ms, op_precision, physics_floor_ms
from app.core.roofline import roofline_time_s
from app.core.vocab import Pass
from app.predictor.base import (
    PHYSICS_EXCESS,
    BackwardExcess,
    LayerTimeEstimate,
    LayerTimeQuery,
    backward_excess_from_ratios,
    backward_from_forward_ms,
    split_training_step,
    transfer_precision_ms,
)
from app.predictor.roofline import KERNEL_FLOOR_MS_BY_STACK, streaming_update_ms

RANGE_MARGIN = 0.05
#: The precision an op kind that was never measured on tensor cores is predicted at before the physics floors
#: carry it to the requested one: strict fp32, which every device runs and every GPU source measured.
REFERENCE_PRECISION = Precision.FP32_STRICT
#: Stacks under which the training data timed whole training steps, per hardware kind, for artifacts whose
#: ``applies_to`` does not list ``train_step_stacks``: on GPUs only the Justus et al. 2018 TensorFlow 1.x
#: sessions time a training step (NeuSight and Vidur time forward kernels); on CPUs the project's profiler
#: times PyTorch-eager steps.
DEFAULT_TRAIN_STEP_STACKS: Mapping[str, tuple[str, ...]] = {"gpu": ("tf1-session",), "cpu": ("pytorch-eager",)}


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
        conv_excess = backward_excess_from_ratios(metadata.get("backward_forward_ratio"))
        self._excess: dict[OpKind, BackwardExcess] = (
            {OpKind.CONV: conv_excess, OpKind.CONV_TRANSPOSE: conv_excess} if conv_excess is not None else {})

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

    def _plan(self, q: LayerTimeQuery) -> _Plan:
        """Validate ``q`` and decide how it is answered (see module docstring, "Whole-model assembly")."""
        reason = self.applies(q)
        if reason is not None:
            raise ValueError(f"LearnedPredictor cannot estimate {q.layer.name!r}: {reason}")
        if q.mode not in ("training", "inference"):
            raise ValueError(f"mode must be 'training' or 'inference', got {q.mode!r}")
        hw, seen = self._canonical(q.hardware)
        prec, stack = str(q.precision), q.software_stack.value
        spec = precision_spec(hw, prec)
        # never measured on tensor cores: answer at the reference precision, carried over by the floors
        tensor_cores = op_precision(spec, prec, q.layer.kind).tensor_cores
        rng = self._ranges.get((hw.kind, q.layer.kind.value)) or self._ranges.get((hw.kind, "*"))
        tc_col = self.feature_names.index("uses_tensor_cores") if "uses_tensor_cores" in self.feature_names else None
        transfer = bool(tensor_cores and (rng is None or tc_col is None or rng[1][tc_col] < 0.5))
        training = q.mode == "training"
        learned_step = training and stack in self._scope[hw.kind]["train_step_stacks"]
        fwd_floor = physics_floor_ms(q.layer, q.cost, spec, prec, Pass.FORWARD)
        bwd_floor = floors_by_pass_ms(q.layer, q.cost, spec, prec, training=True)[1] if training else 0.0
        step_floor = pass_floor_ms(layer=q.layer, cost=q.cost, hardware=hw, pass_="train_step",
                                   optimizer=self._step_optimizer(q), precision=prec) if learned_step else 0.0
        c = q.cost
        if q.layer.kind in TENSOR_CORE_KINDS:
            n_bwd = int(c.backward_input_flops > 0) + int(c.backward_weight_flops > 0)
        else:
            n_bwd = int(c.backward_flops > 0 or c.backward_bytes > 0)
        return _Plan(q, hw, seen, transfer, learned_step, fwd_floor, bwd_floor, step_floor, n_bwd,
                     KERNEL_FLOOR_MS_BY_STACK[q.software_stack])

    @staticmethod
    def _step_optimizer(q: LayerTimeQuery) -> str:
        return q.optimizer if q.cost.params else "none"

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query, all in one ``session.run`` (stages: plan, featurise, run, assemble).

        Raises ``ValueError`` for a query :meth:`applies` rejects or with an unknown mode.
        """
        plans = [self._plan(q) for q in queries]
        rows: list[FeatureInput] = []
        for p in plans:
            q = p.query
            prec = REFERENCE_PRECISION.value if p.transfer else str(q.precision)
            stack = q.software_stack.value
            rows.append(FeatureInput(q.layer, q.cost, p.hardware, "forward", "none", prec, stack))
            if p.learned_step:
                rows.append(FeatureInput(q.layer, q.cost, p.hardware, "train_step", self._step_optimizer(q), prec,
                                         stack))
        raw = raw_matrix(rows)
        feats = features_from_raw(raw)
        out_ln = self.run_features(feats).astype(np.float64)
        # never below the physics floor of the row (the graph guarantees it up to float32 rounding; this in float64)
        row_floor = floor_ms_from_raw(raw)
        out_ms = np.maximum(np.exp(out_ln), row_floor[:, None])
        results: list[LayerTimeEstimate] = []
        i = 0
        for p in plans:
            n = 2 if p.learned_step else 1
            results.append(self._assemble(p, out_ms[i:i + n], row_floor[i:i + n], feats[i:i + n]))
            i += n
        return results

    def _assemble(self, p: _Plan, out_ms: np.ndarray, row_floor: np.ndarray, feats: np.ndarray) -> LayerTimeEstimate:
        """One estimate from the model's quantiles ``out_ms`` ``[rows, 3]`` (ms; forward row, then the train-step
        row when ``p.learned_step``) at the precision the rows were featurised with."""
        q = p.query
        notes = self._ood_notes(q, feats[0], p.seen)
        if p.learned_step:
            notes += [n for n in self._ood_notes(q, feats[1], p.seen) if n not in notes]
        fwd_q = out_ms[0]
        if p.transfer:
            fwd_q = np.array([transfer_precision_ms(time_ms=float(t), floor_from_ms=float(row_floor[0]),
                                                    floor_to_ms=p.forward_floor_ms, overhead_ms=p.kernel_ms)
                              for t in fwd_q])  # fmt: skip
            notes.insert(0, f"{q.layer.kind.value} was not measured on tensor cores: predicted at "
                            f"{REFERENCE_PRECISION.value} and carried to {q.precision} by the physics floors "
                            "(same efficiency above the launch cost)")
        if q.mode == "inference":
            f10, f50, f90 = (float(v) for v in fwd_q)
            return self._estimate(f50, 0.0, 0.0, f10, f90, notes)
        if p.learned_step:
            step_q = out_ms[1]
            if p.transfer:
                over = p.kernel_ms * (1 + p.backward_kernels)
                step_q = np.array([transfer_precision_ms(time_ms=float(t), floor_from_ms=float(row_floor[1]),
                                                         floor_to_ms=p.step_floor_ms, overhead_ms=over)
                                   for t in step_q])  # fmt: skip
            parts = self._split(q, total=float(step_q[1]), forward=float(fwd_q[1]))
            return self._estimate(*parts, min(float(step_q[0]), sum(parts)), max(float(step_q[2]), sum(parts)),
                                  notes)
        excess = self._excess.get(q.layer.kind, PHYSICS_EXCESS)
        upd = streaming_update_ms(q)

        def bwd(forward_ms: float, ratio: float) -> float:
            return backward_from_forward_ms(forward_ms=forward_ms, floor_forward_ms=p.forward_floor_ms,
                                            floor_backward_ms=p.backward_floor_ms, kernels=p.backward_kernels,
                                            kernel_ms=p.kernel_ms, excess=ratio)  # fmt: skip

        f10, f50, f90 = (float(v) for v in fwd_q)
        b50 = bwd(f50, excess.median)
        how = f"backward from the forward: {excess.median:.3g} x the physics-floor ratio ({excess.source})"
        # the interval is the forward's (conformal, leave-one-GPU-out) carried through the same ratio
        return self._estimate(f50, b50, upd, f10 + bwd(f10, excess.median) + upd,
                              f90 + bwd(f90, excess.median) + upd, notes, (how,))

    @staticmethod
    def _estimate(fwd: float, bwd: float, upd: float, p10: float, p90: float, ood_notes: list[str],
                  info: tuple[str, ...] = ()) -> LayerTimeEstimate:
        """The estimate of passes (ms) and total quantiles; out of distribution when any ``ood_notes``."""
        total = fwd + bwd + upd
        return LayerTimeEstimate(forward_ms=fwd, backward_ms=bwd, update_ms=upd, total_ms_p10=min(p10, total),
                                 total_ms_p90=max(p90, total), method="learned", out_of_distribution=bool(ood_notes),
                                 notes=(*ood_notes, *info))  # fmt: skip

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


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one query is answered: the spec it is featurised with (``hardware``), whether that device is in the
    training data (``seen``), whether it is predicted at :data:`REFERENCE_PRECISION` and carried over
    (``transfer``), whether a learned train-step row times the step (``learned_step``) or the backward comes
    from the forward, the floors (ms, at the query's precision) of the forward, backward and train step, the
    backward's kernel launches and the stack's fixed cost per kernel (ms)."""

    query: LayerTimeQuery
    hardware: HardwareSpec
    seen: bool
    transfer: bool
    learned_step: bool
    forward_floor_ms: float
    backward_floor_ms: float
    step_floor_ms: float
    backward_kernels: int
    kernel_ms: float


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
            "train_step_stacks": frozenset(a.get("train_step_stacks", DEFAULT_TRAIN_STEP_STACKS.get(str(kind), ()))),
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
