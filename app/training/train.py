"""Train the learned per-layer runtime predictor from scratch on the Justus et al. 2018 data.

``python -m app.training.train [--data-dir D] [--out-dir models] [--epochs N] [--sample N] [--seed S]``
(also ``layercast train``). Steps:

1. load and featurise every row (:func:`app.training.justus.load_justus`, the serving feature code);
2. split by **distinct layer configuration** (family, batch, geometry, bias, activation; GPU and
   optimizer excluded) 70/10/20 train/validation/test, so one configuration never sits on both sides;
3. fit the roofline fallback's constants on the training rows (:mod:`app.predictor.roofline`);
4. train an MLP that outputs the log-time quantiles p10/p50/p90 as a residual over a physics prior
   ``ln(roofline_ms / efficiency + floor_ms(pass))`` with learned efficiency and floors (pinball loss);
5. calibrate the interval width on the validation rows (split-conformal scaling of the p10/p90 offsets);
6. evaluate on the test rows against the FLOP-linear (least squares per GPU) and roofline baselines;
7. leave-one-GPU-out: retrain on the training configurations of four GPUs, test on the test
   configurations of the fifth;
8. export one ONNX file (normalisation, prior and calibration baked in; input ``features`` float32
   ``[N, F]``, output ``log_time_ms`` float32 ``[N, 3]`` = ln ms at p10, p50, p90) plus a JSON metadata
   file, and point ``models/CURRENT`` at the new version.

Deterministic for a given seed on CPU (torch deterministic algorithms, fixed thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from app.core.features import FEATURE_NAMES, ROOFLINE_FEATURE_INDEX, raw_index, roofline_ms_from_raw
from app.predictor.roofline import fit_roofline_constants, predict_total_ms
from app.training.justus import (
    DEFAULT_DATA_DIR,
    GPU_IDS,
    JustusData,
    load_hardware_catalog,
    load_justus,
    split_by_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "models"
MODEL_NAME = "layer-time-mlp"
QUANTILES = (0.1, 0.5, 0.9)
IS_TRAIN_INDEX = FEATURE_NAMES.index("is_train")
OPSET = 17


class LayerTimeNet(nn.Module):
    """Quantile MLP over a physics prior; input raw features ``[N, F]``, output ln ms ``[N, 3]``.

    ``prior = ln(exp(log_roofline_ms − ln efficiency) + exp(ln floor_fwd + is_train · Δ))`` with
    efficiency, floor_fwd and Δ learned scalars; the MLP sees standardised features (mean/std buffers
    baked into the graph) and adds a residual to the prior for p50; p10/p90 sit below/above p50 by
    softplus offsets multiplied by the conformal scales ``q_scale`` (1 until calibrated). Features named
    in ``ignore`` are masked to 0 after standardisation (kept in the input schema, unused by the MLP).
    """

    def __init__(
        self, mean: np.ndarray, std: np.ndarray, *, hidden: int = 128, depth: int = 3, ignore: Sequence[str] = ()
    ) -> None:
        super().__init__()
        n = len(mean)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        mask = torch.tensor([0.0 if name in ignore else 1.0 for name in FEATURE_NAMES], dtype=torch.float32)
        self.register_buffer("mask", mask)
        self.register_buffer("q_scale", torch.ones(2, dtype=torch.float32))
        layers: list[nn.Module] = []
        width = n
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, 3))
        self.mlp = nn.Sequential(*layers)
        self.log_eff = nn.Parameter(torch.tensor(math.log(0.5)))
        self.log_floor = nn.Parameter(torch.tensor(math.log(0.1)))
        self.log_floor_train = nn.Parameter(torch.tensor(math.log(3.0)))

    def prior(self, x: torch.Tensor) -> torch.Tensor:
        """Physics prior ln ms ``[N]``."""
        roof = torch.exp(x[:, ROOFLINE_FEATURE_INDEX] - self.log_eff)
        floor = torch.exp(self.log_floor + x[:, IS_TRAIN_INDEX] * self.log_floor_train)
        return torch.log(roof + floor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean) / self.std * self.mask
        out = self.mlp(z)
        p50 = self.prior(x) + out[:, 1]
        lo = p50 - nn.functional.softplus(out[:, 0]) * self.q_scale[0]
        hi = p50 + nn.functional.softplus(out[:, 2]) * self.q_scale[1]
        return torch.stack([lo, p50, hi], dim=1)


def pinball(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean pinball loss of the three quantile columns of ``pred`` ``[N, 3]`` against ``y`` ``[N]``."""
    q = torch.tensor(QUANTILES, dtype=pred.dtype)
    err = y[:, None] - pred
    return torch.maximum(q * err, (q - 1) * err).mean()


