"""The learned predictor's vectorised plan/assemble (numpy over layer-table rows) equals its per-row definition.

:class:`app.predictor.onnx_model.LearnedPredictor` answers table rows with numpy over all rows of a setting
(floors, tensor-core flags, transfer mask, learned-step mask, backward kernel counts, the stack's kernel floor)
and one ``session.run``. :func:`per_row` below is the per-query definition it replaced (plan, featurise, run,
assemble, written with the scalar helpers of :mod:`app.core` and :mod:`app.predictor.base`); the test compares
both on ResNet-50, BERT-base and GPT-2 small for one catalog device of each behaviour (kind, vendor, seen in
training or not, tensor cores per precision and op kind: about 10 of the 27) x precision x mode x stack (relative
1e-6: the model runs in float32 either way, the rest is float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from app.config import REPO_ROOT
from app.core.analysis import GraphAnalysis, analyze
from app.core.costs import optimizer_update_cost
from app.core.features import (
    FeatureInput,
    features_from_raw,
    floor_ms_from_raw,
    gemm_view_applies,
    is_pointwise_conv,
    pass_floor_ms,
    precision_spec,
    raw_matrix,
)
from app.core.hardware import HardwareSpec
from app.core.ir import OpKind
from app.core.precision import (
    TENSOR_CORE_KINDS,
    Precision,
    PrecisionNotSupported,
    autocast_cast_bytes,
    check_precision,
    floors_by_pass_ms,
    op_precision,
    physics_floor_ms,
)
from app.core.roofline import roofline_time_s
from app.core.vocab import Pass, SoftwareStack
from app.graphs.service import build_graph
from app.hardware.catalog import load_catalog
from app.predictor.base import (
    PHYSICS_EXCESS,
    LayerTimeEstimate,
    LayerTimeQuery,
    backward_from_forward_ms,
    split_training_step,
    transfer_precision_ms,
)
from app.predictor.onnx_model import POINTWISE_GEMM_NOTE, REFERENCE_PRECISION, LearnedPredictor
from app.predictor.registry import load_predictor
from app.predictor.roofline import KERNEL_FLOOR_MS_BY_STACK, autocast_weight_cast_ms, streaming_update_ms
from tests.helpers import light_model


def _feature_kind(q: LayerTimeQuery) -> OpKind:
    """The op kind ``q``'s row is featurised as: a pointwise convolution's is gemm where the GEMM view applies."""
    view = is_pointwise_conv(q.layer) and gemm_view_applies(q.hardware.kind, q.software_stack.value)
    return OpKind.GEMM if view else q.layer.kind


def _notes(p: LearnedPredictor, q: LayerTimeQuery, feats: np.ndarray, seen: bool) -> list[str]:
    from app.core.features import ACTIVATIONS, DEFAULT_STACK, select_features
    from app.core.ir import ConvAttrs

    notes: list[str] = []
    if not seen:
        notes.append(f"hardware {q.hardware.id!r} ({q.hardware.name}) was not in the training data")
    x = select_features(feats[None, :], p.feature_names)[0]
    fk = _feature_kind(q)
    rng = p._ranges.get((q.hardware.kind, fk.value)) or p._ranges.get((q.hardware.kind, "*"))
    if rng is None:
        notes.append(f"no {q.hardware.kind} training rows of op kind {fk.value}")
    else:
        out = np.nonzero((x < rng[0]) | (x > rng[1]))[0]
        if len(out):
            notes.append("features outside the training range: " + ", ".join(p.feature_names[i] for i in out))
    scope = p._scope.get(q.hardware.kind, {})
    if q.software_stack.value not in scope.get("stacks", (DEFAULT_STACK,)):
        notes.append(f"software stack {q.software_stack.value!r} was not measured")
    if q.mode == "training" and q.optimizer not in scope.get("optimizers", ()) and q.cost.params:
        notes.append(f"optimizer {q.optimizer!r} was not measured")
    if str(q.precision) not in scope.get("measured_precision", scope.get("precision", ("fp32",))):
        notes.append(f"precision {str(q.precision)!r} was not measured")
    act = q.layer.activation
    if act not in ACTIVATIONS and act != "none":
        notes.append(f"fused activation {act!r} was not measured")
    a = q.layer.attrs
    if isinstance(a, ConvAttrs) and any(d != 1 and k > 1 for d, k in zip(a.dilations, a.kernel_shape, strict=False)):
        notes.append("dilated convolutions were not measured")
    return notes


def _split(q: LayerTimeQuery, *, total: float, forward: float) -> tuple[float, float, float]:
    hw, c = q.hardware, q.cost
    peak, bw = float(hw.peak_for(q.precision)), float(hw.memory_bandwidth_bytes_per_s)
    upd_flops, upd_bytes = optimizer_update_cost(c.params, q.optimizer)
    update = roofline_time_s(upd_flops, upd_bytes, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw) * 1e3
    bwd_min = roofline_time_s(c.backward_flops, c.backward_bytes, peak_flops_per_s=peak, bandwidth_bytes_per_s=bw) * 1e3
    return split_training_step(total_ms=total, forward_ms=forward, update_ms=update, backward_min_ms=bwd_min)


def _est(fwd: float, bwd: float, upd: float, p10: float, p90: float, notes: list[str],
         info: tuple[str, ...] = ()) -> LayerTimeEstimate:
    total = fwd + bwd + upd
    return LayerTimeEstimate(forward_ms=fwd, backward_ms=bwd, update_ms=upd, total_ms_p10=min(p10, total),
                             total_ms_p90=max(p90, total), method="learned", out_of_distribution=bool(notes),
                             notes=(*notes, *info))


def _capped(notes: list[str], bound: bool, q: LayerTimeQuery) -> list[str]:
    """``notes`` with the strict-fp32 cap's note where it bound (after the train step's range note, before the
    tensor-core transfer's, which a capped row never has)."""
    if not bound:
        return notes
    return [*notes, f"capped at its {REFERENCE_PRECISION.value} prediction: the {q.precision} kernel time is not above "
                    f"the {REFERENCE_PRECISION.value} one of the same layer (autocast's weight cast is added after)"]


