"""Roofline fallback: streaming ops are bandwidth-bound kernels, views are free."""

from __future__ import annotations

import pytest

from app.core.costs import layer_cost
from app.core.json_import import import_json
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeQuery
from app.predictor.roofline import KERNEL_FLOOR_MS, STREAM_EFFICIENCY, RooflinePredictor


def _queries(mode: str):
    g = import_json(
        {"input_shape": [64, 56, 56], "layers": [{"op": "batchnorm"}, {"op": "relu"}, {"op": "flatten"}]},
        batch_size=32,
    )
    hw = load_catalog()["p100"]
    return (
        hw,
        g,
        [LayerTimeQuery(layer=x, cost=layer_cost(x), hardware=hw, mode=mode, optimizer="sgd") for x in g.layers],
    )


def test_streaming_op_time_is_bytes_over_achievable_bandwidth() -> None:
    hw, g, qs = _queries("inference")
    bn, relu, flatten = RooflinePredictor().estimate(qs)
    relu_bytes = layer_cost(g.layers[1]).forward_bytes
    expected = relu_bytes / (hw.memory_bandwidth_bytes_per_s * STREAM_EFFICIENCY) * 1e3 + KERNEL_FLOOR_MS
    assert relu.forward_ms == pytest.approx(expected)
    assert relu.method == "roofline" and relu.backward_ms == 0
    assert flatten.forward_ms == 0 and flatten.total_ms_p90 == 0  # a view launches no kernel
    assert bn.forward_ms > relu.forward_ms  # BN reads its parameters and buffers too


def test_training_adds_backward_and_update_for_parametrised_ops_only() -> None:
    _, _, qs = _queries("training")
    bn, relu, _ = RooflinePredictor().estimate(qs)
    assert bn.backward_ms > 0 and bn.update_ms > 0
    assert relu.backward_ms > 0 and relu.update_ms == 0
    assert bn.total_ms_p10 < bn.forward_ms + bn.backward_ms + bn.update_ms < bn.total_ms_p90


def test_software_stack_sets_the_fixed_cost_per_kernel() -> None:
    from app.core.vocab import SoftwareStack
    from app.predictor.roofline import DEFAULT_CONSTANTS, KERNEL_FLOOR_MS_BY_STACK

    hw = load_catalog()["a100-sxm4-40gb"]
    g = import_json({"input_shape": [64], "layers": [{"op": "relu"}, {"op": "linear", "out_features": 64}]},
                    batch_size=1)
    tiny = g.layers[1]  # a 64x64 GEMM at batch 1: pure overhead

    def fwd(stack: SoftwareStack, layer=tiny) -> float:  # noqa: ANN001
        q = LayerTimeQuery(layer, layer_cost(layer), hw, "inference", "none", software_stack=stack)
        return RooflinePredictor().estimate([q])[0].forward_ms

    eager, graphs, tf1 = (fwd(s) for s in (SoftwareStack.PYTORCH_EAGER, SoftwareStack.PYTORCH_CUDA_GRAPH,
                                           SoftwareStack.TF1_SESSION))
    assert eager == pytest.approx(KERNEL_FLOOR_MS_BY_STACK[SoftwareStack.PYTORCH_EAGER], rel=0.01)
    assert graphs < eager < tf1
    assert tf1 >= DEFAULT_CONSTANTS.floor_forward_ms  # the TF1 session floor only under tf1-session
    relu = g.layers[0]
    assert fwd(SoftwareStack.PYTORCH_CUDA_GRAPH, relu) < fwd(SoftwareStack.PYTORCH_EAGER, relu)


def test_foreach_update_shares_launches_across_layers() -> None:
    hw = load_catalog()["a100-sxm4-40gb"]
    g = import_json({"input_shape": [64], "layers": [{"op": "linear", "out_features": 64}]}, batch_size=1)
    layer = g.layers[0]
    (est,) = RooflinePredictor().estimate([LayerTimeQuery(layer, layer_cost(layer), hw, "training", "adam")])
    # a 64x64 layer's Adam step is ~8 foreach kernels shared by 48 tensors each: far below one launch per layer
    assert est.update_ms < KERNEL_FLOOR_MS


def test_compute_bound_fused_attention_runs_at_the_flash_attention_fraction_of_the_tensor_core_peak() -> None:
    from app.core.ir import AttentionAttrs, Layer, OpKind, Tensor
    from app.predictor.roofline import ATTENTION_EFFICIENCY

    b, h, t, d = 8, 16, 2048, 64
    q = Tensor("q", (b, h, t, d), "float16")
    layer = Layer("attn", "Attention", OpKind.ATTENTION, (q, q, q), (Tensor("o", (b, h, t, d), "float16"),),
                  attrs=AttentionAttrs(batch=b, heads=h, q_len=t, kv_len=t, qk_width=h * d, v_width=h * d))
    hw = load_catalog()["h100-sxm"]
    cost = layer_cost(layer)
    (est,) = RooflinePredictor().estimate([LayerTimeQuery(layer, cost, hw, "inference", "none", precision="bf16")])
    compute_ms = cost.forward_flops / (hw.peak_flops_per_s["bf16"] * ATTENTION_EFFICIENCY) * 1e3
    assert est.forward_ms == pytest.approx(compute_ms + KERNEL_FLOOR_MS)


def test_backward_from_forward_scales_work_not_launches() -> None:
    from app.predictor.base import backward_from_forward_ms, transfer_precision_ms

    # 1 ms forward with a 10 us launch, backward floor twice the forward's, excess 1.31, two backward kernels
    b = backward_from_forward_ms(forward_ms=1.0, floor_forward_ms=0.5, floor_backward_ms=1.0, kernels=2,
                                 kernel_ms=0.01, excess=1.31)  # fmt: skip
    assert b == pytest.approx(2 * 0.01 + 0.99 * 1.31 * 2)
    # a launch-bound forward keeps only the launches
    assert backward_from_forward_ms(forward_ms=0.008, floor_forward_ms=0.001, floor_backward_ms=0.002, kernels=1,
                                    kernel_ms=0.01, excess=1.0) == pytest.approx(0.01)  # fmt: skip
    assert backward_from_forward_ms(forward_ms=0.5, floor_forward_ms=0.1, floor_backward_ms=0.0, kernels=0,
                                    kernel_ms=0.01, excess=1.0) == 0.0  # fmt: skip
    with pytest.raises(ValueError):
        backward_from_forward_ms(forward_ms=-1.0, floor_forward_ms=0.1, floor_backward_ms=0.1, kernels=1,
                                 kernel_ms=0.01, excess=1.0)  # fmt: skip
    # the transfer keeps the launch, scales the work by the floors, and never goes below the target floor
    assert transfer_precision_ms(time_ms=1.01, floor_from_ms=0.5, floor_to_ms=0.05, overhead_ms=0.01) == (
        pytest.approx(0.01 + 1.0 * 0.1))
    assert transfer_precision_ms(time_ms=0.01, floor_from_ms=0.01, floor_to_ms=0.02, overhead_ms=0.005) == (
        pytest.approx(0.02))
    with pytest.raises(ValueError):
        transfer_precision_ms(time_ms=1.0, floor_from_ms=0.0, floor_to_ms=0.1, overhead_ms=0.01)
