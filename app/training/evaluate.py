"""``layercast evaluate``: the shipped predictor against the baselines on held-out rows; writes a report.

``python -m app.training.evaluate [--models-dir models] [--stem NAME] [--previous STEM] [--out-dir reports]
[--no-logo] [--no-e2e] [--logo-gpus CHIP ...]``

Everything on rows the shipped model never trained on, with the artifact's own data recipe (sources,
rows per file, split seed read from its metadata; the same loaders and split as :mod:`app.training.train`):

1. **Held-out configurations** — the test split of every source (Justus TF1 layers, NeuSight fp32
   kernels, Vidur fp16 LLM ops, CPU seed layers). The learned model exactly as served (ONNX through
   onnxruntime) against, on the same rows: the pure roofline (the physics floor at the op's peak for the
   precision), FLOPs at 50 % of peak, the nearest-neighbour lookup table of measured configurations on the
   same device, and the previous predictor (``--previous``, default the artifact created before it, ONNX as shipped);
   MAPE, RMSPE, within ±10 %, Spearman, per source, op family, GPU and precision; 80 % interval coverage;
   and the share of predictions below the pure roofline.
2. **Leave-one-GPU-out** — for each GPU chip of the training data (catalog ``architecture``: the A100
   variants are one fold), the artifact's recipe retrained without any of its rows, tested on its test
   configurations (so the Vidur A40 fold is "trained on A100, tested on A40" and the other way round). The
   80 % interval of fold g is the fold model's offsets times the conformal factor pooled from the *other*
   folds' held-out validation rows (as the shipped factor is pooled from all folds). Baselines on the same
   rows: pure roofline, FLOPs at 50 % of peak, a lookup table built on the nearest training GPU, and the
   previous predictor (note: as shipped, trained on every GPU, so it is in distribution on these rows).
3. **End-to-end training iterations on the CPU** — each whole model of the profiler's e2e records is
   rebuilt, imported, analysed and predicted layer by layer with the registry predictor (the API's
   logic: Σ forward + backward + update); a per-iteration overhead (median of measured − Σ layers) is
   calibrated leave-one-model-out and added only where it lowers the leave-one-model-out error over the
   other models (:func:`overhead_helps`); otherwise the reported error is that of the plain layer sum.

Writes ``<out-dir>/evaluation.json`` (every number) and ``<out-dir>/evaluation.md`` (tables). Needs torch
for step 2 (retraining) and step 3 (rebuilding the models).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.core.aggregate import AggregationInput, IterationEstimate, LayerTime, aggregate
from app.core.features import floor_ms_from_raw
from app.core.hardware import hardware_from_dict
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery
from app.predictor.onnx_model import LearnedPredictor, read_metadata
from app.predictor.registry import current_stem, load_predictor
from app.progress import bar
from app.training.dataset import TrainingRows, iterations_from_database, snapshot_targets
from app.training.metrics import (
    below_floor_pct,
    cross_device_lookup_predict,
    finite_metrics,
    flop_linear_fit,
    flops_at_half_peak_ms,
    grouped,
    metrics,
    nearest_neighbour_predict,
    pure_roofline_ms,
    source_of,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODELS_DIR = REPO_ROOT / "models"
DEFAULT_REPORT_DIR = REPO_ROOT / "reports"
#: ``--previous`` default: the artifact created just before the evaluated one (:func:`previous_stem_of`).
DEFAULT_PREVIOUS = "auto"


def previous_stem_of(models_dir: Path, stem: str) -> str | None:
    """The artifact of ``models_dir`` created just before ``stem`` (by the ``created_unix_s`` of their
    metadata, then name), or None when ``stem`` is the oldest or not there."""
    from app.predictor.registry import list_versions

    versions = sorted(list_versions(models_dir), key=lambda v: (v.created_unix_s or 0, v.stem))
    stems = [v.stem for v in versions]
    i = stems.index(stem) if stem in stems else 0
    return stems[i - 1] if i > 0 else None

#: Targets of issue 8 (reported reached / missed in the report).
TARGETS: dict[str, tuple[str, float]] = {
    "logo_neusight_mape_pct": ("<=", 12.0),
    "logo_justus_mape_pct": ("<=", 15.0),
    "logo_vidur_a100_a40_mape_pct": ("<=", 15.0),
    "logo_coverage_80_pct_low": (">=", 70.0),
    "logo_coverage_80_pct_high": ("<=", 90.0),
    "below_roofline_pct": ("<=", 0.0),
    "e2e_median_abs_error_pct": ("<=", 10.0),
}

#: Methods compared on the same rows: key → label in the report.
METHODS: dict[str, str] = {
    "learned": "**learned (this model)**",
    "previous": "previous predictor",
    "roofline": "pure roofline (physics floor)",
    "flops50": "FLOPs at 50 % of peak",
    "lookup": "lookup table (nearest measured config)",
}


def _previous_ln(previous: LearnedPredictor | None, data: TrainingRows) -> np.ndarray | None:
    return None if previous is None else previous.run_features(data.features).astype(np.float64)


def compare_block(
    data: TrainingRows,
    learned_ln: np.ndarray,
    *,
    lookup_ms: np.ndarray,
    previous_ln: np.ndarray | None,
    lo_hi_ms: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Every method of :data:`METHODS` on the same rows ``data``: overall, and grouped by source, op family,
    hardware and precision; plus the share of each method's predictions below the pure roofline."""
    p = np.exp(learned_ln)
    lo, hi = lo_hi_ms if lo_hi_ms is not None else (p[:, 0], p[:, 2])
    preds: dict[str, np.ndarray] = {
        "learned": p[:, 1],
        "roofline": pure_roofline_ms(data),
        "flops50": flops_at_half_peak_ms(data),
        "lookup": lookup_ms,
    }
    if previous_ln is not None:
        preds["previous"] = np.exp(previous_ln[:, 1])
    out: dict[str, Any] = {"n": len(data)}
    for k, v in preds.items():
        ok = np.isfinite(v) & (v > 0)
        if k == "learned":
            out[k] = metrics(data.time_ms, v, lo, hi)
            out[f"{k}_by"] = grouped(data, v, lo, hi, by=("source", "op", "hardware", "precision"))
        else:
            out[k] = finite_metrics(data.time_ms, np.where(ok, v, np.nan))
            out[f"{k}_by"] = grouped(data.subset(ok), v[ok], by=("source", "op", "hardware", "precision"))
        out[f"{k}_below_roofline_pct"] = round(below_floor_pct(data.subset(ok), v[ok]), 4)
    return out


