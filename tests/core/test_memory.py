"""Training memory footprint by component and precision; largest batch that fits."""

from __future__ import annotations

import pytest

from app.core.analysis import analyze
from app.core.json_import import import_json
from app.core.memory import HEADROOM, fits, footprint, largest_batch_that_fits

DOC = {"input_shape": [3, 32, 32], "layers": [
    {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"},
    {"op": "flatten"}, {"op": "linear", "out_features": 10}]}
PARAMS = 16 * 27 + 16 + 16 * 1024 * 10 + 10


def _a(batch: int = 4):
    return analyze(import_json(DOC, batch_size=batch))


@pytest.mark.parametrize(("opt", "states"), [("sgd", 0), ("momentum", 1), ("adam", 2), ("adamw", 2)])
def test_fp32_components(opt: str, states: int) -> None:
    fp = footprint(_a(), mode="training", optimizer=opt)
    assert fp.weights_bytes == fp.gradients_bytes == 4 * PARAMS
    assert fp.optimizer_state_bytes == 4 * states * PARAMS
    assert fp.master_weights_bytes == 0
    # saved for backward: conv input (graph input), relu output, flatten (view: 0), linear input
    act = 4 * (4 * 3 * 1024 + 4 * 16 * 1024 + 4 * 16 * 1024)
    assert fp.activations_bytes == act
    assert fp.total_bytes == 4 * PARAMS * (2 + states) + act


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_has_fp32_master_and_state_and_half_activations(precision: str) -> None:
    fp32 = footprint(_a(), mode="training", optimizer="adam")
    mixed = footprint(_a(), mode="training", optimizer="adam", precision=precision)
    assert mixed.weights_bytes == mixed.gradients_bytes == 2 * PARAMS
    assert mixed.master_weights_bytes == 4 * PARAMS
    assert mixed.optimizer_state_bytes == 8 * PARAMS  # two fp32 moments
    assert mixed.model_state_bytes == 16 * PARAMS == fp32.model_state_bytes  # ZeRO's 16 bytes/param
    assert mixed.activations_bytes * 2 == fp32.activations_bytes


def test_inference_has_no_gradients_or_state() -> None:
    fp = footprint(_a(), mode="inference", optimizer="adam")
    assert fp.gradients_bytes == fp.optimizer_state_bytes == 0
    assert fp.activations_bytes == 4 * 2 * (4 * 16 * 1024)  # largest layer in + out (the relu)


def test_activations_are_linear_in_batch_and_largest_batch_fits() -> None:
    a4, a8 = _a(4), _a(8)
    f4 = footprint(a4, mode="training", optimizer="adam")
    f8 = footprint(a8, mode="training", optimizer="adam")
    assert f8.activations_bytes == 2 * f4.activations_bytes
    assert f8.model_state_bytes == f4.model_state_bytes
    mem = 64 * 2**20
    best = largest_batch_that_fits(a4, memory_bytes=mem, mode="training", optimizer="adam")
    assert best == largest_batch_that_fits(a8, memory_bytes=mem, mode="training", optimizer="adam")
    assert fits(footprint(_a(best), mode="training", optimizer="adam"), mem)
    assert not fits(footprint(_a(best + 1), mode="training", optimizer="adam"), mem)
    per_sample = f4.activations_bytes / 4
    assert best == int((HEADROOM * mem - f4.model_state_bytes) // per_sample)


def test_nothing_fits_when_model_state_exceeds_memory() -> None:
    assert largest_batch_that_fits(_a(), memory_bytes=1000, mode="training", optimizer="adam") == 0


def test_unknown_precision_or_optimizer_raises() -> None:
    with pytest.raises(KeyError):
        footprint(_a(), mode="training", optimizer="adam", precision="fp8")
    with pytest.raises(KeyError):
        footprint(_a(), mode="training", optimizer="lion")
