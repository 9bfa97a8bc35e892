"""``layercast retrain`` end to end on a tiny database of Justus rows, SQLite and PostgreSQL: a candidate
trained on corrupted timings is rejected and production keeps serving; a better candidate is promoted and
served by a running app without restart; a crash in training leaves production; the benchmark stays frozen;
measurements ingested through the API reach the candidate; scheduler actuals recorded against production
calibrate the next version's job estimates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

pytest.importorskip("torch")

from app.config import REPO_ROOT, Settings  # noqa: E402
from app.db import make_engine, make_sessionmaker  # noqa: E402
from app.main import create_app  # noqa: E402
from app.measurements.models import Measurement  # noqa: E402
from app.observability import REGISTRY  # noqa: E402
from app.predictors import service  # noqa: E402
from app.predictors.models import RetrainRun  # noqa: E402
from app.training import retrain  # noqa: E402
from app.training.dataset import load_from_database  # noqa: E402
from app.training.retrain import RetrainConfig, in_benchmark, run_retrain  # noqa: E402

TINY = RetrainConfig(epochs=120, hidden=32, depth=2, ensemble=1, sample=None, sources=("justus2018",), cpu=False,
                     benchmark_fraction=0.2)  # fmt: skip


def _scale_non_benchmark_times(url: str, factor: float, hardware_id: str = "p100") -> int:
    """Multiply the time of every non-benchmark row of ``hardware_id`` by ``factor`` (a broken profiler on
    one machine: the median loss shrugs off scattered outliers, not a whole device's rows)."""
    rows = load_from_database(url, sources=("justus2018",), hardware_ids=(hardware_id,))
    chosen = rows.measurement_id[~in_benchmark(rows.config, TINY.benchmark_fraction)]
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            session.execute(update(Measurement).where(Measurement.id.in_([int(i) for i in chosen]))
                            .values(time_ms_median=Measurement.time_ms_median * factor))  # fmt: skip
    finally:
        engine.dispose()
    return len(chosen)


def _production(url: str) -> str:
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            row = service.production(session)
            assert row is not None
            return row.version
    finally:
        engine.dispose()


def _promote(url: str, version: str) -> None:
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            service.promote(session, version)
    finally:
        engine.dispose()


def test_benchmark_membership_depends_on_the_key_only() -> None:
    keys = np.array([f"conv|{b}|32|3|1|16|32|same|True|relu" for b in range(400)])
    alone = in_benchmark(keys, 0.2)
    grown = in_benchmark(np.concatenate([keys, np.array([f"dense|{i}|8|8|none" for i in range(300)])]), 0.2)
    assert (grown[: len(keys)] == alone).all()
    assert 0.1 < alone.mean() < 0.3


def _runs_counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("layercast_retrain_runs_total", {"outcome": outcome}) or 0.0


def test_corrupted_candidate_is_rejected_and_production_kept(db: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    promoted, rejected = _runs_counted("promoted"), _runs_counted("rejected")
    first = run_retrain(database_url=db, store_dir=store, cfg=TINY, log=lambda s: None)
    _promote(db, first["candidate_version"])  # an operator accepts a clean tiny model as production
    good = first["candidate_version"]

    assert _scale_non_benchmark_times(db, 100.0) > 300
    result = run_retrain(database_url=db, store_dir=store, cfg=TINY, log=lambda s: None)
    assert result["status"] == "rejected"
    assert result["production_version"] == good and _production(db) == good
    bench = {who: result["metrics"][who]["benchmark"]["by_hardware"]["p100"]["mape_pct"]
             for who in ("candidate", "production")}  # fmt: skip
    assert bench["candidate"] > 10 * bench["production"]  # the frozen benchmark is clean: corruption shows
    failed = [c for c in result["gate"]["checks"] if not c["passed"]]
    assert any(c["split"] == "benchmark" and c["group"] == "hardware:p100" for c in failed)
    assert "worse than production" in result["reason"]
    outcomes = [first["status"], result["status"]]  # both runs are counted for /metrics
    assert _runs_counted("promoted") == promoted + outcomes.count("promoted")
    assert _runs_counted("rejected") == rejected + outcomes.count("rejected")
    engine = make_engine(db)
    try:
        with make_sessionmaker(engine)() as session:
            row = service.get_version(session, result["candidate_version"])
            assert row.status == "candidate"  # registered, never served
            assert service.metadata_of(row).watermark.max_measurement_id == result["watermark_measurement_id"]
            runs = session.scalars(select(RetrainRun).order_by(RetrainRun.id)).all()
            assert runs[-1].status == "rejected" and runs[-1].candidate_version == result["candidate_version"]
            assert runs[-1].metrics["production"]["held_out"]["overall"]["n"] > 0
    finally:
        engine.dispose()


def test_better_candidate_is_promoted_and_served_without_restart(db: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    _scale_non_benchmark_times(db, 100.0)
    bad = run_retrain(database_url=db, store_dir=store, cfg=TINY, log=lambda s: None)
    _promote(db, bad["candidate_version"])  # production is now a model trained on corrupted timings
    settings = Settings(database_url=db, models_dir=REPO_ROOT / "models", artifact_store=store, predictor_poll_s=0)
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").json()["predictor_version"] == bad["candidate_version"]
        _scale_non_benchmark_times(db, 0.01)  # the corruption is repaired (same seeded rows)
        result = run_retrain(database_url=db, store_dir=store, cfg=TINY, log=lambda s: None)
        assert result["status"] == "promoted", result["reason"]
        assert all(c["passed"] for c in result["gate"]["checks"])
        listed = client.get("/v1/predictors").json()
        assert listed["production"] == result["candidate_version"]
        r = client.post("/v1/predictions", json={"graph_id": _graph(client), "hardware_id": "p100",
                                                 "batch_size": 8, "mode": "inference"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["predictor_version"] == result["candidate_version"]


def _graph(client: TestClient) -> str:
    from tests.helpers import light_model

    upload = ("resnet50.onnx", light_model("resnet50"), "application/octet-stream")
    return str(client.post("/v1/graphs", files={"file": upload}).json()["id"])


def test_a_crash_during_training_leaves_production(db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before, failed = _production(db), _runs_counted("failed")

    def crash(**_kwargs: object) -> dict[str, object]:
        raise RuntimeError("killed mid-training")

    monkeypatch.setattr(retrain, "train_run", crash)
    with pytest.raises(RuntimeError, match="mid-training"):
        run_retrain(database_url=db, store_dir=tmp_path / "store", cfg=TINY, log=lambda s: None)
    assert _production(db) == before and _runs_counted("failed") == failed + 1
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".retrain-")]
    engine = make_engine(db)
    try:
        with make_sessionmaker(engine)() as session:
            [run] = session.scalars(select(RetrainRun)).all()
            assert run.status == "failed" and "mid-training" in (run.error or "")
    finally:
        engine.dispose()


def test_retrain_command_exit_code_reports_the_decision(db: str, tmp_path: Path) -> None:
    from app.cli import main as cli_main

    code = cli_main(["retrain", "--database-url", db, "--store", str(tmp_path / "store"), "--sources", "justus2018",
                     "--no-cpu", "--epochs", "2", "--hidden", "8", "--depth", "1", "--ensemble", "1"])  # fmt: skip
    engine = make_engine(db)
    try:
        with make_sessionmaker(engine)() as session:
            [run] = session.scalars(select(RetrainRun)).all()
    finally:
        engine.dispose()
    assert run.status in ("promoted", "rejected") and code == (0 if run.status == "promoted" else 3)
    assert run.metrics["candidate"]["benchmark"]["overall"]["n"] > 0


def test_ingested_rows_and_scheduler_actuals_reach_the_next_version(db: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    settings = Settings(database_url=db, models_dir=REPO_ROOT / "models", artifact_store=store, predictor_poll_s=0)
    with TestClient(create_app(settings)) as client:
        before = client.get("/healthz").json()["predictor_version"]
        # a CI job reports dense layers measured on a P100 (the JSON layer vocabulary), in one batch
        layers = [{"hardware_id": "p100", "source": "ci", "op_kind": "gemm", "pass": "forward", "precision": "fp32",
                   "software_stack": "tf1-session", "granularity": "layer", "batch_size": 16,
                   "config": {"input_shape": [n], "layer": {"op": "linear", "out_features": n}},
                   "time_ms_median": 0.05 + n * n * 16 * 2 / 9e12 * 1e3} for n in range(64, 64 + 40 * 16, 16)]
        assert client.post("/v1/measurements", json={"measurements": layers}).status_code == 201
        # a cluster where every job of this graph takes 1.8x production's estimate
        job = {"graph_id": _graph(client), "hardware_id": "p100", "batch_size": 32, "dataset_size": 20_000,
               "epochs": 1}  # fmt: skip
        p50 = client.post("/v1/job-estimates", json={"jobs": [job]}).json()["estimates"][0]["p50_s"]
        noise = (0.97, 1.03, 1.0, 0.99, 1.01, 1.0)
        r = client.post("/v1/job-estimates/actuals",
                        json={"actuals": [{**job, "measured_s": 1.8 * p50 * e} for e in noise]})  # fmt: skip
        assert r.status_code == 201 and r.json()["recorded"] == 6

        result = run_retrain(database_url=db, store_dir=store, cfg=TINY, log=lambda s: None)
        assert "ci" in result["metrics"]["config"]["sources"]
        assert result["metrics"]["job_calibration"]["actuals"] == 6
        ev = result["metrics"]["job_calibration"]
        assert ev["loo_mape_pct_calibrated"] < ev["loo_mape_pct_uncalibrated"]  # held out within the group
        _promote(db, result["candidate_version"])
        engine = make_engine(db)
        try:
            with make_sessionmaker(engine)() as session:
                rows = load_from_database(db, sources=("ci",))
                assert len(rows) == len(layers)  # the ingested rows are training rows
                fit = service.metadata_of(service.get_version(session, result["candidate_version"])).job_calibration
                assert sum(g.n for g in fit.groups.values()) == 6
        finally:
            engine.dispose()
        answer = client.post("/v1/job-estimates", json={"jobs": [job]}).json()
        assert answer["predictor_version"] == result["candidate_version"] != before
        [est] = answer["estimates"]
        # the new version never saw these actuals recorded, yet its estimate is calibrated by all six
        assert est["actuals"] == 6 and est["p50_s"] == pytest.approx(1.8 * p50, rel=0.1)
