"""Bounded load test (issue 11 item 7): a real server on loopback (uvicorn, 2 worker processes), a fixed
duration, ``--concurrency`` clients at once sending a mix of predictions, graph uploads, measurement
batches and reads; on SQLite and on PostgreSQL. Passes when no request failed (no 5xx, no transport
error, every answer the expected status); records per-kind counts, p50/p99 latency and throughput.

Usage::

    python benchmarks/load.py [--duration-s 20] [--concurrency 100] [--backend sqlite|postgresql|both]
                              [--out benchmarks/load.json]

PostgreSQL: a fresh database ``layercast_load_<random>`` on the server of ``$LAYERCAST_LOAD_POSTGRES_URL``
(default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``), dropped afterwards. The measurement
batches are sent with an API key made by ``layercast keys create`` (scope ``measurements``), as a real
profiler would; rate limiting is off for the run (one client address sends everything).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

#: Share of each request kind in the mix (predictions dominate, as from schedulers and NAS loops).
MIX = {"predict_inline": 0.4, "predict_stored": 0.2, "upload_graph": 0.15, "post_measurements": 0.15,
       "list_hardware": 0.1}  # fmt: skip
EXPECTED = {"predict_inline": 200, "predict_stored": 200, "upload_graph": 201, "post_measurements": 201,
            "list_hardware": 200}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _graph(rng: random.Random) -> dict[str, Any]:
    c = rng.choice([16, 32, 64])
    return {"name": f"load-{uuid.uuid4().hex[:8]}", "input_shape": [3, 32, 32], "layers": [
        {"op": "conv2d", "out_channels": c, "kernel_size": 3, "padding": 1}, {"op": "relu"},
        {"op": "conv2d", "out_channels": rng.randint(8, 256), "kernel_size": 3, "padding": 1},
        {"op": "flatten"}, {"op": "linear", "out_features": 10}]}  # fmt: skip


def _measurements(rng: random.Random) -> dict[str, Any]:
    rows = [{"hardware_id": "a100-sxm4-40gb", "source": "load", "op_kind": "iteration", "pass": "train_step",
             "optimizer": "adam", "software_stack": "pytorch-eager", "granularity": "iteration",
             "batch_size": rng.choice([32, 64, 128]), "config": {"model": "resnet50", "run": uuid.uuid4().hex},
             "time_ms_median": rng.uniform(150, 400)} for _ in range(rng.randint(1, 20))]  # fmt: skip
    return {"measurements": rows}


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, graph_ids: list[str], key: str) -> int:
    if kind == "predict_inline":
        body = {"graph": _graph(rng), "hardware_id": rng.choice(["a100-sxm4-40gb", "v100-sxm2-16gb", "t4"]),
                "batch_size": rng.choice([1, 8, 64]), "mode": rng.choice(["inference", "training"])}
        r = await client.post("/v1/predictions", json=body)
    elif kind == "predict_stored":
        body = {"graph_id": rng.choice(graph_ids), "hardware_id": "a100-sxm4-40gb", "batch_size": rng.choice([1, 32]),
                "mode": "training"}
        r = await client.post("/v1/predictions", json=body)
    elif kind == "upload_graph":
        r = await client.post("/v1/graphs", json=_graph(rng))
    elif kind == "post_measurements":
        r = await client.post("/v1/measurements", json=_measurements(rng), headers={"Authorization": f"Bearer {key}"})
    else:
        r = await client.get("/v1/hardware")
    return r.status_code


async def _drive(base: str, duration_s: float, concurrency: int, key: str, seed: int) -> dict[str, Any]:
    latencies: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, Counter[str]] = defaultdict(Counter)
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120.0, limits=limits) as client:
        graph_ids = []
        for i in range(5):
            r = await client.post("/v1/graphs", json=_graph(random.Random(i)))
            r.raise_for_status()
            graph_ids.append(r.json()["id"])
        deadline = time.perf_counter() + duration_s
        kinds, weights = list(MIX), list(MIX.values())

        async def worker(n: int) -> None:
            rng = random.Random(seed * 1000 + n)
            while time.perf_counter() < deadline:
                kind = rng.choices(kinds, weights)[0]
                start = time.perf_counter()
                try:
                    status = await _one(client, kind, rng, graph_ids, key)
                except httpx.HTTPError as exc:
                    errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                    statuses[kind]["transport_error"] += 1
                    continue
                latencies[kind].append(time.perf_counter() - start)
                statuses[kind][str(status)] += 1

        wall = time.perf_counter()
        await asyncio.gather(*(worker(n) for n in range(concurrency)))
        wall = time.perf_counter() - wall

    def pct(values: list[float], q: float) -> float:
        return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000, 1) if len(values) > 1 \
            else round(values[0] * 1000, 1) if values else float("nan")

    all_lat = [v for vs in latencies.values() for v in vs]
    by_kind = {k: {"requests": sum(statuses[k].values()), "statuses": dict(statuses[k]),
                   "p50_ms": pct(latencies[k], 50), "p99_ms": pct(latencies[k], 99)} for k in MIX}  # fmt: skip
    failed = sum(n for k in MIX for s, n in statuses[k].items() if s != str(EXPECTED[k]))
    return {"requests": sum(v["requests"] for v in by_kind.values()), "failed": failed,
            "server_errors_5xx": sum(n for k in MIX for s, n in statuses[k].items() if s.startswith("5")),
            "transport_errors": len(errors), "wall_s": round(wall, 1),
            "throughput_rps": round(len(all_lat) / wall, 1), "p50_ms": pct(all_lat, 50), "p99_ms": pct(all_lat, 99),
            "by_kind": by_kind, "first_errors": errors[:5]}  # fmt: skip


def _run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="layercast-load-"))
    drop: tuple[str, str] | None = None
    if backend == "sqlite":
        url = f"sqlite:///{tmp / 'load.db'}"
    else:
        import psycopg
        from sqlalchemy.engine import make_url

        admin = make_url(os.environ.get("LAYERCAST_LOAD_POSTGRES_URL", PG_DEFAULT))
        name = f"layercast_load_{uuid.uuid4().hex[:10]}"
        libpq = admin.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        drop = (libpq, name)
        url = admin.set(database=name).render_as_string(hide_password=False)
    env = {**os.environ, "LAYERCAST_DATABASE_URL": url, "LAYERCAST_RATE_LIMIT": "", "LAYERCAST_LOG_LEVEL": "warning",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    port = _free_port()
    server = None
    try:
        subprocess.run([PY, "-m", "app.cli", "migrate"], env=env, cwd=ROOT, check=True)
        key = subprocess.run([PY, "-m", "app.cli", "keys", "create", "load-test", "--scope", "measurements"], env=env,
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        log = open(tmp / "server.log", "w")  # noqa: SIM115 - lives as long as the server
        server = subprocess.Popen([PY, "-m", "uvicorn", "app.main:create_app", "--factory", "--host", "127.0.0.1",
                                   "--port", str(port), "--workers", str(args.workers), "--log-level", "warning",
                                   "--timeout-keep-alive", "75"],
                                  env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"server did not become ready; see {tmp / 'server.log'}")
        result = asyncio.run(_drive(base, args.duration_s, args.concurrency, key, args.seed))
        result["server_log_5xx_lines"] = sum(" 500 " in line or "Traceback" in line
                                             for line in (tmp / "server.log").read_text().splitlines())  # fmt: skip
        return result
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        if drop is not None:
            import psycopg

            with psycopg.connect(drop[0], autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{drop[1]}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    report: dict[str, Any] = {
        "command": "python benchmarks/load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "duration_s": args.duration_s, "concurrency": args.concurrency, "workers": args.workers, "mix": MIX,
        "results": {},
    }  # fmt: skip
    for backend in backends:
        report["results"][backend] = _run_backend(backend, args)
        r = report["results"][backend]
        print(f"{backend}: {r['requests']} requests in {r['wall_s']} s ({r['throughput_rps']}/s), failed {r['failed']}"
              f" (5xx {r['server_errors_5xx']}, transport {r['transport_errors']}), p50 {r['p50_ms']} ms,"
              f" p99 {r['p99_ms']} ms")  # fmt: skip
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0 if all(r["failed"] == 0 for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
