"""A device with no measurements before (issue 10 item 6): the next retrain fine-tunes production for it
and reports its held-out error against the number of its measurements (Syed & Srinivasan 2021), on a
real GPU held out of production: NeuSight's T4 linear-layer kernels, fine-tuned from a model that saw the
Justus GPUs and NeuSight's P4 but never a T4. Measured (seed 0, 3 draws per point, 217 held-out T4 rows):
production 19.6 % MAPE; fine-tuned on 25 / 50 / 100 / 200 T4 rows 12.9 / 13.2 / 12.8 / 12.1 %; the lookup
table of the same rows 55 / 41 / 34 / 30 %. Past 25 rows the tiny test model's own noise floor (~12 %)
dominates, so only the ends of the curve are asserted to fall."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from app.config import REPO_ROOT  # noqa: E402
from app.db import make_engine, make_sessionmaker  # noqa: E402
from app.measurements.neusight import iter_neusight  # noqa: E402
from app.measurements.service import import_records  # noqa: E402
from app.migrate import upgrade  # noqa: E402
from app.predictor.metadata import sha256_file  # noqa: E402
from app.predictors import service  # noqa: E402
from app.training import new_hardware  # noqa: E402
from app.training.retrain import RetrainConfig, run_retrain  # noqa: E402
from tests.helpers import SHARED_DATA  # noqa: E402

NEUSIGHT = SHARED_DATA / "neusight"
CFG = RetrainConfig(epochs=120, hidden=32, depth=2, ensemble=1, sources=("justus2018", "neusight"), cpu=False,
                    benchmark_fraction=0.1, curve_epochs=30)  # fmt: skip


def _import(url: str, *names: str, limit: int) -> None:
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            for name in names:
                import_records(session, records=iter_neusight(NEUSIGHT / name, limit=limit))
    finally:
        engine.dispose()


def _production(url: str) -> service.ArtifactMetadata:  # type: ignore[name-defined]
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            row = service.production(session)
            assert row is not None
            return service.metadata_of(row)
    finally:
        engine.dispose()


def test_new_gpu_learning_curve_falls_with_its_measurements(tmp_path: Path, justus_db: str) -> None:
    db = tmp_path / "m.db"
    shutil.copy(justus_db.removeprefix("sqlite:///"), db)
    url, store = f"sqlite:///{db}", tmp_path / "store"
    upgrade(url)
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            service.seed_from_models_dir(session, REPO_ROOT / "models", store)
    finally:
        engine.dispose()
    _import(url, "train_linear_P4.csv.gz", limit=600)  # NeuSight's linear kernels on one GPU only

    base = run_retrain(database_url=url, store_dir=store, cfg=CFG, log=lambda s: None)
    assert base["metrics"]["new_hardware"] == {}  # the shipped version knows every NeuSight GPU
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine).begin() as session:
            service.promote(session, base["candidate_version"])  # production: a model that never saw a T4
    finally:
        engine.dispose()
    prod = _production(url)
    assert "t4" not in prod.training["training_hardware"]
    # the torch weights travel with the ONNX file into the store, checksummed (the base of this fine-tune)
    assert prod.weights_file is not None and sha256_file(store / prod.weights_file) == prod.weights_sha256

    _import(url, "train_linear_T4.csv.gz", limit=1200)
    result = run_retrain(database_url=url, store_dir=store, cfg=CFG, log=lambda s: None)
    curve = result["metrics"]["new_hardware"]["t4"]
    ks = [p["k"] for p in curve["points"]]
    mape = {p["k"]: p["finetuned"]["mape_pct"] for p in curve["points"]}
    assert ks == [25, 50, 100, 200] and curve["held_out"] >= 150
    assert all(p["finetuned"]["n"] == curve["held_out"] for p in curve["points"])
    # error falls with the number of the new GPU's measurements, from production's own (k = 0) down
    assert mape[200] < mape[25] < curve["base"]["mape_pct"], (curve["base"]["mape_pct"], mape)
    assert mape[200] < 0.7 * curve["base"]["mape_pct"]
    assert all(p["lookup_table"]["mape_pct"] > p["finetuned"]["mape_pct"] for p in curve["points"])
    table = new_hardware.markdown(result["metrics"]["new_hardware"])
    assert "| t4 | 200 |" in table and "| t4 | 0 |" in table
