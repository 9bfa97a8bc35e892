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
