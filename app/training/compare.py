"""Quick leave-one-GPU-out comparison of feature sets, scored on validation configurations only.

``python -m app.training.compare --database-url sqlite:///...`` loads a small subsample of the measurement
database once, then for each variant of :data:`VARIANTS` retrains the GPU head without each GPU chip
(:func:`app.training.train.leave_one_gpu_out`'s recipe, fewer rows and epochs) and scores it on the held-out
chip's **validation** configurations (split 1), never its test configurations (split 2, which ``layercast
evaluate`` reports): choosing a recipe here does not tune on the reported folds. ``--full`` uses the shipped
sample (the quick quarter's rankings did not transfer to it, models/README.md); a mixed-ensemble variant trains
one member per feature set in each fold. The score per variant is the
mean over sources (Justus, NeuSight, Vidur) of the pooled held-out-GPU MAPE, plus per-chip MAPE.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from app.hardware.catalog import load_catalog
from app.measurements.importers import SOURCE_NEUSIGHT
from app.training.metrics import metrics, source_of
from app.training.train import (
    DEFAULT_SAMPLE,
    DEFAULTS,
    DEVICE_BLIND_FEATURES,
    MEMBER_FEATURES,
    MODEL_FEATURES,
    PER_SM_CYCLE_FEATURES,
    V3_FEATURES,
    TrainingRows,
    fit_recipe,
    gpu_group,
    is_cpu_rows,
    load_training_data,
    model_inputs,
    predict,
    splits,
)

#: Absolute hardware figures of v3. With eleven GPUs they let the network learn which GPU a row is on
#: (memorise per-device efficiency) instead of how efficiency follows from hardware-relative ratios; the v4
#: candidates replace them with per-SM, per-cycle ratios.
ABSOLUTE_HW: tuple[str, ...] = (
    "hw_log_op_peak_flops_per_s",
    "hw_log_bandwidth_bytes_per_s",
    "hw_log_compute_units",
    "hw_log_clock_mhz",
    "hw_log_l2_cache_bytes",
)
#: Absolute work (FLOPs, bytes, FLOPs per SM): together with the times (work / peak) they still encode the
#: device's peak; the times, shapes and ratios carry the same information about the layer.
ABSOLUTE_WORK: tuple[str, ...] = ("log_flops", "log_bytes", "log_work_per_sm", "log_update_memory_ms")
#: The second wave count of v4 (a smaller GEMM tile).
SMALL_TILE: tuple[str, ...] = ("log_waves_small_tile", "wave_efficiency_small_tile")


def _without(names: Sequence[str], drop: Sequence[str]) -> tuple[str, ...]:
    return tuple(n for n in names if n not in set(drop))


#: The v4 candidate: v3's features without the absolute hardware figures, plus the v4 block of
#: app.core.features: hardware as FLOPs and DRAM bytes per SM per cycle and L2 per SM (NeuSight, Lee et al.
#: ASPLOS 2025: per-SM ratios, so a new GPU is an interpolation), the wave-quantised floor, an SM-cycle time
#: scale (latency-bound kernels) and waves at a second, smaller GEMM tile.
V4_FEATURES: tuple[str, ...] = (
    *_without(V3_FEATURES, ABSOLUTE_HW),
    "log_wave_floor_ms",
    "log_sm_cycle_ms",
    "hw_log_flops_per_sm_cycle",
    "hw_log_bytes_per_sm_cycle",
    "hw_log_l2_per_sm",
    *SMALL_TILE,
)
#: v4 without its second wave count (the first v4 candidate: v3 minus absolute hardware plus 5 ratio columns).
_V4R5 = _without(V4_FEATURES, SMALL_TILE)

#: Variants compared (models/README.md has the scores): name -> (feature names, a subset of
#: :data:`app.core.features.FEATURE_NAMES`; recipe overrides of :data:`app.training.train.DEFAULTS`).
#: Single-feature-set variants say ``member_features: None`` (every member reads the variant's features);
#: ``mixed_ensemble`` is the shipped recipe (train.DEFAULTS), one member per feature set.
_ONE = {"member_features": None}
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "v3": (V3_FEATURES, {**_ONE, "balance": "source"}),
    "v4_with_absolute_hw": ((*V3_FEATURES, *_without(_V4R5, V3_FEATURES)), {**_ONE, "balance": "source"}),
    "v4r5_keep_sms": ((*_V4R5, "hw_log_compute_units"), {**_ONE, "balance": "source"}),
    "v4r5": (_V4R5, {**_ONE, "balance": "source"}),
    "v4r5_family_weights": (_V4R5, {**_ONE, "balance": "source_family"}),
    "v4r5_no_absolute_work": (_without(_V4R5, ABSOLUTE_WORK), {**_ONE, "balance": "source"}),
    "v4r5_no_wave_floor": (_without(_V4R5, ("log_wave_floor_ms",)), {**_ONE, "balance": "source"}),
    "v4_source_weights": (V4_FEATURES, {**_ONE, "balance": "source"}),
    "v4": (V4_FEATURES, {**_ONE, "balance": "source_family"}),
    "device_blind": (DEVICE_BLIND_FEATURES, {**_ONE, "balance": "source"}),
    "per_sm_cycle": (PER_SM_CYCLE_FEATURES, {**_ONE, "balance": "source"}),
    "per_sm_cycle_keep_sms": ((*PER_SM_CYCLE_FEATURES, "hw_log_compute_units"), {**_ONE, "balance": "source"}),
    # the shipped recipe (layer-time-mlp-4 and -5): one member per feature set, averaged in ln ms (train.Ensemble)
    "mixed_ensemble": (MODEL_FEATURES, {"balance": "source", "member_features": MEMBER_FEATURES}),
}

#: Rows per imported file of each GPU source for the quick loop (~1/4 of the shipped sample).
QUICK_SAMPLE: dict[str, int | None] = {"justus2018": 1500, "neusight": 600, "vidur": 4000}
#: ``--full``: every stored NeuSight row is loaded and split (so that the validation configurations do not
#: depend on how many rows a variant trains on), then this share of its training rows is kept: ~63,900 of
#: 249,797, the shipped sample's NeuSight rows (:data:`app.training.train.DEFAULT_SAMPLE`, 2,500 per file).
FULL_NEUSIGHT_TRAIN_SHARE = 0.2558


def score_variant(
    tr: TrainingRows,
    va: TrainingRows,
    *,
    names: Sequence[str],
    recipe: Mapping[str, Any],
    seed: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Leave-one-GPU-chip-out over the GPU rows of ``tr``, scored on each held-out chip's rows of ``va``.

    Returns ``{"score": mean over sources of the pooled MAPE (%), "by_source": {source: MAPE},
    "by_gpu": {chip: MAPE}, "bias_by_gpu": {chip: {source: median pred/true - 1 in %}},
    "by_family": {op family: pooled MAPE}}`` (the bias's sign says whether a held-out chip is over- or under-predicted).
    """
    catalog = load_catalog()
    gtr, gva = tr.subset(~is_cpu_rows(tr)), va.subset(~is_cpu_rows(va))
    g_tr, g_va = gpu_group(gtr.gpu, catalog), gpu_group(gva.gpu, catalog)
    r = {**recipe, "feature_names": tuple(names)}
    pred_parts, true_parts, src_parts, fam_parts = [], [], [], []
    by_gpu: dict[str, float] = {}
    bias: dict[str, dict[str, float]] = {}
    for g in sorted(set(g_va.tolist())):
        members = len(r.get("member_features") or ()) or 1  # one member per feature set of a mixed ensemble
        model, _ = fit_recipe(gtr.subset(g_tr != g), gva.subset(g_va != g), recipe=r, seed=seed, ensemble=members,
                              log=lambda s: None)  # fmt: skip
        v = gva.subset(g_va == g)
        p = np.exp(predict(model, model_inputs(v, names))[:, 1])
        by_gpu[g] = round(metrics(v.time_ms, p)["mape_pct"], 2)
        src_g = source_of(v)
        bias[g] = {str(s): round(float(np.median(p[src_g == s] / v.time_ms[src_g == s]) - 1) * 100, 1)
                   for s in np.unique(src_g)}  # fmt: skip
        pred_parts.append(p)
        true_parts.append(v.time_ms)
        src_parts.append(source_of(v))
        fam_parts.append(v.family)
    pred, true, src, fam = (np.concatenate(x) for x in (pred_parts, true_parts, src_parts, fam_parts))
    by_family = {str(f): round(metrics(true[fam == f], pred[fam == f])["mape_pct"], 1) for f in np.unique(fam)}
    by_source = {s: round(metrics(true[src == s], pred[src == s])["mape_pct"], 2) for s in np.unique(src)}
    score = round(float(np.mean(list(by_source.values()))), 2)
    log(f"score {score}: {by_source}; {by_gpu}; bias {bias}; by family {by_family}")
    return {"score": score, "by_source": by_source, "by_gpu": by_gpu, "bias_by_gpu": bias, "by_family": by_family}