def train_model(
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    seed: int,
    hidden: int = 128,
    depth: int = 3,
    batch_size: int = 2048,
    lr: float = 3e-3,
    ignore: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> LayerTimeNet:
    """Train a :class:`LayerTimeNet` on features ``x`` ``[N, F]`` and ln ms targets ``y`` ``[N]``."""
    torch.manual_seed(seed)
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    std = np.where(std > 1e-6, std, 1.0)
    model = LayerTimeNet(mean, std, hidden=hidden, depth=depth, ignore=ignore)
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    steps_per_epoch = max(1, math.ceil(len(y) / batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * batch_size : (i + 1) * batch_size]
            loss = pinball(model(xt[idx]), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        if epoch == epochs - 1 or epoch % max(1, epochs // 5) == 0:
            log(f"  epoch {epoch + 1}/{epochs} pinball {total / len(y):.4f}")
    model.eval()
    return model


def predict(model: LayerTimeNet, x: np.ndarray) -> np.ndarray:
    """ln ms quantiles ``[N, 3]`` of ``x`` ``[N, F]`` (torch, no grad)."""
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy().astype(np.float64)


def calibrate(model: LayerTimeNet, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Split-conformal scaling of the p10/p90 offsets so that 10 % of ``y`` falls below p10 and 10 % above
    p90 on these (validation) rows; stores the scales in ``model.q_scale`` and returns them."""
    model.q_scale.fill_(1.0)
    p = predict(model, x)
    d_lo = np.maximum(p[:, 1] - p[:, 0], 1e-6)
    d_hi = np.maximum(p[:, 2] - p[:, 1], 1e-6)
    s_lo = float(np.quantile((p[:, 1] - y) / d_lo, 0.9))
    s_hi = float(np.quantile((y - p[:, 1]) / d_hi, 0.9))
    s_lo, s_hi = max(s_lo, 0.05), max(s_hi, 0.05)
    model.q_scale.copy_(torch.tensor([s_lo, s_hi]))
    return s_lo, s_hi


def _interval_ratios(pred_ln: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How far beyond each side of the interval ``y`` falls, in units of that side's offset (ln space)."""
    d_lo = np.maximum(pred_ln[:, 1] - pred_ln[:, 0], 1e-6)
    d_hi = np.maximum(pred_ln[:, 2] - pred_ln[:, 1], 1e-6)
    return (pred_ln[:, 1] - y) / d_lo, (y - pred_ln[:, 1]) / d_hi


def _ood_scale(ratios: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """Widening (≥ 1) of the p10/p90 offsets so that 10 % of pooled rows fall outside each side."""
    lo = np.concatenate([r[0] for r in ratios])
    hi = np.concatenate([r[1] for r in ratios])
    return max(1.0, float(np.quantile(lo, 0.9))), max(1.0, float(np.quantile(hi, 0.9)))


# ---------------------------------------------------------------- metrics


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def metrics(
    true_ms: np.ndarray, pred_ms: np.ndarray, lo_ms: np.ndarray | None = None, hi_ms: np.ndarray | None = None
) -> dict[str, float]:
    """MAPE %, RMSPE %, share within ±10 % (%), Spearman ρ, and 80 % interval coverage (%) when given."""
    rel = (pred_ms - true_ms) / true_ms
    out = {
        "n": int(len(true_ms)),
        "mape_pct": float(np.mean(np.abs(rel)) * 100),
        "rmspe_pct": float(np.sqrt(np.mean(rel**2)) * 100),
        "within_10pct": float(np.mean(np.abs(rel) <= 0.10) * 100),
        "spearman": _spearman(true_ms, pred_ms),
    }
    if lo_ms is not None and hi_ms is not None:
        out["coverage_80_pct"] = float(np.mean((true_ms >= lo_ms) & (true_ms <= hi_ms)) * 100)
        out["below_p10_pct"] = float(np.mean(true_ms < lo_ms) * 100)
        out["above_p90_pct"] = float(np.mean(true_ms > hi_ms) * 100)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def flop_linear_fit(data: JustusData) -> dict[str, tuple[float, float]]:
    """Least squares ``time_ms = a + b · pass_flops`` per GPU (Justus et al. 2018's linear baseline)."""
    flops = data.raw[:, raw_index("pass_flops")]
    coef: dict[str, tuple[float, float]] = {}
    for g in np.unique(data.gpu):
        m = data.gpu == g
        a_mat = np.stack([np.ones(m.sum()), flops[m]], axis=1)
        sol, *_ = np.linalg.lstsq(a_mat, data.time_ms[m], rcond=None)
        coef[str(g)] = (float(sol[0]), float(sol[1]))
    return coef


def flop_linear_predict(data: JustusData, coef: dict[str, tuple[float, float]]) -> np.ndarray:
    """Predictions of :func:`flop_linear_fit` (ms; may be ≤ 0, as the linear model allows)."""
    flops = data.raw[:, raw_index("pass_flops")]
    a = np.array([coef[g][0] for g in data.gpu])
    b = np.array([coef[g][1] for g in data.gpu])
    return a + b * flops


def grouped(data: JustusData, pred: np.ndarray, lo: np.ndarray | None, hi: np.ndarray | None) -> dict[str, Any]:
    """Metrics per op family, pass and GPU."""
    out: dict[str, Any] = {}
    for col, values in (("op", data.family), ("pass", data.pass_), ("gpu", data.gpu)):
        out[col] = {}
        for v in np.unique(values):
            m = values == v
            out[col][str(v)] = metrics(
                data.time_ms[m], pred[m], None if lo is None else lo[m], None if hi is None else hi[m]
            )
    return out


# ---------------------------------------------------------------- export


def export_onnx(model: LayerTimeNet, path: Path) -> None:
    """Export ``model`` to ONNX (opset 17, dynamic batch axis) at ``path``."""
    model.eval()
    dummy = torch.zeros(4, len(FEATURE_NAMES), dtype=torch.float32)
    torch.onnx.export(
        model,
        (dummy,),
        str(path),
        input_names=["features"],
        output_names=["log_time_ms"],
        dynamic_axes={"features": {0: "n"}, "log_time_ms": {0: "n"}},
        opset_version=OPSET,
        dynamo=False,
    )


def _evaluate(model: LayerTimeNet, test: JustusData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = np.exp(predict(model, test.features))
    return p[:, 1], p[:, 0], p[:, 2]


def run(
    *,
    data_dir: Path,
    out_dir: Path,
    epochs: int,
    sample: int | None,
    seed: int,
    version: str,
    logo: bool = True,
    hidden: int = 128,
    depth: int = 3,
    threads: int = 1,
    write_current: bool = True,
    argv: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train, evaluate, export; returns the metadata dict written next to the ONNX file."""
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    catalog = load_hardware_catalog()
    data = load_justus(data_dir, catalog=catalog, sample=sample, seed=seed)
    log(f"loaded {len(data)} rows in {time.time() - t0:.1f}s")
    split = split_by_config(data.config, seed=seed)
    tr, va, te = data.subset(split == 0), data.subset(split == 1), data.subset(split == 2)
    y_tr, y_va = np.log(tr.time_ms), np.log(va.time_ms)
    is_tr_train = tr.pass_ == "train_step"

    # roofline fallback constants (fit on train, interval on validation)
    roof_tr, roof_va, roof_te = (roofline_ms_from_raw(d.raw) for d in (tr, va, te))
    rconst = fit_roofline_constants(
        roofline_ms=roof_tr,
        time_ms=tr.time_ms,
        is_train=is_tr_train,
        calib_roofline_ms=roof_va,
        calib_time_ms=va.time_ms,
        calib_is_train=va.pass_ == "train_step",
        source=f"fitted on Justus 2018 training split (seed {seed})",
    )
    log(f"roofline constants: {rconst}")

    log(f"training on {len(tr)} rows ({epochs} epochs)")
    t1 = time.time()
    model = train_model(tr.features, y_tr, epochs=epochs, seed=seed, hidden=hidden, depth=depth, log=log)
    train_s = time.time() - t1
    q_scale = calibrate(model, va.features, y_va)
    log(f"trained in {train_s:.1f}s; conformal scales {q_scale}")

    pred, lo, hi = _evaluate(model, te)
    lin = flop_linear_predict(te, flop_linear_fit(tr))
    pure_roof = roof_te
    fit_roof = predict_total_ms(roof_te, te.pass_ == "train_step", rconst)
    test_metrics = {
        "learned": metrics(te.time_ms, pred, lo, hi),
        "learned_by": grouped(te, pred, lo, hi),
        "baseline_flop_linear_per_gpu": metrics(te.time_ms, lin),
        "baseline_flop_linear_per_gpu_by": grouped(te, lin, None, None),
        "baseline_roofline_pure": metrics(te.time_ms, pure_roof),
        "baseline_roofline_fitted": metrics(
            te.time_ms, fit_roof, fit_roof * rconst.interval_low, fit_roof * rconst.interval_high
        ),
        "baseline_roofline_fitted_by": grouped(
            te, fit_roof, fit_roof * rconst.interval_low, fit_roof * rconst.interval_high
        ),
    }
    log(f"test learned: {test_metrics['learned']}")
    log(f"test flop-linear: {test_metrics['baseline_flop_linear_per_gpu']}")
    log(f"test roofline fitted: {test_metrics['baseline_roofline_fitted']}")

    logo_metrics: dict[str, Any] = {}
    ood_scale = (1.0, 1.0)
    if logo:
        ratios: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        preds: dict[str, np.ndarray] = {}
        gpus = [str(g) for g in sorted(np.unique(data.gpu))]
        for g in gpus:
            t2 = time.time()
            tr_g, va_g, te_g = tr.subset(tr.gpu != g), va.subset(va.gpu != g), te.subset(te.gpu == g)
            m_g = train_model(
                tr_g.features, np.log(tr_g.time_ms), epochs=epochs, seed=seed, hidden=hidden, depth=depth,
                log=lambda s: None,
            )  # fmt: skip
            calibrate(m_g, va_g.features, np.log(va_g.time_ms))
            # interval misfit on the held-out GPU's *validation* configurations (for the OOD scale)
            va_held = va.subset(va.gpu == g)
            ratios[g] = _interval_ratios(predict(m_g, va_held.features), np.log(va_held.time_ms))
            preds[g] = predict(m_g, te_g.features)
            p_g = np.exp(preds[g][:, 1])
            rc_g = fit_roofline_constants(
                roofline_ms=roofline_ms_from_raw(tr_g.raw), time_ms=tr_g.time_ms,
                is_train=tr_g.pass_ == "train_step", calib_roofline_ms=roofline_ms_from_raw(va_g.raw),
                calib_time_ms=va_g.time_ms, calib_is_train=va_g.pass_ == "train_step", source="logo",
            )  # fmt: skip
            r_g = predict_total_ms(roofline_ms_from_raw(te_g.raw), te_g.pass_ == "train_step", rc_g)
            p_all = np.exp(preds[g])
            logo_metrics[g] = {
                "learned": metrics(te_g.time_ms, p_g, p_all[:, 0], p_all[:, 2]),
                "learned_by_op": {
                    str(f): metrics(te_g.time_ms[te_g.family == f], p_g[te_g.family == f])
                    for f in np.unique(te_g.family)
                },
                "baseline_roofline_fitted": metrics(te_g.time_ms, r_g),
            }
            log(f"LOGO {g}: {logo_metrics[g]['learned']} ({time.time() - t2:.0f}s)")
        # Intervals for unseen hardware: widen the log-space offsets by the 0.9 quantile of the misfit
        # ratios pooled over the *other* folds (nested, so fold g's test rows never set its own scale).
        for g in gpus:
            others = [ratios[h] for h in gpus if h != g]
            s_lo, s_hi = _ood_scale(others)
            p = preds[g]
            te_g = te.subset(te.gpu == g)
            lo = np.exp(p[:, 1] - (p[:, 1] - p[:, 0]) * s_lo)
            hi = np.exp(p[:, 1] + (p[:, 2] - p[:, 1]) * s_hi)
            logo_metrics[g]["learned_ood_widened_interval"] = metrics(te_g.time_ms, np.exp(p[:, 1]), lo, hi)
        ood_scale = _ood_scale(list(ratios.values()))
        per_gpu = [logo_metrics[g] for g in gpus]
        logo_metrics["mean_mape_pct"] = round(float(np.mean([v["learned"]["mape_pct"] for v in per_gpu])), 4)
        logo_metrics["mean_within_10pct"] = round(float(np.mean([v["learned"]["within_10pct"] for v in per_gpu])), 4)
        logo_metrics["mean_roofline_fitted_mape_pct"] = round(
            float(np.mean([v["baseline_roofline_fitted"]["mape_pct"] for v in per_gpu])), 4
        )
        logo_metrics["mean_ood_widened_coverage_80_pct"] = round(
            float(np.mean([v["learned_ood_widened_interval"]["coverage_80_pct"] for v in per_gpu])), 4
        )
        logo_metrics["ood_interval_scale"] = list(ood_scale)
        log(f"LOGO mean MAPE {logo_metrics['mean_mape_pct']}; OOD interval scale {ood_scale}")

    # export
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{MODEL_NAME}-{version}"
    onnx_path = out_dir / f"{stem}.onnx"
    export_onnx(model, onnx_path)
    train_gpus = sorted(str(g) for g in np.unique(tr.gpu))
    meta: dict[str, Any] = {
        "name": MODEL_NAME,
        "version": version,
        "onnx_file": onnx_path.name,
        "created_unix_s": int(time.time()),
        "input": {"name": "features", "dtype": "float32", "shape": ["n", len(FEATURE_NAMES)]},
        "output": {
            "name": "log_time_ms",
            "dtype": "float32",
            "shape": ["n", 3],
            "meaning": "natural log of the layer time in ms at quantiles 0.1, 0.5, 0.9 "
            "(forward pass, or whole training step forward+backward+update)",
        },
        "quantiles": list(QUANTILES),
        "feature_names": list(FEATURE_NAMES),
        "feature_function": "app.core.features.layer_features",
        "normalisation": "baked into the ONNX graph (mean/std of the training rows)",
        "feature_min": [float(v) for v in tr.features.min(axis=0)],
        "feature_max": [float(v) for v in tr.features.max(axis=0)],
        "applies_to": {
            "op_kinds": ["conv", "gemm"],
            "conv_spatial_dims": 2,
            "hardware_kind": "gpu",
            "precision": ["fp32"],
            "optimizers": ["none", "sgd", "momentum", "adagrad", "adadelta", "adam", "rmsprop"],
        },
        "training_hardware": {
            g: {
                "peak_fp32_flops_per_s": catalog[g].peak_for("fp32"),
                "memory_bandwidth_bytes_per_s": catalog[g].memory_bandwidth_bytes_per_s,
                "memory_bytes": catalog[g].memory_bytes,
                "compute_units": catalog[g].compute_units,
                "boost_clock_mhz": catalog[g].boost_clock_mhz,
                "base_clock_mhz": catalog[g].base_clock_mhz,
            }
            for g in train_gpus
        },
        "training_data": {
            "source": "Justus et al. 2018 (CDECatapult/ml-performance-prediction e649f32), ../shared/data/justus2018",
            "files": [
                {"name": f.name, "rows_read": f.rows_read, "rows_kept": f.rows_kept, "sha256": f.sha256}
                for f in data.files
            ],
            "sample_rows_per_file": sample,
            "target": "time_ms_median",
            "split": "by distinct layer configuration (family, batch, geometry, bias, activation; GPU and "
            "optimizer excluded), seeded shuffle, 70/10/20 train/validation/test",
            "rows": {"train": len(tr), "validation": len(va), "test": len(te)},
            "gpu_column_to_catalog_id": GPU_IDS,
        },
        "model": {
            "architecture": f"MLP {depth}x{hidden} SiLU, quantile heads over a physics prior",
            "prior": "ln(exp(log_roofline_ms)/efficiency + floor_ms * exp(is_train*delta))",
            "learned_efficiency": math.exp(model.log_eff.item()),
            "learned_floor_forward_ms": math.exp(model.log_floor.item()),
            "learned_floor_train_step_ms": math.exp(model.log_floor.item() + model.log_floor_train.item()),
            "conformal_scales": list(q_scale),
            "epochs": epochs,
            "seed": seed,
            "loss": "pinball on ln ms at 0.1/0.5/0.9",
            "optimizer": "AdamW + OneCycle",
        },
        "roofline": rconst.to_dict(),
        "metrics_test": test_metrics,
        "metrics_leave_one_gpu_out": logo_metrics,
        "ood_hardware_interval_scale": list(ood_scale),
        "paper_reference": {
            "justus2018_conv_mlp_mape_pct": 10.9,
            "justus2018_linear_flop_mape_pct": 399.9,
            "justus2018_unseen_gpu_mape_pct": 39.6,
        },
        "reproduce": "python -m app.training.train " + " ".join(argv),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "threads": threads,
        },
        "wall_time_s": None,
    }
    meta["wall_time_s"] = round(time.time() - t0, 1)
    (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    if write_current:
        (out_dir / "CURRENT").write_text(stem + "\n")
    log(f"wrote {onnx_path} and {stem}.json in {meta['wall_time_s']}s")
    return meta


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``layercast train`` / ``python -m app.training.train``); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="layercast train", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--sample", type=int, default=None, help="rows per file (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version", default="1")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--no-logo", action="store_true", help="skip leave-one-GPU-out evaluation")
    p.add_argument("--no-current", action="store_true", help="do not update models/CURRENT")
    a = p.parse_args(args_list)
    run(
        data_dir=a.data_dir,
        out_dir=a.out_dir,
        epochs=a.epochs,
        sample=a.sample,
        seed=a.seed,
        version=a.version,
        logo=not a.no_logo,
        hidden=a.hidden,
        depth=a.depth,
        threads=a.threads,
        write_current=not a.no_current,
        argv=args_list,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
