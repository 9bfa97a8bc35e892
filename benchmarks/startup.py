"""``layercast serve`` start to ready (first ``GET /healthz`` answered 200), interleaved A/B of two environments:

    python benchmarks/startup.py [--starts 9] [--b-path DIR] [--out benchmarks/startup.json]

A is this checkout as installed; B is the same with ``DIR`` put first on ``PYTHONPATH`` (e.g. another version of a
dependency installed there with ``pip install --no-deps --target DIR pkg==X``), so a dependency's effect is measured
side by side under the same machine load. Starts alternate A, B, A, B ...; one warm-up start of each is dropped.
Also records, per environment, the wall time of ``import app.main`` and of ``import onnx`` in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.migrate import upgrade  # noqa: E402
from benchmarks.upload import _port, start_server  # noqa: E402


def start_to_ready(env: dict[str, str]) -> float:
    """Seconds from spawning ``layercast serve`` to its first 200 on ``/healthz`` (the process is then stopped)."""
    proc, seconds = start_server(env, REPO, _port())
    proc.terminate()
    proc.wait()
    return seconds


def import_s(env: dict[str, str], module: str) -> float:
    code = f"import time, numpy; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return float(out.stdout)


def versions(env: dict[str, str]) -> dict[str, str]:
    code = ("import json; from importlib.metadata import version; import ml_dtypes, numpy, onnx; "
            "print(json.dumps({'ml_dtypes': ml_dtypes.__version__, 'numpy': numpy.__version__, "
            "'onnx': onnx.__version__}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=9, help="measured starts per environment")
    ap.add_argument("--b-path", type=Path, default=None, help="B: this folder first on PYTHONPATH (none: A only)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "startup.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = {**os.environ, "LAYERCAST_DATABASE_URL": f"sqlite:///{tmp}/s.db", "LAYERCAST_LOG_LEVEL": "warning",
                "LAYERCAST_RATE_LIMIT": ""}
        upgrade(base["LAYERCAST_DATABASE_URL"])  # migrated and seeded once, as after a first start
        envs = {"A": base}
        if args.b_path is not None:
            envs["B"] = {**base, "PYTHONPATH": os.pathsep.join([str(args.b_path), base.get("PYTHONPATH", "")])}
        for env in envs.values():
            start_to_ready(env)  # warm-up (file cache, the catalog's first seeding)
        starts: dict[str, list[float]] = {k: [] for k in envs}
        imports: dict[str, dict[str, list[float]]] = {k: {"app.main": [], "onnx": []} for k in envs}
        for _ in range(args.starts):
            for k, env in envs.items():
                starts[k].append(start_to_ready(env))
                for m in imports[k]:
                    imports[k][m].append(import_s(env, m))
        result = {"machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
                  "starts_per_environment": args.starts, "b_path": str(args.b_path) if args.b_path else None}
        for k, env in envs.items():
            result[k] = {"versions": versions(env), "start_to_ready_s": starts[k],
                         "median_s": statistics.median(starts[k]),
                         "spread_s": [min(starts[k]), max(starts[k])],
                         **{f"import_{m.replace('.', '_')}_median_s": statistics.median(v)
                            for m, v in imports[k].items()}}
            print(f"{k} {result[k]['versions']}: start to ready median {result[k]['median_s']:.2f} s "
                  f"[{min(starts[k]):.2f}-{max(starts[k]):.2f}], import app.main "
                  f"{result[k]['import_app_main_median_s']:.2f} s, "
                  f"import onnx {result[k]['import_onnx_median_s']:.2f} s")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
