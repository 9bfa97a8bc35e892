"""Devices new to production: the learning curve of a fine-tune on a few of their measurements (issue 10 item 6).

Syed & Srinivasan 2021 (*Generalized Latency Performance Estimation for Once-For-All NAS*) fine-tune a base
predictor that takes hardware parameters as input on a small number of a new device's measurements, and
report its error against that number. A retrain (:mod:`app.training.retrain`) does the same for every GPU
whose measurements are stored but which production never trained on (:func:`new_devices`):

1. **split** the device's rows by configuration (:func:`app.training.dataset.split_by_config`, seeded):
   :data:`HOLD_OUT` of its configurations are held out, the rest are the pool;
2. for each ``k`` of :data:`CURVE_SIZES` not above the pool: **fine-tune** production's torch weights
   (:func:`app.training.finetune.finetune_model`: every member from the base weights, other devices' rows
   replayed so they are not forgotten) on the first ``k`` rows of a seeded permutation of the pool (the
   sets are nested: 25 ⊂ 50 ⊂ 100 ⊂ 200), and **score** it on the held-out rows; each point is the mean
   over :data:`REPEATS` permutations;
3. score on the same held-out rows production as it is (``k = 0``) and the lookup table of the same ``k``
   rows (:func:`app.training.metrics.nearest_neighbour_predict`, NaN rows left out of its metrics and
   counted as ``lookup_coverage``).

Everything is :func:`app.training.metrics.metrics` of the p50 (MAPE, RMSPE... in %).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.predictor.metadata import ArtifactMetadata, verify_sha256
from app.training.dataset import TrainingRows, split_by_config
from app.training.finetune import finetune_model
from app.training.metrics import metrics, nearest_neighbour_predict
from app.training.train import KindHeads, is_cpu_rows, load_weights, model_inputs, predict

#: Numbers of a new device's measurements the curve is measured at (those of Syed & Srinivasan's figure).
CURVE_SIZES: tuple[int, ...] = (25, 50, 100, 200)
#: Share of a new device's configurations held out to score every point of the curve.
HOLD_OUT = 0.2
#: Rows of the other devices replayed while fine-tuning (a seeded sample of the training rows).
REPLAY_ROWS = 2000
#: Draws of the ``k`` rows each point of the curve averages (one draw's error swings by about a point).
REPEATS = 3


def new_devices(rows: TrainingRows, production: ArtifactMetadata) -> list[str]:
    """GPU hardware ids with rows in ``rows`` that production's ``training_hardware`` does not list, sorted."""
    known = set((production.training.get("training_hardware") or {}).keys())
    gpu = rows.gpu[~is_cpu_rows(rows)] if len(rows) else rows.gpu
    return sorted({str(g) for g in gpu} - known)


def production_weights(store_dir: Path, production: ArtifactMetadata) -> KindHeads:
    """Production's torch weights from the store, checksum verified. Raises ``FileNotFoundError`` when the
    version was registered without weights (or they are missing) and
    :class:`app.predictor.metadata.ChecksumMismatch` when they are torn or altered."""
    if production.weights_file is None or production.weights_sha256 is None:
        raise FileNotFoundError(f"{production.version} was registered without torch weights")
    path = Path(store_dir) / production.weights_file
    verify_sha256(path, production.weights_sha256)
    recipe = production.training["model"]["recipe"]
    return load_weights(path, feature_names=production.feature_names, hidden=int(recipe["hidden"]),
                        depth=int(recipe["depth"]))  # fmt: skip


