"""More work, less time? How often the served predictor answers a layer that strictly grows along one axis
faster than the smaller one (issue 8; a NAS loop ranks candidates by these answers).

Usage: ``PYTHONPATH=. python scripts/monotonicity_check.py [--mode inference|training] [--devices ID,...]
[--precisions]`` (about 1 minute on 2 cores; prints a markdown table). It runs an in-process app on a throwaway
SQLite database and sends ``POST /v1/predictions/batch`` (the NAS path, the shipped predictor) one item per layer:

* single 2-D convolutions, ``C -> C`` channels, stride 1, "same" padding: batch 1-64 (x2 steps), C 16/64/256,
  input 14x14 or 56x56, kernel 1/3/5/7;
* single ``nn.Linear`` layers ``K -> N``: batch 1/8/64/512/4096, K and N 256/1024/4096.

A pair is one layer and the same layer grown along one axis (conv: batch x2, channels x4, side x4 (16x the
pixels), kernel +2; linear: batch x8, K x4, N x4). Every grown layer has strictly more FLOPs and bytes. A pair is
an inversion when the grown layer's p50 ``iteration_ms`` is below the smaller one's. The table gives the share
of inverted pairs, the share inverted by more than 10 %, and the worst ratio (grown / smaller) with its pair.

``--precisions``: the same layers on tensor-core GPUs (:data:`PRECISION_DEVICES`), each answered under ``tf32``
and ``bf16`` and compared with its ``fp32-strict`` answer: the share answered slower than strict fp32, the share
slower by more than 10 %, and the worst ratio (strict / tensor-core). Under ``bf16`` the layer's time includes
autocast's weight cast, a kernel the strict layer does not run, so small weighted layers may legitimately come
out slower; under ``tf32`` nothing is added.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = (("a100-pcie-40gb", "fp32-strict"), ("a100-pcie-40gb", "fp32"), ("a100-pcie-40gb", "fp16"),
            ("h100-sxm", "fp32"), ("h100-sxm", "bf16"), ("v100-sxm2-16gb", "fp32"), ("v100-sxm2-16gb", "fp16"),
            ("t4", "fp32"), ("t4", "fp16"))  # fmt: skip
PRECISION_DEVICES = ("a100-sxm4-80gb", "a10", "l4", "h100-sxm", "h200", "rtx-3090", "rtx-4090")
Key = tuple[Any, ...]


def _conv(c: int, side: int, k: int) -> dict[str, Any]:
    return {"name": "conv", "input_shape": [c, side, side],
            "layers": [{"op": "conv2d", "out_channels": c, "kernel_size": k, "stride": 1, "padding": k // 2}]}


def _linear(k: int, n: int) -> dict[str, Any]:
    return {"name": "linear", "input_shape": [k], "layers": [{"op": "linear", "out_features": n}]}


def cases() -> list[tuple[Key, dict[str, Any]]]:
    """(key, batch item without device and precision) of every layer of the grid."""
    out: list[tuple[Key, dict[str, Any]]] = []
    for b, c, side, k in itertools.product((1, 2, 4, 8, 16, 32, 64), (16, 64, 256), (14, 56), (1, 3, 5, 7)):
        out.append((("conv", b, c, side, k), {"graph": _conv(c, side, k), "batch_size": b}))
    for b, k, n in itertools.product((1, 8, 64, 512, 4096), (256, 1024, 4096), (256, 1024, 4096)):
        out.append((("linear", b, k, n), {"graph": _linear(k, n), "batch_size": b}))
    return out


def grown(key: Key) -> list[Key]:
    """The layers that grow ``key`` along one axis (strictly more FLOPs and bytes)."""
    if key[0] == "conv":
        _, b, c, side, k = key
        return [("conv", 2 * b, c, side, k), ("conv", b, 4 * c, side, k), ("conv", b, c, 4 * side, k),
                ("conv", b, c, side, k + 2)]
    _, b, k, n = key
    return [("linear", 8 * b, k, n), ("linear", b, 4 * k, n), ("linear", b, k, 4 * n)]


def answers(client: Any, hw: str, precision: str, mode: str) -> dict[Key, float]:
    """p50 ``iteration_ms`` of every layer of :func:`cases` on ``hw`` under ``precision`` and ``mode``."""
    times: dict[Key, float] = {}
    grid = cases()
    for start in range(0, len(grid), 500):
        chunk = grid[start:start + 500]
        items = [{**item, "hardware_id": hw, "precision": precision, "mode": mode} for _, item in chunk]
        r = client.post("/v1/predictions/batch", json={"items": items})
        r.raise_for_status()
        for (key, _), it in zip(chunk, r.json()["items"], strict=True):
            if it["summary"] is not None:
                times[key] = it["summary"]["iteration_ms"]
    return times


def check_precision(client: Any, hw: str, precision: str, mode: str) -> dict[str, Any]:
    """How often a layer under ``precision`` is answered slower than under ``fp32-strict`` (module docstring)."""
    strict, fast = answers(client, hw, "fp32-strict", mode), answers(client, hw, precision, mode)
    ratios = [(strict[k] / fast[k], k) for k in strict if k in fast]
    worst = min(ratios, default=(1.0, None))
    return {"pairs": len(ratios), "inverted": sum(r < 1 for r, _ in ratios),
            "far": sum(r < 1 / 1.1 for r, _ in ratios), "worst": worst}


def check(client: Any, hw: str, precision: str, mode: str) -> dict[str, Any]:
    """Inversion counts of one device and precision (see the module docstring)."""
    times = answers(client, hw, precision, mode)
    pairs = inverted = far = 0
    worst: tuple[float, Any] = (1.0, None)
    for key, t in times.items():
        for g in grown(key):
            if g not in times:
                continue
            pairs += 1
            ratio = times[g] / t
            inverted += ratio < 1
            far += ratio < 0.9
            if ratio < worst[0]:
                worst = (ratio, (key, g))
    return {"pairs": pairs, "inverted": inverted, "far": far, "worst": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="inference", choices=["inference", "training"])
    parser.add_argument("--devices", default=None, help="comma-separated ids (default: the built-in list)")
    parser.add_argument("--precisions", action="store_true",
                        help="compare tf32 and bf16 answers with fp32-strict ones on tensor-core GPUs")
    args = parser.parse_args(argv)
    every = (tuple((d, p) for d in PRECISION_DEVICES for p in ("tf32", "bf16")) if args.precisions
             else SETTINGS)
    settings = every if args.devices is None else tuple((d, p) for d, p in every if d in args.devices.split(","))
    if not settings:
        parser.error(f"--devices names none of {sorted({d for d, _ in every})}")
    run = check_precision if args.precisions else check
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LAYERCAST_DATABASE_URL"] = f"sqlite:///{tmp}/monotonicity.db"
        os.environ["LAYERCAST_IMPORT_WORKER_AT_START"] = "false"
        from fastapi.testclient import TestClient

        from app.main import create_app
        from app.migrate import upgrade

        upgrade(os.environ["LAYERCAST_DATABASE_URL"])
        with TestClient(create_app(), base_url="http://localhost") as client:
            if args.precisions:
                print(f"| device | precision | layers ({args.mode}) | slower than fp32-strict | slower by > 10 % "
                      "| worst (strict / this) |")
            else:
                print(f"| device | precision | pairs ({args.mode}) | inverted | inverted > 10 % "
                      "| worst (grown / smaller) |")
            print("|---|---|---|---|---|---|")
            for hw, precision in settings:
                res = run(client, hw, precision, args.mode)
                n = max(res["pairs"], 1)
                ratio, pair = res["worst"]
                worst = ("none" if pair is None else f"{ratio:.2f} {pair}" if args.precisions
                         else f"{ratio:.2f} {pair[0]} -> {pair[1]}")
                print(f"| {hw} | {precision} | {res['pairs']} | {100 * res['inverted'] / n:.1f} % | "
                      f"{100 * res['far'] / n:.1f} % | {worst} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
