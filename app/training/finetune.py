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
import json
import sys
import time
from collections.abc import Callable
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
    hardware_snapshot,
    is_cpu_rows,
    load_weights,
    model_inputs,
    predict,
    save_weights,
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
        if cpu and base.cpu_head is not None:
            return KindHeads(base.gpu_head, tuned_head)
        return KindHeads(tuned_head, base.cpu_head)
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
    """Fine-tune ``models_dir``'s artifact on ``new`` rows of ``hardware``; write a new version; return its metadata."""
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
    scales = meta["model"]["conformal_scales"]
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
    tuned = finetune_model(base, tune, replay=replay, epochs=epochs, seed=seed, log=log)
    kind_row = 1 if hardware.kind == "cpu" else 0
    members = [m for h in tuned.heads().values() for m in h.members] if isinstance(tuned, KindHeads) else []
    for m in members:
        assert isinstance(m, LayerTimeNet)
        m.q_scale.copy_(torch.tensor([scales["gpu"], scales.get("cpu", scales["gpu"])], dtype=torch.float32))
    # calibrate this kind's interval on the held-out new rows (the other kind keeps the base scales)
    kept = {k: [float(v) for v in vals] for k, vals in scales.items()}
    new_scales = calibrate(tuned, model_inputs(hold, names), np.log(hold.time_ms), is_cpu_rows(hold))
    kind = "cpu" if kind_row else "gpu"
    kept[kind] = list(new_scales[kind])
    for m in members:
        assert isinstance(m, LayerTimeNet)
        m.q_scale.copy_(torch.tensor([kept["gpu"], kept.get("cpu", kept["gpu"])], dtype=torch.float32))

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

    name = meta["name"]
    new_stem = f"{name}-{version}"
    out_dir.mkdir(parents=True, exist_ok=True)
    assert isinstance(tuned, KindHeads)
    export_onnx(tuned, out_dir / f"{new_stem}.onnx", len(names))
    save_weights(tuned, out_dir / f"{new_stem}.weights.npz")
    meta.update(
        version=version,
        onnx_file=f"{new_stem}.onnx",
        weights_file=f"{new_stem}.weights.npz",
        created_unix_s=int(time.time()),
    )
    meta["training_hardware"] = {**meta["training_hardware"], hardware.id: hardware_snapshot(hardware)}
    meta["model"] = {**meta["model"], "conformal_scales": kept}
    meta["finetune"] = {
        "base": stem,
        "hardware_id": hardware.id,
        "rows": {"tuning": len(tune), "held_out": len(hold), "replayed": 0 if replay is None else len(replay)},
        "epochs": epochs,
        "held_out_metrics": gain,
        "method": "Syed & Srinivasan 2021: fine-tune all parameters of each member from the base weights, "
        f"lr 1e-3, replay share {REPLAY_SHARE}",
        "wall_time_s": round(time.time() - t0, 1),
    }
    (out_dir / f"{new_stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
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
