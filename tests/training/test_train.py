"""Trainer details that serving depends on."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from app.training.train import MODEL_FEATURES, predict, train_model  # noqa: E402


def test_constant_columns_are_not_scaled_by_rounding_noise() -> None:
    """The hardware columns of a single CPU never vary; another device's values must not explode."""
    rng = np.random.default_rng(0)
    n, f = 512, len(MODEL_FEATURES)
    x = rng.normal(size=(n, f)).astype(np.float32)
    col = MODEL_FEATURES.index("hw_log_op_peak_flops_per_s")
    x[:, col] = np.float32(26.53103)  # constant, not exactly representable: float32 std is ~1e-3, not 0
    y = rng.normal(size=n)
    m = train_model(x, y, epochs=1, seed=0, hidden=8, depth=1, batch_size=128, log=lambda s: None)
    assert float(m.std[col]) == 1.0
    other = x[:4].copy()
    other[:, col] += 1.5  # a different device
    out = predict(m, other)
    assert np.isfinite(out).all() and np.abs(out).max() < 50


def test_family_balance_gives_each_source_its_share_and_families_sqrt_rows() -> None:
    """``source_family``: sources keep equal shares; within one, a family with 4x the rows gets 2x the weight."""
    from app.training.train import loss_weights

    class Rows:
        def __init__(self, family: np.ndarray, source: np.ndarray) -> None:
            self.family, self.source = family, source

        def __len__(self) -> int:
            return len(self.family)

    family = np.array(["neusight:bmm"] * 400 + ["neusight:add"] * 100 + ["conv"] * 500)
    source = np.array(["neusight"] * 500 + ["justus2018"] * 500)
    data = Rows(family, source)
    w = loss_weights(data, "source_family")  # type: ignore[arg-type]
    assert w.mean() == pytest.approx(1.0)
    assert w[:500].sum() == pytest.approx(w[500:].sum())  # each source half the loss
    assert w[:400].sum() == pytest.approx(2 * w[400:500].sum())  # sqrt(400) : sqrt(100)
    assert np.allclose(loss_weights(data, "source")[:500], 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        loss_weights(data, "family")  # type: ignore[arg-type]


def test_member_reads_only_its_active_features_and_keeps_the_mask_through_weights(tmp_path) -> None:
    """A member trained with ``active`` ignores every other column (a mixed ensemble's device-blind member
    must not see the hardware figures), and the mask survives save/load of the weights."""
    from app.training.train import Ensemble, KindHeads, load_weights, save_weights

    rng = np.random.default_rng(0)
    n, f = 512, len(MODEL_FEATURES)
    x = rng.normal(size=(n, f)).astype(np.float32)
    y = rng.normal(size=n) + x[:, MODEL_FEATURES.index("hw_log_clock_mhz")]
    active = [name for name in MODEL_FEATURES if not name.startswith("hw_")]
    m = train_model(x, y, epochs=2, seed=0, hidden=8, depth=1, batch_size=128, active=active, log=lambda s: None)
    other = x[:8].copy()
    for name in MODEL_FEATURES:
        if name.startswith("hw_"):
            other[:, MODEL_FEATURES.index(name)] += 3.0
    assert np.allclose(predict(m, x[:8]), predict(m, other), atol=1e-6)
    full = train_model(x, y, epochs=2, seed=0, hidden=8, depth=1, batch_size=128, log=lambda s: None)
    assert not np.allclose(predict(full, x[:8]), predict(full, other), atol=1e-3)
    path = tmp_path / "w.npz"
    save_weights(KindHeads(Ensemble([m]), None), path)
    back = load_weights(path, feature_names=MODEL_FEATURES, hidden=8, depth=1).gpu_head.members[0]
    assert np.allclose(predict(back, other), predict(m, other), atol=1e-6)
    with pytest.raises(ValueError, match="not in feature_names"):
        train_model(x, y, epochs=1, seed=0, hidden=8, depth=1, active=["nope"], log=lambda s: None)
