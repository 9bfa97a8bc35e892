"""The exported ONNX graph and the torch model agree on the same feature rows (DESIGN.md), and the
training command runs end to end on a small subsample. Needs torch (the ``train`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from app.core.features import FEATURE_NAMES  # noqa: E402
from app.predictor.registry import list_versions, load_predictor  # noqa: E402
from app.training.dataset import load_from_database  # noqa: E402
from app.training.train import (  # noqa: E402
    MODEL_FEATURES,
    OPSET,
    calibrate,
    export_onnx,
    main,
    model_inputs,
    predict,
    train_ensemble,
)
from tests.helpers import SHARED_DATA  # noqa: E402

DATA_DIR = SHARED_DATA / "justus2018"
pytestmark = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="../shared/data/justus2018 not present")


def test_onnxruntime_matches_torch_on_the_same_rows(tmp_path: Path, justus_db: str) -> None:
    import onnxruntime as ort

    data = load_from_database(justus_db, sources=("justus2018",), sample_per_file=60, seed=1)
    x = model_inputs(data)
    y = np.log(data.time_ms)
    # an ensemble of two members, as shipped: one ONNX graph averages them
    model = train_ensemble(x, y, n=2, epochs=3, seed=1, hidden=32, depth=2, batch_size=128, log=lambda s: None)
    calibrate(model, x, y)
    path = tmp_path / "m.onnx"
    export_onnx(model, path, len(MODEL_FEATURES))

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= OPSET
    dim0 = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param  # symbolic (dynamic) batch axis
    assert proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value == len(MODEL_FEATURES)

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"features": x.astype(np.float32)})[0]
    want = predict(model, x)
    assert got.shape == (len(x), 3)
    np.testing.assert_allclose(np.exp(got), np.exp(want), rtol=1e-4)
    assert (got[:, 0] <= got[:, 1]).all() and (got[:, 1] <= got[:, 2]).all()
    # never faster than physics: every quantile at or above the floor feature, in both runtimes
    floor = x[:, list(MODEL_FEATURES).index("log_floor_ms")]
    assert (got >= floor[:, None] - 1e-5).all() and (want >= floor[:, None] - 1e-5).all()
    # one row and many rows give the same answer (dynamic batch axis)
    np.testing.assert_allclose(sess.run(None, {"features": x[:1]})[0], got[:1], rtol=1e-5)


def test_train_command_writes_a_loadable_versioned_artifact(tmp_path: Path, justus_db: str) -> None:
    rc = main(
        ["--database-url", justus_db, "--no-cpu", "--out-dir", str(tmp_path), "--sample", "80", "--epochs", "2",
         "--hidden", "16", "--depth", "1", "--ensemble", "1", "--version", "t1", "--no-logo"]
    )  # fmt: skip
    assert rc == 0
    assert (tmp_path / "CURRENT").read_text().strip() == "layer-time-mlp-t1"
    versions = list_versions(tmp_path)
    assert [v.stem for v in versions] == ["layer-time-mlp-t1"] and versions[0].current
    predictor = load_predictor(tmp_path)
    assert predictor.version == "layer-time-mlp-t1"
    meta = predictor.learned.metadata
    assert meta["feature_names"] == list(MODEL_FEATURES)
    assert set(meta["feature_names"]) <= set(FEATURE_NAMES)
    assert meta["metrics_test_summary"]["justus"]["mape_pct"] > 0
    assert len(meta["training_data"]["files"]) == 10
    assert meta["applies_to"]["gpu"]["op_kinds"] == ["conv", "gemm"]
    assert meta["applies_to"]["gpu"]["stacks"] == ["pytorch-eager", "tf1-session"]
    # out-of-distribution ranges per hardware kind and op kind, one bound per model feature
    assert set(meta["feature_ranges"]["gpu"]) == {"conv", "gemm"}
    assert len(meta["feature_ranges"]["gpu"]["conv"]["min"]) == len(MODEL_FEATURES)


NEUSIGHT = SHARED_DATA / "neusight"
VIDUR = SHARED_DATA / "vidur"


@pytest.fixture(scope="module")
def kernels_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SQLite URL with the first rows of every Justus, NeuSight and Vidur file imported."""
    from tests.helpers import import_measurements

    url = f"sqlite:///{tmp_path_factory.mktemp('kernels-db') / 'measurements.db'}"
    import_measurements(url, "justus", "--limit", "60")
    import_measurements(url, "neusight", "--limit", "40")
    import_measurements(url, "vidur", "--limit", "30")
    return url


@pytest.mark.skipif(not (NEUSIGHT.is_dir() and VIDUR.is_dir()), reason="NeuSight/Vidur data not present")
def test_kernel_sources_widen_the_gpu_scope_and_logo_calibrates_the_interval(tmp_path: Path, kernels_db: str) -> None:
    rc = main(
        ["--database-url", kernels_db, "--no-cpu", "--out-dir", str(tmp_path), "--epochs", "1", "--hidden", "8",
         "--depth", "1", "--ensemble", "1", "--version", "t2"]
    )  # fmt: skip
    assert rc == 0
    meta = load_predictor(tmp_path).learned.metadata
    assert {"conv", "gemm", "matmul", "elementwise", "norm", "softmax", "embedding"} <= set(
        meta["applies_to"]["gpu"]["op_kinds"]
    )
    assert set(meta["metrics_test_summary"]) == {"justus", "neusight", "vidur"}
    assert "fp16" in meta["applies_to"]["gpu"]["measured_precision"]
    # one fold per GPU chip: the A100 variants of NeuSight and Vidur are one fold
    folds = {k for k in meta["metrics_leave_one_gpu_out_summary"] if k != "mean_mape_pct"}
    assert "Ampere (GA100)" in folds and "Ampere (GA102)" in folds and len(folds) == 11
    lo, hi = meta["model"]["gpu_interval_logo_factor"]
    assert lo > 0 and hi > 0
    assert meta["model"]["conformal_scales"]["gpu"] == pytest.approx(
        [a * b for a, b in zip(meta["model"]["in_distribution_scales"]["gpu"], (lo, hi), strict=True)]
    )
    assert (tmp_path / meta["weights_file"]).is_file()  # torch weights for layercast finetune