def per_row(p: LearnedPredictor, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
    """The per-query definition (plan, featurise, one run, assemble) the vectorised path replaced."""
    plans, rows, ref_rows = [], [], []
    for q in queries:
        hw, seen = p._canonical(q.hardware)
        prec, stack = str(q.precision), q.software_stack.value
        spec = precision_spec(hw, prec)
        tc = op_precision(spec, prec, q.layer.kind).tensor_cores  # the layer's own precision semantics
        # whose tensor-core training rows decide whether its tensor-core answer is learned: the GEMM view's under a
        # 16-bit precision only (no GPU row ran TF32)
        tk = _feature_kind(q) if prec in ("fp16", "bf16") else q.layer.kind
        rng = p._ranges.get((hw.kind, tk.value)) or p._ranges.get((hw.kind, "*"))
        tc_col = p.feature_names.index("uses_tensor_cores") if "uses_tensor_cores" in p.feature_names else None
        transfer = bool(tc and (rng is None or tc_col is None or rng[1][tc_col] < 0.5))
        # predicted on tensor cores directly: capped by the same layer at the reference precision
        cap = len(ref_rows) if tc and not transfer and prec != REFERENCE_PRECISION.value else None
        training = q.mode == "training"
        step = training and stack in p._scope[hw.kind]["train_step_stacks"]
        step_opt = q.optimizer if q.cost.params else "none"
        fwd_floor = physics_floor_ms(q.layer, q.cost, spec, prec, Pass.FORWARD)
        bwd_floor = floors_by_pass_ms(q.layer, q.cost, spec, prec, training=True)[1] if training else 0.0
        step_floor = pass_floor_ms(layer=q.layer, cost=q.cost, hardware=hw, pass_="train_step", optimizer=step_opt,
                                   precision=prec) if step else 0.0
        c = q.cost
        if q.layer.kind in TENSOR_CORE_KINDS:
            n_bwd = int(c.backward_input_flops > 0) + int(c.backward_weight_flops > 0)
        else:
            n_bwd = int(c.backward_flops > 0 or c.backward_bytes > 0)
        ref = REFERENCE_PRECISION.value
        ref_floors = ((physics_floor_ms(q.layer, q.cost, spec, ref, Pass.FORWARD),
                       floors_by_pass_ms(q.layer, q.cost, spec, ref, training=True)[1])
                      if cap is not None and training and not step else None)
        plans.append((q, seen, transfer, step, fwd_floor, bwd_floor, step_floor, n_bwd,
                      KERNEL_FLOOR_MS_BY_STACK[q.software_stack], cap, ref_floors, tk))
        fprec = REFERENCE_PRECISION.value if transfer else prec
        rows.append(FeatureInput(q.layer, q.cost, hw, "forward", "none", fprec, stack))
        if step:
            rows.append(FeatureInput(q.layer, q.cost, hw, "train_step", step_opt, fprec, stack))
        if cap is not None:
            ref_rows.append(FeatureInput(q.layer, q.cost, hw, "forward", "none", REFERENCE_PRECISION.value, stack))
            if step:
                ref_rows.append(FeatureInput(q.layer, q.cost, hw, "train_step", step_opt, REFERENCE_PRECISION.value,
                                             stack))

    def run(inputs: list[FeatureInput]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raw = raw_matrix(inputs)
        feats = features_from_raw(raw)
        row_floor = floor_ms_from_raw(raw)
        return feats, row_floor, np.maximum(np.exp(p.run_features(feats).astype(np.float64)), row_floor[:, None])

    feats, row_floor, out_ms = run(rows)
    ref_ms = run(ref_rows)[2] if ref_rows else np.zeros((0, 3))
    results, i = [], 0
    for q, seen, transfer, step, fwd_floor, bwd_floor, step_floor, n_bwd, k, cap, ref_floors, tk in plans:
        notes = _notes(p, q, feats[i], seen)
        view = (POINTWISE_GEMM_NOTE,) if _feature_kind(q) is not q.layer.kind else ()
        if step:
            notes += [n for n in _notes(p, q, feats[i + 1], seen) if n not in notes]
        fwd_q = out_ms[i]
        step_q = out_ms[i + 1] if step else None
        bound = False
        if cap is not None:
            bound = bool(ref_ms[cap][1] < fwd_q[1]) or bool(step and ref_ms[cap + 1][1] < out_ms[i + 1][1])
            fwd_q = np.minimum(fwd_q, ref_ms[cap])
            if step:
                step_q = np.minimum(step_q, ref_ms[cap + 1])
        if transfer:
            fwd_q = np.array([transfer_precision_ms(time_ms=float(t), floor_from_ms=float(row_floor[i]),
                                                    floor_to_ms=fwd_floor, overhead_ms=k) for t in fwd_q])
            notes.insert(0, f"{tk.value} was not measured on tensor cores: predicted at "
                            f"{REFERENCE_PRECISION.value} and carried to {q.precision} by the physics floors "
                            "(same efficiency above the launch cost)")
        # autocast's weight cast (fp16/bf16 on a GPU): one kernel per weighted conv/GEMM/matmul/recurrent forward
        cast = float(autocast_weight_cast_ms(autocast_cast_bytes(q.layer, str(q.precision),
                                                                 training=q.mode == "training"),
                                             precision=str(q.precision), hardware=q.hardware,
                                             stack=SoftwareStack(q.software_stack), kernel_ms=k))  # fmt: skip
        g10, g50, g90 = (float(v) for v in fwd_q)  # the backward is carried from the forward without its cast
        f10, f50, f90 = g10 + cast, g50 + cast, g90 + cast
        if q.mode == "inference":
            results.append(_est(f50, 0.0, 0.0, f10, f90, _capped(notes, bound, q), view))
        elif step:
            assert step_q is not None
            if transfer:
                step_q = np.array([transfer_precision_ms(time_ms=float(t), floor_from_ms=float(row_floor[i + 1]),
                                                         floor_to_ms=step_floor, overhead_ms=k * (1 + n_bwd))
                                   for t in step_q])
            parts = _split(q, total=float(step_q[1]), forward=f50)
            results.append(_est(*parts, min(float(step_q[0]), sum(parts)), max(float(step_q[2]), sum(parts)),
                                _capped(notes, bound, q), view))
        else:
            excess = p._excess.get(q.layer.kind, PHYSICS_EXCESS)
            upd = streaming_update_ms(q)

            def bwd(f: float, ratio: float, ff: float = fwd_floor, fb: float = bwd_floor, n: int = n_bwd,
                    kk: float = k) -> float:
                return backward_from_forward_ms(forward_ms=f, floor_forward_ms=ff, floor_backward_ms=fb, kernels=n,
                                                kernel_ms=kk, excess=ratio)

            b10, b50, b90 = (bwd(g, excess.median) for g in (g10, g50, g90))
            if ref_floors is not None:  # capped: nor above the backward carried from the strict forward
                r10, r50, r90 = (bwd(float(g), excess.median, ref_floors[0], ref_floors[1]) for g in ref_ms[cap])
                bound = bound or r50 < b50
                b10, b50, b90 = min(b10, r10), min(b50, r50), min(b90, r90)
            how = f"backward from the forward: {excess.median:.3g} x the physics-floor ratio ({excess.source})"
            results.append(_est(f50, b50, upd, f10 + b10 + upd, f90 + b90 + upd, _capped(notes, bound, q),
                                (*view, how)))
        i += 2 if step else 1
    return results


@pytest.fixture(scope="module")
def learned() -> LearnedPredictor:
    return load_predictor(REPO_ROOT / "models").learned


def _analysis(name: str) -> GraphAnalysis:
    if name == "resnet50":
        graph = build_graph(light_model("resnet50"), "onnx", batch_size=8)
    else:
        from tests.core.real_models import exported

        graph = build_graph(exported(name).onnx_bytes, "onnx", batch_size=2, dims={"seq": 32})
    return analyze(graph, software_stack=SoftwareStack.PYTORCH_EAGER)


def _behaviour(p: LearnedPredictor, hw: HardwareSpec, kinds: set[OpKind]) -> tuple[object, ...]:
    """What decides the branches of the learned path on ``hw``: its kind and vendor, whether the predictor was
    trained on it (or on the device it stands for), and per precision whether it runs and, per op kind of the
    graph, on tensor cores."""
    canonical, seen = p._canonical(hw)
    out: list[object] = [hw.kind, hw.vendor, seen]
    for prec in Precision:
        try:
            check_precision(hw, prec)
        except PrecisionNotSupported:
            out.append((prec, None))
            continue
        spec = precision_spec(canonical, str(prec))
        out.append((prec, tuple(op_precision(spec, str(prec), k).tensor_cores for k in sorted(kinds))))
    return tuple(out)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b)) + 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet50", "bert", "gpt2"])
