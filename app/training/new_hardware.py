"""New hardware: a GPU whose measurements production never trained on gets a fine-tuned candidate, and the
learning curve of that fine-tune on a few of its measurements (issue 10 item 6).

Syed & Srinivasan 2021 (*Generalized Latency Performance Estimation for Once-For-All NAS*) fine-tune a base
predictor that takes hardware parameters as input on a small number of a new device's measurements, and
report its error against that number. A retrain (:mod:`app.training.retrain`) finds every GPU with stored
measurements that production's ``training_hardware`` does not list (:func:`new_devices`) and then

1. builds its **candidate** with :func:`adapt`: production's torch weights (:func:`production_weights`)
   fine-tuned (:func:`app.training.finetune.finetune_heads`: every member from the base weights, the new
   devices' training-split rows, :data:`REPLAY_ROWS` training-split rows of the devices production knows
   replayed so they are not forgotten, the GPU interval recalibrated on the new devices' validation rows);
   the candidate is gated like any other (same fresh held-out split, same frozen benchmark);
2. measures the **learning curve** of that same :func:`adapt` (:func:`learning_curve`): for each ``k`` of
   :data:`CURVE_SIZES` not above the device's training rows, the first ``k`` of a seeded permutation of them
   (nested: 25 ⊂ 50 ⊂ 100 ⊂ 200), scored on the device's rows of the retrain's held-out split, each point
   the mean over :data:`REPEATS` permutations; production as it is (``k = 0``) and the lookup table of the
   same ``k`` rows (:func:`app.training.metrics.nearest_neighbour_predict`, NaN rows left out of its metrics
   and counted as ``lookup_coverage``) on the same rows.

Everything is :func:`app.training.metrics.metrics` of the p50 (MAPE, RMSPE... in %).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.predictor.metadata import ArtifactMetadata, verify_sha256
from app.training.dataset import TrainingRows
from app.training.finetune import finetune_heads
from app.training.metrics import metrics, nearest_neighbour_predict
from app.training.train import KindHeads, is_cpu_rows, load_weights, model_inputs, predict

#: Numbers of a new device's measurements the curve is measured at (those of Syed & Srinivasan's figure).
CURVE_SIZES: tuple[int, ...] = (25, 50, 100, 200)
#: Rows of the other devices replayed while fine-tuning (a seeded sample of their training rows). At full
#: scale (reports/new_hardware_t4.md) 2,000 rows over twelve known GPUs let a T4 fine-tune forget them (P4
#: 12.6 -> 16.9 % MAPE) and the gate rejected it; with 20,000 none got worse by more than the tolerance.
REPLAY_ROWS = 20000
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


def replay_sample(known: TrainingRows, *, seed: int) -> TrainingRows | None:
    """At most :data:`REPLAY_ROWS` of ``known`` (a seeded sample, order kept); None when it is empty."""
    if len(known) == 0:
        return None
    if len(known) <= REPLAY_ROWS:
        return known
    pick = np.random.default_rng(seed + 1).choice(len(known), REPLAY_ROWS, replace=False)
    return known.subset(np.sort(pick))


def adapt(
    base: KindHeads,
    scales: Mapping[str, Sequence[float]],
    new: TrainingRows,
    *,
    logo_factor: Sequence[float],
    calib: TrainingRows,
    known: TrainingRows,
    epochs: int = 30,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[KindHeads, dict[str, list[float]]]:
    """The retrain's fine-tune for new devices: ``base`` (with its ``conformal_scales`` ``scales``) tuned on
    the ``new`` devices' rows with :func:`replay_sample` of the ``known`` devices' rows replayed, the
    interval recalibrated on ``calib`` and widened by the base's ``logo_factor``
    (:func:`app.training.finetune.finetune_heads`). Returns the model and
    its scales. Raises ``ValueError`` when ``new`` is empty."""
    if len(new) == 0:
        raise ValueError("no rows of the new devices to fine-tune on")
    return finetune_heads(base, new, calib=calib, replay=replay_sample(known, seed=seed), scales=scales,
                          logo_factor=logo_factor, epochs=epochs, seed=seed, log=log)  # fmt: skip


def learning_curve(
    base: KindHeads,
    scales: Mapping[str, Sequence[float]],
    pool: TrainingRows,
    held_out: TrainingRows,
    *,
    calib: TrainingRows,
    known: TrainingRows,
    sizes: Sequence[int] = CURVE_SIZES,
    epochs: int = 30,
    repeats: int = REPEATS,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The curve of one device (module docstring): :func:`adapt` on ``k`` rows of its training rows
    ``pool``, scored on its ``held_out`` rows; each point the mean over ``repeats`` seeded draws (draw ``r``:
    the first ``k`` of permutation ``seed + r`` of the pool, fine-tuned with seed ``seed + r``). Returns
    ``{"rows", "held_out", "pool", "repeats", "base": metrics of production, "points": [{"k", "finetuned",
    "finetuned_mape_pct_per_draw", "lookup_table", "lookup_coverage"}]}``; ``points`` stops at the pool's
    size. Raises ``ValueError`` when the device has no held-out row or ``repeats`` < 1."""
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats}")
    if len(held_out) == 0:
        raise ValueError(f"{len(pool)} training rows of one device and none held out: too few configurations")
    names = base.feature_names
    orders = [np.random.default_rng(seed + r).permutation(len(pool)) for r in range(repeats)]
    x_hold = model_inputs(held_out, names)
    out: dict[str, Any] = {"rows": len(pool) + len(held_out), "held_out": len(held_out), "pool": len(pool),
                           "repeats": repeats,
                           "base": metrics(held_out.time_ms, np.exp(predict(base, x_hold)[:, 1]))}  # fmt: skip
    points = []
    for k in sizes:
        if k > len(pool):
            break
        tuned_m, lookup_m, coverage = [], [], []
        for r, order in enumerate(orders):
            tune = pool.subset(np.sort(order[:k]))
            # the curve scores the median (MAPE), never the interval: no LOGO widening to carry
            tuned, _ = adapt(base, scales, tune, logo_factor=(1.0, 1.0), calib=calib, known=known, epochs=epochs,
                             seed=seed + r, log=lambda s: None)  # fmt: skip
            tuned_m.append(metrics(held_out.time_ms, np.exp(predict(tuned, x_hold)[:, 1])))
            nn_ = nearest_neighbour_predict(tune, held_out)
            ok = np.isfinite(nn_)
            coverage.append(float(ok.mean()))
            if ok.any():
                lookup_m.append(metrics(held_out.time_ms[ok], nn_[ok]))
        tuned_mean = _mean(tuned_m)
        lookup_mean = _mean(lookup_m) if lookup_m else {"n": 0}
        points.append({"k": k, "finetuned": tuned_mean, "finetuned_mape_pct_per_draw": [m["mape_pct"] for m in tuned_m],
                       "lookup_table": lookup_mean, "lookup_coverage": round(float(np.mean(coverage)), 4)})  # fmt: skip
        log(f"  k={k:>4}: fine-tuned MAPE {tuned_mean['mape_pct']:.1f} % "
            f"(lookup table {lookup_mean.get('mape_pct', float('nan')):.1f} %)")
    out["points"] = points
    return out


def curves(
    base: KindHeads,
    scales: Mapping[str, Sequence[float]],
    devices: Sequence[str],
    *,
    train: TrainingRows,
    val: TrainingRows,
    held_out: TrainingRows,
    sizes: Sequence[int] = CURVE_SIZES,
    epochs: int = 30,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """:func:`learning_curve` of each of ``devices`` on the retrain's splits (``train``, ``val``,
    ``held_out``: GPU rows), the devices production knows replayed from ``train``. ``{device: curve}``, a
    device whose curve cannot be measured ``{"error": why}`` (the curve is a report, not a gate)."""
    known = train.subset(~np.isin(train.gpu, list(devices)))
    out: dict[str, Any] = {}
    for hw in devices:
        log(f"new hardware {hw}: learning curve of the fine-tune on k of its measurements")
        try:
            out[hw] = learning_curve(base, scales, train.subset(train.gpu == hw), held_out.subset(held_out.gpu == hw),
                                     calib=val.subset(val.gpu == hw), known=known, sizes=sizes, epochs=epochs,
                                     seed=seed, log=log)  # fmt: skip
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
