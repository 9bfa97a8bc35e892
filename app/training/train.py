"""Train the learned per-layer runtime predictor: Justus et al. 2018 GPU rows + the CPU seed dataset.

``python -m app.training.train [--database-url URL] [--sources justus2018 profiler] [--out-dir models]
[--epochs N] [--sample N] [--seed S] [--version V]`` (also ``layercast train``). Steps:

1. load and featurise the stored measurements (:func:`app.training.dataset.load_training_rows`, the one
   path training and retraining read; ``layercast import justus`` / ``layercast import profiler`` fill
   it): GPU rows and, unless ``--no-cpu``, CPU rows featurised against the CPU spec stored with their
   hardware row (snapshotted into the metadata);
2. split each source by **distinct layer configuration** 70/10/20 train/validation/test (a configuration
   never sits on both sides, whatever its GPU, optimizer or precision);
3. fit the roofline fallback's constants on the GPU training rows (:mod:`app.predictor.roofline`);
4. train an ensemble of MLPs (different seeds) whose p50 is a residual over the physics prior
   ``ln(roofline_ms / efficiency + floor_ms)`` with efficiency and floor learned per hardware kind (GPU /
   CPU) and pass, pinball loss at p10/p50/p90; CPU rows are re-weighted to a fixed share of the loss;
5. calibrate the 80 % interval on the validation rows, per hardware kind (split-conformal scaling);
6. leave-one-GPU-out: the same recipe without any row of the held-out GPU (training, normalisation,
   calibration), tested on its test configurations; also sets the interval widening for unseen GPUs;
7. export ONE ONNX file (ensemble mean, normalisation, prior and calibration baked in; input
   ``features`` float32 ``[N, F]`` = the ``feature_names`` columns of :mod:`app.core.features`, output
   ``log_time_ms`` float32 ``[N, 3]`` = ln ms at p10, p50, p90), the torch weights (``.weights.npz``, for
   :mod:`app.training.finetune`) and the JSON metadata; point ``models/CURRENT`` at the new version.

The held-out report against the baselines is :mod:`app.training.evaluate` (``layercast evaluate``).
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

from app.core.features import (
    FEATURE_NAMES,
    FEATURE_NAMES_V1,
    roofline_ms_from_raw,
    select_features,
)
from app.core.hardware import HardwareSpec
from app.measurements.importers import JUSTUS_GPU_IDS as GPU_IDS
from app.predictor.roofline import fit_roofline_constants
from app.training.dataset import DEFAULT_SOURCES, load_from_database, split_by_config, split_by_hash
from app.training.dataset import TrainingRows as JustusData
from app.training.metrics import metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "models"
MODEL_NAME = "layer-time-mlp"
QUANTILES = (0.1, 0.5, 0.9)
OPSET = 17

#: Features the model reads: every feature of app.core.features except the device memory size and the L2
#: size, which say little about speed and, with five GPUs, mostly let the network tell them apart
#: (leave-one-GPU-out error rises with them: 20.8 % without memory vs 23.2 % with it in a 40k-row probe).
MODEL_FEATURES: tuple[str, ...] = tuple(
    n for n in FEATURE_NAMES if n not in ("hw_log_memory_bytes", "hw_log_l2_cache_bytes")
)

#: Share of the training loss carried by CPU rows (they are ~5 % of the rows).
CPU_LOSS_SHARE = 0.3

#: CPU head: few rows (~10k), so smaller batches and more epochs than the GPU head.
CPU_HEAD: dict[str, Any] = {"epochs": 80, "batch_size": 256}

#: Model defaults (the shipped artifact's recipe; recorded in its metadata).
DEFAULTS: dict[str, Any] = {
    "epochs": 40,  # the shipped v2 run
    "hidden": 128,
    "depth": 3,
    "ensemble": 3,
    "lr": 3e-3,
    "weight_decay": 1e-5,
    "batch_size": 2048,
}


class LayerTimeNet(nn.Module):
    """Quantile MLP over a physics prior; input features ``[N, F]`` (``feature_names`` columns), output
    ln ms ``[N, 3]`` at p10/p50/p90.

    ``prior = ln(exp(log_roofline_ms − ln eff) + exp(ln floor))`` where ``ln eff`` and ``ln floor`` are
    learned scalars plus learned offsets for a training step and for CPUs (``is_train``, ``is_cpu``
    columns; a feature list without ``is_cpu`` has no CPU offsets). The MLP sees standardised features
    (mean/std buffers baked into the graph) and adds a residual to the prior for p50; p10/p90 sit
    below/above p50 by softplus offsets multiplied by the conformal scales ``q_scale[kind]`` (row 0 GPU,
    row 1 CPU; 1 until calibrated).
    """

    mean: torch.Tensor
    std: torch.Tensor
    q_scale: torch.Tensor

    def __init__(
        self,
        mean: np.ndarray,
        std: np.ndarray,
        *,
        feature_names: Sequence[str] = MODEL_FEATURES,
        hidden: int = 128,
        depth: int = 3,
    ) -> None:
        super().__init__()
        names = list(feature_names)
        if len(mean) != len(names):
            raise ValueError(f"mean has {len(mean)} columns, feature_names {len(names)}")
        self.feature_names = tuple(names)
        self.hidden, self.depth = hidden, depth
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.register_buffer("q_scale", torch.ones(2, 2, dtype=torch.float32))
        self.roof_i = names.index("log_roofline_ms")
        self.train_i = names.index("is_train")
        self.cpu_i = names.index("is_cpu") if "is_cpu" in names else -1
        layers: list[nn.Module] = []
        width = len(names)
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, 3))
        self.mlp = nn.Sequential(*layers)
        self.log_eff = nn.Parameter(torch.tensor(math.log(0.5)))
        self.log_floor = nn.Parameter(torch.tensor(math.log(0.1)))
        self.log_floor_train = nn.Parameter(torch.tensor(math.log(3.0)))
        self.cpu_log_eff = nn.Parameter(torch.tensor(0.0))
        self.cpu_log_floor = nn.Parameter(torch.tensor(math.log(0.05)))
        self.cpu_log_floor_train = nn.Parameter(torch.tensor(0.0))

    def _is_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.cpu_i] if self.cpu_i >= 0 else torch.zeros_like(x[:, 0])

    def prior(self, x: torch.Tensor) -> torch.Tensor:
        """Physics prior ln ms ``[N]``."""
        cpu = self._is_cpu(x)
        train = x[:, self.train_i]
        log_eff = self.log_eff + cpu * self.cpu_log_eff
        log_floor = (
            self.log_floor
            + train * self.log_floor_train
            + cpu * (self.cpu_log_floor + train * self.cpu_log_floor_train)
        )
        a = x[:, self.roof_i] - log_eff
        m = torch.maximum(a, log_floor)  # logaddexp, written out (no ONNX symbolic for aten::logaddexp)
        return m + torch.log(torch.exp(a - m) + torch.exp(log_floor - m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean) / self.std
        out = self.mlp(z)
        p50 = self.prior(x) + out[:, 1]
        cpu = self._is_cpu(x)
        s_lo = self.q_scale[0, 0] + cpu * (self.q_scale[1, 0] - self.q_scale[0, 0])
        s_hi = self.q_scale[0, 1] + cpu * (self.q_scale[1, 1] - self.q_scale[0, 1])
        lo = p50 - nn.functional.softplus(out[:, 0]) * s_lo
        hi = p50 + nn.functional.softplus(out[:, 2]) * s_hi
        return torch.stack([lo, p50, hi], dim=1)

    def prior_summary(self) -> dict[str, float]:
        """Learned prior constants (efficiency and floors in ms, per kind and pass)."""
        e, f, dt = self.log_eff.item(), self.log_floor.item(), self.log_floor_train.item()
        ce, cf, cdt = self.cpu_log_eff.item(), self.cpu_log_floor.item(), self.cpu_log_floor_train.item()
        return {
            "gpu_efficiency": math.exp(e),
            "gpu_floor_forward_ms": math.exp(f),
            "gpu_floor_train_step_ms": math.exp(f + dt),
            "cpu_efficiency": math.exp(e + ce),
            "cpu_floor_forward_ms": math.exp(f + cf),
            "cpu_floor_train_step_ms": math.exp(f + dt + cf + cdt),
        }


class Ensemble(nn.Module):
    """Mean of the members' ln-ms quantiles (one ONNX graph for the whole ensemble)."""

    def __init__(self, members: Sequence[LayerTimeNet]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.feature_names = members[0].feature_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members], dim=0).mean(dim=0)