def test_vectorised_learned_rows_equal_the_per_row_definition(model: str, learned: LearnedPredictor) -> None:
    a = _analysis(model)
    catalog: dict[str, HardwareSpec] = load_catalog()
    pairs = [(la, c) for la, c in zip(a.graph.layers, a.costs, strict=True)
             if c.supported and learned.applies(LayerTimeQuery(layer=la, cost=c, hardware=catalog["a100-sxm4-40gb"],
                                                               mode="inference", optimizer="none")) is None]
    assert len(pairs) > 20
    checked, kinds_seen, transfers, steps, views = 0, set(), 0, 0, 0
    # one device of each behaviour (the per-row reference costs 3-4 s per device and model; on all 27 devices
    # ResNet-50 alone took 95 s): the devices of one group differ only in their figures
    groups: dict[tuple[object, ...], HardwareSpec] = {}
    for hw in catalog.values():
        groups.setdefault(_behaviour(learned, hw, {la.kind for la, _ in pairs}), hw)
    devices = list(groups.values())
    assert {hw.kind for hw in devices} == {hw.kind for hw in catalog.values()} and len(devices) >= 8
    for hw in devices:
        for prec in Precision:
            try:
                check_precision(hw, prec)
            except PrecisionNotSupported:
                continue
            for mode, opt in (("inference", "none"), ("training", "adamw")):
                for stack in SoftwareStack:
                    qs = [LayerTimeQuery(layer=la, cost=c, hardware=hw, mode=mode, optimizer=opt, precision=prec,
                                         software_stack=stack) for la, c in pairs
                          if learned.applies(LayerTimeQuery(layer=la, cost=c, hardware=hw, mode=mode,
                                                            optimizer=opt)) is None]
                    if not qs:
                        continue
                    want, got = per_row(learned, qs), learned.estimate(qs)
                    for q, w, g in zip(qs, want, got, strict=True):
                        ctx = f"{model} {hw.id} {prec} {mode} {stack} {q.layer.name}"
                        for f in ("forward_ms", "backward_ms", "update_ms", "total_ms_p10", "total_ms_p90"):
                            assert _close(getattr(g, f), getattr(w, f)), (ctx, f, getattr(g, f), getattr(w, f))
                        assert (g.method, g.out_of_distribution, g.notes) == (w.method, w.out_of_distribution,
                                                                             w.notes), ctx
                        transfers += any("not measured on tensor cores" in n for n in w.notes)
                        views += POINTWISE_GEMM_NOTE in w.notes
                        kinds_seen.add(q.layer.kind)
                    steps += mode == "training" and stack is SoftwareStack.TF1_SESSION
                    checked += 1
    # every branch ran: transfer, learned train step (TF1 on GPUs), backward from the forward, inference, the GEMM
    # view of ResNet-50's 1x1 convolutions
    assert checked > 100 and steps > 0
    if model == "resnet50":
        assert transfers > 0 and OpKind.CONV in kinds_seen and views > 0
