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


def _cpu_runs_bf16_lstm() -> bool:
    """Whether this CPU's torch runs an LSTM under bf16 autocast: oneDNN's bf16 LSTM needs AVX-512 (on an
    AVX2-only CPU it raises "could not create a primitive descriptor for the LSTM forward propagation
    primitive"), so there is no bf16 LSTM to measure there."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(4, 4)(torch.randn(2, 1, 4))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "batch"), [("AlexNet-small", 8), ("MobileNetV2", 4), ("LSTM", 4),
                                             ("GPT-2-mini", 2)])
def test_estimate_matches_saved_tensors_and_peak(name: str, batch: int, bf16: bool) -> None:
    if bf16 and name == "LSTM" and not _cpu_runs_bf16_lstm():
        pytest.skip("this CPU's torch has no bf16 LSTM to measure (oneDNN needs AVX-512); its fp32 case runs")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = CASES[name]
    model = case.build().train()
    onnx_bytes = mm.export(model, case.example(batch), case)
    opt = torch.optim.Adam(model.parameters())
    model(case.example(batch)).float().sum().backward()
    opt.step()
    est = mm.estimate(onnx_bytes, batch, case, bf16=bf16)
    meas = mm.measure(model, case.example(batch), opt, bf16=bf16)
    saved = est.activations_bytes + est.weight_copies_bytes
    assert 0.9 <= saved / meas["activations"] <= 1.1, (name, bf16, saved, meas)
    assert est.weights_bytes == meas["weights"]
    assert 0 <= meas["optimizer_state"] - est.optimizer_state_bytes <= 1024  # + Adam's scalar step counters
    assert mm.LOW <= est.total_bytes / meas["peak"] <= mm.HIGH, (name, bf16, est.total_bytes, meas)
