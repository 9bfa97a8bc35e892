"""Cross-GPU transfer by roofline ratio (:mod:`app.predictor.transfer`) as served by the shipped predictor."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from app.core.costs import layer_cost
from app.core.features import FeatureInput, layer_features_batch
from app.core.ir import Layer
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeQuery
from app.predictor.registry import load_predictor
from app.predictor.transfer import extrapolates, reference_weights
from app.training.dataset import justus_conv_layer

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def _conv() -> Layer:
    return justus_conv_layer(batch=32, size=56, kernel=3, stride=1, c_in=64, c_out=64, padding="same", use_bias=True,
                      activation="none")  # fmt: skip


def _q(layer: Layer, hw_id: str) -> LayerTimeQuery:
    return LayerTimeQuery(layer, layer_cost(layer), load_catalog()[hw_id], "training", "adam")


@pytest.fixture(scope="module")
def predictor():
    return load_predictor(MODELS_DIR)


@pytest.mark.parametrize("hw_id", ["v100-sxm2-16gb", "h100-sxm"])
def test_conv_on_faster_unseen_gpu_uses_the_transfer_path(predictor, hw_id: str) -> None:
    (est,) = predictor.estimate([_q(_conv(), hw_id)])
    assert est.method == "learned" and est.out_of_distribution
    assert any("by roofline ratio" in n and n.startswith("transferred from") for n in est.notes), est.notes
    assert est.forward_ms > 0 and est.backward_ms > 0 and est.update_ms > 0
    assert est.total_ms_p10 <= est.total_ms <= est.total_ms_p90
    # faster hardware than every training GPU: not slower than the fastest training GPU's prediction
    (p100,) = predictor.estimate([_q(_conv(), "p100")])
    assert est.total_ms < p100.total_ms


def test_prediction_on_a_training_gpu_is_unchanged(predictor) -> None:
    (est,) = predictor.estimate([_q(_conv(), "p100")])
    assert not any("roofline ratio" in n for n in est.notes)
    # exactly the learned model's own train-step output
    layer = _conv()
    hw = load_catalog()["p100"]
    feats = layer_features_batch([FeatureInput(layer, layer_cost(layer), hw, "train_step", "adam")])
    p50 = float(np.exp(predictor.learned.run_features(feats)[0, 1]))
    assert est.total_ms == pytest.approx(p50, rel=1e-5)


@pytest.mark.parametrize("hw_id", ["p100", "gtx-1080-ti", "k80"])
def test_renamed_training_gpu_gives_the_same_time(predictor, hw_id: str) -> None:
    hw = load_catalog()[hw_id]
    renamed = dataclasses.replace(hw, id=f"{hw_id}-renamed", name=f"{hw.name} (renamed)")
    q = _q(_conv(), hw_id)
    (ref,) = predictor.estimate([q])
    (est,) = predictor.estimate([dataclasses.replace(q, hardware=renamed)])
    assert est.out_of_distribution  # unseen id
    assert est.total_ms == pytest.approx(ref.total_ms, rel=1e-5)
    assert est.forward_ms == pytest.approx(ref.forward_ms, rel=1e-5)


def test_reference_weights_and_gate() -> None:
    cat = load_catalog()
    refs = [cat[h] for h in ("gtx-1080-ti", "k40", "k80", "m60", "p100")]
    w = reference_weights(cat["p100"], refs, "weighted")
    assert w[-1] == 1.0 and w.sum() == pytest.approx(1.0)
    w = reference_weights(cat["v100-sxm2-16gb"], refs, "weighted")
    assert w.sum() == pytest.approx(1.0) and int(np.argmax(w)) in (0, 4)
    assert extrapolates(cat["h100-sxm"], refs) and not extrapolates(cat["titan-xp"], refs)
    assert not extrapolates(cat["p100"], refs)