def run(*, database_url: str, variants: Sequence[str], epochs: int, seed: int, full: bool = False,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Load :data:`QUICK_SAMPLE` (``full``: the shipped sample, NeuSight as :data:`FULL_NEUSIGHT_TRAIN_SHARE`
    says) once and :func:`score_variant` each named variant; returns ``{name: result}``."""
    torch.set_num_threads(1)
    sample = {**DEFAULT_SAMPLE, SOURCE_NEUSIGHT: None} if full else QUICK_SAMPLE
    gpu, _, _ = load_training_data(database_url=database_url, cpu=False, sample=sample, seed=seed, log=log)
    tr, va, _ = splits(gpu, None, seed=seed)
    if full:
        share = np.random.default_rng(0).random(len(tr)) < FULL_NEUSIGHT_TRAIN_SHARE
        keep = (source_of(tr) != SOURCE_NEUSIGHT) | share
        tr = tr.subset(keep)
    recipe = {**DEFAULTS, "epochs": epochs}
    out: dict[str, Any] = {}
    for name in variants:
        t0 = time.time()
        names, overrides = VARIANTS[name]
        log(f"variant {name} ({len(names)} features, {overrides})")
        out[name] = {**score_variant(tr, va, names=names, recipe={**recipe, **overrides}, seed=seed, log=log),
                     "seconds": round(time.time() - t0, 1)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints one JSON object ``{variant: result}``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", required=True)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--epochs", type=int, default=None, help="epochs per fold (default 10; --full: the recipe's 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", action="store_true", help="the shipped sample instead of the quick quarter (~3 min "
                   "per variant and member on one thread)")
    a = p.parse_args(argv)
    epochs = a.epochs if a.epochs is not None else int(DEFAULTS["logo_epochs"]) if a.full else 10
    res = run(database_url=a.database_url, variants=a.variants, epochs=epochs, seed=a.seed, full=a.full)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
