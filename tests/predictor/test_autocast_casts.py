"""Autocast's weight casts: under fp16/bf16 on a GPU every conv/GEMM weight is cast to 16 bits once per forward."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.core.vocab import SoftwareStack
from app.estimates.cli import JobParams, OfflineBackend
from app.hardware.catalog import load_catalog
from app.predictor import onnx_model, roofline
from app.predictor.roofline import AUTOCAST_CAST_BYTES_PER_PARAM, STREAM_EFFICIENCY, autocast_weight_cast_ms
from tests.helpers import light_model

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def test_a_cast_moves_six_bytes_per_parameter_and_pays_one_launch() -> None:
    """2.36 M parameters (a 3x3x512x512 conv) on a V100 (900 GB/s at 80 %): 14.16 MB / 720 GB/s = 19.7 us plus
    the 10 us launch; nothing for layers without weights, at fp32/tf32, on a CPU or under a TF1 session."""
    cat = load_catalog()
    v100 = cat["v100-sxm2-16gb"]
    cpu = dataclasses.replace(v100, id="a-cpu", kind="cpu")
    params = np.array([2_359_296.0, 0.0])
    cast_bytes = params * AUTOCAST_CAST_BYTES_PER_PARAM  # fp32 weights
    got = autocast_weight_cast_ms(cast_bytes, precision="fp16", hardware=v100, stack=SoftwareStack.PYTORCH_EAGER,
                                  kernel_ms=0.01)
    bw = v100.memory_bandwidth_bytes_per_s * STREAM_EFFICIENCY
    assert got[0] == pytest.approx(params[0] * AUTOCAST_CAST_BYTES_PER_PARAM / bw * 1e3 + 0.01)
    assert got[0] == pytest.approx(0.0297, abs=5e-4) and got[1] == 0.0
    assert autocast_weight_cast_ms(cast_bytes, precision="bf16", hardware=v100, stack=SoftwareStack.PYTORCH_EAGER,
                                   kernel_ms=0.01)[0] == pytest.approx(got[0])
    eager, tf1 = SoftwareStack.PYTORCH_EAGER, SoftwareStack.TF1_SESSION
    for precision, hw, stack in (("fp32", v100, eager), ("tf32", v100, eager), ("fp16", v100, tf1),
                                 ("bf16", cpu, eager)):
        assert not autocast_weight_cast_ms(cast_bytes, precision=precision, hardware=hw, stack=stack,
                                           kernel_ms=0.01).any()
    with pytest.raises(ValueError):
        autocast_weight_cast_ms(np.array([-1.0]), precision="fp16", hardware=v100, stack=SoftwareStack.PYTORCH_EAGER,
                                kernel_ms=0.01)


def _layers(tmp_path: Path, precision: str, mode: str) -> dict[str, dict[str, Any]]:
    model = tmp_path / "resnet50.onnx"
    if not model.exists():
        model.write_bytes(light_model("resnet50"))
    pred = OfflineBackend(MODELS_DIR).predict(model, "v100-sxm2-16gb",
                                              JobParams(mode=mode, precision=precision, batch_size=8))
    return {la["name"]: la for la in pred["layers"]}


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_served_fp16_forward_of_weighted_layers_carries_the_cast_and_nothing_else_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The served ResNet-50 at fp16 on a V100: every conv's and the classifier's forward is its no-cast forward plus
    the helper's cast of its parameters; batch norms, activations and adds, every backward and update, and the
    whole fp32 answer are unchanged."""
    with_cast = _layers(tmp_path, "fp16", mode)
    fp32 = _layers(tmp_path, "fp32", mode)
    zero = lambda params, **kw: np.zeros_like(np.asarray(params, dtype=np.float64))  # noqa: E731
    monkeypatch.setattr(onnx_model, "autocast_weight_cast_ms", zero)
    monkeypatch.setattr(roofline, "autocast_weight_cast_ms", zero)
    without = _layers(tmp_path, "fp16", mode)
    assert _layers(tmp_path, "fp32", mode) == fp32
    v100 = load_catalog()["v100-sxm2-16gb"]
    weighted = 0
    for name, la in with_cast.items():
        base = without[name]
        assert la["backward_ms"] == pytest.approx(base["backward_ms"])
        assert la["update_ms"] == pytest.approx(base["update_ms"])
        if la["kind"] in ("conv", "gemm") and la["params"] > 0:
            weighted += 1
            cast = autocast_weight_cast_ms(np.array([la["params"] * AUTOCAST_CAST_BYTES_PER_PARAM]), precision="fp16",
                                           hardware=v100,
                                           stack=SoftwareStack.PYTORCH_EAGER, kernel_ms=0.01)[0]
            assert la["forward_ms"] - base["forward_ms"] == pytest.approx(cast, rel=1e-6), name
        else:
            assert la["forward_ms"] == pytest.approx(base["forward_ms"]), name
    assert weighted == 54  # 53 convolutions and the classifier


