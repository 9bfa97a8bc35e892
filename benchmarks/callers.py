"""Benchmarks of the callers' endpoints (issue 9): 1,000 job estimates over cached graphs, and layer
predictions per second through the batch path. Medians of repeated runs, in process through the HTTP app
(FastAPI TestClient: request parsing, validation and response serialisation included), one thread.

    python benchmarks/callers.py [--repeats 5] [--out benchmarks/callers.json]

Graphs: the model-zoo ONNX files shipped in the onnx wheel (ResNet-50, DenseNet-121, Inception v1/v2,
VGG-19, SqueezeNet, ShuffleNet, AlexNet, ZFNet-512), uploaded once; "cached" means the call finds them
stored and imported (the import cache of app.graphs.service), as a scheduler's repeated models would be.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastapi.testclient import TestClient  # noqa: E402

from app.config import Settings  # noqa: E402
from app.main import create_app  # noqa: E402
from app.migrate import upgrade  # noqa: E402

ZOO = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"
MODELS = ["resnet50", "densenet121", "inception_v1", "inception_v2", "vgg19", "squeezenet", "shufflenet",
          "bvlc_alexnet", "zfnet512"]
#: devices whose catalog entry lists an interconnect (data parallel is defined on them)
DEVICES = ["v100-sxm2-16gb", "a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm", "l40s", "a10"]


def _jobs(ids: dict[str, str], rng: np.random.Generator) -> list[dict[str, Any]]:
    jobs = []
    for _ in range(1000):
        n = int(rng.choice([1, 2, 4, 8]))
        jobs.append({"graph_id": ids[str(rng.choice(MODELS))], "hardware_id": str(rng.choice(DEVICES)),
                     "device_count": n, "batch_size": n * int(rng.choice([32, 64, 128])),
                     "dataset_size": int(rng.integers(10_000, 2_000_000)), "epochs": int(rng.integers(1, 100)),
                     "precision": str(rng.choice(["fp32", "bf16"]))})
    return jobs


def bench_jobs(client: TestClient, ids: dict[str, str], repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """Cold: the first 1,000 jobs after the upload (every scenario predicted). Warm: each repeat a fresh
    draw of 1,000 jobs (new dataset sizes, epochs, device counts, devices) over the same stored graphs, as a
    scheduler's queue of recurring models: their (graph, per-device batch, device, precision) scenarios
    are mostly remembered, the aggregation runs for every job."""

    def call(jobs: list[dict[str, Any]]) -> dict[str, Any]:
        r = client.post("/v1/job-estimates", json={"jobs": jobs})
        assert r.status_code == 200, r.text
        return dict(r.json())

    first = _jobs(ids, rng)
    cold_t = time.perf_counter()
    body = call(first)
    cold_s = time.perf_counter() - cold_t
    draws = [_jobs(ids, rng) for _ in range(repeats)]
    runs = []
    for jobs in draws:
        t = time.perf_counter()
        call(jobs)
        runs.append(time.perf_counter() - t)
    distinct = {(j["graph_id"], j["batch_size"] // j["device_count"]) for j in first}
    return {"jobs": len(first), "failed_first_draw": body["failed"], "cold_s": cold_s,
            "warm_median_s": statistics.median(runs), "warm_runs_s": runs,
            "distinct_graph_bindings": len(distinct),
            "distinct_scenarios": len({(j["graph_id"], j["batch_size"] // j["device_count"], j["hardware_id"],
                                        j["precision"]) for j in first})}


def _items(ids: dict[str, str], rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"graph_id": ids[str(rng.choice(MODELS))], "hardware_id": str(rng.choice(DEVICES)),
              "batch_size": int(rng.choice([1, 8, 16, 32, 64, 128, 256])),
              "precision": str(rng.choice(["fp32", "fp16", "bf16"])),
              "mode": str(rng.choice(["training", "inference"]))}
             for _ in range(2000)]


def _serving(predictor: Any) -> Any:
    """A dependency that answers ``predictor`` (no parameters: FastAPI would read them as query fields)."""

    def dependency() -> Any:
        return predictor

    return dependency


def bench_batch(client: TestClient, ids: dict[str, str], repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """A NAS-like batch of 2,000 items over the zoo graphs x devices x batch sizes x precisions x modes.
    Cold: a fresh predictor cache (each repeat on a new app predictor object); warm: a fresh draw of items
    after a first batch, repeated scenarios recalled. Layer predictions = supported layers answered."""

    def call(items: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
        t = time.perf_counter()
        r = client.post("/v1/predictions/batch", json={"items": items})
        assert r.status_code == 200, r.text
        return time.perf_counter() - t, dict(r.json())

    from app.deps import get_predictor
    from app.predictor.registry import load_predictor

    cold = []
    overrides = client.app.dependency_overrides  # type: ignore[attr-defined]
    for _ in range(repeats):  # a new predictor object: nothing remembered (the graphs stay bound)
        overrides[get_predictor] = _serving(load_predictor(REPO / "models"))
        cold.append(call(_items(ids, rng)))
    overrides.pop(get_predictor)
    call(_items(ids, rng))  # the served predictor's first batch of this draw, then the warm repeats
    warm = [call(_items(ids, rng)) for _ in range(repeats)]

    def summary(runs: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
        median = statistics.median(t for t, _ in runs)
        layers = statistics.median(b["layer_queries"] for _, b in runs)
        predicted = statistics.median(b["unique_layer_queries"] for _, b in runs)
        return {"median_s": median, "runs_s": [t for t, _ in runs], "layer_predictions": layers,
                "predictor_queries": predicted, "layer_predictions_per_s": layers / median,
                "predictor_queries_per_s": predicted / median,
                "failed_items": [b["failed"] for _, b in runs]}

    return {"items": 2000, "cold": summary(cold), "warm": summary(warm)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "callers.json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        # TestClient sends Host: testserver; no rate limit: the benchmark is one client timing itself
        settings = Settings(database_url=f"sqlite:///{tmp}/bench.db", models_dir=REPO / "models",
                            allowed_hosts="testserver", rate_limit="")
        upgrade(settings.database_url)
        with TestClient(create_app(settings)) as client:
            ids = {}
            for m in MODELS:
                r = client.post("/v1/graphs", files={"file": (f"{m}.onnx", (ZOO / f"light_{m}.onnx").read_bytes())})
                ids[m] = r.json()["id"]
            result = {
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "platform": platform.platform()},
                "repeats": args.repeats,
                "job_estimates": bench_jobs(client, ids, args.repeats, rng),
                "batch_predictions": bench_batch(client, ids, args.repeats, rng),
            }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
