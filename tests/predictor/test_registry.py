"""The shipped predictor artifact (``models/``) loads without torch and routes layers correctly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.core.costs import layer_cost
from app.core.hardware import HardwareSpec
from app.core.ir import Layer, OpKind, RecurrentAttrs, Tensor, UnsupportedAttrs
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeQuery, split_training_step
from app.predictor.registry import list_versions, load_predictor
from app.predictor.roofline import RooflinePredictor
from app.training.dataset import justus_conv_layer, justus_dense_layer

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def predictor():
    return load_predictor(MODELS_DIR)


def _q(layer: Layer, hw_id: str, mode: str = "training", optimizer: str = "adam") -> LayerTimeQuery:
    hw = load_catalog()[hw_id]
    return LayerTimeQuery(layer, layer_cost(layer), hw, mode, optimizer if mode == "training" else "none")


def _conv() -> Layer:
    return justus_conv_layer(
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


def _batchnorm() -> Layer:
    x = Tensor("x", (32, 64, 56, 56))
    return Layer("bn", "BatchNormalization", OpKind.BATCHNORM, (x,), (Tensor("y", (32, 64, 56, 56)),),
                 weights=(Tensor("g", (64,)), Tensor("b", (64,))), buffers=(Tensor("m", (64,)), Tensor("v", (64,))))


def _lstm() -> Layer:
    return Layer(
        "lstm", "LSTM", OpKind.RECURRENT, (Tensor("x", (35, 20, 256)),), (Tensor("y", (35, 20, 512)),),
        weights=(Tensor("w", (4 * 512, 256)), Tensor("r", (4 * 512, 512))),
        attrs=RecurrentAttrs(seq_len=35, batch=20, input_size=256, hidden_size=512),
    )  # fmt: skip


def test_serving_does_not_import_torch(predictor) -> None:
    # a fresh interpreter: an earlier test in this process may have imported torch itself
    code = ("import sys\n"
            "import app.main  # noqa: F401 - the API package\n"
            "from app.config import REPO_ROOT\n"
            "from app.hardware.catalog import load_catalog\n"
            "from app.predictor.registry import load_predictor\n"
            "from app.training.dataset import justus_dense_layer\n"
            "from app.core.costs import layer_cost\n"
            "from app.predictor.base import LayerTimeQuery\n"
            "p = load_predictor(REPO_ROOT / 'models')\n"
            "layer = justus_dense_layer(batch=64, in_features=512, out_features=512, activation='none')\n"
            "q = LayerTimeQuery(layer=layer, cost=layer_cost(layer), hardware=load_catalog()['p100'],\n"
            "                   mode='training', optimizer='sgd')\n"
            "(e,) = p.estimate([q])\n"
            "assert e.method == 'learned', e\n"
            "print(p.version, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == predictor.version and out[1] == "False", out


def test_conv_on_p100_is_learned_and_consistent(predictor) -> None:
    (est,) = predictor.estimate([_q(_conv(), "p100")])
    assert est.method == "learned"
    assert not est.out_of_distribution, est.notes
    assert est.forward_ms > 0 and est.backward_ms > 0 and est.update_ms > 0
    assert est.total_ms_p10 <= est.total_ms <= est.total_ms_p90
    assert est.total_ms_p90 / est.total_ms_p10 < 5


def test_inference_has_no_backward_or_update(predictor) -> None:
    (est,) = predictor.estimate([_q(justus_dense_layer(batch=64, in_features=1024, out_features=1024,
                                                 activation="none"), "k80", mode="inference")])  # fmt: skip
    assert est.method == "learned"
    assert est.backward_ms == 0 and est.update_ms == 0 and est.forward_ms > 0
    assert est.total_ms_p10 <= est.forward_ms <= est.total_ms_p90


def test_larger_layer_takes_longer(predictor) -> None:
    small, big = predictor.estimate(
        [_q(justus_dense_layer(batch=64, in_features=512, out_features=512, activation="none"), "p100"),
         _q(justus_dense_layer(batch=64, in_features=4096, out_features=4096, activation="none"), "p100")]
    )  # fmt: skip
    assert big.total_ms > small.total_ms


@pytest.mark.parametrize("layer", [_batchnorm(), _lstm()], ids=["batchnorm", "lstm"])
def test_other_op_kinds_on_gpu_fall_back_to_roofline(predictor, layer: Layer) -> None:
    (est,) = predictor.estimate([_q(layer, "p100")])
    assert est.method == "roofline"
    assert est.total_ms > 0 and est.total_ms_p10 < est.total_ms < est.total_ms_p90


def _training_cpu(predictor) -> HardwareSpec:
    from app.core.hardware import hardware_from_dict

    (_, snap), = [(k, v) for k, v in predictor.learned.metadata["training_hardware"].items()
                      if v.get("kind") == "cpu"]  # fmt: skip
    return hardware_from_dict(snap)


def test_training_cpu_is_learned_and_in_distribution(predictor) -> None:
    hw = _training_cpu(predictor)
    layer = _conv()
    (est,) = predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), hw, "training", "adam")])
    assert est.method == "learned" and not any("hardware" in n for n in est.notes), est.notes
    assert est.forward_ms > 0 and est.backward_ms > 0


def test_same_cpu_detected_again_uses_the_stored_spec(predictor) -> None:
    """A re-detected local CPU (bandwidth measured anew) gets exactly the training features."""
    import dataclasses

    hw = _training_cpu(predictor)
    again = dataclasses.replace(hw, memory_bandwidth_bytes_per_s=hw.memory_bandwidth_bytes_per_s * 0.9)
    layer = _conv()
    a, b = predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), h, "inference", "none") for h in (hw, again)])
    assert a.total_ms == b.total_ms and a.notes == b.notes
    assert not any("hardware" in n for n in b.notes), b.notes


def test_unseen_cpu_is_learned_but_flagged(predictor) -> None:
    hw = HardwareSpec(
        id="other-cpu", name="test CPU", vendor="x", kind="cpu", peak_flops_per_s={"fp32": 5e11},
        memory_bytes=16e9, memory_bandwidth_bytes_per_s=20e9, compute_units=8,
    )  # fmt: skip
    layer = _conv()
    (est,) = predictor.estimate([LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none")])
    assert est.method == "learned" and est.out_of_distribution
    assert est.forward_ms > 0


def test_cpu_ops_without_measurements_fall_back(predictor) -> None:
    hw = _training_cpu(predictor)
    x = Tensor("x", (8, 64))
    add = Layer("add", "Add", OpKind.ELEMENTWISE, (x, x), (Tensor("y", (8, 64)),))
    (est,) = predictor.estimate([LayerTimeQuery(add, layer_cost(add), hw, "inference", "none")])
    assert est.method == "roofline"


def test_old_versions_stay_loadable() -> None:
    for v in list_versions(MODELS_DIR):
        p = load_predictor(MODELS_DIR, stem=v.stem)
        (est,) = p.estimate([_q(_conv(), "p100")])
        assert est.method == "learned" and est.total_ms > 0


def test_unseen_gpu_is_flagged_out_of_distribution(predictor) -> None:
    est_h100, est_p100 = predictor.estimate([_q(_conv(), "h100-sxm"), _q(_conv(), "p100")])
    assert est_h100.method == "learned" and est_h100.out_of_distribution
    assert any("h100-sxm" in n for n in est_h100.notes)
    assert est_h100.total_ms > 0


def test_mixed_batch_keeps_query_order(predictor) -> None:
    out = predictor.estimate([_q(_batchnorm(), "p100"), _q(_conv(), "p100"), _q(_lstm(), "k40"),
                              _q(_softmax(), "t4")])  # fmt: skip
    assert [e.method for e in out] == ["roofline", "learned", "roofline", "learned"]


def test_unsupported_layer_is_rejected(predictor) -> None:
    layer = Layer("u", "Weird", OpKind.UNSUPPORTED, (Tensor("x", (1, 4)),), (Tensor("y", (1, 4)),),
                  attrs=UnsupportedAttrs("no cost formula for op 'Weird'"))
    with pytest.raises(ValueError):
        predictor.estimate([_q(layer, "p100")])
    with pytest.raises(ValueError):
        RooflinePredictor().estimate([_q(layer, "p100")])


def test_shipped_metadata_lists_scope_and_held_out_metrics(predictor) -> None:
    meta = predictor.learned.metadata
    test = meta["metrics_test_summary"]
    assert set(test) == {"justus", "neusight", "vidur", "cpu"}
    for src in ("justus", "neusight", "vidur"):
        assert 0 < test[src]["mape_pct"] < 20
    assert 0 < test["cpu"]["mape_pct"] < 40
    assert set(meta["applies_to"]) == {"gpu", "cpu"}
    assert {"conv", "gemm", "matmul", "elementwise", "activation", "norm", "softmax", "embedding"} <= set(
        meta["applies_to"]["gpu"]["op_kinds"]
    )
    assert {"conv", "gemm", "matmul", "recurrent", "batchnorm", "embedding"} <= set(
        meta["applies_to"]["cpu"]["op_kinds"]
    )
    # the GPU interval is calibrated on GPUs the model had not seen (leave-one-GPU-out), so it is wider
    assert all(f > 1 for f in meta["model"]["gpu_interval_logo_factor"])
    assert sum(1 for v in list_versions(MODELS_DIR) if v.current) == 1


def _gemm(m: int, k: int, n: int) -> Layer:
    return justus_dense_layer(batch=m, in_features=k, out_features=n, activation="none")


def test_tf1_session_floor_does_not_leak_into_pytorch_answers(predictor) -> None:
    """A small kernel is answered at PyTorch-eager cost by default; only a TF1 request pays the session floor."""
    from app.core.vocab import SoftwareStack

    layer = _gemm(16, 256, 256)
    hw = load_catalog()["t4"]
    eager, tf1 = predictor.estimate(
        [LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none"),
         LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none", software_stack=SoftwareStack.TF1_SESSION)]
    )  # fmt: skip
    assert eager.method == tf1.method == "learned"
    assert eager.total_ms < 0.1  # NeuSight measures such kernels at ~10-50 us under PyTorch eager
    assert tf1.total_ms > 2 * eager.total_ms


def test_mixed_precision_gemm_uses_tensor_cores(predictor) -> None:
    """fp16 autocast of a large GEMM on an A100 is several times faster than fp32 (312 vs 19.5 TFLOP/s)."""
    from app.core.precision import Precision

    layer = _gemm(4096, 4096, 4096)
    hw = load_catalog()["a100-sxm4-80gb"]
    fp32, fp16 = predictor.estimate(
        [LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none", precision=p)
         for p in (Precision.FP32, Precision.FP16)]
    )  # fmt: skip
    assert fp32.method == fp16.method == "learned"
    assert fp32.total_ms > 4 * fp16.total_ms


def test_no_jump_between_close_gpus(predictor) -> None:
    """V100 PCIe and V100 SXM2 (10 % apart in peak, 0 % in bandwidth) get close answers: no gate between models."""
    layer = _conv()
    pcie, sxm = predictor.estimate([_q(layer, "v100-pcie-16gb", mode="inference"),
                                    _q(layer, "v100-sxm2-16gb", mode="inference")])  # fmt: skip
    assert pcie.method == sxm.method == "learned"
    assert 0.8 < pcie.total_ms / sxm.total_ms < 1.3


def test_evaluation_report_describes_the_shipped_predictor(predictor) -> None:
    """reports/evaluation.json (``layercast evaluate``) was made with the active artifact: every method on the
    same rows, leave-one-GPU-out over every GPU chip, and no learned prediction below the roofline."""
    import json

    rep = json.loads((MODELS_DIR.parent / "reports" / "evaluation.json").read_text())
    assert rep["predictor"] == predictor.version
    held = rep["held_out"]
    assert held["learned"]["n"] == held["previous"]["n"] == held["n"]
    # the baselines are scored on the same rows where they give an answer (> 0 ms)
    assert held["roofline"]["answered_pct"] > 99 and held["flops50"]["answered_pct"] > 95
    assert held["learned"]["mape_pct"] < held["roofline"]["mape_pct"]
    assert held["learned"]["mape_pct"] < held["flops50"]["mape_pct"]
    assert held["learned"]["mape_pct"] < held["lookup"]["mape_pct"]
    assert held["learned_below_roofline_pct"] == 0.0 and rep["logo"]["pooled"]["learned_below_roofline_pct"] == 0.0
    assert len(rep["logo"]["per_gpu"]) == 11
    pooled = rep["logo"]["pooled"]
    assert pooled["learned"]["mape_pct"] < pooled["roofline"]["mape_pct"]
    assert 70 <= pooled["learned"]["coverage_80_pct"] <= 90


def test_split_training_step_keeps_components_positive() -> None:
    f, b, u = split_training_step(total_ms=1.0, forward_ms=0.9, update_ms=0.3, backward_min_ms=0.1)
    assert f > 0 and b >= 0.1 - 1e-12 and u > 0
    assert f + b + u == pytest.approx(1.0)
    assert split_training_step(total_ms=3.0, forward_ms=1.0, update_ms=0.5, backward_min_ms=0.1) == (
        1.0,
        1.5,
        0.5,
    )


def test_pytorch_backward_comes_from_the_forward_at_the_deepbench_ratio(predictor) -> None:
    """Under PyTorch eager on a GPU the conv backward is the forward's work x 2 (both gradients) x the DeepBench
    excess 2.62 / 2, not the TF1 train-step split (~4x); a first layer (no input gradient) gets half of it; a
    TF1 request keeps the learned train step."""
    from app.core.vocab import SoftwareStack
    from app.predictor.base import backward_excess_from_ratios

    excess = backward_excess_from_ratios(predictor.learned.metadata["backward_forward_ratio"])
    assert excess is not None and excess.median == pytest.approx(2.619 / 2, rel=1e-3)
    big = justus_conv_layer(batch=128, size=56, kernel=3, stride=1, c_in=128, c_out=128, padding="same",
                            use_bias=False, activation="none")  # fmt: skip
    first = Layer(big.name, big.op_type, big.kind, big.inputs, big.outputs, weights=big.weights, attrs=big.attrs,
                  needs_input_grad=False)  # fmt: skip
    hw = load_catalog()["v100-sxm2-16gb"]
    eager, stem, tf1 = predictor.estimate([
        LayerTimeQuery(big, layer_cost(big), hw, "training", "sgd"),
        LayerTimeQuery(first, layer_cost(first), hw, "training", "sgd"),
        LayerTimeQuery(big, layer_cost(big), hw, "training", "sgd", software_stack=SoftwareStack.TF1_SESSION),
    ])  # fmt: skip
    assert eager.method == stem.method == tf1.method == "learned"
    assert eager.backward_ms / eager.forward_ms == pytest.approx(2.619, rel=0.02)
    assert stem.backward_ms / stem.forward_ms == pytest.approx(2.619 / 2, rel=0.02)
    assert any("backward from the forward" in n for n in eager.notes)
    assert not any("backward from the forward" in n for n in tf1.notes)


def test_conv_never_measured_on_tensor_cores_is_carried_from_strict_fp32(predictor) -> None:
    """An A100 fp16 conv is the strict-fp32 prediction carried by the floors: much faster, never below its floor,
    and flagged (no conv was measured on tensor cores)."""
    from app.core.precision import Precision, physics_floor_ms
    from app.core.vocab import Pass

    layer = justus_conv_layer(batch=64, size=56, kernel=3, stride=1, c_in=256, c_out=256, padding="same",
                              use_bias=False, activation="none")  # fmt: skip
    hw = load_catalog()["a100-sxm4-80gb"]
    cost = layer_cost(layer)
    strict, fp16 = predictor.estimate([LayerTimeQuery(layer, cost, hw, "inference", "none", precision=p)
                                       for p in (Precision.FP32_STRICT, Precision.FP16)])  # fmt: skip
    f_strict = physics_floor_ms(layer, cost, hw, Precision.FP32_STRICT, Pass.FORWARD)
    f_half = physics_floor_ms(layer, cost, hw, Precision.FP16, Pass.FORWARD)
    assert fp16.out_of_distribution and any("not measured on tensor cores" in n for n in fp16.notes)
    assert not any("tensor cores" in n for n in strict.notes)
    from app.core.precision import autocast_cast_bytes
    from app.core.vocab import SoftwareStack
    from app.predictor.roofline import autocast_weight_cast_ms

    cast = float(autocast_weight_cast_ms(autocast_cast_bytes(layer, "fp16", training=False), precision="fp16",
                                         hardware=hw, stack=SoftwareStack.PYTORCH_EAGER, kernel_ms=0.010))
    assert cast > 0.010  # autocast's weight cast: one launch and 6 bytes per parameter
    expected = 0.010 + (strict.forward_ms - 0.010) * f_half / f_strict + cast
    assert fp16.forward_ms == pytest.approx(expected, rel=1e-6)
    assert fp16.forward_ms >= f_half and strict.forward_ms > 4 * fp16.forward_ms
