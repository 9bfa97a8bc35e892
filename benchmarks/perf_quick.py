"""Quick subset of ``benchmarks/perf.py`` (issue 12): stored-graph predictions (repeat, fresh device/precision)
next to ``/healthz``, 1,000 job estimates and whole-catalog comparisons, in process; prints a summary, writes
nothing. ``python benchmarks/perf_quick.py [REPEATS]`` (default 9); run it on two checkouts to compare."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fastapi.testclient import TestClient  # noqa: E402

import benchmarks.perf as perf  # noqa: E402
from app.config import Settings  # noqa: E402
from app.main import create_app  # noqa: E402


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    paths = perf.build_models(Path(tempfile.gettempdir()) / "layercast-perf-models")
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=f"sqlite:///{tmp}/bench.db", models_dir=perf.REPO / "models",
                            allowed_hosts="testserver", rate_limit="")
        perf.upgrade(settings.database_url)
        with TestClient(create_app(settings)) as client:
            ids = {}
            for m in perf.MODELS:
                r = client.post("/v1/graphs", content=paths[m].read_bytes(),
                                headers={"content-type": "application/octet-stream"},
                                params={"dims": "seq=16"} if perf.DIMS[m] else {})
                assert r.status_code == 201, r.text
                ids[m] = r.json()["id"]
            p = perf.bench_predictions(client, ids, repeats)
            j = perf.bench_jobs_and_comparisons(client, ids, repeats)
    for k, v in p.items():
        print(f"{k:45s} p50 {v['p50_ms']:8.1f} ms  p99 {v['p99_ms']:8.1f} ms  x{v['p50_x_healthz']:.1f}")
    print("jobs 1000 first call", round(j["jobs_1000_first_call_s"], 3), "s; warm", json.dumps(j["jobs_1000_warm"]))
    print("comparisons p50 ms", {m: round(v["p50_ms"], 1) for m, v in j["comparison_whole_catalog"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
