"""``layercast worker``: two workers started at once run one retrain (SQLite lease row, PostgreSQL advisory
lock); an API request is picked up; an expired lease of a crashed worker does not block; a due check."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.config import REPO_ROOT, Settings
from app.db import make_engine, make_sessionmaker, utcnow
from app.main import create_app
from app.migrate import upgrade
from app.predictors.models import LeaseLock, RetrainRun
from app.training.retrain import RetrainConfig
from app.training.worker import WorkerConfig, retrain_lock, run_once

CFG = RetrainConfig(epochs=1)
WCFG = WorkerConfig(min_new_measurements=10**9, interval_s=None)


def _request(url: str) -> int:
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            run = RetrainRun(status="requested", trigger="api", metrics={}, gate={})
            session.add(run)
            session.flush()
            return run.id
    finally:
        engine.dispose()


def test_two_workers_at_once_run_one_retrain(database_url: str, tmp_path: Path) -> None:
    upgrade(database_url)
    _request(database_url)
    started: list[int | None] = []
    barrier = threading.Barrier(2)

    results: list[dict[str, Any] | None] = []

    def slow_retrain(**kwargs: Any) -> dict[str, Any]:
        started.append(kwargs["run_id"])
        deadline = time.monotonic() + 20
        while not results and time.monotonic() < deadline:  # hold the lock until the other worker gave up
            time.sleep(0.05)
        return {"status": "rejected"}

    def worker() -> None:
        barrier.wait()
        results.append(run_once(database_url=database_url, store_dir=tmp_path, cfg=CFG, wcfg=WCFG,
                                retrain=slow_retrain))  # fmt: skip

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1
    assert sorted(r is None for r in results) == [False, True]


def test_a_crashed_workers_lease_expires(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            session.add(LeaseLock(name="retrain", holder="dead", expires_at=utcnow() - timedelta(seconds=1)))
        with retrain_lock(engine) as got:
            assert got
            with retrain_lock(engine) as second:
                assert not second
        with make_sessionmaker(engine)() as session:
            assert session.scalars(select(LeaseLock)).all() == []  # released
    finally:
        engine.dispose()


def test_api_request_is_recorded_and_taken_by_the_worker(sqlite_url: str, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, models_dir=REPO_ROOT / "models", admin_key="k" * 32)
    with TestClient(create_app(settings)) as client:
        assert client.post("/v1/predictors/retrain").status_code == 401
        r = client.post("/v1/predictors/retrain", headers={"Authorization": "Bearer " + "k" * 32})
        assert r.status_code == 202 and r.json()["status"] == "requested"
        run_id = r.json()["id"]
    seen: list[tuple[str, int | None]] = []

    def record(**kwargs: Any) -> dict[str, Any]:
        seen.append((kwargs["trigger"], kwargs["run_id"]))
        raise RuntimeError("training blew up")

    out = run_once(database_url=sqlite_url, store_dir=tmp_path, cfg=CFG, wcfg=WCFG, retrain=record)
    assert seen == [("api", run_id)] and out == {"status": "failed", "trigger": "api"}
    # a failed request is not picked up forever; nothing else is due
    assert run_once(database_url=sqlite_url, store_dir=tmp_path, cfg=CFG, wcfg=WCFG, retrain=record) is None


def test_a_run_orphaned_by_a_dead_worker_is_marked_failed(sqlite_url: str, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            session.add(RetrainRun(status="running", trigger="schedule", metrics={}, gate={}))
        assert run_once(database_url=sqlite_url, store_dir=tmp_path, cfg=CFG, wcfg=WCFG) is None
        with make_sessionmaker(engine)() as session:
            [run] = session.scalars(select(RetrainRun)).all()
            assert run.status == "failed" and "stopped" in (run.error or "")
        with retrain_lock(engine) as got:  # a running retrain blocks the command
            assert got
            from app.training.retrain import main as retrain_main

            assert retrain_main(["--database-url", sqlite_url, "--store", str(tmp_path)]) == 4
    finally:
        engine.dispose()


def test_schedule_makes_a_run_due(sqlite_url: str, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    calls: list[str] = []
    wcfg = WorkerConfig(min_new_measurements=10**9, interval_s=3600)
    run_once(database_url=sqlite_url, store_dir=tmp_path, cfg=CFG, wcfg=wcfg,
             retrain=lambda **kw: calls.append(kw["trigger"]) or {})  # fmt: skip
    assert calls == ["schedule"]


@pytest.mark.parametrize("n_new, due", [(5, False), (20, True)])
def test_new_measurements_make_a_run_due(sqlite_url: str, tmp_path: Path, n_new: int, due: bool) -> None:
    from app.measurements.models import Measurement
    from app.predictor.metadata import ArtifactMetadata, Watermark
    from app.predictors import service

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            from app.hardware.service import seed_builtin

            seed_builtin(session)
            meta = ArtifactMetadata(name="m", version="m-1", onnx_file="m.onnx", sha256="0" * 64, feature_names=[],
                                    watermark=Watermark(max_measurement_id=0), training={})  # fmt: skip
            service.register(session, meta, status="production")
            for _ in range(n_new):
                session.add(Measurement(hardware_id="p100", source="t", op_kind="gemm", pass_="forward",
                                        batch_size=1, config={}, time_ms_median=1.0, context={}))  # fmt: skip
    finally:
        engine.dispose()
    calls: list[str] = []
    run_once(database_url=sqlite_url, store_dir=tmp_path, cfg=CFG,
             wcfg=WorkerConfig(min_new_measurements=10, interval_s=None),
             retrain=lambda **kw: calls.append(kw["trigger"]) or {})  # fmt: skip
    assert calls == (["new_measurements"] if due else [])