def _mean(ms: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key-wise mean of :func:`metrics` dicts over repeats (``n`` kept), 4 decimals."""
    out = {k: round(float(np.mean([m[k] for m in ms])), 4) for k in ms[0] if k != "n"}
    return {"n": ms[0]["n"], **out}


def learning_curve(
    base: KindHeads,
    device_rows: TrainingRows,
    replay: TrainingRows | None,
    *,
    feature_names: Sequence[str],
    sizes: Sequence[int] = CURVE_SIZES,
    epochs: int = 30,
    repeats: int = REPEATS,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The curve of one device (module docstring), each point the mean over ``repeats`` seeded draws of its
    ``k`` rows (draw ``r``: the first ``k`` of permutation ``seed + r`` of the pool, fine-tuned with seed
    ``seed + r``). Returns ``{"rows", "held_out", "pool", "repeats", "base": metrics of production, "points":
    [{"k", "finetuned", "finetuned_mape_pct_per_draw", "lookup_table", "lookup_coverage"}]}``; ``points`` stops
    at the pool's size. Raises ``ValueError`` when the device has no held-out row or ``repeats`` < 1."""
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats}")
    split = split_by_config(device_rows.config, seed=seed, fractions=(1 - HOLD_OUT, 0.0, HOLD_OUT))
    pool, hold = device_rows.subset(split == 0), device_rows.subset(split == 2)
    if len(hold) == 0:
        raise ValueError(f"{len(device_rows)} rows of one device: too few configurations to hold some out")
    orders = [np.random.default_rng(seed + r).permutation(len(pool)) for r in range(repeats)]
    x_hold = model_inputs(hold, feature_names)
    out: dict[str, Any] = {"rows": len(device_rows), "held_out": len(hold), "pool": len(pool), "repeats": repeats,
                           "base": metrics(hold.time_ms, np.exp(predict(base, x_hold)[:, 1]))}  # fmt: skip
    points = []
    for k in sizes:
        if k > len(pool):
            break
        tuned_m, lookup_m, coverage = [], [], []
        for r, order in enumerate(orders):
            tune = pool.subset(np.sort(order[:k]))
            tuned = finetune_model(base, tune, replay=replay, epochs=epochs, seed=seed + r, log=lambda s: None)
            tuned_m.append(metrics(hold.time_ms, np.exp(predict(tuned, x_hold)[:, 1])))
            nn_ = nearest_neighbour_predict(tune, hold)
            ok = np.isfinite(nn_)
            coverage.append(float(ok.mean()))
            if ok.any():
                lookup_m.append(metrics(hold.time_ms[ok], nn_[ok]))
        tuned_mean = _mean(tuned_m)
        lookup_mean = _mean(lookup_m) if lookup_m else {"n": 0}
        points.append({"k": k, "finetuned": tuned_mean, "finetuned_mape_pct_per_draw": [m["mape_pct"] for m in tuned_m],
                       "lookup_table": lookup_mean, "lookup_coverage": round(float(np.mean(coverage)), 4)})  # fmt: skip
        log(f"  k={k:>4}: fine-tuned MAPE {tuned_mean['mape_pct']:.1f} % "
            f"(lookup table {lookup_mean.get('mape_pct', float('nan')):.1f} %)")
    out["points"] = points
    return out


def curves(
    *,
    store_dir: Path,
    production: ArtifactMetadata,
    gpu_rows: TrainingRows,
    sizes: Sequence[int] = CURVE_SIZES,
    epochs: int = 30,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The learning curve of every device of ``gpu_rows`` new to production (:func:`new_devices`), replaying
    :data:`REPLAY_ROWS` rows of the devices production knows. ``{}`` when there is none; ``{"error": why}``
    when production's weights cannot be loaded (the retrain goes on: the curve is a report, not a gate)."""
    devices = new_devices(gpu_rows, production)
    if not devices:
        return {}
    try:
        base = production_weights(store_dir, production)
    except (FileNotFoundError, ValueError) as exc:
        log(f"new hardware {devices}: no learning curve ({exc})")
        return {"error": str(exc), "devices": devices}
    known = ~np.isin(gpu_rows.gpu, devices)
    replay = gpu_rows.subset(known)
    if len(replay) > REPLAY_ROWS:
        replay = replay.subset(np.sort(np.random.default_rng(seed + 1).choice(len(replay), REPLAY_ROWS,
                                                                              replace=False)))  # fmt: skip
    out: dict[str, Any] = {}
    for hw in devices:
        log(f"new hardware {hw}: fine-tuning {production.version} on k of its measurements")
        try:
            out[hw] = learning_curve(base, gpu_rows.subset(gpu_rows.gpu == hw), replay if len(replay) else None,
                                     feature_names=production.feature_names, sizes=sizes, epochs=epochs, seed=seed,
                                     log=log)  # fmt: skip
        except ValueError as exc:
            out[hw] = {"error": str(exc)}
    return out


def markdown(curves_: Mapping[str, Any]) -> str:
    """The curves as a Markdown table: one row per device and ``k`` (``0``: production untouched)."""
    lines = ["| device | k | fine-tuned MAPE % | lookup-table MAPE % | held-out rows |", "|---|---:|---:|---:|---:|"]
    for hw, c in curves_.items():
        if not isinstance(c, Mapping) or "points" not in c:
            continue
        lines.append(f"| {hw} | 0 | {c['base']['mape_pct']:.1f} | | {c['held_out']} |")
        for p in c["points"]:
            lookup = p["lookup_table"].get("mape_pct")
            lines.append(f"| {hw} | {p['k']} | {p['finetuned']['mape_pct']:.1f} | "
                         f"{'' if lookup is None else f'{lookup:.1f}'} | {c['held_out']} |")  # fmt: skip
    return "\n".join(lines)
