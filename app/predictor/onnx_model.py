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
clamp still bounds it). Such layers are flagged out of distribution with a note. Under fp16/bf16 autocast each
conv/GEMM/matmul/recurrent layer's forward also pays autocast's weight cast
(:meth:`LearnedPredictor._autocast_casts`).

Never slower on tensor cores than without: a row that runs on tensor cores under the query's precision and
is predicted there directly (its op kind was measured on tensor cores: GEMMs in Vidur's fp16 rows) is also
predicted at :data:`REFERENCE_PRECISION`, and each quantile of each pass is the smaller of the two: the
forward, the learned train step, and a backward carried from the forward against the one carried from the
strict forward by the strict floors (autocast's weight cast, which the strict kernel would not pay, is added
after). The library may always run the strict-fp32 kernel (cuBLAS keeps its SIMT kernels under TF32 and picks
by heuristic), and a tensor-core kernel reads at most the strict kernel's bytes at no less than its peak
(:func:`app.core.precision.op_precision`). The model alone extrapolates TF32 GEMMs from kernel-time 16-bit
rows and answered 14-17 % of single conv/linear layers under ``tf32`` slower than strict fp32 on the A10, L4,
H100 and H200, up to 3.4x (``scripts/monotonicity_check.py --precisions``). Capped rows carry a note and are
flagged out of distribution.

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
import logging
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
    HALF_PRECISIONS,
    features_from_raw,
    floor_ms_from_raw,
    gemm_view_applies,
    precision_spec,
    select_features,
)
from app.core.fusion import FOREACH_KERNELS_PER_STEP, TENSORS_PER_LAUNCH
from app.core.hardware import HardwareSpec, hardware_from_dict
from app.core.ir import ConvAttrs, Layer, OpKind
from app.core.precision import TENSOR_CORE_KINDS, Precision, op_precision
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
from app.predictor.roofline import KERNEL_FLOOR_MS_BY_STACK, STREAM_EFFICIENCY, autocast_weight_cast_ms
from app.predictor.table import (
    Estimates,
    LayerTable,
    LazyNotes,
    Setting,
    estimate_queries,
    floors_for,
    raw_for,
    update_cost,
)

_log = logging.getLogger(__name__)

