"""Lockstep A/B of fresh device/precision predictions (issue 12) between checkouts, in one run:

    python benchmarks/fresh_ab.py --repo /path/to/old --repo . [--rounds 150] [--models resnet50,bert,gpt2]

Each ``--repo`` gets a worker process (its own in-process app, TestClient, SQLite database and the graphs of
``benchmarks/perf.py``, uploaded once) that imports that checkout's code. Every round sends, to each worker in
turn (the order alternates round by round), ``GET /healthz`` and one summary prediction per graph, training,
batch 64, on the next GPU x precision of the catalog's cycle (as ``perf.py``'s fresh rows do), with the binding's
memoised estimates, rows, footprints and largest batches dropped first, so every prediction computes its
answer. Prints each checkout's medians (ms) and ratios to its own ``/healthz`` median, and how many responses
differed between the first two checkouts (sha256 of the body; the answers must be byte-identical).
``OMP_NUM_THREADS=1`` in the workers; the graphs are built with the ``train`` extra like ``perf.py``'s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GPUS_WITH_BF16 = ("a10", "a100-sxm4-40gb", "a100-pcie-40gb", "a100-sxm4-80gb", "a100-pcie-80gb", "l4", "l40s",
                  "h100-sxm", "h100-pcie", "h200", "rtx-3090", "rtx-4090", "mi250x", "mi300x", "a40", "mi100", "mi210")
PRECISIONS = ("fp32", "bf16", "fp16")
#: Memo keys of a binding a fresh device/precision finds empty (app.predictions.service).
DROPPED = ("estimates", "rows", "footprint", "largest")


def worker(models: list[str], models_dir: Path) -> None:
    """Serve timing commands on stdin: ``h`` (``/healthz``), ``f MODEL HW PRECISION`` (a fresh prediction),
    ``q``; answers ``seconds [sha256 prefix]`` per line."""
    sys.path.insert(0, os.getcwd())
    from fastapi.testclient import TestClient

    from app.config import Settings
    from app.graphs import service as graphs
    from app.main import create_app
    from app.migrate import upgrade

    dims = {"resnet50": {}, "bert": {"seq": 128}, "gpt2": {"seq": 128}}
    tmp = tempfile.mkdtemp()
    settings = Settings(database_url=f"sqlite:///{tmp}/ab.db", models_dir=Path("models").resolve(),
                        allowed_hosts="testserver", rate_limit="")
    upgrade(settings.database_url)
    with TestClient(create_app(settings)) as client:
        ids, bounds = {}, {}
        for m in models:
            r = client.post("/v1/graphs", content=(models_dir / f"{m}.onnx").read_bytes(),
                            headers={"content-type": "application/octet-stream"},
                            params={"dims": "seq=16"} if dims[m] else {})
            assert r.status_code == 201, r.text
            ids[m] = r.json()["id"]

        def body(m: str, **kw: Any) -> dict[str, Any]:
            return {"graph_id": ids[m], "hardware_id": "a100-sxm4-40gb", "batch_size": 64, "dims": dims[m],
                    "detail": "summary", **kw}

        for m in models:
            assert client.post("/v1/predictions", json=body(m)).status_code == 200
            with client.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
                bounds[m] = graphs.bound_graph(session, graph_id=ids[m], batch_size=64, dims=dims[m])
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "q":
                break
            if cmd[0] == "h":
                t = time.perf_counter()
                client.get("/healthz")
                print(time.perf_counter() - t, flush=True)
                continue
            m, hw, precision = cmd[1:]
            memo = bounds[m]._memo
            for k in [k for k in memo if isinstance(k, tuple) and k and k[0] in DROPPED]:
                del memo[k]
            t = time.perf_counter()
            r = client.post("/v1/predictions", json=body(m, hardware_id=hw, precision=precision))
            dt = time.perf_counter() - t
            assert r.status_code == 200, r.text
            print(dt, hashlib.sha256(r.content).hexdigest()[:16], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, action="append", required=True, help="a checkout (give two or more)")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--models", default="resnet50,bert,gpt2")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "layercast-perf-models")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    models = args.models.split(",")
    if args.worker:
        worker(models, args.models_dir)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.perf import build_models

    build_models(args.models_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for repo in args.repo:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--repo", str(repo), "--models",
               args.models, "--models-dir", str(args.models_dir)]
        procs.append(subprocess.Popen(cmd, cwd=repo, env={**env, "PYTHONPATH": str(repo.resolve())},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True))
    for p in procs:
        while (line := p.stdout.readline()) and line.strip() != "ready":  # type: ignore[union-attr]
            pass

    def ask(p: subprocess.Popen[str], cmd: str) -> list[str]:
        p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        return p.stdout.readline().split()  # type: ignore[union-attr]

    times: list[dict[str, list[float]]] = [{"healthz": []} for _ in procs]
    digests: list[list[str]] = [[] for _ in procs]
    for i in range(args.rounds):
        hw, precision = GPUS_WITH_BF16[i % len(GPUS_WITH_BF16)], PRECISIONS[i % len(PRECISIONS)]
        for j in (range(len(procs)) if i % 2 == 0 else reversed(range(len(procs)))):
            times[j]["healthz"].append(float(ask(procs[j], "h")[0]))
            for m in models:
                t, digest = ask(procs[j], f"f {m} {hw} {precision}")
                times[j].setdefault(m, []).append(float(t))
                digests[j].append(digest)
    for p in procs:
        ask(p, "q")
    for repo, ts in zip(args.repo, times, strict=True):
        ref = statistics.median(ts["healthz"]) * 1e3
        print(f"{repo}: /healthz p50 {ref:.2f} ms; fresh p50 " + ", ".join(
            f"{m} {statistics.median(ts[m]) * 1e3:.2f} ms ({statistics.median(ts[m]) * 1e3 / ref:.2f}x)"
            for m in models))
    if len(procs) > 1:
        differ = sum(a != b for a, b in zip(digests[0], digests[1], strict=True))
        print(f"responses differing between the first two checkouts: {differ} of {len(digests[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
