"""Metrics, baselines and the ``layercast evaluate`` command on a tiny model (< 60 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from app.training.dataset import load_from_database  # noqa: E402
from app.training.evaluate import e2e_block, fit_overhead, overhead_helps  # noqa: E402
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


def _e2e_rows(offsets: dict[str, float]) -> list[dict[str, float | str]]:
    return [{"arch": a, "batch_size": 8, "measured_ms": s + c, "learned_sum_ms": s, "learned_sum_p10_ms": s / 2,
             "learned_sum_p90_ms": s * 2, "roofline_sum_ms": s / 3, "layers": 10, "train_flops": 1e9}
            for a, c in offsets.items() for s in (20.0, 50.0)]  # fmt: skip


def test_overhead_is_used_only_where_it_helps_leave_one_model_out() -> None:
    # a shared 5 ms per-iteration overhead: adding it (fitted on the other models) removes the error
    shared = _e2e_rows({"a": 5.0, "b": 5.0, "c": 5.0, "d": 5.0})
    assert overhead_helps(shared)
    block = e2e_block(shared, None)
    assert all(r["overhead_used"] for r in block["rows"])
    assert block["summary"]["learned_calibrated_ms"]["median_abs_error_pct"] < 1e-9
    # offsets of either sign: the median offset fitted on the others makes most models worse -> plain sum
    mixed = _e2e_rows({"a": 6.0, "b": -6.0, "c": 6.0, "d": -6.0, "e": 0.0})
    assert not overhead_helps(mixed)
    block = e2e_block(mixed, None)
    assert not any(r["overhead_used"] for r in block["rows"])
    s = block["summary"]
    assert s["learned_calibrated_ms"] == s["learned_sum_ms"] and s["overhead_all_models"]["overhead_ms"] == 0.0
    assert not overhead_helps(shared[:4])  # two architectures: nothing to fit on and test against


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


@pytest.fixture(scope="module")
def kernels_training_db(tmp_path_factory: pytest.TempPathFactory, seed_dir: Path) -> str:
    """SQLite URL with the first rows of every Justus, NeuSight and Vidur file and the synthetic CPU shard."""
    from tests.helpers import import_measurements

    url = f"sqlite:///{tmp_path_factory.mktemp('kernels-training-db') / 'measurements.db'}"
    import_measurements(url, "justus", "--limit", "40")
    import_measurements(url, "neusight", "--limit", "30")
    import_measurements(url, "vidur", "--limit", "20")
    import_measurements(url, "profiler", "--data-dir", str(seed_dir))
    return url


@needs_data
def test_evaluate_writes_report_with_targets_and_baselines(tmp_path: Path, kernels_training_db: str) -> None:
    models = tmp_path / "models"
    assert train_main(["--database-url", kernels_training_db, "--out-dir", str(models), "--epochs", "1",
                       "--ensemble", "1", "--hidden", "8", "--depth", "1", "--version", "t",
                       "--no-logo"]) == 0  # fmt: skip
    assert (models / "layer-time-mlp-t.loss.png").read_bytes()[:4] == b"\x89PNG"  # the loss curve, beside the JSON
    out = tmp_path / "reports"
    assert evaluate_main(["--models-dir", str(models), "--previous", "", "--database-url", kernels_training_db,
                          "--out-dir", str(out), "--logo-epochs", "1", "--no-e2e"]) == 0  # fmt: skip
    rep = json.loads((out / "evaluation.json").read_text())
    assert (out / "evaluation_errors.png").read_bytes()[:4] == b"\x89PNG"  # predicted vs measured per device
    held = rep["held_out"]
    assert {"learned", "roofline", "flops50", "lookup"} <= set(held)
    assert held["learned"]["n"] == held["n"] and held["roofline"]["answered_pct"] > 95  # the same rows
    assert "coverage_80_pct" in held["learned"]
    assert set(held["learned_by"]["source"]) == {"justus", "neusight", "vidur", "cpu"}
    # never faster than physics; the pure roofline is the floor itself
    assert held["learned_below_roofline_pct"] == 0.0 and held["roofline_below_roofline_pct"] == 0.0
    logo = rep["logo"]
    assert "Ampere (GA102)" in logo["per_gpu"] and {"justus", "neusight", "vidur"} <= set(logo["by_source"])
    assert logo["vidur_a100_a40"]["n"] > 0
    assert set(rep["targets"]) >= {"logo_neusight_mape_pct", "logo_justus_mape_pct", "below_roofline_pct"}
    assert rep["targets"]["below_roofline_pct"]["reached"] is True
    md = (out / "evaluation.md").read_text()
    assert "## Targets" in md and "Leave-one-GPU-out" in md and "lookup table" in md and "FLOPs at 50 %" in md
    # only the two Vidur folds: the same fold results, nothing else retrained, and the report says so
    vidur = ["Ampere (GA100)", "Ampere (GA102)"]
    quick = tmp_path / "quick"
    assert evaluate_main(["--models-dir", str(models), "--previous", "", "--database-url", kernels_training_db,
                          "--out-dir", str(quick), "--logo-epochs", "1", "--no-e2e", "--logo-gpus", *vidur]) == 0
    q = json.loads((quick / "evaluation.json").read_text())["logo"]
    assert sorted(q["per_gpu"]) == vidur and q["only_folds"] == vidur
    assert q["vidur_a100_a40"] == logo["vidur_a100_a40"]  # the folds do not depend on which others run
    assert "Only the folds Ampere (GA100), Ampere (GA102)" in (quick / "evaluation.md").read_text()


def test_evaluate_rejects_an_unknown_gpu_chip_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert evaluate_main(["--database-url", "sqlite:////nonexistent/x.db", "--logo-gpus", "Ampere (GA999)"]) == 2
    err = capsys.readouterr().err
    assert "Ampere (GA999)" in err and "Ampere (GA100)" in err  # names the bad chip and the known ones


def test_e2e_rebuilds_the_graph_fused_as_the_api_serves_it() -> None:
    """A whole BERT iteration is predicted over the layers the API costs for PyTorch eager on a CPU: the graph
    fused as a CPU runs it (Erf-GELU chains, bias adds; the attention core as its parts), not the raw ONNX
    nodes, and the loss layer the measured step includes."""
    from app.core.analysis import analyze
    from app.core.hardware import hardware_from_dict
    from app.core.onnx_import import import_onnx
    from app.predictor.onnx_model import read_metadata
    from app.profiler.e2e import export_onnx
    from app.training.evaluate import DEFAULT_MODELS_DIR, e2e_predictions

    snapshot = read_metadata(DEFAULT_MODELS_DIR / "layer-time-mlp-3.json")["training_hardware"]
    cpu = hardware_from_dict(next(v for v in snapshot.values() if v.get("kind") == "cpu"))
    record = {"arch": "bert_4l_256", "batch_size": 1, "train_step_ms": 100.0, "optimizer": "adamw",
              "precision": "fp32", "software_stack": "pytorch-eager"}
    rows = e2e_predictions([record], models_dir=DEFAULT_MODELS_DIR, stem="layer-time-mlp-3", cpu_hardware=cpu,
                           log=lambda s: None)  # fmt: skip
    g = import_onnx(export_onnx("bert_4l_256"), batch_size=1)
    fused = analyze(g, software_stack="pytorch-eager", hardware_kind="cpu")
    raw = analyze(g)
    n_fused = sum(c.supported for c in fused.costs)
    assert "gelu" in fused.fusion_rules and "attention" not in fused.fusion_rules
    assert "error" not in rows[0] and n_fused < sum(c.supported for c in raw.costs)
    assert rows[0]["layers"] == n_fused + 1 and rows[0]["loss_ms"] > 0  # + the loss layer


def test_the_previous_predictor_defaults_to_the_artifact_created_before_and_a_missing_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from app.training.evaluate import previous_stem_of

    src = Path(__file__).resolve().parents[2] / "models"
    for i, stem in enumerate(("layer-time-mlp-4", "layer-time-mlp-5")):
        meta = json.loads((src / f"{stem}.json").read_text())
        meta["created_unix_s"] = 1000 + i
        (tmp_path / f"{stem}.json").write_text(json.dumps(meta))
        shutil.copy(src / meta["onnx_file"], tmp_path / meta["onnx_file"])
    assert previous_stem_of(tmp_path, "layer-time-mlp-5") == "layer-time-mlp-4"
    assert previous_stem_of(tmp_path, "layer-time-mlp-4") is None
    assert evaluate_main(["--models-dir", str(tmp_path), "--previous", "layer-time-mlp-1", "--no-logo",
                          "--no-e2e"]) == 2
    assert "no artifact layer-time-mlp-1.json" in capsys.readouterr().err


def _kernel_rows(gpu: str, floors_ms: np.ndarray, times_ms: np.ndarray, families: list[str]) -> Any:
    """Synthetic NeuSight test rows of one GPU: only what :func:`host_floor_block` reads is meaningful."""
    from app.core.features import RAW_FIELDS, raw_index
    from app.training.dataset import TrainingRows

    n = len(floors_ms)
    raw = np.zeros((n, len(RAW_FIELDS)))
    raw[:, raw_index("floor_ms")] = floors_ms
    text = np.full(n, "", dtype=object)
    return TrainingRows(family=np.asarray(families, dtype=object), gpu=np.full(n, gpu, dtype=object), pass_=text,
                        optimizer=text, time_ms=np.asarray(times_ms, dtype=np.float64), config=text, raw=raw,
                        features=np.zeros((n, 1), dtype=np.float32), source=np.full(n, "neusight", dtype=object),
                        precision=text, software_stack=text, granularity=text, op_kind=text,
                        measurement_id=np.arange(n))


def test_host_floor_swaps_the_models_dispatch_floor_for_the_hosts_measured_one() -> None:
    """A model that predicts a 20 us floor on a host whose tiny calls take 40 us: with the 5 tiniest adds timed,
    every row gets the host's floor (q = 1: shifted by 20 us), the big rows barely move under q = 4, the
    calibration rows are not scored, and a host without enough adds is skipped."""
    from app.training.evaluate import host_dispatch_adjusted_ms, host_floor_block

    floors = np.array([1e-4] * 6 + [1e-4] * 3 + [1.0, 2.0])
    fams = ["neusight:add"] * 6 + ["neusight:ln"] * 3 + ["neusight:add", "neusight:ln"]
    model = np.where(floors < 1e-3, 0.020, floors * 1.25)  # the fold model: 20 us floor, 80 % of bandwidth
    truth = np.where(floors < 1e-3, 0.040, floors * 1.25 + 0.020)  # the host: 40 us floor
    rows = _kernel_rows("gpu-a", floors, truth, fams)
    out = host_floor_block([("chip A", rows, np.log(np.stack([model, model, model], axis=1)))])
    assert out["host_ratio_by_gpu"] == {"chip A": 2.0}
    assert out["pooled"]["n"] == len(floors) - 5  # the 5 calibration adds are left out
    assert out["pooled"]["host_floor_q1_mape_pct"] == pytest.approx(0.0, abs=1e-6)  # the shift is exact here
    assert out["pooled"]["blind_mape_pct"] > 10
    assert host_dispatch_adjusted_ms(np.array([2.5]), np.array([0.02]), 2.0, 4.0)[0] == pytest.approx(2.5, rel=1e-6)
    few = _kernel_rows("gpu-b", floors[6:], truth[6:], fams[6:])
    assert host_floor_block([("chip B", few, np.log(np.stack([model[6:]] * 3, axis=1)))]) == {"n": 0}
    with pytest.raises(ValueError):
        host_dispatch_adjusted_ms(np.array([1.0]), np.array([0.1]), 0.0, 1.0)
