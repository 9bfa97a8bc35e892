"""Loader of the CPU seed dataset written by :mod:`app.profiler` (``data/seed/layers_cpu*.jsonl[.gz]``).

Each profiler row is one layer configuration measured on this machine's CPU (hardware id ``local``) at
one precision: an inference ``forward`` (eval mode, no grad) and a whole ``train_step`` (training-mode
forward + backward + the optimizer update of the layer's parameters). The loader rebuilds each row's
layer with :meth:`app.profiler.sampler.LayerConfig.to_layers` (the JSON layer-list importer, the same IR
the API builds), costs it with :func:`app.core.costs.layer_cost` and featurises one row per timed pass
with :mod:`app.core.features` against ONE hardware spec (the spec snapshot the predictor is trained
with and stores in its metadata). The result has the fields of :class:`app.training.justus.JustusData`
so the trainer and the evaluation handle GPU and CPU rows alike.

Rows kept: ``status == "ok"``, a configuration that rebuilds into exactly one IR layer (fused attention
rebuilds into MatMul + Softmax + MatMul and is left out of the per-layer data), cost supported, median
time > 0. ``config`` is the profiler's ``config_id`` (precision excluded), so one configuration never
sits on both sides of a split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.core.costs import layer_cost
from app.core.features import RAW_FIELDS, features_from_raw, raw_quantities
from app.core.hardware import HardwareSpec
from app.profiler import iter_rows
from app.profiler.sampler import LayerConfig
from app.training.justus import JustusData, JustusFile, _sha256

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SEED_DIR = REPO_ROOT / "data" / "seed"
CPU_HARDWARE_ID = "local"

#: profiler pass → feature pass (``forward`` = inference forward; ``train_step`` = whole step)
PASS_MAP: dict[str, str] = {"forward": "forward", "train_step": "train_step"}


def layer_files(seed_dir: Path) -> list[Path]:
    """Layer shards of ``seed_dir`` (``layers_*.jsonl`` and ``.jsonl.gz``; a ``.gz`` wins over its plain twin)."""
    seed_dir = Path(seed_dir)
    gz = sorted(seed_dir.glob("layers_*.jsonl.gz"))
    plain = [p for p in sorted(seed_dir.glob("layers_*.jsonl")) if p.with_suffix(".jsonl.gz") not in gz]
    return gz + plain


def e2e_files(seed_dir: Path) -> list[Path]:
    """End-to-end shards of ``seed_dir`` (``e2e_*.jsonl`` / ``.jsonl.gz``, a ``.gz`` wins)."""
    seed_dir = Path(seed_dir)
    gz = sorted(seed_dir.glob("e2e_*.jsonl.gz"))
    plain = [p for p in sorted(seed_dir.glob("e2e_*.jsonl")) if p.with_suffix(".jsonl.gz") not in gz]
    return gz + plain


def hardware_to_dict(hw: HardwareSpec) -> dict[str, Any]:
    """JSON-ready snapshot of a spec (every field but ``sources``), inverse of :func:`hardware_from_dict`."""
    return {
        "id": hw.id,
        "name": hw.name,
        "vendor": hw.vendor,
        "kind": hw.kind,
        "peak_flops_per_s": dict(hw.peak_flops_per_s),
        "memory_bytes": hw.memory_bytes,
        "memory_bandwidth_bytes_per_s": hw.memory_bandwidth_bytes_per_s,
        "compute_units": hw.compute_units,
        "base_clock_mhz": hw.base_clock_mhz,
        "boost_clock_mhz": hw.boost_clock_mhz,
        "tdp_w": hw.tdp_w,
        "l2_cache_bytes": hw.l2_cache_bytes,
        "vector_width_bits": hw.vector_width_bits,
        "architecture": hw.architecture,
    }


def hardware_from_dict(d: dict[str, Any]) -> HardwareSpec:
    """Rebuild a :class:`HardwareSpec` from :func:`hardware_to_dict`; raises ``KeyError`` if a field is missing."""
    return HardwareSpec(
        id=str(d["id"]),
        name=str(d["name"]),
        vendor=str(d.get("vendor", "")),
        kind=d["kind"],
        peak_flops_per_s={str(k): float(v) for k, v in d["peak_flops_per_s"].items()},
        memory_bytes=float(d["memory_bytes"]),
        memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
        compute_units=int(d["compute_units"]),
        base_clock_mhz=d.get("base_clock_mhz"),
        boost_clock_mhz=d.get("boost_clock_mhz"),
        tdp_w=d.get("tdp_w"),
        l2_cache_bytes=d.get("l2_cache_bytes"),
        vector_width_bits=d.get("vector_width_bits"),
        architecture=d.get("architecture"),
    )


def _rows(paths: Iterable[Path]) -> Iterable[tuple[int, dict[str, Any]]]:
    for i, p in enumerate(paths):
        for row in iter_rows(p):
            yield i, row


def load_seed_layers(
    seed_dir: Path | None = None,
    *,
    hardware: HardwareSpec,
    paths: Sequence[Path] | None = None,
    limit: int | None = None,
) -> JustusData:
    """Read, rebuild, cost and featurise the CPU layer rows (see module docstring).

    ``hardware`` is the spec every row is featurised with (the ``local`` CPU snapshot); ``paths``
    overrides the shard discovery in ``seed_dir`` (default :data:`DEFAULT_SEED_DIR`); ``limit`` keeps the
    first rows only (tests). ``family`` of the result is the profiler family (``conv2d``, ``linear``,
    ``lstm``...), ``gpu`` the hardware id, ``optimizer`` the measured optimizer (``none`` for forward
    rows and parameter-free layers). Raises ``FileNotFoundError`` when no shard is found.
    """
    files = list(paths) if paths is not None else layer_files(seed_dir or DEFAULT_SEED_DIR)
    if not files:
        raise FileNotFoundError(f"no layers_*.jsonl[.gz] under {seed_dir or DEFAULT_SEED_DIR}")
    fam_l: list[str] = []
    pass_l: list[str] = []
    opt_l: list[str] = []
    prec_l: list[str] = []
    time_l: list[float] = []
    cfg_l: list[str] = []
    raw_l: list[tuple[float, ...]] = []
    src_l: list[tuple[int, int]] = []
    counts = [[0, 0] for _ in files]
    n_seen = 0
    for file_idx, row in _rows(files):
        counts[file_idx][0] += 1
        if limit is not None and n_seen >= limit:
            continue
        n_seen += 1
        if row.get("status") != "ok":
            continue
        try:
            cfg = LayerConfig.from_row(row)
            layers = cfg.to_layers(row["precision"])
        except (KeyError, TypeError, ValueError):
            continue
        if len(layers) != 1:
            continue
        layer = layers[0]
        cost = layer_cost(layer)
        if not cost.supported:
            continue
        timings = row.get("timings") or {}
        kept = False
        for src_pass, pass_ in PASS_MAP.items():
            st = timings.get(src_pass)
            if not st or not st.get("median_ms") or float(st["median_ms"]) <= 0:
                continue
            opt = str(row.get("optimizer", "none")) if pass_ == "train_step" and cost.params else "none"
            raw_l.append(
                raw_quantities(
                    layer=layer, cost=cost, hardware=hardware, pass_=pass_, optimizer=opt,
                    precision=str(row["precision"]),
                )
            )  # fmt: skip
            fam_l.append(str(row["family"]))
            pass_l.append(pass_)
            opt_l.append(opt)
            prec_l.append(str(row["precision"]))
            time_l.append(float(st["median_ms"]))
            cfg_l.append(str(row["config_id"]))
            src_l.append((file_idx, counts[file_idx][0] - 1))
            kept = True
        counts[file_idx][1] += int(kept)
    raw = np.asarray(raw_l, dtype=np.float64).reshape(-1, len(RAW_FIELDS))
    return JustusData(
        family=np.asarray(fam_l, dtype=object).astype(str),
        gpu=np.full(len(time_l), hardware.id),
        pass_=np.asarray(pass_l, dtype=object).astype(str),
        optimizer=np.asarray(opt_l, dtype=object).astype(str),
        time_ms=np.asarray(time_l, dtype=np.float64),
        config=np.asarray(cfg_l, dtype=object).astype(str),
        raw=raw,
        features=features_from_raw(raw),
        source=np.asarray(src_l, dtype=np.int64).reshape(-1, 2),
        files=[JustusFile(p.name, counts[i][0], counts[i][1], _sha256(p)) for i, p in enumerate(files)],
        precision=np.asarray(prec_l, dtype=object).astype(str),
    )


def load_e2e(seed_dir: Path | None = None, *, paths: Sequence[Path] | None = None) -> list[dict[str, Any]]:
    """The ``status == "ok"`` end-to-end iteration records (:mod:`app.profiler.e2e`), file order."""
    files = list(paths) if paths is not None else e2e_files(seed_dir or DEFAULT_SEED_DIR)
    return [row for p in files for row in iter_rows(p) if row.get("status") == "ok" and row.get("train_step_ms")]


def split_by_hash(
    config: np.ndarray, *, seed: int, fractions: tuple[float, float, float] = (0.7, 0.1, 0.2)
) -> np.ndarray:
    """``0`` train / ``1`` validation / ``2`` test per row from a hash of ``(seed, configuration key)``.

    Unlike :func:`app.training.justus.split_by_config` the side of a configuration does not depend on
    which other configurations are present, so a seed dataset that grows (more shards, refinement
    rounds) never moves an already-held-out configuration into training. Returns int8 ``[N]``.
    """
    keys, inverse = np.unique(np.asarray(config).astype(str), return_inverse=True)
    u = np.array([int(hashlib.sha1(f"{seed}:{k}".encode()).hexdigest()[:12], 16) / 16**12 for k in keys])
    side = np.where(u < fractions[0], 0, np.where(u < fractions[0] + fractions[1], 1, 2)).astype(np.int8)
    return side[inverse]


def describe_files(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Name and sha256 of each file (training-data watermark for the metadata)."""
    return [{"name": p.name, "sha256": _sha256(p)} for p in paths]


def dumps_compact(obj: Any) -> str:
    """Compact JSON (for logging)."""
    return json.dumps(obj, separators=(",", ":"))
