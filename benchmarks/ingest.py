"""Benchmark of measurement ingestion (issue 10 item 1): batches of 5,000 measurements through
``POST /v1/measurements`` (fresh, and replayed by their ``Idempotency-Key``), cursor paging and the streamed
CSV export, on SQLite and (when reachable) PostgreSQL, side by side. Medians of repeated runs, in process
through the HTTP app (FastAPI TestClient: parsing, validation, serialisation included), one thread.

    python benchmarks/ingest.py [--repeats 5] [--postgres URL] [--out benchmarks/ingest.json]

``--postgres``: a SQLAlchemy URL of an existing database on a server where a scratch database may be created
(default: the local server of the tests, ``postgresql+psycopg://postgres@127.0.0.1:5432/test``; skipped when
it does not answer).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastapi.testclient import TestClient  # noqa: E402

from app.config import Settings  # noqa: E402
from app.main import create_app  # noqa: E402
from app.migrate import upgrade  # noqa: E402

BATCH = 5000


def _rows(run: int) -> list[dict[str, Any]]:
    return [{"hardware_id": "a100-sxm4-40gb", "source": "bench", "op_kind": "gemm", "pass": "forward",
             "software_stack": "pytorch-eager", "granularity": "kernel", "batch_size": 1 + (i % 64),
             "config": {"layer": {"op": "matmul", "m": 64 + i, "n": 512, "k": 1024}, "run": run},
             "time_ms_median": 0.01 + i * 1e-5, "context": {"framework": "torch 2.13", "driver": "550.54"},
             "measured_at": "2026-12-01T12:00:00Z"} for i in range(BATCH)]  # fmt: skip


def _median_s(times: list[float]) -> float:
    return round(statistics.median(times), 4)


def bench(url: str, repeats: int) -> dict[str, Any]:
    """Timings on the database at ``url`` (migrated here)."""
    upgrade(url)
    # anonymous callers may report measurements here (the default needs a key with the measurements scope)
    settings = Settings(database_url=url, models_dir=REPO / "models", open_scopes="read,graphs,measurements",
                        allowed_hosts="testserver", rate_limit="")
    post, replay, page, export = [], [], [], []
    with TestClient(create_app(settings)) as client:
        for run in range(repeats):
            body = {"measurements": _rows(run)}
            t = time.perf_counter()
            r = client.post("/v1/measurements", json=body, headers={"Idempotency-Key": f"bench-{run}"})
            post.append(time.perf_counter() - t)
            assert r.status_code == 201 and r.json()["count"] == BATCH, r.text
            t = time.perf_counter()
            r = client.post("/v1/measurements", json=body, headers={"Idempotency-Key": f"bench-{run}"})
            replay.append(time.perf_counter() - t)
            assert r.json()["replayed"]
        stored = repeats * BATCH
        for _ in range(repeats):
            t, cursor, seen = time.perf_counter(), None, 0
            while True:
                params: dict[str, Any] = {"limit": 1000, "source": "bench"}
                if cursor is not None:
                    params["cursor"] = cursor
                body_ = client.get("/v1/measurements", params=params).json()
                seen += body_["count"]
                if (cursor := body_["next_cursor"]) is None:
                    break
            page.append(time.perf_counter() - t)
            assert seen == stored
            t = time.perf_counter()
            text = client.get("/v1/measurements.csv", params={"source": "bench"}).text
            export.append(time.perf_counter() - t)
            assert text.count("\n") == stored + 1
    return {
        "post_5000_s": _median_s(post), "post_rows_per_s": round(BATCH / statistics.median(post)),
        "replay_5000_s": _median_s(replay),
        f"page_all_{stored}_by_cursor_s": _median_s(page), f"csv_export_{stored}_s": _median_s(export),
        "csv_rows_per_s": round(stored / statistics.median(export)),
        "runs": {"post_s": [round(x, 4) for x in post], "replay_s": [round(x, 4) for x in replay]},
    }  # fmt: skip


@contextmanager
def _postgres(admin: str) -> Iterator[str | None]:
    try:
        import psycopg
        from sqlalchemy.engine import make_url

        base = make_url(admin)
        libpq = base.set(drivername="postgresql").render_as_string(hide_password=False)
        name = f"layercast_bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(libpq, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except Exception as exc:  # noqa: BLE001 - no server: the PostgreSQL column is left out, said so
        print(f"PostgreSQL skipped: {exc}", file=sys.stderr)
        yield None
        return
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    """Run both backends and write the JSON (module docstring)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "ingest.json")
    a = p.parse_args(argv)
    out: dict[str, Any] = {"batch": BATCH, "repeats": a.repeats, "python": platform.python_version(),
                           "machine": platform.machine()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out["sqlite"] = bench(f"sqlite:///{Path(tmp) / 'bench.db'}", a.repeats)
    with _postgres(a.postgres) as url:
        if url is not None:
            out["postgresql"] = bench(url, a.repeats)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
