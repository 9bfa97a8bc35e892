"""A 1x1 stride-1 convolution is answered as the GEMM it is on GPUs (issue 8: physics-anchored features).

Its output is the weight ``[C_out, C_in]`` times the input at each of the ``N x H x W`` positions: the same FLOPs
and bytes as a bias-free ``nn.Linear(C_in, C_out)`` over ``N x H x W`` rows. The GPU conv training rows have no
1x1 convolution with many channels outside a TensorFlow 1.x session (NeuSight's convolutions are 3x3 only), so
the model featurised such a layer as a convolution and answered DeepBench's 1x1 convolutions (cuDNN, never
trained on) 2.2x too slow; featurised as the GEMM, 1.06x (``scripts/served_kernels.py --source deepbench``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from app.core import features
from app.core.costs import layer_cost
from app.core.features import RAW_FIELDS, gemm_view_applies, is_pointwise_conv, raw_index, raw_quantities
from app.core.ir import Layer
from app.core.json_import import import_json
from app.core.precision import Precision
from app.core.vocab import SoftwareStack
from app.hardware.catalog import load_catalog
from app.predictor import onnx_model, table
from app.predictor.base import LayerTimeQuery
from app.predictor.onnx_model import POINTWISE_GEMM_NOTE
from app.predictor.registry import load_predictor

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def _conv(c_in: int, c_out: int, side: int, batch: int, *, k: int = 1, stride: int = 1, padding: int = 0,
          groups: int = 1) -> Layer:
    spec = {"op": "conv2d", "out_channels": c_out, "kernel_size": k, "stride": stride, "padding": padding,
            "bias": False, "groups": groups}
    return import_json({"input_shape": [c_in, side, side], "layers": [spec]}, batch_size=batch).layers[0]


def _linear(c_in: int, c_out: int, rows: int) -> Layer:
    return import_json({"input_shape": [c_in], "layers": [{"op": "linear", "out_features": c_out, "bias": False}]},
                       batch_size=rows).layers[0]


@pytest.fixture(scope="module")
def predictor():  # type: ignore[no-untyped-def]
    return load_predictor(MODELS_DIR)


def test_only_unstrided_unpadded_ungrouped_1x1_convolutions_are_pointwise() -> None:
    assert is_pointwise_conv(_conv(64, 256, 56, 8))
    assert not is_pointwise_conv(_conv(64, 256, 56, 8, stride=2))  # a strided gather, not one GEMM
    assert not is_pointwise_conv(_conv(64, 256, 56, 8, padding=1))  # a zero border around the output
    assert not is_pointwise_conv(_conv(64, 256, 56, 8, groups=4))
    assert not is_pointwise_conv(_conv(64, 256, 56, 8, k=3, padding=1))
    assert not is_pointwise_conv(_linear(64, 256, 8))


def test_gpu_rows_outside_a_tf1_session_describe_the_conv_as_its_gemm() -> None:
    """The raw row of a pointwise conv equals the bias-free linear's over N x H x W rows in every field but the
    input-gradient flag, on a GPU under PyTorch; under a TF1 session and on a CPU it keeps its conv geometry."""
    catalog = load_catalog()
    gpu = catalog["a100-pcie-40gb"]
    cpu = dataclasses.replace(gpu, id="a-cpu", kind="cpu")  # the catalog holds GPUs only; the kind decides
    conv, lin = _conv(256, 64, 28, 16), _linear(256, 64, 16 * 28 * 28)
    assert layer_cost(conv).forward_flops == layer_cost(lin).forward_flops

    def raw(layer: Layer, hw, stack: str) -> np.ndarray:  # type: ignore[no-untyped-def]
        return np.asarray(raw_quantities(layer=layer, cost=layer_cost(layer), hardware=hw, pass_="forward",
                                         optimizer="none", precision="fp32-strict", stack=stack))

    same = [i for i, f in enumerate(RAW_FIELDS) if f != "needs_input_grad"]
    as_gemm = raw(conv, gpu, "pytorch-eager")
    np.testing.assert_allclose(as_gemm[same], raw(lin, gpu, "pytorch-eager")[same], rtol=1e-12)
    for hw, stack in ((gpu, "tf1-session"), (cpu, "pytorch-eager")):
        assert not gemm_view_applies(hw.kind, stack)
        kept = raw(conv, hw, stack)
        assert kept[raw_index("is_conv")] == 1.0 and kept[raw_index("is_gemm")] == 0.0
        assert kept[raw_index("batch")] == 16 and kept[raw_index("out_spatial")] == 28 * 28


def test_a_pointwise_conv_is_served_as_its_gemm_under_pytorch_and_as_a_conv_under_tf1(predictor) -> None:  # type: ignore[no-untyped-def]
    """Strict fp32 (convolutions and GEMMs share it), inference: the conv's time is the linear's on every catalog
    GPU under PyTorch eager, with the GEMM-view note and no out-of-distribution flag of its own making; under a
    TF1 session it is answered from the conv rows (a different time, no note)."""
    conv, lin = _conv(512, 128, 28, 32), _linear(512, 128, 32 * 28 * 28)
    gpus = [hw for hw in load_catalog().values() if hw.kind == "gpu"]

    def est(layer: Layer, hw, stack: SoftwareStack):  # type: ignore[no-untyped-def]
        return predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none",
                                                  Precision.FP32_STRICT, software_stack=stack)])[0]

    for hw in gpus:
        c, g = est(conv, hw, SoftwareStack.PYTORCH_EAGER), est(lin, hw, SoftwareStack.PYTORCH_EAGER)
        assert c.method == g.method == "learned", hw.id
        assert c.forward_ms == pytest.approx(g.forward_ms, rel=1e-9), hw.id
        assert POINTWISE_GEMM_NOTE in c.notes and POINTWISE_GEMM_NOTE not in g.notes
        assert c.out_of_distribution == g.out_of_distribution, (hw.id, c.notes, g.notes)
    a100 = load_catalog()["a100-pcie-40gb"]
    tf1 = est(conv, a100, SoftwareStack.TF1_SESSION)
    assert POINTWISE_GEMM_NOTE not in tf1.notes
    assert tf1.forward_ms != pytest.approx(est(lin, a100, SoftwareStack.TF1_SESSION).forward_ms, rel=1e-3)
    off = lambda hardware_kind, stack: False  # noqa: E731
    with (mock.patch.object(features, "gemm_view_applies", off), mock.patch.object(table, "gemm_view_applies", off),
          mock.patch.object(onnx_model, "gemm_view_applies", off)):  # fmt: skip
        fresh = load_predictor(MODELS_DIR)
        as_conv = fresh.estimate([LayerTimeQuery(conv, layer_cost(conv), a100, "inference", "none",
                                                 Precision.FP32_STRICT, software_stack=SoftwareStack.TF1_SESSION)])[0]
    assert tf1.forward_ms == pytest.approx(as_conv.forward_ms, rel=1e-12)  # TF1: the conv rows answer, as before


def test_under_tf32_the_pointwise_conv_is_carried_from_strict_fp32_like_every_convolution(predictor) -> None:  # type: ignore[no-untyped-def]
    """PyTorch's default ``fp32`` runs convolutions in TF32 on Ampere and newer (cuDNN's allow_tf32), and no GPU
    training row ran TF32: the pointwise conv's TF32 answer is its strict-fp32 GEMM-view answer carried by the
    floors, as a 3x3 conv's is, never a direct extrapolation to TF32 (which answered 0.9-1.0x of strict). So on the
    A100 and the H100 at batch 8 it is never above its strict answer (below it where compute-bound: 1024 channels)
    and below the 3x3 conv of the same channels and size (9x the FLOPs), under ``fp32`` and ``tf32``; under fp16
    the GEMM rows (Vidur's) answer it directly."""
    catalog = load_catalog()

    def est(layer: Layer, hw, p: Precision):  # type: ignore[no-untyped-def]
        return predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none", p)])[0]

    for hw_id in ("a100-pcie-40gb", "a100-sxm4-80gb", "h100-sxm"):
        hw = catalog[hw_id]
        for c in (64, 256, 1024):
            one, three = _conv(c, c, 14, 8), _conv(c, c, 14, 8, k=3, padding=1)
            strict = est(one, hw, Precision.FP32_STRICT).forward_ms
            for p in (Precision.FP32, Precision.TF32):
                e = est(one, hw, p)
                assert any(n.startswith("conv was not measured on tensor cores") for n in e.notes), (hw_id, c, p)
                assert e.forward_ms <= strict and (c < 1024 or e.forward_ms < 0.8 * strict), (hw_id, c, p, strict)
                assert e.forward_ms < est(three, hw, p).forward_ms, (hw_id, c, p)
            half = est(one, hw, Precision.FP16)
            assert not any("not measured on tensor cores" in n for n in half.notes), (hw_id, c)


def test_a_dilation_of_a_1_wide_kernel_axis_is_not_noted_as_a_dilated_convolution(predictor) -> None:  # type: ignore[no-untyped-def]
    """Dilation spaces a kernel's taps: on a 1-wide axis there is nothing to space, so a dilated 1x1 convolution is
    the same GEMM and carries no "dilated convolutions were not measured" note, while a dilated 3x3 does."""
    a100 = load_catalog()["a100-pcie-40gb"]

    def notes(k: int, dilation: int) -> tuple[str, ...]:
        spec = {"op": "conv2d", "out_channels": 64, "kernel_size": k, "stride": 1, "padding": 0, "bias": False,
                "dilation": dilation}
        layer = import_json({"input_shape": [64, 28, 28], "layers": [spec]}, batch_size=8).layers[0]
        return predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), a100, "inference", "none",
                                                  Precision.FP32_STRICT)])[0].notes

    dilated = "dilated convolutions were not measured"
    assert dilated not in notes(1, 2) and POINTWISE_GEMM_NOTE in notes(1, 2)
    assert dilated in notes(3, 2) and dilated not in notes(3, 1)
