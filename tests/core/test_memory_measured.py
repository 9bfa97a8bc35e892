"""The memory estimate against torch itself: saved-tensor hooks and live storage bytes of a real step.

Uses the harness of ``scripts/measure_memory.py`` on small models (a CNN with max-pool and dropout, a
BN+ReLU6 inverted-residual net, an LSTM LM, GPT-2 with fused attention), fp32 and bf16 autocast, so that a
regression in any per-op rule moves a ratio out of its band.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

_SPEC = importlib.util.spec_from_file_location(
    "measure_memory", Path(__file__).resolve().parents[2] / "scripts" / "measure_memory.py")
assert _SPEC is not None and _SPEC.loader is not None
mm = importlib.util.module_from_spec(_SPEC)
sys.modules["measure_memory"] = mm
_SPEC.loader.exec_module(mm)

CASES = {c.name.split(" ")[0]: c for c in mm.CASES}


@pytest.mark.parametrize(("name", "batch"), [("AlexNet-small", 8), ("MobileNetV2", 4), ("LSTM", 4),
                                             ("GPT-2-mini", 2)])
def test_estimate_matches_saved_tensors_and_peak(name: str, batch: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = CASES[name]
    model = case.build().train()
    onnx_bytes = mm.export(model, case.example(batch), case)
    opt = torch.optim.Adam(model.parameters())
    model(case.example(batch)).float().sum().backward()
    opt.step()
    for bf16 in (False, True):
        est = mm.estimate(onnx_bytes, batch, case, bf16=bf16)
        meas = mm.measure(model, case.example(batch), opt, bf16=bf16)
        saved = est.activations_bytes + est.weight_copies_bytes
        assert 0.9 <= saved / meas["activations"] <= 1.1, (name, bf16, saved, meas)
        assert est.weights_bytes == meas["weights"]
        assert 0 <= meas["optimizer_state"] - est.optimizer_state_bytes <= 1024  # + Adam's scalar step counters
        assert mm.LOW <= est.total_bytes / meas["peak"] <= mm.HIGH, (name, bf16, est.total_bytes, meas)
