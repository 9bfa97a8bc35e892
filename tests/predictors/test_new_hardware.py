"""A device with no measurements before (issue 10 item 6): the next retrain registers a candidate fine-tuned
from production's weights for it (no model trained from scratch), gated like any other on the same fresh
held-out split and frozen benchmark, and reports its held-out error against the number of its measurements
(Syed & Srinivasan 2021). On a real GPU held out of production: NeuSight's T4 linear-layer kernels,
fine-tuned from a model that saw the Justus GPUs and NeuSight's P4 but never a T4. Measured (seed 0, 3 draws
per point, the 215 T4 rows of the retrain's held-out split, SQLite and PostgreSQL alike): production 13.5 %
MAPE, the fine-tuned candidate (775 T4 training rows, the 2,251 training rows of the known GPUs replayed)
10.8 %; the curve at 25 / 50 / 100 / 200 T4 rows 12.2 / 11.0 / 11.1 / 10.8 %, the lookup table of the same
rows 84 / 57 / 39 / 29 %. (Before layer-time-mlp-4's recipe, production was 19.3 % and the candidate 10.7 %:
the one-member test model now reads v3's features out of the mixed recipe's 71-column row, and that other
random initialisation lands 6 points better on the unseen T4; the fine-tuned figures did not move. The
factors below are 0.85, not 0.8 / 0.7, for that reason.) The gate then rejects that candidate: on the
frozen benchmark its P4 MAPE (16.9 %) is more than 10 % above production's (13.9 %; both measured before
layer-time-mlp-4's recipe): the tiny test model forgets some of the other
NeuSight GPU (at full scale the same path is promoted: reports/new_hardware_t4.md). Past 25 rows the tiny
model's own noise floor dominates, so only the ends of the curve are asserted to fall."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

pytest.importorskip("torch")

from app.db import make_engine, make_sessionmaker  # noqa: E402
from app.measurements.neusight import iter_neusight  # noqa: E402
from app.measurements.service import import_records  # noqa: E402
from app.predictor.metadata import sha256_file  # noqa: E402
from app.predictors import service  # noqa: E402
from app.predictors.models import RetrainRun  # noqa: E402
from app.training import new_hardware, retrain  # noqa: E402
from app.training.retrain import RetrainConfig, run_retrain  # noqa: E402
from tests.helpers import SHARED_DATA  # noqa: E402

NEUSIGHT = SHARED_DATA / "neusight"
CFG = RetrainConfig(epochs=120, hidden=32, depth=2, ensemble=1, sources=("justus2018", "neusight"), cpu=False,
                    benchmark_fraction=0.1, finetune_epochs=30)  # fmt: skip


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


def test_new_gpu_gets_a_finetuned_candidate_and_a_learning_curve(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, store = db, tmp_path / "store"
    _import(url, "train_linear_P4.csv.gz", limit=600)  # NeuSight's linear kernels on one GPU only

    base = run_retrain(database_url=url, store_dir=store, cfg=CFG, log=lambda s: None)
    assert base["metrics"]["new_hardware"] == {}  # the shipped version knows every NeuSight GPU
    assert base["metrics"]["training"]["method"] == "scratch"
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

    def from_scratch(**_kwargs: object) -> dict[str, object]:
        raise AssertionError("a retrain that found new hardware trained a candidate from scratch")

    monkeypatch.setattr(retrain, "train_run", from_scratch)
    result = run_retrain(database_url=url, store_dir=store, cfg=CFG, log=lambda s: None)

    # the candidate: production's weights fine-tuned for the T4, registered, gated on the same splits
    assert result["metrics"]["training"] == {"method": "finetune", "base": prod.version, "hardware_ids": ["t4"],
                                             "reason": "hardware new to production: t4"}  # fmt: skip
    assert result["status"] in ("promoted", "rejected") and result["production_version"] == prod.version
    cand = _version(url, result["candidate_version"])
    assert "t4" in cand.training["training_hardware"] and cand.training["finetune"]["base"] == prod.version
    assert cand.training["finetune"]["rows"]["tuning"] > 200 and cand.weights_file is not None
    assert sha256_file(store / cand.weights_file) == cand.weights_sha256  # the next fine-tune's base
    t4 = {who: result["metrics"][who]["held_out"]["by_hardware"]["t4"] for who in ("candidate", "production")}
    assert t4["candidate"]["mape_pct"] < 0.85 * t4["production"]["mape_pct"], t4
    checks = {(c["split"], c["group"]): c for c in result["gate"]["checks"]}
    assert checks[("held_out", "hardware:t4")]["passed"] and ("benchmark", "overall") in checks
    assert result["gate"]["passed"] == all(c["passed"] for c in checks.values())
    assert result["status"] == ("promoted" if result["gate"]["passed"] else "rejected")
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.scalars(select(RetrainRun).where(RetrainRun.id == result["id"])).one()
            assert run.status == result["status"] and run.metrics["training"]["method"] == "finetune"
    finally:
        engine.dispose()

    # the learning curve of that same fine-tune, on the T4 rows of the same held-out split
    curve = result["metrics"]["new_hardware"]["t4"]
    ks = [p["k"] for p in curve["points"]]
    mape = {p["k"]: p["finetuned"]["mape_pct"] for p in curve["points"]}
    assert ks == [25, 50, 100, 200] and curve["held_out"] == t4["candidate"]["n"] >= 150
    assert curve["base"]["mape_pct"] == pytest.approx(t4["production"]["mape_pct"], rel=1e-3)
    assert all(p["finetuned"]["n"] == curve["held_out"] for p in curve["points"])
    # error falls with the number of the new GPU's measurements, from production's own (k = 0) down
    assert mape[200] < mape[25] < curve["base"]["mape_pct"], (curve["base"]["mape_pct"], mape)
    assert mape[200] < 0.85 * curve["base"]["mape_pct"]
    assert all(p["lookup_table"]["mape_pct"] > p["finetuned"]["mape_pct"] for p in curve["points"])
    table = new_hardware.markdown(result["metrics"]["new_hardware"])
    assert "| t4 | 200 |" in table and "| t4 | 0 |" in table


def _version(url: str, version: str) -> service.ArtifactMetadata:  # type: ignore[name-defined]
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            return service.metadata_of(service.get_version(session, version))
    finally:
        engine.dispose()