#: The note of a pointwise convolution featurised as a GEMM (:func:`app.core.features.gemm_view_applies`).
POINTWISE_GEMM_NOTE = ("a 1x1 stride-1 convolution: predicted as the GEMM it is (M = batch x spatial positions, "
                       "K = input channels, N = output channels)")

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
        # the exported model runs its GPU and its CPU head on every row and picks one per row: a batch of GPU
        # rows alone goes through the GPU head only (half the nodes), when that gives the same bytes here
        try:
            self._branch = _head_branch(onnx_path, opts, self._session, len(names), np.random.default_rng(0))
        except Exception as exc:  # noqa: BLE001 - an optimisation only: a graph it cannot cut runs whole
            _log.warning("model %s: its GPU head could not be cut out (%s: %s); every row runs the whole graph "
                         "(same answers, slower)", onnx_path.name, type(exc).__name__, exc)
            self._branch = None
        # one thread only: with more, MLAS splits a run's rows among the threads by its length, which moves the
        # remainder rows of each share (measured: 2 threads, 20,001 rows, last-bit differences the small runs
        # of the load-time check do not show)
        self.distinct_rows = threads == 1 and _distinct_run_reproduces(self._run, len(names),
                                                                       np.random.default_rng(0))
        if threads == 1 and not self.distinct_rows:
            _log.warning("model %s: onnxruntime's outputs on this CPU depend on the rows run beside them other than "
                         "as ORT_ROW_BLOCK predicts; every feature row is run (same answers, slower)", onnx_path.name)
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
        return self._run_selected(x)

    def _run_selected(self, x: np.ndarray) -> np.ndarray:
        """:meth:`run_features` of ``x`` ``[N, len(feature_names)]`` float32 (C order), the artifact's columns."""
        if x.shape[0] == 0:
            return np.zeros((0, 3), dtype=np.float32)
        if self.distinct_rows:
            return _run_distinct(self._run, x)
        return self._run(x)

    def _run(self, x: np.ndarray) -> np.ndarray:
        """One ``session.run`` over ``x`` ``[M, len(feature_names)]`` float32 (C order): ``[M, 3]``; through the
        model's else-branch alone (:func:`_head_branch`) when no row of ``x`` takes the other."""
        b = self._branch
        if b is not None and not (x[:, b.column] > b.threshold).any():
            return b.session.run(None, {self._input: x})[0]  # type: ignore[no-any-return]
        return self._session.run(None, {self._input: x})[0]  # type: ignore[no-any-return]

    def _rows(self, table: LayerTable) -> _Rows:
        """Per-row layer facts of ``table`` this predictor reads (once per table and predictor version)."""

        def build() -> _Rows:
            kinds = list(dict.fromkeys(table.kinds))
            if table.pointwise.any() and OpKind.GEMM not in kinds:  # the kind a pointwise conv is featurised as
                kinds.append(OpKind.GEMM)
            pos = {k: i for i, k in enumerate(kinds)}
            n_bwd = [int(x.backward_input_flops > 0) + int(x.backward_weight_flops > 0) if k in TENSOR_CORE_KINDS
                     else int(x.backward_flops > 0 or x.backward_bytes > 0)
                     for k, x in zip(table.kinds, table.costs, strict=True)]
            n = len(table)
            notes = [self._layer_notes(layer) for layer in table.layers]
            sets: dict[tuple[str, ...], int] = {}
            return _Rows(
                kinds=tuple(kinds),
                kind_index=np.asarray([pos[k] for k in table.kinds], dtype=np.intp).reshape(n),
                gemm_kind=pos.get(OpKind.GEMM, -1),
                backward_kernels=np.asarray(n_bwd, dtype=np.float64).reshape(n),
                weight_tensors=np.asarray([len(layer.weights) for layer in table.layers], dtype=np.float64).reshape(n),
                layer_note_index=np.asarray([sets.setdefault(nt, len(sets)) for nt in notes], dtype=np.intp).reshape(n),
                layer_note_sets=tuple(sets),
                reasons={},
                ranges={},
            )

        found = table.memo(("learned-rows", self.version), build)
        assert isinstance(found, _Rows)
        return found

    @staticmethod
    def _layer_notes(layer: Layer) -> tuple[str, ...]:
        """Out-of-distribution notes that depend on the layer alone (fused activation, dilation)."""
        notes: list[str] = []
        act = layer.activation
        if act not in ACTIVATIONS and act != "none":
            notes.append(f"fused activation {act!r} was not measured")
        if isinstance(layer.attrs, ConvAttrs) and any(d != 1 for d, k in zip(layer.attrs.dilations,
                                                                               layer.attrs.kernel_shape, strict=False)
                                                      if k > 1):  # a dilation of a 1-wide kernel axis does nothing
            notes.append("dilated convolutions were not measured")
        return tuple(notes)

    def _range_flags(self, hw_kind: str, rows: _Rows, ki: np.ndarray, x: np.ndarray) -> _RangeFlags:
        """Which rows (model inputs ``x`` ``[len(ki), len(feature_names)]``, featurised as the op kinds
        ``rows.kinds[ki]``) have a range note: their op kind has no training rows on ``hw_kind`` devices, or a
        feature lies outside the widened training range of their (hardware kind, op kind); every row compared
        with its kind's range at once. What :meth:`_range_notes` needs to name them, kept small (the out-of-range
        features of those rows alone, as packed bits) so that the notes can be built later, or never."""
        lo, hi, has = self._kind_ranges(hw_kind, rows)
        out = (x < lo[ki]) | (x > hi[ki])  # the range of a kind without one is (-inf, inf)
        outside = out.any(axis=1)
        bad = np.nonzero(outside)[0]
        return _RangeFlags(missing=~has[ki], outside=outside, bad=bad, bits=np.packbits(out[bad], axis=1),
                           width=out.shape[1])

    def _range_notes(self, hw_kind: str, rows: _Rows, ki: np.ndarray, flags: _RangeFlags
                     ) -> tuple[np.ndarray, list[str | None]]:
        """Per row (featurised as ``rows.kinds[ki]``, its :meth:`_range_flags`): the note on features outside the
        widened training range of its (hardware kind, op kind), or on missing training rows of that op kind;
        ``None`` inside the range. As ``(codes [len(ki)], texts)``: row ``j``'s note is ``texts[codes[j]]``
        (``texts[0]`` is ``None``; one text per op kind without training rows and per distinct set of features out
        of range)."""
        codes = np.zeros(len(ki), dtype=np.intp)
        texts: list[str | None] = [None]
        missing = flags.missing
        for k in np.unique(ki[missing]).tolist():
            codes[ki == k] = len(texts)
            texts.append(f"no {hw_kind} training rows of op kind {rows.kinds[k].value}")
        bad = flags.bad
        if len(bad):
            out = np.unpackbits(flags.bits, axis=1, count=flags.width).astype(bool)
            first, which = _distinct_rows(out)
            codes[bad] = len(texts) + which
            names = self.feature_names
            texts += ["features outside the training range: " + ", ".join(
                names[c] for c in np.nonzero(out[j])[0].tolist()) for j in first.tolist()]  # fmt: skip
        return codes, texts

    def _kind_ranges(self, hw_kind: str, rows: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The widened training range of each op kind of ``rows`` on ``hw_kind`` devices, as ``(lo, hi)``
        ``[K, len(feature_names)]`` float64 (``-inf``/``inf`` for a kind without training rows) and whether
        the kind has one ``[K]``; kept on ``rows`` per device kind."""
        found = rows.ranges.get(hw_kind)
        if found is None:
            width = len(self.feature_names)
            lo = np.full((len(rows.kinds), width), -np.inf)
            hi = np.full((len(rows.kinds), width), np.inf)
            has = np.zeros(len(rows.kinds), dtype=bool)
            for k, kind in enumerate(rows.kinds):
                rng = self._ranges.get((hw_kind, kind.value)) or self._ranges.get((hw_kind, "*"))
                if rng is not None:
                    lo[k], hi[k], has[k] = rng[0], rng[1], True
            found = rows.ranges[hw_kind] = (lo, hi, has)
        return found

    def _prepare(self, table: LayerTable, idx: np.ndarray, s: Setting) -> _Prepared:
        """Plan and featurise rows ``idx`` of ``table`` in ``s`` (module docstring, "Whole-model assembly"), numpy
        over the rows: a forward feature row per layer and, where a learned train step times the step, a
        train-step row (interleaved); rows never measured on tensor cores that use them are featurised at
        :data:`REFERENCE_PRECISION`. Raises ``ValueError`` for a row :meth:`applies` rejects or an unknown mode."""
        if s.mode not in ("training", "inference"):
            raise ValueError(f"mode must be 'training' or 'inference', got {s.mode!r}")
        rows = self._rows(table)
        kind = s.hardware.kind
        if kind not in rows.reasons:
            rows.reasons[kind] = [self.applies_layer(la, c, kind) for la, c in zip(table.layers, table.costs,
                                                                                    strict=True)]
        reasons = rows.reasons[kind]
        for i in idx.tolist():
            if reasons[i] is not None:
                raise ValueError(f"LearnedPredictor cannot estimate {table.layers[i].name!r}: {reasons[i]}")
        hw, seen = self._canonical(s.hardware)
        prec, stack = str(s.precision), s.software_stack.value
        spec = precision_spec(hw, prec)
        # never measured on tensor cores: answer at the reference precision, carried over by the floors
        tc_col = self.feature_names.index("uses_tensor_cores") if "uses_tensor_cores" in self.feature_names else None

        def measured_on_tensor_cores(k: OpKind) -> bool:
            rng = self._ranges.get((hw.kind, k.value)) or self._ranges.get((hw.kind, "*"))
            return not (rng is None or tc_col is None or rng[1][tc_col] < 0.5)

        # the kind each row is featurised as: a pointwise convolution's is gemm where the GEMM view applies
        # (app.core.features.gemm_view_applies); its precision semantics stay a convolution's
        ki = rows.kind_index[idx]
        view = (table.pointwise[idx] if gemm_view_applies(hw.kind, stack) else np.zeros(len(idx), dtype=bool))
        fk = np.where(view, rows.gemm_kind, ki)
        # whose tensor-core rows decide the answer on tensor cores: the GEMM view's only under a 16-bit precision
        # (the GPU GEMM rows on tensor cores are Vidur's fp16 ones; no GPU row ran TF32), so under TF32 a pointwise
        # convolution is carried from strict fp32 like every other convolution
        tk = fk if prec in HALF_PRECISIONS else ki
        on_tc = np.asarray([op_precision(spec, prec, k).tensor_cores for k in rows.kinds], dtype=bool)[ki]
        seen_tc = np.asarray([measured_on_tensor_cores(k) for k in rows.kinds], dtype=bool)[tk]
        transfer = on_tc & ~seen_tc
        ref = REFERENCE_PRECISION.value
        # predicted on tensor cores directly: also at the reference precision, the cap of _assemble
        cap = on_tc & seen_tc if prec != ref else np.zeros(len(idx), dtype=bool)
        training = s.mode == "training"
        learned_step = training and stack in self._scope[hw.kind]["train_step_stacks"]
        floors = floors_for(table, spec, prec, "none")

        def raw(pass_: str, optimizer: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """(raw rows as featurised, the floor_ms column at the query's precision, the capped rows' raw rows at
            the reference precision)."""
            at = raw_for(table, hw, pass_=pass_, optimizer=optimizer, precision=prec, stack=stack,
                         optimizer_per_params=True)[idx]
            floor = floor_ms_from_raw(at)
            if not (transfer.any() or cap.any()):
                return at, floor, at[:0]
            at_ref = raw_for(table, hw, pass_=pass_, optimizer=optimizer, precision=ref, stack=stack,
                             optimizer_per_params=True)[idx]
            return np.where(transfer[:, None], at_ref, at), floor, at_ref[cap]

        raw_f, _, cap_f = raw("forward", "none")
        step_floor = np.zeros(len(idx))
        if learned_step:
            raw_t, step_floor, cap_t = raw("train_step", s.optimizer)
            raw_all, cap_all = _interleave(raw_f, raw_t), _interleave(cap_f, cap_t)
        else:
            raw_all, cap_all = raw_f, cap_f
        # the strict floors of the capped rows: their backward is capped by the one carried from the strict forward
        ref_floors = floors_for(table, spec, ref, "none") if cap.any() and training and not learned_step else None
        cap_floors = ((ref_floors.forward[idx][cap], ref_floors.backward[idx][cap]) if ref_floors is not None
                      else (np.zeros(0), np.zeros(0)))
        # one featurisation of the rows and the capped rows together (row by row: the same bytes as two calls,
        # without the second call's fixed cost, ~0.1 ms of numpy calls)
        features = select_features(features_from_raw(np.concatenate([raw_all, cap_all]) if len(cap_all)
                                                     else raw_all), self.feature_names)
        return _Prepared(table=table, idx=idx, setting=s, rows=rows, feature_kind=fk, tensor_core_kind=tk,
                         seen=seen, transfer=transfer,
                         learned_step=learned_step, forward_floor_ms=floors.forward[idx],
                         backward_floor_ms=floors.backward[idx] if training else np.zeros(len(idx)),
                         step_floor_ms=step_floor, kernel_ms=KERNEL_FLOOR_MS_BY_STACK[s.software_stack],
                         raw=raw_all, features=features, cap=cap, cap_raw=cap_all,
                         cap_forward_floor_ms=cap_floors[0], cap_backward_floor_ms=cap_floors[1])

    def estimate_tables(self, items: Sequence[tuple[LayerTable, np.ndarray, Setting]]) -> list[Estimates]:
        """Estimates of rows ``idx`` of each ``(table, idx, setting)`` (stages: plan and featurise, run,
        assemble), every item's feature rows through one ``session.run``, the rest numpy over the rows.
        Raises ``ValueError`` for a row :meth:`applies` rejects or an unknown mode."""
        preps = [self._prepare(t, idx, s) for t, idx, s in items]
        if not preps:
            return []
        blocks = [p.features for p in preps if len(p.features)]
        x = np.concatenate(blocks) if len(blocks) > 1 else blocks[0] if blocks else preps[0].features
        out = self._run_selected(x)
        results, start = [], 0
        for p in preps:
            mid = start + len(p.raw)
            stop = start + len(p.features)
            results.append(self._assemble(p, out[start:mid], out[mid:stop]))
            start = stop
        return results

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query (:meth:`estimate_tables` over the queries grouped by setting).

        Raises ``ValueError`` for a query :meth:`applies` rejects or with an unknown mode.
        """
        return estimate_queries(queries, self.estimate_tables)

    def _notes(self, p: _Prepared, suffix: Mapping[int, tuple[str, ...]],
               capped: np.ndarray) -> tuple[LazyNotes, np.ndarray]:
        """Notes per row and whether the row is out of distribution (any note besides how its backward was obtained and
        :data:`POINTWISE_GEMM_NOTE`): transfer, unseen hardware, feature range, stack, optimizer, precision, layer, then
        the train-step row's range note where it differs, the reference-precision cap where ``capped`` ``[N]`` (the
        row's p50 came from it), the GEMM view, then ``suffix[kind]`` (how the backward of that op kind index was
        obtained; not out of distribution). The flags are computed here, numpy over the rows; the notes are built on
        their first read (:class:`~app.predictor.table.LazyNotes`: a summary answer never reads them) from what
        :meth:`_note_rows` needs, not from the feature rows."""
        s, idx, rows = p.setting, p.idx, p.rows
        hw = s.hardware
        scope = self._scope.get(hw.kind, {})
        training = s.mode == "training"
        before = [] if p.seen else [f"hardware {hw.id!r} ({hw.name}) was not in the training data"]
        after = ([f"software stack {s.software_stack.value!r} was not measured"]
                 if s.software_stack.value not in scope.get("stacks", (DEFAULT_STACK,)) else [])
        opt_note = (f"optimizer {s.optimizer!r} was not measured"
                    if training and s.optimizer not in scope.get("optimizers", ()) else None)
        prec_note = ([f"precision {str(s.precision)!r} was not measured"]
                     if str(s.precision) not in scope.get("measured_precision", scope.get("precision", ("fp32",)))
                     else [])
        fk = p.feature_kind
        f_flags = self._range_flags(hw.kind, rows, fk, p.selected[0::2] if p.learned_step else p.selected)
        t_flags = self._range_flags(hw.kind, rows, fk, p.selected[1::2]) if p.learned_step else f_flags
        opt = p.table.params[idx] != 0 if opt_note is not None else np.zeros(len(idx), dtype=bool)
        layer_noted = np.asarray([bool(nt) for nt in rows.layer_note_sets], dtype=bool)[rows.layer_note_index[idx]]
        # a row's notes are empty exactly when none of their parts is there (the train step's range note is only
        # left out when the forward's says the same)
        ood = (f_flags.missing | f_flags.outside | t_flags.missing | t_flags.outside | layer_noted
               | p.transfer | capped | opt | bool(before or after or prec_note))
        transfer = p.transfer

        # featurised as another kind than their own: exactly the GEMM-view rows
        view, tk = fk != rows.kind_index[idx], p.tensor_core_kind

        def build() -> list[tuple[str, ...]]:
            return self._note_rows(hw.kind, s.precision, rows, idx, fk, tk, (f_flags, t_flags), opt, transfer,
                                   capped, view, suffix, before=before, after=after, opt_note=opt_note,
                                   prec_note=prec_note)

        return LazyNotes(build), ood

    def _note_rows(self, hw_kind: str, precision: Precision, rows: _Rows, idx: np.ndarray, fk: np.ndarray,
                   tk: np.ndarray, flags: tuple[_RangeFlags, _RangeFlags], opt: np.ndarray, transfer: np.ndarray,
                   capped: np.ndarray, view: np.ndarray, suffix: Mapping[int, tuple[str, ...]], *, before: list[str],
                   after: list[str], opt_note: str | None, prec_note: list[str]) -> list[tuple[str, ...]]:
        """The notes of :meth:`_notes`, row by row. Rows with the same notes share one tuple: the notes are built
        once per distinct combination (range notes, optimizer, layer notes, transfer, cap, GEMM view, kind), not
        once per row."""
        f_code, f_text = self._range_notes(hw_kind, rows, fk, flags[0])
        t_code, t_text = (self._range_notes(hw_kind, rows, fk, flags[1]) if flags[1] is not flags[0]
                          else (f_code, f_text))  # fmt: skip
        columns = (f_code, t_code, opt.astype(np.intp), rows.layer_note_index[idx], transfer.astype(np.intp),
                   capped.astype(np.intp), view.astype(np.intp), tk, rows.kind_index[idx])
        kinds = max(len(rows.kinds), 1)
        radix = (len(f_text), len(t_text), 2, max(len(rows.layer_note_sets), 1), 2, 2, 2, kinds, kinds)
        key = np.zeros(len(idx), dtype=np.int64)
        for col, size in zip(columns, radix, strict=True):
            key = key * size + col
        _, first, which = np.unique(key, return_index=True, return_inverse=True)
        built: list[tuple[str, ...]] = []
        for j in first.tolist():
            f, t, o, ln, tr, cp, vw, tc, ki = (int(col[j]) for col in columns)
            row = list(before)
            if f_text[f] is not None:
                row.append(f_text[f])  # type: ignore[arg-type]
            row += after
            if o:
                row.append(opt_note)  # type: ignore[arg-type]
            row += prec_note
            row += rows.layer_note_sets[ln]
            if t_text[t] is not None and t_text[t] not in row:
                row.append(t_text[t])  # type: ignore[arg-type]
            if cp:
                row.append(f"capped at its {REFERENCE_PRECISION.value} prediction: the {precision} kernel time is "
                           f"not above the {REFERENCE_PRECISION.value} one of the same layer (autocast's weight cast "
                           "is added after)")
            if vw:  # informative, not out of distribution (like the backward's note)
                row.append(POINTWISE_GEMM_NOTE)
            if tr:
                row.insert(0, f"{rows.kinds[tc].value} was not measured on tensor cores: predicted "
                              f"at {REFERENCE_PRECISION.value} and carried to {precision} by the physics floors "
                              "(same efficiency above the launch cost)")
            built.append((*row, *suffix.get(ki, ())))
        return [built[u] for u in which.reshape(len(idx)).tolist()]

    def _assemble(self, p: _Prepared, out_ln: np.ndarray, cap_ln: np.ndarray) -> Estimates:
        """Estimates of a :meth:`_prepare` from the model's ln-ms quantiles ``out_ln`` ``[rows, 3]`` of its features
        and ``cap_ln`` of its capped rows at the reference precision (``[N]`` numpy per pass; see the module
        docstring)."""
        s, idx = p.setting, p.idx
        # never below the physics floor of the row (the graph guarantees it up to float32 rounding; this in float64)
        row_floor = floor_ms_from_raw(p.raw)
        out_ms = np.maximum(np.exp(out_ln.astype(np.float64)), row_floor[:, None])
        step = p.learned_step
        capped = np.zeros(len(idx), dtype=bool)
        ref_fwd: np.ndarray | None = None
        if p.cap.any():  # never above the strict-fp32 answer (module docstring); each pass, each quantile
            ref_ms = np.maximum(np.exp(cap_ln.astype(np.float64)), floor_ms_from_raw(p.cap_raw)[:, None])
            where = np.repeat(p.cap, 2) if step else p.cap
            mine = out_ms[where]
            out_ms[where] = np.minimum(mine, ref_ms)
            ref_fwd = ref_ms[0::2] if step else ref_ms
            bound = ref_fwd[:, 1] < (mine[0::2] if step else mine)[:, 1]
            if step:  # the train step's p50 is the answered total
                bound |= ref_ms[1::2, 1] < mine[1::2, 1]
            capped[p.cap] = bound
        fwd_q = out_ms[0::2] if step else out_ms
        k = p.kernel_ms
        tr = p.transfer
        if tr.any():
            fwd_q = fwd_q.copy()
            fwd_q[tr] = transfer_precision_ms(time_ms=fwd_q[tr], floor_from_ms=(row_floor[0::2] if step else row_floor)
                                              [tr, None], floor_to_ms=p.forward_floor_ms[tr, None], overhead_ms=k)
        suffix: dict[int, tuple[str, ...]] = {}
        if s.mode == "training" and not step:
            for ki, c in enumerate(p.rows.kinds):
                e = self._excess.get(c, PHYSICS_EXCESS)
                suffix[ki] = (f"backward from the forward: {e.median:.3g} x the physics-floor ratio ({e.source})",)
        f10, f50, f90 = fwd_q[:, 0], fwd_q[:, 1], fwd_q[:, 2]
        n = len(idx)
        cast = self._autocast_casts(p)
        if cast is not None:  # forward only: the backward reads autocast's cached 16-bit copy
            f10, f50, f90 = f10 + cast, f50 + cast, f90 + cast
        if s.mode == "inference":
            fwd, bwd, upd, p10, p90 = f50, np.zeros(n), np.zeros(n), f10, f90
        elif step:
            step_q = out_ms[1::2]
            if tr.any():
                step_q = step_q.copy()
                over = k * (1 + p.rows.backward_kernels[idx][tr, None])
                step_q[tr] = transfer_precision_ms(time_ms=step_q[tr], floor_from_ms=row_floor[1::2][tr, None],
                                                   floor_to_ms=p.step_floor_ms[tr, None], overhead_ms=over)
            fwd, bwd, upd = self._split(p, total=step_q[:, 1], forward=f50)
            parts = fwd + bwd + upd
            p10, p90 = np.minimum(step_q[:, 0], parts), np.maximum(step_q[:, 2], parts)
        else:
            excess = np.asarray([self._excess.get(k_, PHYSICS_EXCESS).median for k_ in p.rows.kinds],
                                dtype=np.float64)[p.rows.kind_index[idx]]
            upd = self._update(p)

            # the three quantiles at once (element-wise: the same figures as one call per quantile)
            bwd_q = np.asarray(backward_from_forward_ms(
                forward_ms=fwd_q, floor_forward_ms=p.forward_floor_ms[:, None],
                floor_backward_ms=p.backward_floor_ms[:, None], kernels=p.rows.backward_kernels[idx][:, None],
                kernel_ms=k, excess=excess[:, None]))
            if ref_fwd is not None:  # capped rows: nor above the backward carried from the strict forward
                cap = p.cap
                ref_bwd = np.asarray(backward_from_forward_ms(
                    forward_ms=ref_fwd, floor_forward_ms=p.cap_forward_floor_ms[:, None],
                    floor_backward_ms=p.cap_backward_floor_ms[:, None],
                    kernels=p.rows.backward_kernels[idx][cap][:, None], kernel_ms=k, excess=excess[cap][:, None]))
                mine_bwd = bwd_q[cap]
                capped[cap] |= ref_bwd[:, 1] < mine_bwd[:, 1]
                bwd_q[cap] = np.minimum(mine_bwd, ref_bwd)
            fwd, bwd = f50, bwd_q[:, 1]
            # the interval is the forward's (conformal, leave-one-GPU-out) carried through the same ratio
            p10, p90 = f10 + bwd_q[:, 0] + upd, f90 + bwd_q[:, 2] + upd
        total = fwd + bwd + upd
        notes, ood = self._notes(p, suffix, capped)
        return Estimates(forward_ms=fwd, backward_ms=bwd, update_ms=upd, total_ms_p10=np.minimum(p10, total),
                         total_ms_p90=np.maximum(p90, total), method=["learned"] * n, out_of_distribution=ood,
                         notes=notes)

    @staticmethod
    def _autocast_casts(p: _Prepared) -> np.ndarray | None:
        """:func:`app.predictor.roofline.autocast_weight_cast_ms` of each row's conv/GEMM/matmul/recurrent weights
        (:func:`app.core.precision.autocast_cast_bytes`), ms ``[N]``; None when no row pays one."""
        s, idx = p.setting, p.idx
        cast_bytes = p.table.cast_bytes(str(s.precision), training=s.mode == "training")[idx]
        cast = autocast_weight_cast_ms(cast_bytes, precision=str(s.precision),
                                       hardware=s.hardware, stack=s.software_stack, kernel_ms=p.kernel_ms)
        return cast if cast.any() else None

    @staticmethod
    def _update(p: _Prepared) -> np.ndarray:
        """The optimizer step of each row (ms, ``[N]``): :func:`app.predictor.roofline.streaming_update_ms`
        over the rows (a streaming kernel at the fp32 vector peak plus the layer's share of the foreach
        launches at the stack's per-kernel floor); 0 without parameters."""
        s, idx = p.setting, p.idx
        params = p.table.params[idx]
        flops, nbytes = update_cost(params, s.optimizer)
        work = (params > 0) & ((flops != 0) | (nbytes != 0))
        if not work.any():
            return np.zeros(len(idx))
        peak = op_precision(s.hardware, s.precision, OpKind.ELEMENTWISE).peak_flops_per_s
        bw = float(s.hardware.memory_bandwidth_bytes_per_s) * STREAM_EFFICIENCY
        launches = FOREACH_KERNELS_PER_STEP[s.optimizer] * p.rows.weight_tensors[idx] / TENSORS_PER_LAUNCH
        ms = np.maximum(flops / peak, nbytes / bw) * 1e3 + p.kernel_ms * launches
        return np.where(work, ms, 0.0)

    @staticmethod
    def _split(p: _Prepared, *, total: np.ndarray, forward: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, backward, update) of each learned train step: :func:`split_training_step` with the update's
        and the backward's roofline times at the device's peak for the precision."""
        s, t, idx = p.setting, p.table, p.idx
        hw = s.hardware
        peak = float(hw.peak_for(s.precision))
        bw = float(hw.memory_bandwidth_bytes_per_s)
        upd_flops, upd_bytes = update_cost(t.params[idx], s.optimizer)
        update = np.maximum(upd_flops / peak, upd_bytes / bw) * 1e3
        bwd_min = np.maximum(t.backward_flops[idx] / peak, t.backward_bytes[idx] / bw) * 1e3
        return split_training_step(total_ms=total, forward_ms=forward, update_ms=update, backward_min_ms=bwd_min)


#: Rows of a ``session.run`` that onnxruntime's CPU GEMMs (MLAS) compute in blocks: measured on the shipped
#: model (one thread, AVX-512), a row's output depends on its own values alone when it lies among the first
#: ``M - M % ORT_ROW_BLOCK`` rows of a run of ``M``; the last ``M % ORT_ROW_BLOCK`` rows go through remainder
#: kernels whose last bits differ (up to 2.4e-7 in ln ms) and equal those rows run on their own. 400 random
#: draws of 1-400 rows from real graphs' features: no exception. :func:`_distinct_run_reproduces` checks it
#: on the machine at load. Not with more than one intra-op thread: the threads' shares of the rows (and so
#: their remainders) depend on ``M`` (2 threads: 20,001 rows differ in the last bit, up to 3e-8), so a
#: predictor with ``threads > 1`` runs every row.
ORT_ROW_BLOCK = 4


def _run_distinct(run: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``run(x)`` (``[M, 3]``, bit for bit as :data:`ORT_ROW_BLOCK` describes it) from one run over fewer rows:
    the distinct rows among the first ``M - M % ORT_ROW_BLOCK``, padded to whole blocks with copies of the
    first, then the last ``M % ORT_ROW_BLOCK`` rows as they are (the run's remainder again). A transformer
    repeats its blocks: a BERT-base table's 140 feature rows hold 17 distinct ones. Rows are compared as
    bytes (``-0.0`` and ``0.0`` are distinct; so is every NaN payload)."""
    m = len(x)
    body = m - m % ORT_ROW_BLOCK
    if body == 0:
        return run(x)
    keys = x[:body].view(np.dtype((np.void, x.shape[1] * x.itemsize))).reshape(body)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    n_u = len(first)
    padded = -(-n_u // ORT_ROW_BLOCK) * ORT_ROW_BLOCK
    if padded >= body:
        return run(x)  # no repeated block's worth of rows
    rows = np.empty((padded + m - body, x.shape[1]), dtype=x.dtype)
    rows[:n_u] = x[first]
    rows[n_u:padded] = x[first[0]]
    rows[padded:] = x[body:]
    done = run(rows)
    out = np.empty((m, done.shape[1]), dtype=done.dtype)
    out[:body] = done[inverse.reshape(body)]
    out[body:] = done[padded:]
    return out


def _distinct_run_reproduces(run: Callable[[np.ndarray], np.ndarray], width: int, rng: np.random.Generator) -> bool:
    """Whether :func:`_run_distinct` equals ``run`` byte for byte on this machine: runs of 1-67 rows, each
    drawn from 24 random rows (so most repeat) with every remainder of :data:`ORT_ROW_BLOCK`."""
    pool = rng.standard_normal((24, width)).astype(np.float32)
    for m in (1, 2, 3, 5, 8, 13, 31, 40, 66, 67):
        x = np.ascontiguousarray(pool[rng.integers(0, len(pool), m)])
        if run(x).tobytes() != _run_distinct(run, x).tobytes():
            return False
    return True


@dataclass(frozen=True, slots=True)
class _Branch:
    """The else-branch of a model whose output is ``Where(features[:, column] > threshold, then, else)``, as a
    session of its own (see :func:`_head_branch`)."""

    session: ort.InferenceSession
    column: int
    threshold: float


def _head_branch(onnx_path: Path, opts: ort.SessionOptions, full: ort.InferenceSession, width: int,
                 rng: np.random.Generator) -> _Branch | None:
    """The GPU head of an exported model as a session of its own: :mod:`app.training.train` exports one graph
    that runs the GPU head and the CPU head on every row and ends in ``Where(is_cpu > 0.5, cpu, gpu)``; a run
    whose rows all take the else-branch needs only the nodes that branch reads (on ``layer-time-mlp-5`` 342 of
    659; 0.09 ms instead of 0.16 ms for one row, 0.17 instead of 0.31 for 44). ``None`` when the output is not
    such a ``Where`` on one input column against a constant, or when the pruned session's outputs differ from
    ``full``'s by a single bit on random else-branch rows (runs of 1-67 and 257 rows; what is served must not
    change)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    g = model.graph
    made = {o: n for n in g.node for o in n.output}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node
              if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"}
    consts.update({t.name: numpy_helper.to_array(t) for t in g.initializer})
    if len(g.input) != 1 or len(g.output) != 1:
        return None
    where = made.get(g.output[0].name)
    greater = made.get(where.input[0]) if where is not None and where.op_type == "Where" else None
    sliced = made.get(greater.input[0]) if greater is not None and greater.op_type == "Greater" else None
    if (where is None or greater is None or sliced is None or sliced.op_type != "Slice"
            or sliced.input[0] != g.input[0].name or len(sliced.input) < 4):
        return None
    args = [consts.get(a) for a in sliced.input[1:5]] + [None] * (5 - len(sliced.input))
    threshold = consts.get(greater.input[1])
    if any(a is None for a in args[:3]) or threshold is None or threshold.size != 1:
        return None
    start, end, axes, steps = (np.asarray(a).reshape(-1).tolist() if a is not None else [1] for a in args[:4])
    if axes not in ([1], [-1]) or steps != [1] or len(start) != 1 or end != [start[0] + 1] or not 0 <= start[0] < width:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        return None  # If/Loop/Scan bodies read outer names the input walk below does not follow
    # the nodes and initializers the else-branch reads, in graph order
    need, todo = set(), [where.input[2]]
    while todo:
        name = todo.pop()
        if name not in need:
            need.add(name)
            if name in made:
                todo.extend(i for i in made[name].input if i)
    pruned = onnx.ModelProto()
    pruned.CopyFrom(model)
    pg = pruned.graph
    del pg.node[:], pg.initializer[:], pg.value_info[:], pg.output[:]
    pg.node.extend(n for n in g.node if any(o in need for o in n.output))
    pg.initializer.extend(t for t in g.initializer if t.name in need)
    out = pg.output.add()
    out.CopyFrom(g.output[0])
    out.name = where.input[2]
    branch = _Branch(ort.InferenceSession(pruned.SerializeToString(), opts, providers=["CPUExecutionProvider"]),
                     int(start[0]), float(threshold.reshape(-1)[0]))
    name = full.get_inputs()[0].name
    for m in (1, 2, 3, 4, 5, 8, 13, 31, 40, 44, 66, 67, 257):
        x = (3 * rng.standard_normal((m, width))).astype(np.float32)
        x[:, branch.column] = np.minimum(x[:, branch.column], branch.threshold)
        if (full.run(None, {name: x})[0].tobytes() != branch.session.run(None, {name: x})[0].tobytes()):
            _log.warning("model %s: its else-branch alone answers other bytes than the whole graph; every row runs "
                         "the whole graph (same answers, slower)", onnx_path.name)
            return None
    return branch


def _distinct_rows(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of equal rows of the boolean matrix ``bits`` ``[M, F]``: ``(first, group)``, the index of one row
    of each group ``[G]`` and each row's group ``[M]``. The rows are packed into 64-bit words and sorted
    numerically (``np.unique(axis=0)`` sorts them as opaque byte strings, ten times slower)."""
    packed = np.packbits(bits, axis=1)
    words = np.zeros((len(packed), -(-packed.shape[1] // 8) * 8), dtype=np.uint8)
    words[:, : packed.shape[1]] = packed
    keys = words.view(np.uint64)
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    group = np.empty(len(order), dtype=np.intp)
    group[order] = np.cumsum(starts) - 1
    return order[starts], group


@dataclass(frozen=True, slots=True)
class _Rows:
    """Layer facts of a table's rows (``[N]`` each): the distinct op kinds and each row's index into them (with
    ``gemm`` among them where a row is a pointwise convolution, ``gemm_kind`` its index, else -1), the
    backward's kernel launches (input and weight gradients, or one), the parameter tensors, the layer-only
    notes (each row's index into the distinct sets of them), and per device kind the reason
    :meth:`LearnedPredictor.applies` rejects a row (``None``: served) and the op kinds' feature ranges
    (:meth:`LearnedPredictor._kind_ranges`)."""

    kinds: tuple[OpKind, ...]
    kind_index: np.ndarray
    gemm_kind: int
    backward_kernels: np.ndarray
    weight_tensors: np.ndarray
    layer_note_index: np.ndarray
    layer_note_sets: tuple[tuple[str, ...], ...]
    reasons: dict[str, list[str | None]]
    ranges: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True, slots=True)
class _RangeFlags:
    """:meth:`LearnedPredictor._range_flags` of rows (``[N]`` each): whether the row's op kind has no training
    rows on the device kind (``missing``), whether a feature lies outside its kind's range (``outside``), and
    for those rows alone (``bad``, their indices ``[B]``) which features, as ``np.packbits`` of the
    ``[B, width]`` booleans along the features."""

    missing: np.ndarray
    outside: np.ndarray
    bad: np.ndarray
    bits: np.ndarray
    width: int


@dataclass(frozen=True, slots=True)
class _Prepared:
    """How rows ``idx`` of ``table`` are answered in ``setting`` (``[N]`` each): the op kind each row is featurised as
    (``feature_kind``, an index into ``rows.kinds``: ``gemm`` for the pointwise convolutions described as GEMMs, the
    only rows whose feature kind is not their own) and the one whose tensor-core training rows decide whether its
    tensor-core answer is learned or carried (``tensor_core_kind``), whether the device is in the training data
    (``seen``), which rows are predicted at :data:`REFERENCE_PRECISION` and carried over (``transfer``), whether a
    learned train-step row times the step (``learned_step``) or the backward comes from the forward, the floors (ms, at
    the setting's precision) of the forward, backward and train step, the stack's fixed cost per kernel (ms), and the
    raw rows and their model inputs (the artifact's feature columns, float32, C order; forward, train step interleaved);
    ``cap`` ``[N]``: the rows predicted on tensor cores directly, whose answers are capped by the same rows at
    :data:`REFERENCE_PRECISION` (``cap_raw`` and ``cap_selected``: those rows only, laid out like ``raw``; ``features``
    holds ``selected`` then ``cap_selected``, one block for the model run;
    ``cap_forward_floor_ms`` and ``cap_backward_floor_ms``: their floors at that precision, where the backward comes
    from the forward, else empty)."""

    table: LayerTable
    idx: np.ndarray
    setting: Setting
    rows: _Rows
    feature_kind: np.ndarray
    tensor_core_kind: np.ndarray
    seen: bool
    transfer: np.ndarray
    learned_step: bool
    forward_floor_ms: np.ndarray
    backward_floor_ms: np.ndarray
    step_floor_ms: np.ndarray
    kernel_ms: float
    raw: np.ndarray
    features: np.ndarray
    cap: np.ndarray
    cap_raw: np.ndarray
    cap_forward_floor_ms: np.ndarray
    cap_backward_floor_ms: np.ndarray

    @property
    def selected(self) -> np.ndarray:
        """The model inputs of ``raw``'s rows (C-order rows of ``features``)."""
        return self.features[: len(self.raw)]

    @property
    def cap_selected(self) -> np.ndarray:
        """The model inputs of ``cap_raw``'s rows (C-order rows of ``features``)."""
        return self.features[len(self.raw):]


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows of ``a`` and ``b`` (same shape ``[N, F]``) alternating: ``[2N, F]``, ``a`` at the even rows."""
    out = np.empty((2 * len(a), a.shape[1]), dtype=a.dtype)
    out[0::2], out[1::2] = a, b
    return out


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
