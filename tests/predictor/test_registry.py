"""The shipped predictor artifact (``models/``) loads without torch and routes layers correctly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.core.costs import layer_cost
from app.core.hardware import HardwareSpec
from app.core.ir import Layer, OpKind, Tensor
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeQuery, split_training_step
from app.predictor.registry import list_versions, load_predictor
from app.predictor.roofline import RooflinePredictor
from app.training.justus import conv_layer, dense_layer

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def predictor():
    return load_predictor(MODELS_DIR)


def _q(layer: Layer, hw_id: str, mode: str = "training", optimizer: str = "adam") -> LayerTimeQuery:
    hw = load_catalog()[hw_id]
    return LayerTimeQuery(layer, layer_cost(layer), hw, mode, optimizer if mode == "training" else "none")


def _conv() -> Layer:
    return conv_layer(
        batch=32,
        size=56,
        kernel=3,
        stride=1,
        c_in=64,
        c_out=64,
        padding="same",
        use_bias=True,
        activation="none",
    )


def _softmax() -> Layer:
    x = Tensor("x", (32, 1000))
    return Layer("sm", "Softmax", OpKind.SOFTMAX, (x,), (Tensor("y", (32, 1000)),))


def _lstm() -> Layer:
    return Layer(
        "lstm", "LSTM", OpKind.RECURRENT, (Tensor("x", (35, 20, 256)),), (Tensor("y", (35, 20, 512)),),
        weights=(Tensor("w", (4 * 512, 256)), Tensor("r", (4 * 512, 512))),
        attrs={"macs": 35 * 20 * 4 * 512 * (256 + 512)},
    )  # fmt: skip


def test_serving_does_not_import_torch(predictor) -> None:
    assert predictor.version.startswith("layer-time-mlp-")
    assert "torch" not in sys.modules or "app.training.train" in sys.modules


def test_conv_on_p100_is_learned_and_consistent(predictor) -> None:
    (est,) = predictor.estimate([_q(_conv(), "p100")])
    assert est.method == "learned"
    assert not est.out_of_distribution, est.notes
    assert est.forward_ms > 0 and est.backward_ms > 0 and est.update_ms > 0
    assert est.total_ms_p10 <= est.total_ms <= est.total_ms_p90
    assert est.total_ms_p90 / est.total_ms_p10 < 5


def test_inference_has_no_backward_or_update(predictor) -> None:
    (est,) = predictor.estimate([_q(dense_layer(batch=64, in_features=1024, out_features=1024,
                                                 activation="none"), "k80", mode="inference")])  # fmt: skip
    assert est.method == "learned"
    assert est.backward_ms == 0 and est.update_ms == 0 and est.forward_ms > 0
    assert est.total_ms_p10 <= est.forward_ms <= est.total_ms_p90


def test_larger_layer_takes_longer(predictor) -> None:
    small, big = predictor.estimate(
        [_q(dense_layer(batch=64, in_features=512, out_features=512, activation="none"), "p100"),
         _q(dense_layer(batch=64, in_features=4096, out_features=4096, activation="none"), "p100")]
    )  # fmt: skip
    assert big.total_ms > small.total_ms


@pytest.mark.parametrize("layer", [_softmax(), _lstm()], ids=["softmax", "lstm"])
def test_other_op_kinds_fall_back_to_roofline(predictor, layer: Layer) -> None:
    (est,) = predictor.estimate([_q(layer, "p100")])
    assert est.method == "roofline"
    assert est.total_ms > 0 and est.total_ms_p10 < est.total_ms < est.total_ms_p90


def test_cpu_falls_back_to_roofline(predictor) -> None:
    hw = HardwareSpec(
        id="local", name="test CPU", vendor="x", kind="cpu", peak_flops_per_s={"fp32": 5e11},
        memory_bytes=16e9, memory_bandwidth_bytes_per_s=20e9, compute_units=8,
    )  # fmt: skip
    layer = _conv()
    (est,) = predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none")])
    assert est.method == "roofline"
    assert est.forward_ms > 0


def test_unseen_gpu_is_flagged_out_of_distribution(predictor) -> None:
    est_h100, est_p100 = predictor.estimate([_q(_conv(), "h100-sxm"), _q(_conv(), "p100")])
    assert est_h100.method == "learned" and est_h100.out_of_distribution
    assert any("h100-sxm" in n for n in est_h100.notes)
    assert est_h100.total_ms > 0


def test_mixed_batch_keeps_query_order(predictor) -> None:
    out = predictor.estimate([_q(_softmax(), "p100"), _q(_conv(), "p100"), _q(_lstm(), "k40")])
    assert [e.method for e in out] == ["roofline", "learned", "roofline"]


def test_unsupported_layer_is_rejected(predictor) -> None:
    layer = Layer("u", "Weird", OpKind.UNSUPPORTED, (Tensor("x", (1, 4)),), (Tensor("y", (1, 4)),))
    with pytest.raises(ValueError):
        predictor.estimate([_q(layer, "p100")])
    with pytest.raises(ValueError):
        RooflinePredictor().estimate([_q(layer, "p100")])


def test_shipped_metadata_reports_held_out_metrics_better_than_baselines(predictor) -> None:
    meta = predictor.learned.metadata
    test = meta["metrics_test"]
    learned = test["learned"]["mape_pct"]
    assert 0 < learned < test["baseline_flop_linear_per_gpu"]["mape_pct"]
    assert learned < test["baseline_roofline_fitted"]["mape_pct"]
    assert test["learned"]["n"] == test["baseline_flop_linear_per_gpu"]["n"]  # same rows
    assert 60 <= test["learned"]["coverage_80_pct"] <= 95
    assert set(meta["metrics_leave_one_gpu_out"]) >= {"k40", "k80", "m60", "gtx-1080-ti", "p100"}
    assert sum(1 for v in list_versions(MODELS_DIR) if v.current) == 1


def test_split_training_step_keeps_components_positive() -> None:
    f, b, u = split_training_step(total_ms=1.0, forward_ms=0.9, update_ms=0.3, backward_min_ms=0.1)
    assert f > 0 and b >= 0.1 - 1e-12 and u > 0
    assert f + b + u == pytest.approx(1.0)
    assert split_training_step(total_ms=3.0, forward_ms=1.0, update_ms=0.5, backward_min_ms=0.1) == (
        1.0,
        1.5,
        0.5,
    )