def test_weights_stored_in_16_bits_are_not_cast_in_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """In inference autocast casts a weight only when its type differs from autocast's (``cached_cast``): a linear
    layer stored in fp16 (a model held in fp16, as LLM inference servers hold it) answers under fp16 exactly what
    it answers with the cast switched off; stored in fp32 it pays the cast of its 6 bytes per parameter, stored in
    bf16 under fp16 one of 4, on the learned and on the roofline path. In training every weight is an fp32 master
    (mixed precision), so all three pay 6. Norms are never cast."""
    from app.core.costs import layer_cost
    from app.core.json_import import import_json
    from app.core.precision import autocast_cast_bytes
    from app.predictor.base import LayerTimeQuery
    from app.predictor.registry import load_predictor

    def linear(dtype: str):  # type: ignore[no-untyped-def]
        doc = {"input_shape": [4096], "input_dtype": dtype, "layers": [{"op": "linear", "out_features": 12288}]}
        return import_json(doc, batch_size=16).layers[0]

    a100 = load_catalog()["a100-sxm4-80gb"]
    half, full, brain = linear("float16"), linear("float32"), linear("bfloat16")
    n = 4096 * 12288 + 12288
    assert [autocast_cast_bytes(la, "fp16", training=False) for la in (half, full, brain)] == [0, 6 * n, 4 * n]
    assert [autocast_cast_bytes(la, "bf16", training=False) for la in (half, full, brain)] == [4 * n, 6 * n, 0]
    assert {autocast_cast_bytes(la, "fp16", training=True) for la in (half, full, brain)} == {6 * n}
    assert autocast_cast_bytes(full, "fp32", training=False) == autocast_cast_bytes(full, "tf32", training=True) == 0
    norm = import_json({"input_shape": [4096], "layers": [{"op": "layernorm"}]}, batch_size=16).layers[0]
    assert norm.weights and autocast_cast_bytes(norm, "fp16", training=True) == 0

    def cast_ms(nbytes: int) -> float:
        return float(autocast_weight_cast_ms(np.array([nbytes]), precision="fp16", hardware=a100,
                                             stack=SoftwareStack.PYTORCH_EAGER, kernel_ms=0.01)[0])

    def forward(predictor: Any, la: Any, mode: str) -> float:
        q = LayerTimeQuery(la, layer_cost(la), a100, mode, "adamw" if mode == "training" else "none", "fp16")
        return float(predictor.estimate([q])[0].forward_ms)

    paths = (load_predictor(MODELS_DIR), roofline.RooflinePredictor())
    layers = (half, full, brain)
    with_cast = {(i, m): [forward(p, la, m) for la in layers] for i, p in enumerate(paths)
                 for m in ("inference", "training")}  # fmt: skip
    zero = lambda cast_bytes, **kw: np.zeros_like(np.asarray(cast_bytes, dtype=np.float64))  # noqa: E731
    monkeypatch.setattr(onnx_model, "autocast_weight_cast_ms", zero)
    monkeypatch.setattr(roofline, "autocast_weight_cast_ms", zero)
    for (i, m), got in with_cast.items():
        expect = [0.0, cast_ms(6 * n), cast_ms(4 * n)] if m == "inference" else [cast_ms(6 * n)] * 3
        for la, g, e in zip(layers, got, expect, strict=True):
            assert g - forward(paths[i], la, m) == pytest.approx(e, rel=1e-6, abs=1e-12), (i, m, la.weights[0].dtype)
