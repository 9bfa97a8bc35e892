"""Accuracy metrics and the baselines every learned predictor is compared with (DESIGN.md "Judging accuracy").

Metrics (on ms, never on logs): MAPE, RMSPE, share of rows within ±10 %, Spearman rank correlation, and
for intervals the share of truths inside ``[p10, p90]`` (and below / above it).

Baselines, fitted on training rows only and evaluated on the same held-out rows as the learned model:

* **FLOP-linear per hardware** — least squares ``time_ms = a + b · pass_flops`` for each device
  (Justus et al. 2018's linear baseline);
* **roofline** — pure ``max(F/P, B/W)`` (Williams et al. 2009) at the op's peak for the precision, the
  cheapest algorithm's FLOPs and the precision's bytes (the physics floor,
  :func:`app.core.features.pass_floor_ms`), and the fitted fallback of :mod:`app.predictor.roofline`;
* **FLOPs at 50 % of peak** — ``pass_flops / (0.5 · op peak)`` (the naive estimate practitioners use);
* **lookup table (nearest neighbour)** — the measured time of the closest *measured* configuration on the
  same device, op family, pass and precision (distance over standardised log geometry, FLOPs and
  optimizer), i.e. a latency lookup table that answers unseen configurations with its nearest entry
  (the ProxylessNAS-style table Syed & Srinivasan 2021 compare against).

Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from app.core.features import feature_index, floor_ms_from_raw, raw_index
from app.training.dataset import TrainingRows

#: Measurement source → the name the reports use.
SOURCE_NAMES: dict[str, str] = {"justus2018": "justus", "profiler": "cpu"}


def source_of(data: TrainingRows) -> np.ndarray:
    """Source of each row as the reports name it (``justus``, ``neusight``, ``vidur``, ``cpu``, or the
    stored source name)."""
    return np.asarray([SOURCE_NAMES.get(str(s), str(s)) for s in data.source])


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties broken by order; NaN for fewer than 2 rows)."""
    if len(a) < 2:
        return float("nan")
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def metrics(
    true_ms: np.ndarray, pred_ms: np.ndarray, lo_ms: np.ndarray | None = None, hi_ms: np.ndarray | None = None
) -> dict[str, float]:
    """MAPE, RMSPE, within ±10 % (all in %), Spearman; plus 80 % interval coverage when bounds are given."""
    true_ms = np.asarray(true_ms, dtype=np.float64)
    pred_ms = np.asarray(pred_ms, dtype=np.float64)
    if len(true_ms) == 0:
        return {"n": 0}
    rel = (pred_ms - true_ms) / true_ms
    out: dict[str, float] = {
        "n": int(len(true_ms)),
        "mape_pct": float(np.mean(np.abs(rel)) * 100),
        "rmspe_pct": float(np.sqrt(np.mean(rel**2)) * 100),
        "within_10pct": float(np.mean(np.abs(rel) <= 0.10) * 100),
        "spearman": spearman(true_ms, pred_ms),
    }
    if lo_ms is not None and hi_ms is not None:
        out["coverage_80_pct"] = float(np.mean((true_ms >= lo_ms) & (true_ms <= hi_ms)) * 100)
        out["below_p10_pct"] = float(np.mean(true_ms < lo_ms) * 100)
        out["above_p90_pct"] = float(np.mean(true_ms > hi_ms) * 100)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def grouped(
    data: TrainingRows,
    pred: np.ndarray,
    lo: np.ndarray | None = None,
    hi: np.ndarray | None = None,
    *,
    by: Sequence[str] = ("op", "pass", "hardware", "precision"),
) -> dict[str, Any]:
    """:func:`metrics` per op family, pass, hardware id, precision and source (keys of ``by``)."""
    cols: dict[str, np.ndarray] = {
        "source": source_of(data),
        "op": data.family,
        "pass": data.pass_,
        "hardware": data.gpu,
        "precision": data.precisions,
    }
    out: dict[str, Any] = {}
    for name in by:
        values = cols[name]
        out[name] = {}
        for v in np.unique(values):
            m = values == v
            out[name][str(v)] = metrics(
                data.time_ms[m], pred[m], None if lo is None else lo[m], None if hi is None else hi[m]
            )
    return out


# ---------------------------------------------------------------- baselines


def flop_linear_fit(data: TrainingRows) -> dict[str, tuple[float, float]]:
    """Least squares ``time_ms = a + b · pass_flops`` per hardware id (Justus et al. 2018's linear baseline)."""
    flops = data.raw[:, raw_index("pass_flops")]
    coef: dict[str, tuple[float, float]] = {}
    for g in np.unique(data.gpu):
        m = data.gpu == g
        a_mat = np.stack([np.ones(int(m.sum())), flops[m]], axis=1)
        sol, *_ = np.linalg.lstsq(a_mat, data.time_ms[m], rcond=None)
        coef[str(g)] = (float(sol[0]), float(sol[1]))
    return coef