class KindHeads(nn.Module):
    """One ONNX graph, two heads: the GPU ensemble (Justus rows) and the CPU ensemble (seed rows), picked per
    row by the ``is_cpu`` feature. Separate heads keep hardware generalisation across GPUs independent of
    the CPU rows (with them in one network the CPU's far-away hardware features distorted the GPU
    extrapolation: leave-one-GPU-out 39.6 % vs 2x.x % apart). ``cpu`` may be None (GPU-only model)."""

    def __init__(self, gpu: Ensemble, cpu: Ensemble | None) -> None:
        super().__init__()
        self.gpu_head = gpu
        self.cpu_head = cpu
        self.feature_names = gpu.feature_names
        self.cpu_i = list(self.feature_names).index("is_cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gpu_head(x)
        if self.cpu_head is None:
            return g
        c = self.cpu_head(x)
        return torch.where(x[:, self.cpu_i : self.cpu_i + 1] > 0.5, c, g)

    def heads(self) -> dict[str, Ensemble]:
        """``{"gpu": ..., "cpu": ...}`` (CPU only when present)."""
        return {"gpu": self.gpu_head, **({"cpu": self.cpu_head} if self.cpu_head is not None else {})}


def pinball(pred: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """(Weighted) mean pinball loss of the quantile columns of ``pred`` ``[N, 3]`` against ``y`` ``[N]``."""
    q = torch.tensor(QUANTILES, dtype=pred.dtype)
    err = y[:, None] - pred
    loss = torch.maximum(q * err, (q - 1) * err).mean(dim=1)
    if w is None:
        return loss.mean()
    return (loss * w).sum() / w.sum()


def train_model(
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    seed: int,
    feature_names: Sequence[str] = MODEL_FEATURES,
    weights: np.ndarray | None = None,
    hidden: int = 128,
    depth: int = 3,
    batch_size: int = 2048,
    lr: float = 3e-3,
    weight_decay: float = 1e-5,
    init: LayerTimeNet | None = None,
    log: Callable[[str], None] = print,
) -> LayerTimeNet:
    """Train a :class:`LayerTimeNet` on features ``x`` ``[N, F]`` (``feature_names`` columns) and ln ms
    targets ``y`` ``[N]``, optional per-row loss ``weights``. ``init`` starts from a copy of an existing
    model (its normalisation kept: fine-tuning)."""
    torch.manual_seed(seed)
    if init is not None:
        model = LayerTimeNet(
            init.mean.numpy(), init.std.numpy(), feature_names=init.feature_names, hidden=init.hidden,
            depth=init.depth,
        )  # fmt: skip
        model.load_state_dict(init.state_dict())
        model.q_scale.fill_(1.0)
    else:
        # float64 statistics, and a column that (nearly) never varies — the hardware features of a single
        # CPU — is left unscaled: dividing by its float32 rounding noise would blow up any other device
        x64 = np.asarray(x, dtype=np.float64)
        mean = x64.mean(axis=0)
        std = x64.std(axis=0)
        std = np.where(std > 1e-3, std, 1.0)
        model = LayerTimeNet(mean, std, feature_names=feature_names, hidden=hidden, depth=depth)
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    wt = None if weights is None else torch.tensor(weights, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = max(1, math.ceil(len(y) / batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * batch_size : (i + 1) * batch_size]
            loss = pinball(model(xt[idx]), yt[idx], None if wt is None else wt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        if epoch == epochs - 1 or epoch % max(1, epochs // 5) == 0:
            log(f"  epoch {epoch + 1}/{epochs} pinball {total / len(y):.4f}")
    model.eval()
    return model


def train_ensemble(
    x: np.ndarray,
    y: np.ndarray,
    *,
    n: int,
    seed: int,
    log: Callable[[str], None] = print,
    **kwargs: Any,
) -> Ensemble:
    """``n`` :func:`train_model` members with seeds ``seed, seed+1, ...``."""
    members = []
    for k in range(n):
        t0 = time.time()
        members.append(train_model(x, y, seed=seed + k, log=log, **kwargs))
        log(f"  member {k + 1}/{n} trained in {time.time() - t0:.0f}s")
    return Ensemble(members)


def predict(model: nn.Module, x: np.ndarray) -> np.ndarray:
    """ln ms quantiles ``[N, 3]`` of ``x`` ``[N, F]`` (torch, no grad)."""
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy().astype(np.float64)


def _members(model: nn.Module) -> list[LayerTimeNet]:
    if isinstance(model, KindHeads):
        return [m for head in model.heads().values() for m in _members(head)]
    if isinstance(model, Ensemble):
        return [m for m in model.members if isinstance(m, LayerTimeNet)]
    assert isinstance(model, LayerTimeNet)
    return [model]


def calibrate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, is_cpu: np.ndarray | None = None
) -> dict[str, tuple[float, float]]:
    """Split-conformal scaling of the p10/p90 offsets so that 10 % of ``y`` falls below p10 and 10 % above
    p90 on these (validation) rows, separately for GPU and CPU rows (``is_cpu``; all GPU when None).
    Sets ``q_scale`` of every member (an ensemble's offsets are the mean of its members', so one common
    scale per kind calibrates the mean) and returns ``{"gpu": (lo, hi), "cpu": (lo, hi)}``."""
    members = _members(model)
    for m in members:
        m.q_scale.fill_(1.0)
    p = predict(model, x)
    cpu = np.zeros(len(y), dtype=bool) if is_cpu is None else np.asarray(is_cpu, dtype=bool)
    out: dict[str, tuple[float, float]] = {}
    for row, (kind, sel) in enumerate((("gpu", ~cpu), ("cpu", cpu))):
        if not sel.any():
            out[kind] = (1.0, 1.0)
            continue
        ps, ys = p[sel], y[sel]
        d_lo = np.maximum(ps[:, 1] - ps[:, 0], 1e-6)
        d_hi = np.maximum(ps[:, 2] - ps[:, 1], 1e-6)
        s_lo = max(float(np.quantile((ps[:, 1] - ys) / d_lo, 0.9)), 0.05)
        s_hi = max(float(np.quantile((ys - ps[:, 1]) / d_hi, 0.9)), 0.05)
        out[kind] = (s_lo, s_hi)
        for m in members:
            m.q_scale[row].copy_(torch.tensor([s_lo, s_hi]))
    return out


def interval_ratios(pred_ln: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How far beyond each side of the interval ``y`` falls, in units of that side's offset (ln space)."""
    d_lo = np.maximum(pred_ln[:, 1] - pred_ln[:, 0], 1e-6)
    d_hi = np.maximum(pred_ln[:, 2] - pred_ln[:, 1], 1e-6)
    return (pred_ln[:, 1] - y) / d_lo, (y - pred_ln[:, 1]) / d_hi


def ood_scale(ratios: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """Widening (≥ 1) of the p10/p90 offsets so that 10 % of pooled rows fall outside each side."""
    lo = np.concatenate([r[0] for r in ratios])
    hi = np.concatenate([r[1] for r in ratios])
    return max(1.0, float(np.quantile(lo, 0.9))), max(1.0, float(np.quantile(hi, 0.9)))


# ---------------------------------------------------------------- data


def loss_weights(data: JustusData, cpu_share: float = CPU_LOSS_SHARE) -> np.ndarray:
    """Per-row loss weights: CPU rows carry ``cpu_share`` of the total, GPU rows the rest."""
    cpu = is_cpu_rows(data)
    w = np.ones(len(data))
    n_cpu, n_gpu = int(cpu.sum()), int((~cpu).sum())
    if n_cpu and n_gpu:
        w[cpu] = cpu_share / (1 - cpu_share) * n_gpu / n_cpu
    return w


def is_cpu_rows(data: JustusData) -> np.ndarray:
    """Boolean ``[N]``: rows featurised against a CPU."""
    from app.core.features import feature_index

    return data.features[:, feature_index("is_cpu")] > 0.5


def model_inputs(data: JustusData, names: Sequence[str] = MODEL_FEATURES) -> np.ndarray:
    """The model's input columns of ``data.features``."""
    return select_features(data.features, names)


def load_training_data(
    *,
    database_url: str,
    sources: Sequence[str],
    cpu: bool,
    sample: int | None,
    seed: int,
    log: Callable[[str], None] = print,
) -> tuple[JustusData, JustusData | None, HardwareSpec | None]:
    """GPU rows, CPU rows (None without ``cpu`` or without stored CPU rows) and the CPU spec they use, from
    the measurement database (:func:`app.training.dataset.load_training_rows`).

    ``sample``: measurements per imported GPU file (seeded), and ``4 · sample`` CPU configurations.
    Raises ``ValueError`` when no GPU measurement of ``sources`` is stored.
    """
    t0 = time.time()
    gpu = load_from_database(database_url, sources=sources, hardware_kinds=("gpu",), sample_per_file=sample, seed=seed)
    log(f"loaded {len(gpu)} GPU rows in {time.time() - t0:.1f}s (skipped {dict(gpu.skipped)})")
    cpu_rows: JustusData | None = None
    cpu_spec: HardwareSpec | None = None
    if cpu:
        try:
            cpu_rows = load_from_database(database_url, sources=sources, hardware_kinds=("cpu",))
        except ValueError:
            log("no CPU measurements stored: GPU-only model")
        if cpu_rows is not None:
            if len(cpu_rows.hardware) != 1:
                raise ValueError(f"the CPU head trains on one CPU; stored CPU rows name {sorted(cpu_rows.hardware)}")
            cpu_spec = next(iter(cpu_rows.hardware.values()))
            if sample is not None:
                keys = np.unique(cpu_rows.config)
                keep = np.random.default_rng(seed).permutation(keys)[: max(1, sample * 4)]
                cpu_rows = cpu_rows.subset(np.isin(cpu_rows.config, keep))
            log(f"loaded {len(cpu_rows)} CPU rows of {cpu_spec.id} (skipped {dict(cpu_rows.skipped)})")
    return gpu, cpu_rows, cpu_spec


def splits(gpu: JustusData, cpu: JustusData | None, *, seed: int) -> tuple[JustusData, JustusData, JustusData]:
    """Train / validation / test of both sources, each split by configuration 70/10/20 (GPU:
    :func:`split_by_config`, as for v1; CPU: :func:`app.training.dataset.split_by_hash`, stable as the
    seed dataset grows)."""
    parts: list[tuple[JustusData, JustusData, JustusData]] = []
    for d, split in ((gpu, split_by_config), (cpu, split_by_hash)):
        if d is None or len(d) == 0:
            continue
        s = split(d.config, seed=seed)
        parts.append((d.subset(s == 0), d.subset(s == 1), d.subset(s == 2)))
    tr, va, te = (JustusData.concat([p[i] for p in parts]) for i in range(3))
    return tr, va, te


def fit_recipe(
    tr: JustusData,
    va: JustusData,
    *,
    recipe: dict[str, Any],
    seed: int,
    log: Callable[[str], None] = print,
) -> tuple[KindHeads, dict[str, tuple[float, float]]]:
    """Train the heads of ``recipe`` (keys of :data:`DEFAULTS`; CPU head with :data:`CPU_HEAD` overrides)
    on ``tr`` — the GPU head on its GPU rows, the CPU head on its CPU rows (none without CPU rows) — and
    calibrate each on its kind's ``va`` rows."""
    names = tuple(recipe.get("feature_names", MODEL_FEATURES))
    heads: dict[str, Ensemble] = {}
    scales: dict[str, tuple[float, float]] = {"gpu": (1.0, 1.0), "cpu": (1.0, 1.0)}
    for kind, cpu in (("gpu", False), ("cpu", True)):
        t, v = tr.subset(is_cpu_rows(tr) == cpu), va.subset(is_cpu_rows(va) == cpu)
        if len(t) == 0:
            continue
        r = {**recipe, **(recipe.get("cpu_head", CPU_HEAD) if cpu else {})}
        heads[kind] = train_ensemble(
            model_inputs(t, names), np.log(t.time_ms), n=int(r["ensemble"]), seed=seed, log=log,
            feature_names=names, epochs=int(r["epochs"]), hidden=int(r["hidden"]), depth=int(r["depth"]),
            batch_size=int(r["batch_size"]), lr=float(r["lr"]), weight_decay=float(r["weight_decay"]),
        )  # fmt: skip
        if len(v):
            scales[kind] = calibrate(heads[kind], model_inputs(v, names), np.log(v.time_ms), is_cpu_rows(v))[kind]
    if "gpu" not in heads:
        raise ValueError("no GPU training rows")
    return KindHeads(heads["gpu"], heads.get("cpu")), scales


def leave_one_gpu_out(
    tr: JustusData,
    va: JustusData,
    te: JustusData,
    *,
    recipe: dict[str, Any],
    seed: int,
    gpus: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """For each GPU: train and calibrate the recipe without any of its rows, predict its test rows.

    Returns ``{gpu: {"pred_ln": [N, 3], "test": JustusData, "model": the fold's model, "val_ratios": (lo, hi)}}``;
    ``val_ratios`` are the interval misfits on the held-out GPU's validation rows (used, pooled over the *other*
    folds, to widen intervals on unseen hardware).
    """
    names = tuple(recipe.get("feature_names", MODEL_FEATURES))
    gpus = list(gpus) if gpus is not None else sorted({str(g) for g in np.unique(tr.gpu) if g in GPU_IDS.values()})
    out: dict[str, Any] = {}
    for g in gpus:
        t0 = time.time()
        # GPU rows only: the CPU head never answers a GPU row, so it need not be retrained here
        gtr, gva = tr.subset(~is_cpu_rows(tr)), va.subset(~is_cpu_rows(va))
        model, _ = fit_recipe(gtr.subset(gtr.gpu != g), gva.subset(gva.gpu != g), recipe=recipe, seed=seed,
                              log=lambda s: None)  # fmt: skip
        te_g, va_g = te.subset(te.gpu == g), va.subset(va.gpu == g)
        out[g] = {
            "pred_ln": predict(model, model_inputs(te_g, names)),
            "test": te_g,
            "model": model,
            "val_ratios": interval_ratios(predict(model, model_inputs(va_g, names)), np.log(va_g.time_ms)),
        }
        p = np.exp(out[g]["pred_ln"][:, 1])
        log(f"LOGO {g}: MAPE {metrics(te_g.time_ms, p)['mape_pct']:.1f} % ({time.time() - t0:.0f}s)")
    return out


# ---------------------------------------------------------------- export


def export_onnx(model: nn.Module, path: Path, n_features: int | None = None) -> None:
    """Export ``model`` to ONNX (opset 17, dynamic batch axis) at ``path``."""
    model.eval()
    n = n_features if n_features is not None else len(getattr(model, "feature_names", FEATURE_NAMES))
    dummy = torch.zeros(4, n, dtype=torch.float32)
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


def save_weights(model: KindHeads, path: Path) -> None:
    """Torch weights of every member (``<head>.member<k>.<state key>``) as a numpy ``.npz`` (for fine-tuning)."""
    arrays = {
        f"{head}.member{k}.{key}": v.detach().numpy()
        for head, ens in model.heads().items()
        for k, m in enumerate(ens.members)
        for key, v in m.state_dict().items()
    }
    np.savez(path, **arrays)  # type: ignore[arg-type]


def load_weights(path: Path, *, feature_names: Sequence[str], hidden: int, depth: int) -> KindHeads:
    """Inverse of :func:`save_weights`; raises ``FileNotFoundError``/``KeyError`` on a bad file."""
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    heads: dict[str, Ensemble] = {}
    for head in ("gpu", "cpu"):
        keys = [k for k in data if k.startswith(f"{head}.member")]
        if not keys:
            continue
        n = 1 + max(int(k.split(".")[1][len("member") :]) for k in keys)
        members = []
        for k in range(n):
            prefix = f"{head}.member{k}."
            sd = {key[len(prefix) :]: torch.tensor(v) for key, v in data.items() if key.startswith(prefix)}
            m = LayerTimeNet(sd["mean"].numpy(), sd["std"].numpy(), feature_names=feature_names, hidden=hidden,
                             depth=depth)  # fmt: skip
            m.load_state_dict(sd)
            m.eval()
            members.append(m)
        heads[head] = Ensemble(members)
    return KindHeads(heads["gpu"], heads.get("cpu"))


def hardware_snapshot(hw: HardwareSpec) -> dict[str, Any]:
    """Spec fields stored in ``training_hardware`` (everything the features read, plus identity)."""
    from app.training.snapshot import hardware_to_dict

    return hardware_to_dict(hw)


def run(
    *,
    database_url: str,
    out_dir: Path,
    sources: Sequence[str] = DEFAULT_SOURCES,
    cpu: bool = True,
    epochs: int,
    sample: int | None,
    seed: int,
    version: str,
    logo: bool = True,
    hidden: int = 128,
    depth: int = 3,
    ensemble: int = 3,
    threads: int = 1,
    write_current: bool = True,
    argv: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train, calibrate, run leave-one-GPU-out, export; returns the metadata written next to the ONNX file."""
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    gpu, cpu_rows, cpu_spec = load_training_data(
        database_url=database_url, sources=sources, cpu=cpu, sample=sample, seed=seed, log=log
    )
    catalog = gpu.hardware
    tr, va, te = splits(gpu, cpu_rows, seed=seed)
    recipe = {
        **DEFAULTS,
        "epochs": epochs,
        "hidden": hidden,
        "depth": depth,
        "ensemble": ensemble,
        "cpu_head": CPU_HEAD,
    }

    # roofline fallback constants: GPU rows (the fallback's CPU use is indicative only)
    g_tr, g_va = tr.subset(~is_cpu_rows(tr)), va.subset(~is_cpu_rows(va))
    rconst = fit_roofline_constants(
        roofline_ms=roofline_ms_from_raw(g_tr.raw), time_ms=g_tr.time_ms, is_train=g_tr.pass_ == "train_step",
        calib_roofline_ms=roofline_ms_from_raw(g_va.raw), calib_time_ms=g_va.time_ms,
        calib_is_train=g_va.pass_ == "train_step", source=f"fitted on Justus 2018 training split (seed {seed})",
    )  # fmt: skip
    log(f"roofline constants: {rconst}")

    log(f"training on {len(tr)} rows ({int(is_cpu_rows(tr).sum())} CPU), {ensemble} x {epochs} epochs")
    t1 = time.time()
    model, q_scale = fit_recipe(tr, va, recipe=recipe, seed=seed, log=log)
    train_s = time.time() - t1
    log(f"trained in {train_s:.1f}s; conformal scales {q_scale}")

    test_pred = predict(model, model_inputs(te))
    p = np.exp(test_pred)
    cpu_te = is_cpu_rows(te)
    summary = {
        kind: metrics(te.time_ms[sel], p[sel, 1], p[sel, 0], p[sel, 2])
        for kind, sel in (("gpu", ~cpu_te), ("cpu", cpu_te))
        if sel.any()
    }
    log(f"test: {summary}")

    logo_summary: dict[str, Any] = {}
    ood = (1.0, 1.0)
    if logo:
        folds = leave_one_gpu_out(tr, va, te, recipe=recipe, seed=seed, log=log)
        ood = ood_scale([f["val_ratios"] for f in folds.values()])
        logo_summary = {g: metrics(f["test"].time_ms, np.exp(f["pred_ln"][:, 1])) for g, f in folds.items()}
        logo_summary["mean_mape_pct"] = round(float(np.mean([v["mape_pct"] for v in logo_summary.values()])), 4)
        log(f"LOGO mean MAPE {logo_summary['mean_mape_pct']}; OOD interval scale {ood}")

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{MODEL_NAME}-{version}"
    onnx_path = out_dir / f"{stem}.onnx"
    export_onnx(model, onnx_path, len(MODEL_FEATURES))
    weights_path = out_dir / f"{stem}.weights.npz"
    save_weights(model, weights_path)
    x_tr = model_inputs(tr)
    cpu_kinds = sorted({str(f) for f in np.unique(tr.family[is_cpu_rows(tr)])}) if cpu_rows is not None else []
    training_hw: dict[str, Any] = {g: hardware_snapshot(catalog[g]) for g in sorted({str(g) for g in g_tr.gpu})}
    if cpu_spec is not None:
        training_hw[cpu_spec.id] = hardware_snapshot(cpu_spec)
    meta: dict[str, Any] = {
        "name": MODEL_NAME,
        "version": version,
        "onnx_file": onnx_path.name,
        "weights_file": weights_path.name,
        "created_unix_s": int(time.time()),
        "input": {"name": "features", "dtype": "float32", "shape": ["n", len(MODEL_FEATURES)]},
        "output": {
            "name": "log_time_ms",
            "dtype": "float32",
            "shape": ["n", 3],
            "meaning": "natural log of the layer time in ms at quantiles 0.1, 0.5, 0.9 "
            "(forward pass, or whole training step forward+backward+update)",
        },
        "quantiles": list(QUANTILES),
        "feature_names": list(MODEL_FEATURES),
        "feature_function": "app.core.features.layer_features, columns feature_names (select_features)",
        "normalisation": "baked into the ONNX graph (mean/std of the training rows)",
        "feature_min": [float(v) for v in x_tr.min(axis=0)],
        "feature_max": [float(v) for v in x_tr.max(axis=0)],
        "applies_to": {
            "gpu": {
                "op_kinds": ["conv", "gemm"],
                "conv_spatial_dims": [2],
                "grouped_conv": False,
                "precision": ["fp32"],
                "optimizers": ["none", "sgd", "momentum", "adagrad", "adadelta", "adam", "rmsprop"],
            },
            **(
                {
                    "cpu": {
                        "op_kinds": sorted(_cpu_op_kinds(tr)),
                        "profiler_families": cpu_kinds,
                        "conv_spatial_dims": [1, 2],
                        "grouped_conv": True,
                        "precision": sorted({str(v) for v in tr.precisions[is_cpu_rows(tr)]}),
                        "optimizers": ["none", "sgd", "momentum", "adam"],
                        "threads": 1,
                        "hardware_ids": [cpu_spec.id] if cpu_spec is not None else [],
                    }
                }
                if cpu_rows is not None
                else {}
            ),
        },
        "training_hardware": training_hw,
        "training_data": {
            "sources": list(sources),
            "database": "measurements table (app.training.dataset.load_training_rows)",
            "files": [
                {"name": f.name, "rows_read": f.rows_read, "rows_kept": f.rows_kept, "sha256": f.sha256}
                for f in tr.files
            ],
            "seed_files": [f.name for f in cpu_rows.files] if cpu_rows is not None else [],
            "sample_rows_per_file": sample,
            "skipped": {f"{src}:{reason}": n for (src, reason), n in sorted((gpu.skipped + (
                cpu_rows.skipped if cpu_rows is not None else type(gpu.skipped)())).items())},
            "target": "time_ms_median",
            "split": "per source, by distinct layer configuration (Justus: family, batch, geometry, bias, "
            "activation, GPU and optimizer excluded; CPU: profiler config_id, precision excluded), seeded "
            "shuffle, 70/10/20 train/validation/test",
            "split_seed": seed,
            "rows": {
                "train": len(tr),
                "validation": len(va),
                "test": len(te),
                "train_cpu": int(is_cpu_rows(tr).sum()),
            },  # fmt: skip
            "gpu_column_to_catalog_id": GPU_IDS,
        },
        "model": {
            "architecture": f"two heads (GPU, CPU; picked by is_cpu), each an ensemble of {ensemble} MLPs "
            f"{depth}x{hidden} SiLU with quantile outputs over a physics prior",
            "prior": "ln(exp(log_roofline_ms)/efficiency + floor_ms), efficiency and floor per hardware kind and pass",
            "prior_constants_member0": {k: _members(h)[0].prior_summary() for k, h in model.heads().items()},
            "conformal_scales": {k: list(v) for k, v in q_scale.items()},
            "recipe": recipe,
            "cpu_head": CPU_HEAD,
            "seed": seed,
            "loss": "pinball on ln ms at 0.1/0.5/0.9",
            "optimizer": "AdamW + OneCycle",
        },
        "roofline": rconst.to_dict(),
        "metrics_test_summary": summary,
        "metrics_leave_one_gpu_out_summary": logo_summary,
        "ood_hardware_interval_scale": list(ood),
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
        "train_wall_time_s": round(train_s, 1),
        "wall_time_s": None,
    }
    meta["wall_time_s"] = round(time.time() - t0, 1)
    (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    if write_current:
        (out_dir / "CURRENT").write_text(stem + "\n")
    log(f"wrote {onnx_path} and {stem}.json in {meta['wall_time_s']}s")
    return meta


def _cpu_op_kinds(tr: JustusData) -> set[str]:
    from app.core.features import EXTRA_KINDS, feature_index

    x = tr.features[is_cpu_rows(tr)]
    kinds = {k for k, name in (("conv", "is_conv"), ("gemm", "is_gemm")) if (x[:, feature_index(name)] > 0.5).any()}
    kinds |= {k.value for k in EXTRA_KINDS if (x[:, feature_index(f"is_{k.value}")] > 0.5).any()}
    return kinds


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``layercast train``."""
    p = argparse.ArgumentParser(prog="layercast train", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--database-url", default=None, help="measurement database (default $LAYERCAST_DATABASE_URL)")
    p.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES), help="measurement sources to train on")
    p.add_argument("--no-cpu", action="store_true", help="GPU rows only")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--sample", type=int, default=None, help="measurements per imported GPU file (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version", default="2")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    p.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    p.add_argument("--ensemble", type=int, default=DEFAULTS["ensemble"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--no-logo", action="store_true", help="skip leave-one-GPU-out")
    p.add_argument("--no-current", action="store_true", help="do not update models/CURRENT")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``layercast train`` / ``python -m app.training.train``); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(args_list)
    from app.config import Settings

    run(
        database_url=a.database_url or Settings().database_url,
        out_dir=a.out_dir,
        sources=tuple(a.sources),
        cpu=not a.no_cpu,
        epochs=a.epochs,
        sample=a.sample,
        seed=a.seed,
        version=a.version,
        logo=not a.no_logo,
        hidden=a.hidden,
        depth=a.depth,
        ensemble=a.ensemble,
        threads=a.threads,
        write_current=not a.no_current,
        argv=args_list,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["FEATURE_NAMES_V1", "LayerTimeNet", "main", "run", "train_model", "predict", "calibrate", "export_onnx"]
