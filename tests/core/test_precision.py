"""Precision semantics, peaks per op kind and the physics floor (app/core/precision.py)."""

from __future__ import annotations

import pytest

from app.core.costs import layer_cost
from app.core.ir import OpKind
from app.core.json_import import import_json
from app.core.precision import (
    PRECISION_SEMANTICS,
    Precision,
    PrecisionNotSupported,
    check_precision,
    cost_at_precision,
    floors_by_pass_ms,
    min_algorithm_flops_factor,
    op_precision,
    physics_floor_ms,
)
from app.core.vocab import Pass
from app.hardware.catalog import load_catalog

CAT = load_catalog()


def _layer(spec: dict, shape: list[int], batch: int = 8):
    g = import_json({"input_shape": shape, "layers": [{"op": "relu"}, spec]}, batch_size=batch)
    layer = g.layers[1]
    return layer, layer_cost(layer)


def test_every_precision_has_semantics_text() -> None:
    assert set(PRECISION_SEMANTICS) == set(Precision)


def test_fp32_default_uses_tf32_for_convolutions_only_on_ampere() -> None:
    a100 = CAT["a100-sxm4-40gb"]
    assert op_precision(a100, "fp32", OpKind.CONV).peak_flops_per_s == a100.peak_flops_per_s["tf32"]
    assert op_precision(a100, "fp32", OpKind.GEMM).peak_flops_per_s == a100.peak_flops_per_s["fp32"]
    assert op_precision(a100, "fp32", OpKind.MATMUL).math == "fp32"
    assert op_precision(a100, "fp32-strict", OpKind.CONV).math == "fp32"
    assert op_precision(a100, "tf32", OpKind.GEMM).math == "tf32"
    # Volta has no TF32: fp32 conv stays fp32, no error
    v100 = CAT["v100-sxm2-16gb"]
    assert op_precision(v100, "fp32", OpKind.CONV).math == "fp32"


def test_mixed_precision_uses_tensor_cores_for_mac_ops_and_16_bit_bytes() -> None:
    h100 = CAT["h100-sxm"]
    gemm = op_precision(h100, "bf16", OpKind.GEMM)
    assert gemm.peak_flops_per_s == h100.peak_flops_per_s["bf16"] and gemm.tensor_cores
    assert gemm.activation_bytes == 2 and gemm.update_bytes_per_param == 4
    relu = op_precision(h100, "bf16", OpKind.ACTIVATION)
    assert relu.peak_flops_per_s == h100.peak_flops_per_s["fp32"] and relu.activation_bytes == 2


def test_fp16_peak_is_never_below_fp32_on_pascal_consumer_parts() -> None:
    gtx = CAT["gtx-1080-ti"]
    assert gtx.peak_flops_per_s["fp16"] < gtx.peak_flops_per_s["fp32"] / 32  # 1/64 rate in the catalog
    assert op_precision(gtx, "fp16", OpKind.CONV).peak_flops_per_s == gtx.peak_flops_per_s["fp32"]
    p100 = CAT["p100"]
    assert op_precision(p100, "fp16", OpKind.GEMM).peak_flops_per_s == pytest.approx(
        2 * p100.peak_flops_per_s["fp32"], rel=0.01)


@pytest.mark.parametrize(("hw", "precision", "missing"),
                         [("v100-sxm2-16gb", "bf16", "bf16"), ("t4", "tf32", "tf32"), ("p100", "bf16", "bf16"),
                          ("k80", "fp16", "fp16")])
def test_precision_the_device_lacks_is_an_error(hw: str, precision: str, missing: str) -> None:
    with pytest.raises(PrecisionNotSupported) as exc:
        check_precision(CAT[hw], precision)
    assert exc.value.missing_peak == missing and exc.value.code == "precision_not_supported"
    with pytest.raises(PrecisionNotSupported):
        op_precision(CAT[hw], precision, OpKind.ELEMENTWISE)


def test_winograd_factor_only_for_3x3_stride1_ungrouped_conv() -> None:
    conv3, _ = _layer({"op": "conv2d", "out_channels": 64, "kernel_size": 3, "padding": 1}, [64, 56, 56])
    assert min_algorithm_flops_factor(conv3) == 4.0
    strided, _ = _layer({"op": "conv2d", "out_channels": 64, "kernel_size": 3, "stride": 2}, [64, 56, 56])
    grouped, _ = _layer({"op": "conv2d", "out_channels": 64, "kernel_size": 3, "groups": 64}, [64, 56, 56])
    conv1, _ = _layer({"op": "conv2d", "out_channels": 64, "kernel_size": 1}, [64, 56, 56])
    assert {min_algorithm_flops_factor(x) for x in (strided, grouped, conv1)} == {1.0}