def pure_roofline_ms(data: TrainingRows) -> np.ndarray:
    """Pure roofline time of each row's pass in ms at the op's peak for the precision (the physics floor)."""
    return floor_ms_from_raw(data.raw)



def flops_at_half_peak_ms(data: TrainingRows) -> np.ndarray:
    """Naive estimate ``pass_flops / (0.5 · op peak)`` in ms (0 FLOPs → 0 ms: the estimate has no memory term)."""
    return data.raw[:, raw_index("pass_flops")] / (0.5 * data.raw[:, raw_index("op_peak_flops_per_s")]) * 1e3


def below_floor_pct(data: TrainingRows, pred_ms: np.ndarray) -> float:
    """Share (%) of predictions below the physics floor (:func:`pure_roofline_ms`), with a 1e-6 relative
    tolerance for float32 rounding."""
    if len(data) == 0:
        return 0.0
    return float(np.mean(np.asarray(pred_ms) < pure_roofline_ms(data) * (1 - 1e-6)) * 100)


# Columns of the lookup-table distance: log geometry, log FLOPs, optimizer one-hots.
_NN_FEATURES: tuple[str, ...] = (
    "log_batch",
    "log_kernel",
    "log_stride",
    "log_c_in",
    "log_c_out",
    "log_in_spatial",
    "log_out_spatial",
    "log_groups",
    "log_seq_len",
    "log_in_elems",
    "log_forward_flops",
    "has_bias",
    "opt_sgd",
    "opt_momentum",
    "opt_adagrad",
    "opt_adadelta",
    "opt_adam",
    "opt_rmsprop",
)


def _nn_key(data: TrainingRows) -> np.ndarray:
    return np.char.add(
        np.char.add(np.char.add(data.gpu.astype(str), "|"), np.char.add(data.family.astype(str), "|")),
        np.char.add(np.char.add(data.pass_.astype(str), "|"), data.precisions.astype(str)),
    )


def cross_device_lookup_predict(train: TrainingRows, test: TrainingRows, *, chunk: int = 2048) -> np.ndarray:
    """Lookup-table baseline for a device without measurements: :func:`nearest_neighbour_predict` on the
    training device closest to each test row's device in (ln op peak, ln bandwidth), same family, pass and
    precision; the measured time there is the answer (what a lookup table built elsewhere can offer)."""
    pk, bw = raw_index("op_peak_flops_per_s"), raw_index("bandwidth_bytes_per_s")
    out = np.full(len(test), np.nan)
    for g in np.unique(test.gpu):
        tm = test.gpu == g
        p_t = np.log(test.raw[tm][0, [pk, bw]])
        best, best_d = None, np.inf
        for h in np.unique(train.gpu):
            hm = (train.gpu == h) & np.isin(train.family, np.unique(test.family[tm]))
            if not hm.any():
                continue
            d = float(np.linalg.norm(np.log(train.raw[hm][0, [pk, bw]]) - p_t))
            if d < best_d:
                best, best_d = h, d
        if best is None:
            continue
        ref = train.subset(train.gpu == best)
        ref.gpu = np.full(len(ref), g)
        out[tm] = nearest_neighbour_predict(ref, test.subset(tm), chunk=chunk)
    return out


def nearest_neighbour_predict(train: TrainingRows, test: TrainingRows, *, chunk: int = 2048) -> np.ndarray:
    """Lookup-table baseline: measured time of the nearest training row with the same device, family,
    pass and precision (Euclidean distance over standardised :data:`_NN_FEATURES`). Rows whose key has
    no training row get NaN (a lookup table cannot answer for an unmeasured device/op).
    """
    cols = [feature_index(n) for n in _NN_FEATURES]
    xtr = train.features[:, cols].astype(np.float64)
    xte = test.features[:, cols].astype(np.float64)
    std = xtr.std(axis=0)
    std = np.where(std > 1e-9, std, 1.0)
    xtr, xte = xtr / std, xte / std
    ktr, kte = _nn_key(train), _nn_key(test)
    out = np.full(len(test), np.nan)
    for key in np.unique(kte):
        itr = np.nonzero(ktr == key)[0]
        ite = np.nonzero(kte == key)[0]
        if len(itr) == 0:
            continue
        a = xtr[itr]
        a2 = (a**2).sum(axis=1)
        for s in range(0, len(ite), chunk):
            b = xte[ite[s : s + chunk]]
            d = a2[None, :] - 2 * b @ a.T
            out[ite[s : s + chunk]] = train.time_ms[itr[np.argmin(d, axis=1)]]
    return out


def finite_metrics(true_ms: np.ndarray, pred_ms: np.ndarray) -> dict[str, float]:
    """:func:`metrics` over the rows where ``pred_ms`` is finite, with ``answered_pct`` (share of rows)."""
    ok = np.isfinite(pred_ms)
    out = metrics(true_ms[ok], pred_ms[ok])
    out["answered_pct"] = round(float(ok.mean() * 100), 4) if len(ok) else 0.0
    return out
