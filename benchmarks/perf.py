"""Performance benchmarks of issue 12, each figure next to its in-run reference (``/healthz``, raw
onnxruntime, ``onnx.load``), medians and p99 of interleaved repeats, one run:

    python benchmarks/perf.py [--repeats 30] [--out benchmarks/perf.json]

In process through the HTTP app (FastAPI TestClient: parsing, validation, serialisation included) unless
said otherwise; uploads, concurrency, start-up and the prediction rows once more (``predictions_over_http``, how
issue 12 measured them) against a real ``layercast serve`` (uvicorn) process.
Graphs: BERT-base, GPT-2 small and ResNet-50 exported by ``tests/core/real_models.py`` (transformers configs,
random weights, TorchScript exporter, the files a user uploads: 438 MB, 653 MB, 102 MB), built once and kept in
``--models-dir`` (default a temporary folder). Needs the ``train`` extra (torch, transformers) to build them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from app.config import Settings  # noqa: E402
from app.main import create_app  # noqa: E402
from app.migrate import upgrade  # noqa: E402
from benchmarks.upload import _port, measure_upload, start_server  # noqa: E402

MODELS = ("resnet50", "bert", "gpt2")
DIMS = {"resnet50": {}, "bert": {"seq": 128}, "gpt2": {"seq": 128}}
HW = "a100-sxm4-40gb"


def _q(xs: list[float]) -> dict[str, float]:
    """p50 and p99 (ms) of ``xs`` (seconds)."""
    a = np.asarray(xs) * 1e3
    return {"p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "n": len(xs)}


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build_models(folder: Path) -> dict[str, Path]:
    """The three exports as files (built with torch once, then reused from ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {m: folder / f"{m}.onnx" for m in MODELS}
    missing = [m for m, p in paths.items() if not p.is_file()]
    if missing:
        from tests.core.real_models import exported

        for m in missing:
            paths[m].write_bytes(exported(m).onnx_bytes)
    return paths


def bench_predictions(client: Any, ids: dict[str, str], repeats: int) -> dict[str, Any]:
    """Stored-graph predictions (``client``: the in-process TestClient, or an ``httpx.Client`` on a server), one
    device, training, batch 64, interleaved with /healthz. ``repeat``: the same request again (cached binding);
    ``fresh``: a different device x precision each time (no memo can answer)."""
    from app.hardware.catalog import load_catalog

    gpus = [h.id for h in load_catalog().values() if h.kind == "gpu" and "bf16" in h.peak_flops_per_s]
    times: dict[str, list[float]] = {"healthz": []}

    def body(m: str, **kw: Any) -> dict[str, Any]:
        return {"graph_id": ids[m], "hardware_id": HW, "batch_size": 64, "dims": DIMS[m], "detail": "summary", **kw}

    def post(b: dict[str, Any]) -> None:
        r = client.post("/v1/predictions", json=b)
        assert r.status_code == 200, r.text

    for m in MODELS:  # warm: first binding import and analysis
        post(body(m))
    for i in range(repeats):
        times["healthz"].append(_timed(lambda: client.get("/healthz")))
        for m in MODELS:
            times.setdefault(f"{m} summary repeat", []).append(_timed(lambda m=m: post(body(m))))
            hw = gpus[i % len(gpus)]
            prec = ("fp32", "bf16", "fp16")[i % 3]
            times.setdefault(f"{m} summary fresh device/precision", []).append(
                _timed(lambda m=m, hw=hw, prec=prec: post(body(m, hardware_id=hw, precision=prec))))
        times.setdefault("resnet50 layers repeat", []).append(
            _timed(lambda: post(body("resnet50", detail="layers"))))
    out = {k: _q(v) for k, v in times.items()}
    ref = out["healthz"]["p50_ms"]
    for v in out.values():
        v["p50_x_healthz"] = v["p50_ms"] / ref
        v["p99_x_healthz_p50"] = v["p99_ms"] / ref
    return out


def bench_layer_throughput(client: TestClient, ids: dict[str, str], repeats: int) -> dict[str, Any]:
    """Layer predictions through the vectorised path (``estimate_tables``: features, routing, fallback, clamp)
    vs raw onnxruntime on the same feature rows (one thread), same run; plus /v1/predictions/batch."""
    from app.core.precision import Precision
    from app.graphs import service as graphs
    from app.hardware.catalog import load_catalog
    from app.predictor.table import Setting

    predictor = client.app.state.predictors.current()  # type: ignore[attr-defined]
    cat = [h for h in load_catalog().values() if h.kind == "gpu"]
    items = []
    with client.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
        for m in MODELS:
            bound = graphs.bound_graph(session, graph_id=ids[m], batch_size=32, dims=DIMS[m])
            t = bound.table(cat[0])
            for hw in cat:
                items.append((t, np.arange(len(t)), Setting(hw, "training", "adam", Precision.FP32)))
    rows = sum(len(i[1]) for i in items)
    learned = predictor.learned
    from app.core.features import FeatureInput, features_from_raw, raw_matrix

    fin = []
    for t, _, st in items:
        for i in predictor._route(t, st.hardware.kind)[0].tolist():
            for pass_, opt in (("forward", "none"), ("train_step", "adam")):
                fin.append(FeatureInput(t.layers[i], t.costs[i], st.hardware, pass_, opt, "fp32"))
    feats = features_from_raw(raw_matrix(fin))  # the learned rows' forward and train-step features
    x = learned._session.get_inputs()[0].name
    from app.core.features import select_features

    xin = select_features(feats, learned.feature_names)
    path, raw = [], []
    for _ in range(repeats):
        path.append(_timed(lambda: predictor.estimate_tables(items)))
        raw.append(_timed(lambda: learned._session.run(None, {x: xin})))
    path_s, raw_s = statistics.median(path), statistics.median(raw)
    out: dict[str, Any] = {
        "layers": rows, "model_rows": int(xin.shape[0]), "scenarios": len(items),
        "path_layers_per_s": rows / path_s, "path_median_s": path_s,
        "raw_onnxruntime_rows_per_s": xin.shape[0] / raw_s, "raw_median_s": raw_s,
        # the path answers one layer per layer; the raw model needs 2 rows per training layer (forward +
        # train-step): compare model rows per second, the same work
        "path_model_rows_per_s": xin.shape[0] / path_s,
        "ratio_path_to_raw": (xin.shape[0] / path_s) / (xin.shape[0] / raw_s),
    }
    # the HTTP batch endpoint (issue 9): 2,000 items over bindings imported before (the analysis cache), the
    # predictor's memoised estimates left behind before each call (another object in front of the predictor
    # is another memo key: app.predictions.service.predictor_key), so every item's layers are predicted
    from app.deps import get_predictor

    class Fresh:
        def __init__(self, inner: Any) -> None:
            self.inner, self.version = inner, inner.version

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        @staticmethod
        def serving(p: Any) -> Any:
            return lambda: p  # a dependency without parameters (a default argument would be a query field)

    rng = np.random.default_rng(0)
    devs = [h.id for h in cat]
    http = []
    sizes = [1, 8, 16, 32, 64]
    for r in range(max(3, repeats // 10)):
        batch = [{"graph_id": ids[str(rng.choice(MODELS))], "hardware_id": str(rng.choice(devs)),
                  "batch_size": int(rng.choice(sizes)), "mode": str(rng.choice(["inference", "training"])),
                  "precision": "fp32"}
                 for _ in range(2000)]
        for b in batch:
            m = next(k for k, v in ids.items() if v == b["graph_id"])
            b["dims"] = DIMS[m]
        if r == 0:  # import every binding once (not timed)
            client.post("/v1/predictions/batch", json={"items": batch})
        fresh = Fresh(predictor)
        client.app.dependency_overrides[get_predictor] = Fresh.serving(fresh)  # type: ignore[attr-defined]
        t = time.perf_counter()
        resp = client.post("/v1/predictions/batch", json={"items": batch})
        dt = time.perf_counter() - t
        client.app.dependency_overrides.pop(get_predictor)  # type: ignore[attr-defined]
        body = resp.json()
        http.append((dt, body["layer_queries"], body["unique_layer_queries"], body["failed"]))
    out["http_batch_2000_items"] = {
        "runs": [{"s": d, "layers": q, "predicted": u, "failed": f} for d, q, u, f in http],
        "layer_predictions_per_s_median": statistics.median(q / d for d, q, _, _ in http),
    }
    return out


def bench_jobs_and_comparisons(client: TestClient, ids: dict[str, str], repeats: int) -> dict[str, Any]:
    """1,000 job estimates in one call over cached graphs (scenarios recur), and whole-catalog comparisons."""
    from app.hardware.catalog import load_catalog

    rng = np.random.default_rng(1)
    devs = [h.id for h in load_catalog().values() if h.kind == "gpu"]

    def jobs() -> list[dict[str, Any]]:  # each with its graph's dims (without them BERT/GPT-2 answer 422)
        out = []
        for _ in range(1000):
            m = str(rng.choice(MODELS))
            out.append({"graph_id": ids[m], "hardware_id": str(rng.choice(devs)), "device_count": 1,
                        "batch_size": int(rng.choice([32, 64])), "dataset_size": int(rng.integers(10_000, 1_000_000)),
                        "epochs": int(rng.integers(1, 50)), "precision": "fp32", "dims": DIMS[m]})
        return out

    def call(js: list[dict[str, Any]]) -> float:
        t = time.perf_counter()
        r = client.post("/v1/job-estimates", json={"jobs": js})
        assert r.status_code == 200, r.text
        assert all(e["error"] is None for e in r.json()["estimates"]), r.text[:500]
        return time.perf_counter() - t

    cold = call(jobs())
    warm = [call(jobs()) for _ in range(max(5, repeats // 3))]
    cmp: dict[str, list[float]] = {}
    for m in MODELS:
        body = {"graph_id": ids[m], "batch_size": 32, "dims": DIMS[m], "dataset_size": 100_000, "epochs": 1}
        client.post("/v1/comparisons", json=body)  # first: every device predicted once
        cmp[m] = [_timed(lambda body=body: client.post("/v1/comparisons", json=body)) for _ in range(5)]
    hz = [_timed(lambda: client.get("/healthz")) for _ in range(50)]
    return {"jobs_1000_first_call_s": cold, "jobs_1000_warm": _q(warm),
            "comparison_whole_catalog": {m: _q(v) for m, v in cmp.items()}, "healthz": _q(hz)}


def bench_linearity() -> dict[str, Any]:
    """In-process prediction time of inline JSON graphs of N linear layers (first call: import, analysis,
    footprints, prediction), per layer."""
    from app.core.ir import OpKind  # noqa: F401 - import cost outside the timing
    from app.db import make_engine, make_sessionmaker
    from app.predictions import service as ps
    from app.predictions.schemas import PredictionCreate
    from app.predictor.registry import load_predictor

    pred = load_predictor(REPO / "models")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/lin.db"
        upgrade(url)
        sm = make_sessionmaker(make_engine(url))
        from app.hardware.service import seed_builtin

        with sm.begin() as s:
            seed_builtin(s)
        out = {}
        for n in (1_000, 10_000, 100_000):
            graph = {"name": f"mlp-{n}", "input_shape": [256],
                     "layers": [{"op": "linear", "out_features": 256} if i % 2 == 0 else {"op": "relu"}
                                for i in range(n)]}
            req = PredictionCreate.model_validate({"graph": graph, "hardware_id": HW, "batch_size": 32,
                                                   "detail": "summary"})
            with sm() as s:
                t = time.perf_counter()
                ps.predict(s, pred, request=req)
                first = time.perf_counter() - t
                t = time.perf_counter()
                ps.predict(s, pred, request=req)
                again = time.perf_counter() - t
            print(f"  {n} layers: {first:.2f} s first, {again:.2f} s cached", file=sys.stderr, flush=True)
            out[str(n)] = {"first_s": first, "cached_binding_s": again, "first_us_per_layer": first / n * 1e6,
                           "cached_us_per_layer": again / n * 1e6}
        return out


def bench_server(paths: dict[str, Path], tmp: Path, repeats: int) -> dict[str, Any]:
    """Against ``layercast serve``: start-up to ready, BERT upload vs onnx.load + infer_shapes with a concurrent
    /healthz, duplicate upload, 413 before parsing, 16 concurrent JSON writers on SQLite, and
    :func:`bench_predictions` over HTTP (``predictions_over_http``)."""
    import onnx

    out: dict[str, Any] = {}
    t = time.perf_counter()
    model = onnx.load(str(paths["bert"]))
    onnx.shape_inference.infer_shapes(model)
    out["onnx_load_plus_infer_shapes_s"] = time.perf_counter() - t
    del model
    port = _port()
    db = tmp / "server.db"
    env = {**os.environ, "LAYERCAST_DATABASE_URL": f"sqlite:///{db}", "LAYERCAST_LOG_LEVEL": "warning",
           "LAYERCAST_MAX_UPLOAD_BYTES": str(1024**3), "LAYERCAST_RATE_LIMIT": ""}
    upgrade(env["LAYERCAST_DATABASE_URL"])  # migrated and seeded once, as after a first start
    base = f"http://127.0.0.1:{port}"

    def start() -> tuple[subprocess.Popen[bytes], float]:
        return start_server(env, REPO, port)

    proc, first = start()
    proc.terminate()
    proc.wait()
    starts = []
    for _ in range(3):
        proc, s = start()
        starts.append(s)
        if _ < 2:
            proc.terminate()
            proc.wait()
    out["startup_to_ready_s"] = {"first_start_s": first, "later_starts_s": starts,
                                 "median_s": statistics.median(starts)}
    code = "import sys, time; t = time.perf_counter(); import app.main; print(time.perf_counter() - t, " \
           "'torch' in sys.modules, 'alembic' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    secs, torch_in, alembic_in = res.stdout.split()
    out["import_app_main_s"] = float(secs)
    out["import_app_main_pulls_torch"], out["import_app_main_pulls_alembic"] = torch_in, alembic_in
    # onnx is imported by the app's lifespan before ready (never by importing the package): its one-time
    # cost in a fresh process, GIL held
    code = "import time, numpy; t = time.perf_counter(); import onnx; print(time.perf_counter() - t)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    out["import_onnx_s"] = float(res.stdout)
    try:
        m = measure_upload(base, proc.pid, paths["bert"])
        size = m["file_bytes"]
        out["upload_bert"] = {
            "file_bytes": size, "upload_s": m["upload_s"],
            "ratio_to_onnx_load_plus_infer_shapes": m["upload_s"] / out["onnx_load_plus_infer_shapes_s"],
            "server_peak_rss_growth_bytes": m["peak_rss"] - m["rss_before"],
            "peak_growth_over_file_size": (m["peak_rss"] - m["rss_before"]) / size,
            "healthz_during_upload": _q(m["healthz_s"]), "duplicate_upload_s": m["duplicate_s"],
            "duplicate_status": m["duplicate_status"], "sha256_of_file_s": m["sha256_s"],
        }

        def big_body() -> Any:
            chunk = b"\0" * (1 << 20)
            for _ in range(1630):  # 1.63 GB, streamed
                yield chunk

        with httpx.Client(base_url=base, timeout=600) as c:
            t = time.perf_counter()
            r3 = c.post("/v1/graphs", content=big_body(), headers={"content-type": "application/octet-stream"})
            out["upload_1_63_gb_over_1_gib_limit"] = {"status": r3.status_code, "s": time.perf_counter() - t,
                                                       "code": r3.json().get("error", {}).get("code")}
        errors: list[int] = []

        def writer(w: int) -> None:
            with httpx.Client(base_url=base, timeout=120) as c:
                for k in range(10):
                    g = {"name": f"w{w}-{k}", "input_shape": [16 + w],
                         "layers": [{"op": "linear", "out_features": 8 + k}]}
                    errors.append(c.post("/v1/graphs", json=g).status_code)

        ths = [threading.Thread(target=writer, args=(w,)) for w in range(16)]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        out["sqlite_16_concurrent_writers"] = {"requests": len(errors), "5xx": sum(c >= 500 for c in errors),
                                               "statuses": sorted(set(errors)), "s": time.perf_counter() - t}
        # the prediction rows again over HTTP, as issue 12 measured them (one keep-alive client in this process,
        # the server in its own): the same requests in the same order as bench_predictions in process
        with httpx.Client(base_url=base, timeout=120) as c:
            ids = {}
            for name in MODELS:  # BERT is stored already (the upload above): answered 200 with its id
                r = c.post("/v1/graphs", content=paths[name].read_bytes(),
                           headers={"content-type": "application/octet-stream"},
                           params={"dims": "seq=16"} if DIMS[name] else {})
                assert r.status_code in (200, 201), r.text
                ids[name] = r.json()["id"]
            out["predictions_over_http"] = bench_predictions(c, ids, repeats)
    finally:
        proc.terminate()
        proc.wait()
    return out


def _prediction_rows(p: dict[str, Any], prefix: str = "") -> list[str]:
    """Table rows of a :func:`bench_predictions` result, ``/healthz`` first, each label after ``prefix``."""
    rows = [f"| {prefix}`GET /healthz` (reference) | p50 {p['healthz']['p50_ms']:.2f} ms, p99 "
            f"{p['healthz']['p99_ms']:.2f} ms | — | — |"]
    for k, v in p.items():
        if k == "healthz":
            continue
        target = "≤ 5×" if "layers" in k else "p50 ≤ 3×, p99 ≤ 10×"
        rows.append(f"| {prefix}`POST /v1/predictions` {k} | p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms | "
                    f"{v['p50_x_healthz']:.1f}× / {v['p99_x_healthz_p50']:.1f}× | {target} |")
    return rows


def markdown(r: dict[str, Any]) -> str:
    """The README table of a result: each figure next to its in-run reference and the issue-12 target."""
    rows = _prediction_rows(r["predictions"])
    t = r["layer_throughput"]
    rows.append(f"| layer predictions, vectorised path ({t['layers']:,} layers, {t['scenarios']} scenarios) | "
                f"{t['path_layers_per_s']:,.0f} layers/s ({t['path_model_rows_per_s']:,.0f} model rows/s) | "
                f"raw onnxruntime {t['raw_onnxruntime_rows_per_s']:,.0f} rows/s: {t['ratio_path_to_raw']:.0%} | "
                "≥ 50 % |")
    hb = t["http_batch_2000_items"]
    rows.append(f"| `POST /v1/predictions/batch`, 2,000 fresh items | {hb['layer_predictions_per_s_median']:,.0f} "
                "layer predictions/s | — | 100,000/s (issue 9) |")
    j = r["jobs_and_comparisons"]
    rows.append(f"| `POST /v1/job-estimates`, 1,000 jobs, cached graphs | p50 {j['jobs_1000_warm']['p50_ms']:.0f} ms "
                f"(first call {j['jobs_1000_first_call_s']:.2f} s) | — | ≤ 100 ms |")
    for m, v in j["comparison_whole_catalog"].items():
        rows.append(f"| `POST /v1/comparisons` {m}, whole catalog | p50 {v['p50_ms']:.0f} ms | — | ≤ 50 ms |")
    for n, v in r["linearity"].items():
        rows.append(f"| inline graph of {int(n):,} layers, summary | first {v['first_s']:.2f} s "
                    f"({v['first_us_per_layer']:.0f} µs/layer), cached binding {v['cached_binding_s']:.2f} s "
                    f"({v['cached_us_per_layer']:.0f} µs/layer) | — | linear |")
    sv = r.get("server")
    if sv and "predictions_over_http" in sv:
        rows += _prediction_rows(sv["predictions_over_http"], "over HTTP (`layercast serve`): ")
    if sv:
        u = sv["upload_bert"]
        rows.append(f"| upload BERT ({u['file_bytes'] / 1e6:.0f} MB) | {u['upload_s']:.2f} s | "
                    f"onnx.load + infer_shapes "
                    f"{sv['onnx_load_plus_infer_shapes_s']:.2f} s: {u['ratio_to_onnx_load_plus_infer_shapes']:.2f}× | "
                    "≤ 1.2× |")
        rows.append(f"| server RSS growth during the upload | {u['server_peak_rss_growth_bytes'] / 1e6:.0f} MB | "
                    f"{u['peak_growth_over_file_size']:.2f}× file size | ≤ 1.5× |")
        rows.append(f"| `/healthz` during the upload | p50 {u['healthz_during_upload']['p50_ms']:.1f} ms, p99 "
                    f"{u['healthz_during_upload']['p99_ms']:.1f} ms | — | p99 ≤ 50 ms |")
        rows.append(f"| duplicate upload | {u['duplicate_upload_s']:.2f} s (status {u['duplicate_status']}) | sha256 "
                    f"of the file {u['sha256_of_file_s']:.2f} s | ≤ 0.2 s + hash |")
        b = sv["upload_1_63_gb_over_1_gib_limit"]
        rows.append(f"| 1.63 GB streamed upload, 1 GiB limit | {b['status']} `{b['code']}` after {b['s']:.2f} s | — | "
                    "413 before parsing |")
        w = sv["sqlite_16_concurrent_writers"]
        rows.append(f"| 16 concurrent JSON writers on SQLite | {w['5xx']} 5xx of {w['requests']} | — | 0 |")
        st = sv["startup_to_ready_s"]
        rows.append(f"| `layercast serve` start to ready | {st['median_s']:.2f} s (first start "
                    f"{st['first_start_s']:.2f} s) | `import app.main` "
                    f"{sv['import_app_main_s']:.2f} s, torch {sv['import_app_main_pulls_torch']}, "
                    f"alembic {sv['import_app_main_pulls_alembic']}; onnx imported before ready "
                    f"({sv.get('import_onnx_s', float('nan')):.2f} s) | ≤ 2 s, neither |")
    head = "| what | measured | in-run reference | target |\n|---|---|---|---|\n"
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "perf.json")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "layercast-perf-models")
    ap.add_argument("--skip-server", action="store_true", help="in-process benchmarks only")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    paths = build_models(args.models_dir)
    result: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                          "platform": platform.platform(), "processor": platform.processor()},
                              "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        # TestClient's Host is "testserver"; no rate limit (the benchmark is one client on purpose)
        settings = Settings(database_url=f"sqlite:///{tmp}/bench.db", models_dir=REPO / "models",
                            allowed_hosts="testserver", rate_limit="")
        upgrade(settings.database_url)
        with TestClient(create_app(settings)) as client:
            ids = {}
            for m in MODELS:
                r = client.post("/v1/graphs", content=paths[m].read_bytes(),
                                headers={"content-type": "application/octet-stream"},
                                params={"dims": "seq=16"} if DIMS[m] else {})
                assert r.status_code == 201, r.text
                ids[m] = r.json()["id"]
            print("running predictions", file=sys.stderr, flush=True)
            result["predictions"] = bench_predictions(client, ids, args.repeats)
            print("running layer_throughput", file=sys.stderr, flush=True)
            result["layer_throughput"] = bench_layer_throughput(client, ids, args.repeats)
            print("running jobs_and_comparisons", file=sys.stderr, flush=True)
            result["jobs_and_comparisons"] = bench_jobs_and_comparisons(client, ids, args.repeats)
        print("running linearity", file=sys.stderr, flush=True)
        result["linearity"] = bench_linearity()
        if not args.skip_server:
            print("running server", file=sys.stderr, flush=True)
            result["server"] = bench_server(paths, Path(tmp), args.repeats)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
