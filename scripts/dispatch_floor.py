"""How much of the leave-one-GPU-out error on NeuSight's memory-bound kernels is the host's dispatch floor?
(issue 8: the NeuSight leave-one-GPU-out target).

Usage: ``PYTHONPATH=. python scripts/dispatch_floor.py [--data-dir ../shared/data/neusight] [--calibration-rows 5]``
(about 1 minute; prints markdown tables). Reads the NeuSight element-wise, layernorm and softmax files through
the measurements domain's parser (:func:`app.measurements.neusight.iter_neusight`) and costs each row's physics
floor with the served cost model (:func:`app.training.dataset.record_layer`, :func:`app.core.costs.layer_cost`,
:func:`app.core.features.pass_floor_ms` on the catalog spec: bytes / datasheet DRAM bandwidth for these ops).

NeuSight times one PyTorch call between two CUDA events (the folder's README), so a kernel too small to matter
still costs the time the host takes to dispatch it: the floor of the call, set by the host CPU, driver and
framework, not by the GPU. The script fits, per op, a two-term roofline on the *other* GPUs::

    t = (c0**p + (floor / e)**p) ** (1 / p)      # c0: dispatch floor (ms), e: DRAM efficiency, p in {1, 2, 4}

and scores the held-out GPU two ways, on the same rows:

* **blind**: ``c0`` fitted on the other GPUs' rows (what a leave-one-GPU-out prediction knows);
* **host floor measured**: ``c0`` of every GPU is the median time of its ``--calibration-rows`` rows with the
  smallest floor (tiny calls of the op timed on the host), ``e`` and ``p`` fitted on the other GPUs; the
  held-out GPU's calibration rows are left out of its test rows;
* **one add measured**: the held-out host's floor of every op from its tiny ``add`` calls only:
  ``c0(op) = median over the other GPUs g of c0(op, g) x c0(add, held) / c0(add, g)`` (one calibration kernel
  per host, as a user could time in a second), ``e`` and ``p`` as above.

A large gap between the two says the error is the host's, which no datasheet feature of the GPU can carry.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.core.costs import layer_cost  # noqa: E402
from app.core.features import pass_floor_ms  # noqa: E402
from app.hardware.catalog import load_catalog  # noqa: E402
from app.measurements.importers import SOURCE_NEUSIGHT  # noqa: E402
from app.measurements.neusight import iter_neusight, neusight_files  # noqa: E402
from app.training.dataset import record_layer  # noqa: E402

FAMILIES = ("elementwise", "ln", "softmax")
C0_GRID_MS = np.geomspace(0.004, 0.08, 40)
EFF_GRID = np.linspace(0.2, 1.0, 41)
P_GRID = (1.0, 2.0, 4.0)


def load(data_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """``op -> hardware id -> [n, 2]`` array of (physics floor ms, measured ms) of the NeuSight rows."""
    specs = load_catalog()
    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for path in neusight_files(data_dir, families=FAMILIES):
        for rec in iter_neusight(path):
            layer = record_layer(source=SOURCE_NEUSIGHT, config=rec.config, batch_size=rec.batch_size,
                                 precision=rec.precision)  # fmt: skip
            if isinstance(layer, str):
                continue
            floor = pass_floor_ms(layer=layer, cost=layer_cost(layer), hardware=specs[rec.hardware_id],
                                  pass_="forward", optimizer="none", precision=rec.precision)  # fmt: skip
            out[rec.context["op_name"]][rec.hardware_id].append((floor, rec.time_ms_median))
    return {op: {g: np.asarray(v) for g, v in by_gpu.items()} for op, by_gpu in out.items()}


def model_ms(floor: np.ndarray, c0: np.ndarray | float, e: float, p: float) -> np.ndarray:
    """Smooth maximum (power ``p``) of the dispatch floor ``c0`` and the floor at DRAM efficiency ``e``."""
    return np.power(np.power(c0, p) + np.power(floor / e, p), 1.0 / p)


def _mape(pred: np.ndarray, true: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / true - 1.0)) * 100.0)


def fit(floor: np.ndarray, true: np.ndarray, c0: np.ndarray | None) -> tuple[float, float, float]:
    """Grid-search (c0, e, p) minimising MAPE; with ``c0`` given (per row) only (e, p)."""
    best = (np.inf, 0.0, 0.0, 0.0)
    for p in P_GRID:
        for e in EFF_GRID:
            for c in (C0_GRID_MS if c0 is None else (None,)):
                m = _mape(model_ms(floor, c0 if c is None else c, e, p), true)
                if m < best[0]:
                    best = (m, float(c) if c is not None else float("nan"), float(e), p)
    return best[1], best[2], best[3]


def host_floor(rows: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """(median time of the ``k`` rows with the smallest physics floor, mask of the other rows)."""
    order = np.argsort(rows[:, 0], kind="stable")
    keep = np.ones(len(rows), dtype=bool)
    keep[order[:k]] = False
    return float(np.median(rows[order[:k], 1])), keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "neusight")
    ap.add_argument("--calibration-rows", type=int, default=5)
    args = ap.parse_args()
    data = load(args.data_dir)
    gpus = sorted({g for by_gpu in data.values() for g in by_gpu})
    floors = {op: {g: host_floor(r, args.calibration_rows) for g, r in by_gpu.items()} for op, by_gpu in data.items()}

    print("Host dispatch floor: median time (us) of each GPU's", args.calibration_rows, "smallest rows\n")
    print("| op | " + " | ".join(gpus) + " |")
    print("|---|" + "---:|" * len(gpus))
    for op in sorted(data):
        cells = (f"{floors[op][g][0] * 1e3:.1f}" if g in floors[op] else "–" for g in gpus)
        print(f"| {op} | " + " | ".join(cells) + " |")

    print("\nLeave-one-GPU-out MAPE (%) of the two-term roofline, same test rows for both columns\n")
    print("| op | rows | blind (c0 of the other GPUs) | host floor measured | one add measured "
          "| blind, per held-out GPU |")
    print("|---|---:|---:|---:|---:|---|")
    pooled: dict[str, list[np.ndarray]] = {"blind": [], "host": [], "add": []}
    for op in sorted(data):
        by_gpu = data[op]
        ape_b: list[np.ndarray] = []
        ape_h: list[np.ndarray] = []
        ape_a: list[np.ndarray] = []
        per_gpu = []
        for held in sorted(by_gpu):
            train = np.concatenate([by_gpu[g] for g in by_gpu if g != held])
            train_c0 = np.concatenate([np.full(len(by_gpu[g]), floors[op][g][0]) for g in by_gpu if g != held])
            c0_held, keep = floors[op][held]
            test = by_gpu[held][keep]
            c0, e, p = fit(train[:, 0], train[:, 1], None)
            blind = np.abs(model_ms(test[:, 0], c0, e, p) / test[:, 1] - 1.0)
            _, e_h, p_h = fit(train[:, 0], train[:, 1], train_c0)
            host = np.abs(model_ms(test[:, 0], c0_held, e_h, p_h) / test[:, 1] - 1.0)
            others = [g for g in by_gpu if g != held]
            c0_add = float(np.median([floors[op][g][0] * floors["add"][held][0] / floors["add"][g][0]
                                      for g in others]))  # fmt: skip
            one_add = np.abs(model_ms(test[:, 0], c0_add, e_h, p_h) / test[:, 1] - 1.0)
            ape_b.append(blind)
            ape_h.append(host)
            ape_a.append(one_add)
            per_gpu.append(f"{held} {blind.mean() * 100:.1f}")
        b, h, a = np.concatenate(ape_b), np.concatenate(ape_h), np.concatenate(ape_a)
        pooled["blind"].append(b)
        pooled["host"].append(h)
        pooled["add"].append(a)
        print(f"| {op} | {len(b)} | {b.mean() * 100:.1f} | {h.mean() * 100:.1f} | {a.mean() * 100:.1f} "
              f"| {', '.join(per_gpu)} |")
    b, h, a = (np.concatenate(pooled[k]) for k in ("blind", "host", "add"))
    print(f"| **all** | {len(b)} | **{b.mean() * 100:.1f}** | **{h.mean() * 100:.1f}** | **{a.mean() * 100:.1f}** | |")


if __name__ == "__main__":
    main()
