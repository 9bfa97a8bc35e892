"""The upload rows of ``benchmarks/perf.py`` alone, against a real ``layercast serve``, for side-by-side runs:

    python benchmarks/upload.py [--repo PATH] [--model FILE] [--repeats 3]

``--repo``: the checkout whose ``app`` the server runs (default this one), so two checkouts can be measured
back to back in the same minute by the same script. Per repeat: start to ready (the first 200 of ``/healthz``),
a first upload of the model (a fresh database) with ``GET /healthz`` polled every 20 ms beside it (as perf.py
does; peak RSS of the server and its child processes), then a duplicate upload of the same file, then the
sha256 of the file read from disk (the duplicate row's reference). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(env: dict[str, str], cwd: Path, port: int) -> tuple[subprocess.Popen[bytes], float]:
    """Spawn ``layercast serve --port port`` (in ``cwd``, with ``env``) and wait for its first 200 on ``/healthz``,
    polled every 20 ms. Returns the process (still running: the caller stops it) and the seconds from spawn to
    that answer. Raises ``RuntimeError`` when the process exits before it is ready (the process is reaped)."""
    import httpx

    cmd = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())", "serve", "--port",
           str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"layercast serve exited with {proc.returncode} before it was ready")
        time.sleep(0.02)


def measure_upload(base: str, pid: int, model: Path) -> dict[str, Any]:
    """Against the running server at ``base`` (process ``pid``), 2 s after it is ready (an import worker started
    with the app has finished its imports): a first upload of the ONNX file ``model`` (``dims=seq=16``) with
    ``GET /healthz`` polled every 20 ms beside it, recording the resident size of the server and of the server
    with its child processes (its import worker counts); then a duplicate upload of the same file; then the sha256
    of the file read from disk (the duplicate's reference). Returns ``file_bytes``, ``upload_s``, ``healthz_s``
    (each poll's latency, s), ``rss_before`` / ``peak_rss`` / ``rss_after`` (server and children, bytes),
    ``server_rss_before`` / ``server_peak_rss`` (the server alone), ``duplicate_s``, ``duplicate_status``,
    ``sha256_s``. Raises ``AssertionError`` when the first upload is not a 201."""
    import httpx
    import psutil

    server = psutil.Process(pid)
    time.sleep(2)

    def tree_rss() -> int:
        total = 0
        for p in (server, *server.children(recursive=True)):
            with contextlib.suppress(psutil.Error):  # a worker that just ended
                total += p.memory_info().rss
        return total

    rss0, server0 = tree_rss(), server.memory_info().rss
    peak, server_peak = [rss0], [server0]
    hz: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get("/healthz")
                hz.append(time.perf_counter() - t)
                peak.append(tree_rss())
                server_peak.append(server.memory_info().rss)
                time.sleep(0.02)

    size = model.stat().st_size
    headers = {"content-type": "application/octet-stream", "content-length": str(size)}
    th = threading.Thread(target=poll)
    th.start()
    with httpx.Client(base_url=base, timeout=600) as c, model.open("rb") as f:
        t = time.perf_counter()
        r = c.post("/v1/graphs", content=f, params={"dims": "seq=16"}, headers=headers)
        upload_s = time.perf_counter() - t
    stop.set()
    th.join()
    assert r.status_code == 201, r.text
    with httpx.Client(base_url=base, timeout=600) as c, model.open("rb") as f:
        t = time.perf_counter()
        r2 = c.post("/v1/graphs", content=f, headers=headers)
        dup_s = time.perf_counter() - t
    t = time.perf_counter()
    hashlib.sha256(model.read_bytes()).hexdigest()
    hash_s = time.perf_counter() - t
    return {"file_bytes": size, "upload_s": upload_s, "healthz_s": hz, "rss_before": rss0, "peak_rss": max(peak),
            "rss_after": tree_rss(), "server_rss_before": server0, "server_peak_rss": max(server_peak),
            "duplicate_s": dup_s, "duplicate_status": r2.status_code, "sha256_s": hash_s}


def once(repo: Path, model: Path, tmp: Path) -> dict[str, Any]:
    """One server start, first upload with /healthz polled beside it, duplicate upload, sha256 of the file."""
    port = _port()
    db = tmp / f"upload-{port}.db"
    env = {**os.environ, "LAYERCAST_DATABASE_URL": f"sqlite:///{db}", "LAYERCAST_LOG_LEVEL": "warning",
           "LAYERCAST_MAX_UPLOAD_BYTES": str(1024**3), "LAYERCAST_RATE_LIMIT": "", "PYTHONPATH": str(repo)}
    base = f"http://127.0.0.1:{port}"
    proc, ready_s = start_server(env, repo, port)
    try:
        m = measure_upload(base, proc.pid, model)
        assert m["duplicate_status"] == 200, m["duplicate_status"]
        a = np.asarray(m["healthz_s"]) * 1e3
        size = m["file_bytes"]
        return {"start_to_ready_s": ready_s, "upload_s": m["upload_s"], "healthz_p50_ms": float(np.median(a)),
                "healthz_p99_ms": float(np.percentile(a, 99)), "healthz_max_ms": float(a.max()), "healthz_n": len(a),
                "peak_rss_growth_over_file": (m["peak_rss"] - m["rss_before"]) / size,
                "server_process_peak_growth_over_file": (m["server_peak_rss"] - m["server_rss_before"]) / size,
                "rss_after_mb": m["rss_after"] >> 20, "rss_before_mb": m["rss_before"] >> 20,
                "duplicate_s": m["duplicate_s"], "sha256_s": m["sha256_s"],
                "duplicate_over_hash_s": m["duplicate_s"] - m["sha256_s"]}
    finally:
        proc.terminate()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "layercast-perf-models" / "bert.onnx")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [once(args.repo.resolve(), args.model, Path(tmp)) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(json.dumps({"repo": str(args.repo), "model": str(args.model), "median": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