def held_out(
    tr: TrainingRows, te: TrainingRows, learned: LearnedPredictor, previous: LearnedPredictor | None
) -> dict[str, Any]:
    """Block 1 of the module docstring (the trainer's test split, learned model through onnxruntime)."""
    learned_ln = learned.run_features(te.features).astype(np.float64)
    return compare_block(te, learned_ln, lookup_ms=nearest_neighbour_predict(tr, te),
                         previous_ln=_previous_ln(previous, te))  # fmt: skip


def logo_block(
    tr: TrainingRows,
    va: TrainingRows,
    te: TrainingRows,
    meta: Mapping[str, Any],
    previous: LearnedPredictor | None,
    *,
    recipe_override: Mapping[str, Any] | None,
    seed: int,
    groups: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Block 2 of the module docstring (needs torch). ``groups`` keeps only those folds (GPU chips, catalog
    ``architecture``; quick runs such as the two Vidur folds): pooled figures are then over those folds only,
    and each fold's interval factor comes from the other kept folds."""
    from app.training.train import DEFAULTS, conformal_factor, is_cpu_rows, leave_one_gpu_out

    # an artifact whose recipe names no member_features (v3 and older) had every member read every feature
    recipe = {**DEFAULTS, "member_features": None, **meta.get("model", {}).get("recipe", {}), **(recipe_override or {})}
    recipe["feature_names"] = tuple(meta["feature_names"])
    folds = leave_one_gpu_out(tr, va, te, recipe=recipe, seed=seed, groups=groups, log=log)
    gtr = tr.subset(~is_cpu_rows(tr))
    per: dict[str, Any] = {}
    all_rows: list[TrainingRows] = []
    all_ln: list[np.ndarray] = []
    all_lo: list[np.ndarray] = []
    all_hi: list[np.ndarray] = []
    all_lookup: list[np.ndarray] = []
    parts: list[tuple[str, TrainingRows, np.ndarray]] = []
    for g, f in folds.items():
        te_g: TrainingRows = f["test"]
        if not len(te_g):
            continue
        p = f["pred_ln"]
        s_lo, s_hi = conformal_factor([folds[h]["val_ratios"] for h in folds if h != g])
        lo = np.maximum(np.exp(p[:, 1] - (p[:, 1] - p[:, 0]) * s_lo), pure_roofline_ms(te_g))
        hi = np.exp(p[:, 1] + (p[:, 2] - p[:, 1]) * s_hi)
        lookup = cross_device_lookup_predict(gtr.subset(~np.isin(gtr.gpu, np.unique(te_g.gpu))), te_g)
        per[g] = compare_block(te_g, p, lookup_ms=lookup, previous_ln=_previous_ln(previous, te_g), lo_hi_ms=(lo, hi))
        per[g]["interval_factor_from_other_folds"] = [s_lo, s_hi]
        all_rows.append(te_g)
        all_ln.append(p)
        all_lo.append(lo)
        all_hi.append(hi)
        all_lookup.append(lookup)
        parts.append((g, te_g, p))
        m = per[g]["learned"]
        log(f"LOGO {g}: learned {m['mape_pct']:.1f} %, coverage {m['coverage_80_pct']:.1f} %")
    rows = TrainingRows.concat(all_rows)
    pooled = compare_block(rows, np.concatenate(all_ln), lookup_ms=np.concatenate(all_lookup),
                           previous_ln=_previous_ln(previous, rows),
                           lo_hi_ms=(np.concatenate(all_lo), np.concatenate(all_hi)))  # fmt: skip
    src = source_of(rows)
    p_all = np.exp(np.concatenate(all_ln))
    by_source = {str(s): metrics(rows.time_ms[src == s], p_all[src == s, 1], np.concatenate(all_lo)[src == s],
                                 np.concatenate(all_hi)[src == s]) for s in np.unique(src)}  # fmt: skip
    vid = src == "vidur"
    return {
        "recipe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in recipe.items() if k != "feature_names"},
        "only_folds": list(groups) if groups is not None else None,
        "per_gpu": per,
        "pooled": pooled,
        "by_source": by_source,
        "vidur_a100_a40": metrics(rows.time_ms[vid], p_all[vid, 1]) if vid.any() else {"n": 0},
        "neusight_host_floor": host_floor_block(parts),
        "mean_over_gpus_mape_pct": round(float(np.mean([v["learned"]["mape_pct"] for v in per.values()])), 4),
    }


#: Tiny ``add`` calls of the held-out GPU timed on its host (:func:`host_floor_block`): the one measurement a
#: user can take on a machine in a second (models/README.md, "what bounds blind leave-one-GPU-out on NeuSight").
HOST_FLOOR_CALIBRATION_ROWS = 5
#: Norms tried for swapping the model's dispatch floor for the host's (1: additive; 2, 4: smooth maxima).
HOST_FLOOR_NORMS = (1.0, 2.0, 4.0)


def host_dispatch_adjusted_ms(pred_ms: np.ndarray, model_floor_ms: np.ndarray, host_ratio: float,
                              q: float) -> np.ndarray:
    """Predictions ``pred_ms`` ``[N]`` with the model's dispatch floor ``model_floor_ms`` ``[N]`` (its own answer
    for the tiniest calls of each row's op family on this GPU, ms) swapped for the host's, ``host_ratio`` times
    it: ``(max(t^q - c^q, 0) + (rho c)^q)^(1/q)`` (``q = 1`` shifts every row by the floor difference; larger
    ``q`` leaves rows far above the floor alone). The host ratio is a measured tiny call's time over the
    model's answer for it; NeuSight's floors keep one ratio per host across op families
    (reports/dispatch_floor.md). Raises ``ValueError`` for ``q <= 0`` or a non-positive ratio."""
    if q <= 0 or not host_ratio > 0:
        raise ValueError(f"need q > 0 and host_ratio > 0, got q={q!r}, host_ratio={host_ratio!r}")
    t, c = np.asarray(pred_ms, dtype=np.float64), np.asarray(model_floor_ms, dtype=np.float64)
    return np.asarray((np.maximum(t**q - c**q, 0.0) + (host_ratio * c) ** q) ** (1.0 / q))


def host_floor_block(parts: Sequence[tuple[str, TrainingRows, np.ndarray]]) -> dict[str, Any]:
    """Leave-one-GPU-out on NeuSight's rows two ways, same rows: blind (the fold model as is) and with the
    held-out host's dispatch floor measured (:func:`host_dispatch_adjusted_ms`, every norm of
    :data:`HOST_FLOOR_NORMS`). ``parts`` are ``(fold, test rows, fold model's ln-ms quantiles [n, 3])``. Per
    held-out GPU the only measurement used is the median time of its :data:`HOST_FLOOR_CALIBRATION_ROWS`
    ``add`` rows with the smallest physics floor (left out of the scored rows); the model's floor of each op
    family is the median of its own answers for that family's tiniest calls (no measured time). Every
    NeuSight family is adjusted, GEMMs and convolutions too. Empty (``{"n": 0}``) without NeuSight rows."""
    k = HOST_FLOOR_CALIBRATION_ROWS
    true, blind, fams, gpus = [], [], [], []
    adjusted: dict[float, list[np.ndarray]] = {q: [] for q in HOST_FLOOR_NORMS}
    ratios: dict[str, float] = {}
    for g, rows, ln in parts:
        ns = np.nonzero(source_of(rows) == "neusight")[0]
        fam = rows.family[ns]
        add = np.nonzero(fam == "neusight:add")[0]
        if len(add) <= k:
            continue
        floor = floor_ms_from_raw(rows.raw[ns])
        pred = np.exp(ln[ns, 1].astype(np.float64))
        t = rows.time_ms[ns]
        cal = add[np.argsort(floor[add], kind="stable")[:k]]
        rho = float(np.median(t[cal]) / np.median(pred[cal]))
        ratios[g] = round(rho, 4)
        c_hat = np.empty(len(ns))
        for f in np.unique(fam):
            idx = np.nonzero(fam == f)[0]
            c_hat[idx] = np.median(pred[idx[np.argsort(floor[idx], kind="stable")[:k]]])
        keep = np.ones(len(ns), dtype=bool)
        keep[cal] = False
        true.append(t[keep])
        blind.append(pred[keep])
        fams.append(fam[keep])
        gpus.append(np.full(int(keep.sum()), g, dtype=object))
        for q in HOST_FLOOR_NORMS:
            adj = np.maximum(host_dispatch_adjusted_ms(pred, c_hat, rho, q), floor)
            adjusted[q].append(adj[keep])
    if not true:
        return {"n": 0}
    t_all, b_all, f_all, g_all = (np.concatenate(x) for x in (true, blind, fams, gpus))
    a_all = {q: np.concatenate(v) for q, v in adjusted.items()}

    def mape(pred: np.ndarray, m: np.ndarray) -> float:
        return round(metrics(t_all[m], pred[m])["mape_pct"], 2)

    def block(m: np.ndarray) -> dict[str, Any]:
        return {"n": int(m.sum()), "blind_mape_pct": mape(b_all, m),
                **{f"host_floor_q{q:g}_mape_pct": mape(a, m) for q, a in a_all.items()}}

    every = np.ones(len(t_all), dtype=bool)
    return {
        "calibration_rows": k,
        "host_ratio_by_gpu": ratios,
        "pooled": block(every),
        "by_gpu": {str(g): block(g_all == g) for g in np.unique(g_all)},
        "by_op": {str(f): block(f_all == f) for f in np.unique(f_all)},
    }


# ---------------------------------------------------------------- end to end


def e2e_predictions(
    records: Sequence[dict[str, Any]],
    *,
    models_dir: Path,
    stem: str,
    cpu_hardware: Any,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Per e2e record: measured train step, learned layer sum, roofline layer sum, layer count, FLOPs.

    Each architecture is exported once (:func:`app.profiler.e2e.export_onnx`) and imported at every
    measured batch size; prediction follows the API (:func:`app.predictions.service.estimate`): the graph
    analysed for the record's software stack on a CPU (fused as it fuses there: no attention fusion), one
    training-mode query per costed layer and one for the loss layer (the measured step includes the loss:
    :func:`app.core.analysis.loss_layer`) with the record's optimizer and stack, summed.
    """
    from app.core.analysis import analyze
    from app.core.onnx_import import import_onnx
    from app.core.precision import Precision
    from app.core.vocab import SoftwareStack
    from app.predictor.roofline import RooflineConstants, RooflinePredictor
    from app.profiler.e2e import export_onnx

    predictor = load_predictor(models_dir, stem=stem)
    roof = RooflinePredictor(RooflineConstants.from_dict(predictor.learned.metadata["roofline"]))
    cache: dict[str, bytes] = {}
    out = []
    for r in bar(records, desc="end-to-end iterations", unit="record"):
        arch = str(r["arch"])
        try:
            if arch not in cache:
                cache[arch] = export_onnx(arch, seed=int(r.get("seed", 0)))
            dims = dict((r.get("onnx") or {}).get("import_dims") or {})
            g = import_onnx(cache[arch], batch_size=int(r["batch_size"]), dims=dims)
        except Exception as exc:  # a model that cannot be rebuilt is reported, not hidden
            log(f"e2e {arch} b={r['batch_size']}: cannot rebuild ({type(exc).__name__}: {exc})")
            out.append({"arch": arch, "batch_size": r["batch_size"], "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        # as the API analyses a graph for the request's software stack (default PyTorch eager) on the device's
        # kind: fused as that stack fuses there (GELU, bias; attention on GPUs only: app.core.fusion), every
        # query under that stack
        stack = SoftwareStack(str(r.get("software_stack") or SoftwareStack.PYTORCH_EAGER.value))
        a = analyze(g, software_stack=stack, hardware_kind=cpu_hardware.kind)
        opt = str(r.get("optimizer", "sgd"))
        # the measured step times forward with the loss and loss.backward() (app.profiler.e2e): the graph's
        # layers and then the loss layer (app.core.analysis.loss_layer), as the API's training table ends with it
        pairs = a.step_layers(training=True)
        queries = [
            LayerTimeQuery(layer=layer, cost=cost, hardware=cpu_hardware, mode="training", optimizer=opt,
                           precision=Precision(str(r.get("precision", "fp32"))), software_stack=stack)
            for layer, cost in pairs
        ]  # fmt: skip
        est = predictor.estimate(queries)
        loss = est[-1].total_ms if a.loss is not None else 0.0
        learned = _iteration(est, int(r["batch_size"]))
        roofline = _iteration(roof.estimate(queries), int(r["batch_size"]))
        methods: dict[str, int] = {}
        for e in est:
            methods[e.method] = methods.get(e.method, 0) + 1
        flops = sum(q.cost.forward_flops + q.cost.backward_flops for q in queries)
        out.append({
            "arch": arch,
            "batch_size": int(r["batch_size"]),
            "measured_ms": float(r["train_step_ms"]),
            "learned_sum_ms": learned.time_ms,
            "learned_sum_p10_ms": learned.time_ms_p10,
            "learned_sum_p90_ms": learned.time_ms_p90,
            "roofline_sum_ms": roofline.time_ms,
            "layers": len(queries),
            "loss_ms": loss,
            "unsupported_layers": a.unsupported_layer_count,
            "train_flops": float(flops),
            "methods": methods,
        })  # fmt: skip
    return out


def _iteration(estimates: Sequence[LayerTimeEstimate], batch_size: int) -> IterationEstimate:
    """One training step on one device without overhead: the layer sum, through the same core aggregation
    (:func:`app.core.aggregate.aggregate`) the API and the CLI use."""
    layers = [LayerTime(forward_ms=e.forward_ms, backward_ms=e.backward_ms, update_ms=e.update_ms,
                        total_ms_p10=e.total_ms_p10, total_ms_p90=e.total_ms_p90) for e in estimates]
    return aggregate(AggregationInput(layers=layers, global_batch_size=batch_size)).iteration


def fit_overhead(rows: Sequence[dict[str, Any]], key: str = "learned_sum_ms") -> tuple[float, float]:
    """Per-iteration overhead ``(α, c_ms)`` of ``measured ≈ α · Σ layers + c_ms`` with ``α = 1``: ``c_ms`` is the
    median of ``measured − Σ layers`` over ``rows`` (loss, ``zero_grad``, framework glue; robust to one odd
    model). A fitted scale ``α`` or a per-layer term were tried and generalise worse leave-one-model-out
    (the per-layer measurements already include each layer's dispatch overhead)."""
    return 1.0, float(np.median([r["measured_ms"] - r[key] for r in rows]))


def overhead_helps(rows: Sequence[dict[str, Any]], key: str = "learned_sum_ms") -> bool:
    """Whether adding the fitted per-iteration overhead (:func:`fit_overhead`) beats the plain layer sum,
    judged leave-one-model-out within ``rows`` only: each architecture's error with the overhead fitted on
    the other architectures against its error without; True when the median absolute error is lower with it.
    False with fewer than three architectures (nothing to fit on and test against)."""
    archs = sorted({r["arch"] for r in rows})
    if len(archs) < 3:
        return False
    with_, without = [], []
    for r in rows:
        others = [o for o in rows if o["arch"] != r["arch"]]
        _, beta = fit_overhead(others)
        with_.append(abs(r[key] + beta - r["measured_ms"]) / r["measured_ms"])
        without.append(abs(r[key] - r["measured_ms"]) / r["measured_ms"])
    return bool(np.median(with_) < np.median(without))


def e2e_block(rows: Sequence[dict[str, Any]], cpu_train: TrainingRows | None) -> dict[str, Any]:
    """Leave-one-model-out overhead calibration and errors of the learned sum vs the baselines.

    For each held-out architecture the overhead is fitted on the other architectures, and used only when
    :func:`overhead_helps` on those other architectures (a decision that never sees the held-out model);
    otherwise its calibrated prediction is the plain layer sum (``overhead_ms`` 0, ``overhead_used`` False).
    The roofline layer sum gets the same decision on its own residuals.
    """
    ok = [r for r in rows if "error" not in r]
    archs = sorted({r["arch"] for r in ok})
    out_rows = []
    lin_coef = flop_linear_fit(cpu_train) if cpu_train is not None and len(cpu_train) else None
    for r in ok:
        others = [o for o in ok if o["arch"] != r["arch"]]
        alpha, beta = fit_overhead(others) if len(others) >= 2 else (1.0, 0.0)
        used = overhead_helps(others)
        if not used:
            beta = 0.0
        r_alpha, r_beta = fit_overhead(others, "roofline_sum_ms") if len(others) >= 2 else (1.0, 0.0)
        if not overhead_helps(others, "roofline_sum_ms"):  # the baseline gets the same decision
            r_beta = 0.0
        pred = alpha * r["learned_sum_ms"] + beta
        roof = r_alpha * r["roofline_sum_ms"] + r_beta
        row = dict(r, learned_calibrated_ms=pred, roofline_calibrated_ms=roof, overhead_alpha=alpha,
                   overhead_ms=beta, overhead_used=used)  # fmt: skip
        if lin_coef is not None:
            a0, b0 = next(iter(lin_coef.values()))
            row["flop_linear_ms"] = a0 * r["layers"] + b0 * r["train_flops"]
        out_rows.append(row)

    def err(key: str) -> np.ndarray:
        return np.array([abs(x[key] - x["measured_ms"]) / x["measured_ms"] * 100 for x in out_rows if key in x])

    summary: dict[str, Any] = {"records": len(rows), "rebuilt": len(ok), "architectures": archs}
    for key in ("learned_calibrated_ms", "learned_sum_ms", "roofline_calibrated_ms", "roofline_sum_ms",
                "flop_linear_ms"):  # fmt: skip
        e = err(key)
        if len(e):
            summary[key] = {"median_abs_error_pct": round(float(np.median(e)), 3),
                            "mean_abs_error_pct": round(float(np.mean(e)), 3),
                            "within_15pct": round(float(np.mean(e <= 15) * 100), 3)}  # fmt: skip
    if ok:
        inside = [x["learned_sum_p10_ms"] + x["overhead_ms"] <= x["measured_ms"] <= x["learned_sum_p90_ms"]
                  + x["overhead_ms"] for x in out_rows]  # fmt: skip
        summary["interval_coverage_pct"] = round(float(np.mean(inside) * 100), 2)
        alpha, beta = fit_overhead(ok) if len(ok) >= 2 else (1.0, 0.0)
        helps = overhead_helps(ok)
        summary["overhead_all_models"] = {
            "overhead_ms": beta if helps else 0.0, "fitted_overhead_ms": beta, "used": helps,
            "formula": "iteration_ms = sum(layer total_ms) + overhead_ms",
            "decision": "the fitted overhead is used only where it lowers the leave-one-model-out median "
                        "error over the training models; otherwise the plain layer sum",
        }  # fmt: skip
    return {"summary": summary, "rows": out_rows}


# ---------------------------------------------------------------- report
# ---------------------------------------------------------------- report


def _fmt(v: Any, pct: bool = True) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:.1f} %" if pct else f"{v:.3f}"


def targets_table(report: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and a dict of each target: value, goal, reached."""
    logo = report.get("logo") or {}
    bs = logo.get("by_source", {})
    cov = (logo.get("pooled") or {}).get("learned", {}).get("coverage_80_pct")
    below = [report["held_out"].get("learned_below_roofline_pct")]
    if logo:
        below.append(logo["pooled"].get("learned_below_roofline_pct"))
    vals: dict[str, float | None] = {
        "logo_neusight_mape_pct": bs.get("neusight", {}).get("mape_pct"),
        "logo_justus_mape_pct": bs.get("justus", {}).get("mape_pct"),
        "logo_vidur_a100_a40_mape_pct": logo.get("vidur_a100_a40", {}).get("mape_pct"),
        "logo_coverage_80_pct_low": cov,
        "logo_coverage_80_pct_high": cov,
        "below_roofline_pct": max(v for v in below if v is not None),
        "e2e_median_abs_error_pct": (
            (report.get("e2e") or {}).get("summary", {}).get("learned_calibrated_ms") or {}
        ).get("median_abs_error_pct"),
    }
    lines = ["| target | goal | measured | status |", "|---|---|---|---|"]
    res: dict[str, Any] = {}
    for key, (op, goal) in TARGETS.items():
        v = vals[key]
        if v is None:
            status, reached = "not measured (no data)", None
        else:
            reached = v <= goal if op == "<=" else v >= goal
            status = "reached" if reached else f"missed by {abs(v - goal):.1f} points"
        res[key] = {"value": v, "goal": f"{op} {goal}", "reached": reached}
        lines.append(f"| {key} | {op} {goal} | {_fmt(v)} | {status} |")
    return lines, res


def _method_rows(block: Mapping[str, Any]) -> list[str]:
    out = ["| method | MAPE | RMSPE | within ±10 % | Spearman | 80 % coverage | below roofline |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for k, name in METHODS.items():
        m = block.get(k)
        if not m:
            continue
        label = name + (f" (answers {m['answered_pct']:.0f} %)" if m.get("answered_pct", 100) < 100 else "")
        out.append(f"| {label} | {_fmt(m.get('mape_pct'))} | {_fmt(m.get('rmspe_pct'))} | "
                   f"{_fmt(m.get('within_10pct'))} | {_fmt(m.get('spearman'), False)} | "
                   f"{_fmt(m.get('coverage_80_pct'))} | {_fmt(block.get(f'{k}_below_roofline_pct'))} |")  # fmt: skip
    return out


def _grouped_rows(block: Mapping[str, Any], by: str) -> list[str]:
    groups = block["learned_by"].get(by, {})
    keys = [k for k in METHODS if f"{k}_by" in block]
    out = [f"| {by} | n | " + " | ".join(k for k in keys) + " | learned coverage |",
           "|---|---|" + "---|" * (len(keys) + 1)]  # fmt: skip
    for g, m in groups.items():
        cells = [_fmt(block[f"{k}_by"].get(by, {}).get(g, {}).get("mape_pct")) for k in keys]
        out.append(f"| {g} | {m['n']} | " + " | ".join(cells) + f" | {_fmt(m.get('coverage_80_pct'))} |")
    return out


def _host_floor_lines(hf: Mapping[str, Any]) -> list[str]:
    """The markdown of :func:`host_floor_block` (nothing without NeuSight folds)."""
    if "pooled" not in hf:
        return []
    qs = [f"q = {q:g}" for q in HOST_FLOOR_NORMS]
    keys = ["blind_mape_pct", *(f"host_floor_q{q:g}_mape_pct" for q in HOST_FLOOR_NORMS)]
    head = ["| rows | n | blind | " + " | ".join(f"host floor measured, {q}" for q in qs) + " |",
            "|---|---|" + "---|" * (1 + len(qs))]

    def row(name: str, b: Mapping[str, Any]) -> str:
        return f"| {name} | {b['n']} | " + " | ".join(_fmt(b[k]) for k in keys) + " |"

    ratios = ", ".join(f"{g} {r:.2f}" for g, r in hf["host_ratio_by_gpu"].items())
    return ["", "NeuSight leave-one-GPU-out with the held-out host's dispatch floor measured (MAPE, same rows: the "
            f"{hf['calibration_rows']} tiniest `add` calls of the held-out GPU timed, left out of the scored rows; "
            "each family's model floor swapped for the host's by the norm q; not a target, which stays blind). "
            f"Host ratio (measured / model) per held-out GPU: {ratios}.", "", *head,
            row("**all NeuSight**", hf["pooled"]), *(row(g, b) for g, b in hf["by_gpu"].items()),
            *(row(f, b) for f, b in hf["by_op"].items())]


def markdown(report: Mapping[str, Any]) -> str:
    """The human-readable report (MAPE of every method on the same rows)."""
    h = report["held_out"]
    lines = [
        f"# layercast evaluation — {report['predictor']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Generated {report['generated_utc']} in {report['wall_time_s']:.0f} s (python "
        f"{report['environment']['python']}, onnxruntime {report['environment']['onnxruntime']}); previous "
        f"predictor: {report.get('previous') or 'none'}.",
        "",
        "## Targets (issue 8)",
        "",
        *targets_table(report)[0],
        "",
    ]
    logo = report.get("logo")
    if logo:
        lines += ["## Leave-one-GPU-out (recipe retrained without the GPU chip; its test configurations)", "",
                  "Pooled over every held-out GPU's rows; 80 % intervals calibrated on the other folds only.", "",
                  *([f"Only the folds {', '.join(logo['only_folds'])} (`--logo-gpus`): not the full "
                     "leave-one-GPU-out, and its targets below are over these folds only.", ""]
                    if logo.get("only_folds") else []),
                  *_method_rows(logo["pooled"]), "", "By source (learned):", "",
                  "| source | n | MAPE | within ±10 % | 80 % coverage |", "|---|---|---|---|---|",
                  *[f"| {s} | {m['n']} | {_fmt(m['mape_pct'])} | {_fmt(m['within_10pct'])} | "
                    f"{_fmt(m.get('coverage_80_pct'))} |" for s, m in logo["by_source"].items()], "",
                  f"Vidur fp16 ops, A40 predicted without A40 and A100 without A100: MAPE "
                  f"{_fmt(logo['vidur_a100_a40'].get('mape_pct'))} over {logo['vidur_a100_a40'].get('n', 0)} rows.",
                  "", "Per held-out GPU chip (MAPE):", "",
                  "| held-out GPU | n | " + " | ".join(METHODS) + " | learned coverage |",
                  "|---|---|" + "---|" * (len(METHODS) + 1)]  # fmt: skip
        for g, b in logo["per_gpu"].items():
            cells = [_fmt((b.get(k) or {}).get("mape_pct")) for k in METHODS]
            lines.append(
                f"| {g} | {b['n']} | " + " | ".join(cells) + f" | {_fmt(b['learned'].get('coverage_80_pct'))} |"
            )
        for by in ("op", "precision"):
            lines += ["", f"Pooled leave-one-GPU-out by {by} (MAPE):", "", *_grouped_rows(logo["pooled"], by)]
        lines += _host_floor_lines(logo.get("neusight_host_floor") or {"n": 0})
        lines += [
            "",
            f"The previous predictor ({report.get('previous')}) is the shipped artifact, trained on every GPU: on "
            "these rows it is in distribution, not held out (its own leave-one-GPU-out figures are in its "
            "evaluation); the lookup table answers from the nearest training GPU's measurements.",
            "",
        ]
    lines += [f"## Held-out configurations (test split, every source) — {h['n']} rows", "", *_method_rows(h), ""]
    for by in ("source", "op", "hardware", "precision"):
        lines += [f"By {by} (MAPE):", "", *_grouped_rows(h, by), ""]
    e2e = report.get("e2e")
    if e2e:
        s = e2e["summary"]
        lines += ["## End-to-end training iterations on the CPU (leave-one-model-out overhead)", "",
                  f"{s['rebuilt']} of {s['records']} records rebuilt; architectures: {', '.join(s['architectures'])}.",
                  "", "| method | median abs error | mean abs error | within ±15 % |", "|---|---|---|---|"]  # fmt: skip
        names = {
            "learned_calibrated_ms": "**learned layer sum + overhead where it helps (leave-one-model-out)**",
            "learned_sum_ms": "learned layer sum, no overhead",
            "roofline_calibrated_ms": "roofline layer sum + overhead where it helps (leave-one-model-out)",
            "roofline_sum_ms": "roofline layer sum",
            "flop_linear_ms": "FLOP-linear (CPU layers fit), summed",
        }
        for key, name in names.items():
            if key in s:
                m = s[key]
                lines.append(f"| {name} | {_fmt(m['median_abs_error_pct'])} | {_fmt(m['mean_abs_error_pct'])} | "
                             f"{_fmt(m['within_15pct'])} |")  # fmt: skip
        used = sum(bool(x.get("overhead_used")) for x in e2e["rows"])
        oa = s.get("overhead_all_models") or {}
        lines += ["", f"The fitted per-iteration overhead is added only when it lowers the median error "
                      f"leave-one-model-out over the other (training) models: used for {used} of "
                      f"{len(e2e['rows'])} held-out records; over all models it "
                      f"{'helps' if oa.get('used') else 'does not help, so the plain layer sum is served'} "
                      f"(fitted {_fmt(oa.get('fitted_overhead_ms'), pct=False)} ms)."]  # fmt: skip
        lines += ["", "The layer sums include the loss layer (cross-entropy on the output; its share in the "
                      "loss column); on the CPU the attention core is costed as its parts (app/core/fusion.py).",
                  "", "| model | batch | measured ms | learned Σ ms | of which loss ms | calibrated ms | error |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for x in e2e["rows"]:
            lines.append(f"| {x['arch']} | {x['batch_size']} | {x['measured_ms']:.1f} | {x['learned_sum_ms']:.1f} | "
                         f"{x.get('loss_ms', 0.0):.1f} | {x['learned_calibrated_ms']:.1f} | "
                         f"{(x['learned_calibrated_ms'] / x['measured_ms'] - 1) * 100:+.1f} % |")  # fmt: skip
        lines.append("")
    elif report.get("e2e_note"):
        lines += ["## End-to-end training iterations", "", report["e2e_note"], ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def run(
    *,
    models_dir: Path,
    stem: str | None,
    previous_stem: str | None,
    database_url: str,
    out_dir: Path,
    logo: bool,
    e2e: bool,
    sample: int | None = None,
    logo_recipe: Mapping[str, Any] | None = None,
    logo_gpus: Sequence[str] | None = None,
    threads: int = 1,
    argv: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate ``models_dir``'s active (or ``stem``) artifact; writes and returns the report dict.

    ``sample`` overrides the artifact's rows per file (quick runs); ``logo_gpus`` keeps only those
    leave-one-GPU-out folds (:func:`logo_block`); ``previous_stem`` names the artifact compared side by side
    (skipped when its files are absent)."""
    import onnxruntime as ort

    from app.training.train import DEFAULT_SAMPLE, V3_SOURCES, load_training_data, splits

    t0 = time.time()
    stem = stem or current_stem(models_dir)
    predictor = load_predictor(models_dir, stem=stem, threads=threads)
    learned: LearnedPredictor = predictor.learned
    meta = learned.metadata
    previous: LearnedPredictor | None = None
    if previous_stem == DEFAULT_PREVIOUS:
        previous_stem = previous_stem_of(models_dir, stem)
    if previous_stem and not (models_dir / f"{previous_stem}.json").is_file():
        raise FileNotFoundError(f"--previous {previous_stem}: no {previous_stem}.json in {models_dir}")
    if previous_stem:
        pm = read_metadata(models_dir / f"{previous_stem}.json")
        previous = LearnedPredictor(models_dir / pm["onnx_file"], pm, threads=threads)
    tdata = meta.get("training_data", {})
    split_seed = int(tdata.get("split_seed", meta.get("model", {}).get("seed", 0)))
    rows_per_file = dict(tdata.get("sample_rows_per_file") or DEFAULT_SAMPLE)
    if sample is not None:
        rows_per_file = {k: sample for k in rows_per_file}
    cpu_snapshot = {k: v for k, v in meta.get("training_hardware", {}).items() if v.get("kind") == "cpu"}
    cpu_hw = hardware_from_dict(next(iter(cpu_snapshot.values()))) if cpu_snapshot else None
    sources = tuple(tdata.get("sources") or V3_SOURCES)
    # CPU rows featurised against the artifact's snapshot of the CPU, as it was trained: stored under the
    # snapshot's id or under the measuring machine's own id (same CPU identity)
    cpu_specs = snapshot_targets(database_url, cpu_hw) if cpu_hw is not None else None
    gpu, cpu, _ = load_training_data(database_url=database_url, sources=sources, cpu=cpu_hw is not None,
                                     sample=rows_per_file, seed=split_seed, cpu_specs=cpu_specs,
                                     log=log)  # fmt: skip
    tr, va, te = splits(gpu, cpu, seed=split_seed)
    report: dict[str, Any] = {
        "predictor": stem,
        "previous": previous.version if previous is not None else None,
        "command": "layercast evaluate " + " ".join(argv),
        "generated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "split_seed": split_seed,
        "rows_per_file": rows_per_file,
        "held_out": held_out(tr, te, learned, previous),
        "environment": {"python": platform.python_version(), "onnxruntime": ort.__version__, "threads": threads},
    }
    log(f"held-out: learned {report['held_out']['learned']['mape_pct']:.1f} % MAPE")
    from app.training.plots import error_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    plot = error_plots(out_dir / "evaluation_errors.png", hardware=te.gpu, measured_ms=te.time_ms,
                       predicted_ms=np.exp(learned.run_features(te.features)[:, 1].astype(np.float64)),
                       title=f"{stem}: held-out layers, predicted vs measured per device")
    log(f"wrote {plot}")
    if logo:
        report["logo"] = logo_block(tr, va, te, meta, previous, recipe_override=logo_recipe, seed=split_seed,
                                    groups=logo_gpus, log=log)  # fmt: skip
    if e2e:
        records = iterations_from_database(database_url, hardware_ids=tuple(cpu_specs)) if cpu_specs else []
        # one record per (architecture, batch, precision): the last measurement wins (resumed campaigns)
        records = list({(r["arch"], r["batch_size"], r.get("precision", "fp32")): r for r in records}.values())
        if not records or cpu_hw is None:
            report["e2e_note"] = (
                "no stored whole-iteration measurements (layercast import profiler) or no CPU model: not measured"
            )
        else:
            rows = e2e_predictions(records, models_dir=models_dir, stem=stem, cpu_hardware=cpu_hw, log=log)
            from app.training.train import is_cpu_rows

            report["e2e"] = e2e_block(rows, tr.subset(is_cpu_rows(tr)))
            log(f"e2e: {report['e2e']['summary']}")
    report["wall_time_s"] = round(time.time() - t0, 1)
    report["targets"] = targets_table(report)[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "evaluation.json").write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    (out_dir / "evaluation.md").write_text(markdown(report))
    log(f"wrote {out_dir / 'evaluation.md'} and evaluation.json in {report['wall_time_s']}s")
    return report


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``layercast evaluate``."""
    p = argparse.ArgumentParser(prog="layercast evaluate", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    p.add_argument("--stem", default=None, help="artifact stem (default: models/CURRENT)")
    p.add_argument("--previous", default=DEFAULT_PREVIOUS,
                   help="artifact compared side by side (default: the one made before the evaluated one; '' for none)")
    p.add_argument("--database-url", default=None, help="measurement database (default $LAYERCAST_DATABASE_URL)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_REPORT_DIR)
    p.add_argument("--no-logo", action="store_true", help="skip leave-one-GPU-out (needs torch, retrains)")
    p.add_argument("--no-e2e", action="store_true", help="skip end-to-end iterations (needs torch, transformers)")
    p.add_argument("--sample", type=int, default=None, help="rows per file of every source (quick runs)")
    p.add_argument("--logo-epochs", type=int, default=None, help="override the recipe's epochs for LOGO (quick runs)")
    p.add_argument("--logo-gpus", nargs="+", default=None, metavar="CHIP",
                   help="leave out only these GPU chips (catalog architecture), e.g. 'Ampere (GA100)' "
                        "'Ampere (GA102)': the two Vidur folds (quick runs)")
    p.add_argument("--threads", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``layercast evaluate`` / ``python -m app.training.evaluate``); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(args_list)
    override: dict[str, Any] = {}
    if a.logo_epochs is not None:
        override["logo_epochs"] = a.logo_epochs
    if a.logo_gpus:
        from app.hardware.catalog import load_catalog

        chips = sorted({spec.architecture for spec in load_catalog().values() if spec.architecture})
        unknown = [g for g in a.logo_gpus if g not in chips]
        if unknown:
            print(f"--logo-gpus: unknown GPU chip(s) {unknown}; catalog chips: {chips}", file=sys.stderr)
            return 2
    if a.previous not in (DEFAULT_PREVIOUS, "") and not (a.models_dir / f"{a.previous}.json").is_file():
        print(f"--previous: no artifact {a.previous}.json in {a.models_dir}", file=sys.stderr)
        return 2
    if not a.no_logo or not a.no_e2e:
        try:
            import torch

            torch.set_num_threads(a.threads)
        except ModuleNotFoundError:
            print("leave-one-GPU-out and end-to-end need torch: pip install -e '.[train]'", file=sys.stderr)
            return 2
    from app.config import Settings

    run(
        models_dir=a.models_dir, stem=a.stem, previous_stem=a.previous or None,
        database_url=a.database_url or Settings().database_url, out_dir=a.out_dir,
        logo=not a.no_logo, e2e=not a.no_e2e, sample=a.sample, logo_recipe=override or None, threads=a.threads,
        logo_gpus=a.logo_gpus, argv=args_list,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
