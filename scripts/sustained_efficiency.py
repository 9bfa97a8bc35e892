"""Compute efficiency of NeuSight's fp32 GEMMs against the kernel's own duration, per GPU.

``python scripts/sustained_efficiency.py`` reads ``../shared/data/neusight/train_{linear,bmm}_<gpu>.csv.gz``
(FP32, TF32 off: the SIMT peak of the catalog, ``peak_for("fp32-strict")``) and prints, per GPU and per decade of
measured latency, the median of ``FLOPs / peak / measured`` over compute-bound calls (FLOPs / peak at least twice
bytes / bandwidth, every GEMM dimension >= 256), with the count. FLOPs = 2 x B x M x N x K; bytes = 4 x B x
(M N + N K + M K).

Why it matters (issue 8, models/README.md): leave-one-GPU-out errors on NeuSight's GEMMs are mostly per-chip
biases, and this shows where they come from: the 70-75 W inference cards (P4, T4) lose efficiency the longer a
kernel runs (P4: 0.45 at 0.1-10 ms, 0.13 above 1 s; a sustained power or thermal clock limit), while the 250 W
A100 PCIe holds 0.73-0.78. No datasheet figure in the catalog tells a new GPU's sustained clock (board power per
peak FLOP/s was tried as a feature and made held-out chips worse: models/README.md).
"""

from __future__ import annotations

import csv
import gzip
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.hardware.catalog import load_catalog  # noqa: E402
from app.measurements.neusight import NEUSIGHT_HARDWARE_IDS  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "neusight"
GPUS = {"P4": "Tesla P4", "T4": "Tesla T4", "P100-PCIe-16GB": "Tesla P100-PCIE-16GB",
        "A100-PCIe-40GB": "NVIDIA A100-PCIE-40GB"}  # fmt: skip


def efficiency_by_duration(gpu_file: str, device: str) -> dict[int, tuple[float, int]]:
    """``{decade: (median efficiency, calls)}`` of the compute-bound linear and bmm calls of one GPU (decade
    k holds calls of 10^k to 10^(k+1) ms)."""
    hw = load_catalog()[NEUSIGHT_HARDWARE_IDS[device]]
    peak, bw = hw.peak_for("fp32-strict"), hw.memory_bandwidth_bytes_per_s
    bins: dict[int, list[float]] = {}
    for family in ("linear", "bmm"):
        with gzip.open(DATA / f"train_{family}_{gpu_file}.csv.gz", "rt") as f:
            for r in csv.DictReader(f):
                b, m, n, k = int(r.get("B") or 1), int(r["M"]), int(r["N"]), int(r["K"])
                ms = float(r["Latency"])
                compute_s = 2 * b * m * n * k / peak
                if compute_s < 2 * 4 * b * (m * n + n * k + m * k) / bw or min(m, n, k) < 256:
                    continue
                bins.setdefault(math.floor(math.log10(ms)), []).append(compute_s * 1e3 / ms)
    return {d: (statistics.median(v), len(v)) for d, v in sorted(bins.items())}


def main() -> int:
    print("| GPU | " + " | ".join(f"1e{d}-1e{d + 1} ms" for d in range(-1, 4)) + " |")
    print("|---|" + "---|" * 5)
    for gpu_file, device in GPUS.items():
        e = efficiency_by_duration(gpu_file, device)
        cells = [f"{e[d][0]:.2f} ({e[d][1]})" if d in e else "–" for d in range(-1, 4)]
        print(f"| {gpu_file} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
