"""``layercast finetune``: adapt the shipped predictor to a new device from a few of its measurements.

Syed & Srinivasan 2021 (*Generalized Latency Performance Estimation for Once-For-All NAS*): a base
predictor that takes hardware parameters as input is fine-tuned on a small fraction of a new device's
measurements instead of building a per-device lookup table (they report > 50 % lower RMSE than the
ProxylessNAS lookup table).

``python -m app.training.finetune --hardware-id ID [--database-url URL] [--sources S ...]
[--models-dir models] [--base STEM] [--version V] [--promote]``

The new device's rows are its stored measurements (:func:`app.training.dataset.load_training_rows`, the
path training reads): every ``forward``/``train_step`` measurement of ``--hardware-id`` (of ``--sources``,
default all) whose layer can be rebuilt; the replayed base rows are stored Justus GPU rows of the other
devices. Import or report the device's measurements first (``layercast import``, ``POST
/v1/measurements``). The hardware spec is the one stored with the device's hardware row.
The new rows are split by configuration 80/20: every ensemble member is fine-tuned from the base
weights on the 80 % (all parameters, small learning rate, the base training rows replayed at a fixed
share so the other devices are not forgotten), the 20 % calibrate the interval of that hardware kind and
measure the gain. A new artifact ``<name>-<version>`` (ONNX + weights + metadata listing the device under
``training_hardware``) is written; ``--promote`` makes it current only if it beats the base model on the
held-out 20 % (gated retraining, DESIGN.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.core.hardware import HardwareSpec
from app.measurements.importers import SOURCE_JUSTUS
from app.training.dataset import TrainingRows, load_from_database, split_by_config
from app.training.metrics import metrics, nearest_neighbour_predict
from app.training.train import (
    DEFAULT_OUT_DIR,
    Ensemble,
    KindHeads,
    LayerTimeNet,
    calibrate,
    export_onnx,
    feature_ranges,
    hardware_snapshot,
    is_cpu_rows,
    load_weights,
    model_inputs,
    predict,
    save_weights,
    set_scale,
    train_model,
)

#: Share of the fine-tuning loss carried by replayed base training rows.
REPLAY_SHARE = 0.5


def finetune_model(
    base: Ensemble | KindHeads,
    new: TrainingRows,
    *,
    replay: TrainingRows | None = None,
    epochs: int = 30,
    lr: float = 1e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Ensemble | KindHeads:
    """Fine-tune every member of ``base`` on ``new`` rows (plus ``replay`` rows at :data:`REPLAY_SHARE` of
    the loss); returns a new model (``base`` is not modified; calibration scales reset to 1). For a two-head
    model the head of the new rows' hardware kind is fine-tuned (replay rows of that kind only) and the
    other head is kept."""
    if isinstance(base, KindHeads):
        cpu = bool(is_cpu_rows(new).any())
        head = base.cpu_head if cpu and base.cpu_head is not None else base.gpu_head
        rep = None if replay is None else replay.subset(is_cpu_rows(replay) == cpu)
        tuned_head = finetune_model(head, new, replay=rep, epochs=epochs, lr=lr, seed=seed, log=log)
        assert isinstance(tuned_head, Ensemble)
        # the kept head is copied: its calibration scale is set on the new model, never on ``base``
        if cpu and base.cpu_head is not None:
            return KindHeads(copy.deepcopy(base.gpu_head), tuned_head)
        return KindHeads(tuned_head, copy.deepcopy(base.cpu_head))
    names = base.feature_names
    data = new if replay is None or len(replay) == 0 else TrainingRows.concat([new, replay])
    w = np.ones(len(data))
    if replay is not None and len(replay):
        w[len(new) :] = REPLAY_SHARE / (1 - REPLAY_SHARE) * len(new) / len(replay)
    x, y = model_inputs(data, names), np.log(data.time_ms)
    batch = int(min(512, max(32, len(data) // 8)))
    members = []
    for k, m in enumerate(base.members):
        assert isinstance(m, LayerTimeNet)
        members.append(train_model(x, y, epochs=epochs, seed=seed + k, weights=w, init=m, lr=lr, batch_size=batch,
                                   weight_decay=1e-4, log=lambda s: None))  # fmt: skip
    log(
        f"fine-tuned {len(members)} member(s) on {len(new)} new rows (+{0 if replay is None else len(replay)} replayed)"
    )
    return Ensemble(members)


def finetune_heads(
    base: KindHeads,
    tune: TrainingRows,
    *,
    calib: TrainingRows,
    replay: TrainingRows | None,
    scales: Mapping[str, Sequence[float]],
    logo_factor: Sequence[float],
    epochs: int = 30,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[KindHeads, dict[str, list[float]]]:
    """Fine-tune ``base`` on ``tune`` (:func:`finetune_model`, ``replay`` at :data:`REPLAY_SHARE`), then
    calibrate the interval of the tuned hardware kind split-conformally on ``calib`` rows of that kind
    (:func:`app.training.train.calibrate`); the other kind keeps its ``scales`` (``{"gpu": [lo, hi],
    "cpu": [lo, hi]}``, the base artifact's ``conformal_scales``), and so does the tuned kind when ``calib``
    is empty. A recalibrated GPU scale is multiplied by ``logo_factor`` (``[lo, hi]``, the base artifact's
    ``gpu_interval_logo_factor``: how much wider the leave-one-GPU-out misfits were than the in-distribution
    ones), because the one GPU scale serves GPUs the model has never seen too; calibrated on the tuned
    device's rows alone it would narrow every GPU's interval about 3x. Returns the model (``base``
    untouched) and the scales set in it."""
    tuned = finetune_model(base, tune, replay=replay, epochs=epochs, seed=seed, log=log)
    assert isinstance(tuned, KindHeads)
    kept = {k: [float(v) for v in vals] for k, vals in scales.items()}
    kind = "cpu" if is_cpu_rows(tune).any() else "gpu"
    names = base.feature_names
    mine = calib.subset(is_cpu_rows(calib) == (kind == "cpu")) if len(calib) else calib
    if len(mine):
        lo, hi = calibrate(tuned, model_inputs(mine, names), np.log(mine.time_ms), is_cpu_rows(mine))[kind]
        f_lo, f_hi = (float(v) for v in logo_factor) if kind == "gpu" else (1.0, 1.0)
        kept[kind] = [float(lo) * f_lo, float(hi) * f_hi]
    for k in ("gpu", "cpu"):
        lo, hi = kept.get(k, kept["gpu"])
        set_scale(tuned, k, (lo, hi))
    return tuned, kept


def write_finetuned(
    tuned: KindHeads,
    *,
    base_training: Mapping[str, Any],
    base_version: str,
    scales: Mapping[str, Sequence[float]],
    tune: TrainingRows,
    hardware: Mapping[str, HardwareSpec],
    out_dir: Path,
    version: str,
    record: Mapping[str, Any],
) -> dict[str, Any]:
    """Write a fine-tuned version ``<name>-<version>`` into ``out_dir`` (ONNX graph, torch weights, JSON
    metadata) and return its metadata: the base's (``base_training``, the trainer's JSON) with the new files,
    ``hardware`` (the devices tuned for) added to ``training_hardware``, ``feature_ranges`` (when the base
    has them) widened to cover ``tune``, ``scales`` as ``conformal_scales`` (and, the GPU's divided by the
    base's ``gpu_interval_logo_factor``, as ``in_distribution_scales``), the tuning rows added to
    ``training_data.rows.train`` and ``finetune`` = ``{"base": base_version, "hardware_ids", "rows":
    {"tuning"}, "method"}`` updated by ``record``."""
    meta = json.loads(json.dumps(base_training))  # a deep copy: the base's metadata is not modified
    names = tuple(meta["feature_names"])
    stem = f"{meta['name']}-{version}"
    out_dir.mkdir(parents=True, exist_ok=True)
    export_onnx(tuned, out_dir / f"{stem}.onnx", len(names))
    save_weights(tuned, out_dir / f"{stem}.weights.npz")
    devices = sorted(hardware)
    ranges = meta.get("feature_ranges")
    for hw_kind, per_op in (feature_ranges(tune, names) if ranges is not None else {}).items():
        for op, new in per_op.items():
            old = ranges.setdefault(hw_kind, {}).get(op)
            ranges[hw_kind][op] = new if old is None else {
                "min": [min(a, b) for a, b in zip(old["min"], new["min"], strict=True)],
                "max": [max(a, b) for a, b in zip(old["max"], new["max"], strict=True)]}  # fmt: skip
    rows = meta.setdefault("training_data", {}).setdefault("rows", {})
    rows["train"] = int(rows.get("train", 0)) + len(tune)
    meta.update(version=version, onnx_file=f"{stem}.onnx", weights_file=f"{stem}.weights.npz",
                created_unix_s=int(time.time()))  # fmt: skip
    meta["training_hardware"] = {**meta.get("training_hardware", {}),
                                 **{g: hardware_snapshot(hardware[g]) for g in devices}}  # fmt: skip
    factor = meta["model"]["gpu_interval_logo_factor"]
    meta["model"] = {**meta["model"], "conformal_scales": {k: list(v) for k, v in scales.items()},
                     "in_distribution_scales": {k: [v[0] / factor[0], v[1] / factor[1]] if k == "gpu" else list(v)
                                                for k, v in scales.items()}}  # fmt: skip
    meta["finetune"] = {"base": base_version, "hardware_ids": devices, "rows": {"tuning": len(tune)},
                        "method": "Syed & Srinivasan 2021: fine-tune all parameters of each member from the base "
                        f"weights, lr 1e-3, replay share {REPLAY_SHARE}", **record}  # fmt: skip
    (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def run(
    *,
    models_dir: Path,
    base_stem: str | None,
    hardware: HardwareSpec,
    new: TrainingRows,
    version: str,
    out_dir: Path | None = None,
    database_url: str | None = None,
    replay_rows: int = 20000,
    epochs: int = 30,
    seed: int = 0,
    promote: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Fine-tune ``models_dir``'s artifact on ``new`` rows of ``hardware`` (:func:`finetune_heads`, the
    interval calibrated on the held-out 20 %); write a new version (:func:`write_finetuned`); return its
    metadata. Raises ``ValueError`` when ``new`` has too few configurations to split."""
    from app.predictor.registry import current_stem

    t0 = time.time()
    torch.use_deterministic_algorithms(True)
    out_dir = out_dir or models_dir
    stem = base_stem or current_stem(models_dir)
    meta = json.loads((models_dir / f"{stem}.json").read_text())
    recipe = meta["model"]["recipe"]
    names = tuple(meta["feature_names"])
    base = load_weights(models_dir / meta["weights_file"], feature_names=names, hidden=int(recipe["hidden"]),
                        depth=int(recipe["depth"]))  # fmt: skip
    split = split_by_config(new.config, seed=seed, fractions=(0.8, 0.0, 0.2))
    tune, hold = new.subset(split == 0), new.subset(split == 2)
    if len(tune) == 0 or len(hold) == 0:
        raise ValueError(f"need at least a few configurations to fine-tune and check, got {len(new)} rows")
    replay = None
    if replay_rows > 0 and database_url is not None:
        per_file = max(1, replay_rows // 10)
        replay = load_from_database(database_url, sources=(SOURCE_JUSTUS,), hardware_kinds=("gpu",),
                                    sample_per_file=per_file, seed=seed + 1)  # fmt: skip
        replay = replay.subset(replay.gpu != hardware.id)
    tuned, scales = finetune_heads(base, tune, calib=hold, replay=replay, scales=meta["model"]["conformal_scales"],
                                   logo_factor=meta["model"]["gpu_interval_logo_factor"], epochs=epochs, seed=seed,
                                   log=log)  # fmt: skip
    before = np.exp(predict(base, model_inputs(hold, names)))
    after = np.exp(predict(tuned, model_inputs(hold, names)))
    nn_ = nearest_neighbour_predict(tune, hold)
    gain = {
        "base": metrics(hold.time_ms, before[:, 1]),
        "finetuned": metrics(hold.time_ms, after[:, 1], after[:, 0], after[:, 2]),
        "lookup_table_of_the_tuning_rows": metrics(hold.time_ms[np.isfinite(nn_)], nn_[np.isfinite(nn_)]),
    }
    log(
        f"held-out new-device rows: base MAPE {gain['base']['mape_pct']} % -> fine-tuned "
        f"{gain['finetuned']['mape_pct']} % (lookup table {gain['lookup_table_of_the_tuning_rows']['mape_pct']} %)"
    )
    new_stem = f"{meta['name']}-{version}"
    rows = {"tuning": len(tune), "held_out": len(hold), "replayed": 0 if replay is None else len(replay)}
    meta = write_finetuned(tuned, base_training=meta, base_version=stem, scales=scales, tune=tune,
                           hardware={hardware.id: hardware}, out_dir=out_dir,
                           version=version, record={"hardware_id": hardware.id, "rows": rows, "epochs": epochs,
                                                    "held_out_metrics": gain,
                                                    "wall_time_s": round(time.time() - t0, 1)})  # fmt: skip
    improved = gain["finetuned"]["mape_pct"] < gain["base"]["mape_pct"]
    if promote and improved:
        (out_dir / "CURRENT").write_text(new_stem + "\n")
        log(f"promoted {new_stem}")
    elif promote:
        log(f"not promoted: {new_stem} is not better than {stem} on the held-out rows")
    return meta


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``layercast finetune``."""
    p = argparse.ArgumentParser(prog="layercast finetune", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--hardware-id", required=True, help="catalog id of the measured device, or 'local'")
    p.add_argument("--database-url", default=None, help="measurement database (default $LAYERCAST_DATABASE_URL)")
    p.add_argument("--sources", nargs="+", default=None, help="measurement sources of the device (default all)")
    p.add_argument("--models-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--out-dir", type=Path, default=None, help="default: --models-dir")
    p.add_argument("--base", default=None, help="base artifact stem (default: CURRENT)")
    p.add_argument("--version", required=True, help="version of the new artifact (e.g. 2-ft-a100)")
    p.add_argument("--replay-rows", type=int, default=20000, help="stored Justus rows of other GPUs replayed")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--promote", action="store_true", help="make it CURRENT if it beats the base on held-out rows")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``layercast finetune`` / ``python -m app.training.finetune``); returns the exit code."""
    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(a.threads)
    from app.config import Settings

    url = a.database_url or Settings().database_url
    try:
        new = load_from_database(url, sources=a.sources, hardware_ids=(a.hardware_id,))
    except ValueError as exc:
        print(f"layercast finetune: {exc}", file=sys.stderr)
        return 1
    hw = new.hardware[a.hardware_id]
    print(f"{len(new)} measurement rows of {hw.id} (skipped {dict(new.skipped)})", file=sys.stderr)
    run(models_dir=a.models_dir, base_stem=a.base, hardware=hw, new=new, version=a.version, out_dir=a.out_dir,
        database_url=url, replay_rows=a.replay_rows, epochs=a.epochs, seed=a.seed, promote=a.promote)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
