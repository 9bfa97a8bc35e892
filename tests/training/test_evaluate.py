"""Metrics, baselines and the ``layercast evaluate`` command on a tiny model (< 60 s)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from app.training.dataset import load_from_database  # noqa: E402
from app.training.evaluate import fit_overhead  # noqa: E402
from app.training.evaluate import main as evaluate_main  # noqa: E402
from app.training.metrics import metrics, nearest_neighbour_predict, spearman  # noqa: E402
from app.training.train import main as train_main  # noqa: E402
from tests.helpers import SHARED_DATA  # noqa: E402

JUSTUS = SHARED_DATA / "justus2018"
needs_data = pytest.mark.skipif(not JUSTUS.is_dir(), reason="../shared/data/justus2018 not present")


def test_metrics_on_known_values() -> None:
    m = metrics(np.array([1.0, 2.0, 4.0]), np.array([1.05, 2.0, 2.0]), np.array([0.5, 1, 1]), np.array([2, 3, 3.0]))
    assert m["mape_pct"] == pytest.approx((5 + 0 + 50) / 3, abs=1e-3)
    assert m["within_10pct"] == pytest.approx(200 / 3, abs=1e-3)
    assert m["coverage_80_pct"] == pytest.approx(200 / 3, abs=1e-3) and m["above_p90_pct"] > 0
    assert spearman(np.arange(5.0), np.arange(5.0) ** 2) == pytest.approx(1.0)


def test_overhead_is_the_median_per_iteration_residual() -> None:
    rows = [{"measured_ms": s + c, "learned_sum_ms": s, "layers": 10} for s, c in ((10, 2), (40, 3), (5, 2.5))]
    assert fit_overhead(rows) == (1.0, pytest.approx(2.5))


@needs_data
def test_nearest_neighbour_lookup_answers_with_a_measured_time(justus_db: str) -> None:
    d = load_from_database(justus_db, sources=("justus2018",), sample_per_file=50, seed=0)
    tr, te = d.subset(np.arange(len(d)) % 2 == 0), d.subset(np.arange(len(d)) % 2 == 1)
    p = nearest_neighbour_predict(tr, te)
    ok = np.isfinite(p)
    assert ok.mean() > 0.9
    assert np.isin(p[ok], tr.time_ms).all()
    # an exact copy of the training rows is answered exactly
    np.testing.assert_array_equal(nearest_neighbour_predict(tr, tr), tr.time_ms)


@needs_data
def test_evaluate_writes_report_with_targets_and_baselines(tmp_path: Path, training_db: str) -> None:
    models = tmp_path / "models"
    assert train_main(["--database-url", training_db, "--out-dir", str(models),
                       "--sample", "60", "--epochs", "2", "--ensemble", "1", "--hidden", "16", "--depth", "1",
                       "--version", "t", "--no-logo"]) == 0  # fmt: skip
    out = tmp_path / "reports"
    assert evaluate_main(["--models-dir", str(models), "--database-url", training_db,
                          "--out-dir", str(out), "--sample", "60", "--logo-epochs", "1", "--logo-ensemble", "1",
                          "--no-e2e"]) == 0  # fmt: skip
    rep = json.loads((out / "evaluation.json").read_text())
    gpu, cpu = rep["held_out"]["gpu"], rep["held_out"]["cpu"]
    for block in (gpu, cpu):
        assert {"learned", "flop_linear", "roofline_pure", "roofline_fitted", "lookup_nn"} <= set(block)
        assert block["learned"]["n"] == block["roofline_pure"]["n"]  # same rows for every method
        assert "coverage_80_pct" in block["learned"]
    assert set(rep["logo"]["per_gpu"]) == {"gtx-1080-ti", "k40", "k80", "m60", "p100"}
    assert set(rep["targets"]) >= {"justus_random_mape_pct", "logo_mean_mape_pct", "cpu_random_mape_pct"}
    md = (out / "evaluation.md").read_text()
    assert "## Targets" in md and "Leave-one-GPU-out" in md and "lookup table" in md