def test_mixed_precision_halves_bytes_of_memory_bound_ops() -> None:
    relu, cost = _layer({"op": "relu"}, [256, 56, 56])
    half = cost_at_precision(relu, cost, "fp16")
    assert half.forward_bytes * 2 == cost.forward_bytes
    assert half.forward_flops == cost.forward_flops
    assert cost_at_precision(relu, cost, "tf32") is cost
    a100 = CAT["a100-sxm4-40gb"]
    f32 = physics_floor_ms(relu, cost, a100, "fp32", "forward")
    f16 = physics_floor_ms(relu, cost, a100, "fp16", "forward")
    assert f16 == pytest.approx(f32 / 2)
    assert f32 == pytest.approx(cost.forward_bytes / a100.memory_bandwidth_bytes_per_s * 1e3)


def test_floor_of_a_compute_bound_gemm_is_flops_over_the_precision_peak() -> None:
    gemm, cost = _layer({"op": "linear", "out_features": 8192}, [8192], batch=8192)
    a100 = CAT["a100-sxm4-40gb"]
    for precision, key in (("fp32", "fp32"), ("tf32", "tf32"), ("bf16", "bf16")):
        floor = physics_floor_ms(gemm, cost, a100, precision, Pass.FORWARD)
        assert floor == pytest.approx(cost.forward_flops / a100.peak_flops_per_s[key] * 1e3)
    back = physics_floor_ms(gemm, cost, a100, "fp32", "backward")
    assert back == pytest.approx(cost.backward_flops / a100.peak_flops_per_s["fp32"] * 1e3)


def test_update_floor_streams_fp32_master_state_even_under_autocast() -> None:
    gemm, cost = _layer({"op": "linear", "out_features": 1024}, [1024])
    h100 = CAT["h100-sxm"]
    sgd = physics_floor_ms(gemm, cost, h100, "bf16", "update", optimizer="sgd")
    adam = physics_floor_ms(gemm, cost, h100, "bf16", "update", optimizer="adam")
    # SGD: read w, g; write w: 3 x 4 bytes per param. Adam: + 2 states read and written: 7 x 4
    assert sgd == pytest.approx(cost.params * 12 / h100.memory_bandwidth_bytes_per_s * 1e3)
    assert adam == pytest.approx(sgd * 7 / 3)
    assert physics_floor_ms(gemm, cost, h100, "bf16", "update") == 0.0  # optimizer "none"


def test_winograd_conv_floor_is_a_quarter_of_the_direct_bound() -> None:
    conv, cost = _layer({"op": "conv2d", "out_channels": 512, "kernel_size": 3, "padding": 1}, [512, 28, 28],
                        batch=64)
    v100 = CAT["v100-sxm2-16gb"]
    floor = physics_floor_ms(conv, cost, v100, "fp32", "forward")
    direct = cost.forward_flops / v100.peak_flops_per_s["fp32"] * 1e3
    assert floor == pytest.approx(max(direct / 4, cost.forward_bytes / v100.memory_bandwidth_bytes_per_s * 1e3))
    assert floor < direct


def test_train_step_floor_is_the_sum_of_its_passes() -> None:
    gemm, cost = _layer({"op": "linear", "out_features": 1024}, [1024], batch=256)
    t4 = CAT["t4"]
    parts = [physics_floor_ms(gemm, cost, t4, "fp16", p, optimizer="adam") for p in ("forward", "backward", "update")]
    assert physics_floor_ms(gemm, cost, t4, "fp16", Pass.TRAIN_STEP, optimizer="adam") == pytest.approx(sum(parts))
    assert physics_floor_ms(gemm, cost, t4, "fp16", Pass.TRAIN_FORWARD) == parts[0]
    with pytest.raises(ValueError):
        physics_floor_ms(gemm, cost, t4, "fp16", Pass.BACKWARD_INPUT)


def test_floors_by_pass_equal_the_floor_of_each_pass() -> None:
    conv, cost = _layer({"op": "conv2d", "out_channels": 128, "kernel_size": 3, "padding": 1}, [64, 28, 28])
    a10 = CAT["a10"]
    for precision in ("fp32", "bf16"):
        got = floors_by_pass_ms(conv, cost, a10, precision, training=True, optimizer="momentum")
        want = tuple(physics_floor_ms(conv, cost, a10, precision, p, optimizer="momentum")
                     for p in ("forward", "backward", "update"))
        assert got == pytest.approx(want)
        assert floors_by_pass_ms(conv, cost, a10, precision, training=False)[1:] == (0.0, 0.0)


def test_a_refused_precision_names_the_precisions_the_device_supports() -> None:
    """bf16 on a V100 is refused, and the message offers fp16 (which it has), not only fp32."""
    v100 = load_catalog()["v100-sxm2-16gb"]
    with pytest.raises(PrecisionNotSupported) as exc:
        check_precision(v100, "bf16")
    assert Precision.FP16 in exc.value.supported and Precision.BF16 not in exc.value.supported
    assert "'fp16'" in str(exc.value)
