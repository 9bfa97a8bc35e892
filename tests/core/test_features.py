"""Tests of the one feature function (app.core.features) and the Justus loader that uses it."""

from __future__ import annotations

import csv
import dataclasses
import gzip
from pathlib import Path

import numpy as np
import pytest

from app.core.costs import layer_cost
from app.core.features import (
    FEATURE_NAMES,
    RAW_FIELDS,
    FeatureInput,
    features_from_raw,
    layer_features,
    layer_features_batch,
)
from app.hardware.catalog import load_catalog
from app.training.dataset import (
    justus_conv_layer,
    justus_dense_layer,
    load_from_database,
    split_by_config,
    tf_conv_output_size,
)

DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "justus2018"
needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="../shared/data/justus2018 not present")


def _conv() -> FeatureInput:
    layer = justus_conv_layer(
        batch=16,
        size=56,
        kernel=3,
        stride=1,
        c_in=64,
        c_out=64,
        padding="same",
        use_bias=True,
        activation="relu",
    )
    return FeatureInput(layer, layer_cost(layer), load_catalog()["p100"], "train_step", "adam", "fp32")


def test_feature_vector_shape_dtype_and_finite() -> None:
    q = _conv()
    f = layer_features(
        layer=q.layer,
        cost=q.cost,
        hardware=q.hardware,
        pass_=q.pass_,
        optimizer=q.optimizer,
        precision="fp32",
    )
    assert f.shape == (len(FEATURE_NAMES),)
    assert f.dtype == np.float32
    assert np.isfinite(f).all()
    assert f[FEATURE_NAMES.index("is_train")] == 1.0
    assert f[FEATURE_NAMES.index("opt_adam")] == 1.0
    assert f[FEATURE_NAMES.index("act_relu")] == 1.0


def test_only_bandwidth_change_moves_memory_roofline_not_compute() -> None:
    q = _conv()
    slow = dataclasses.replace(q.hardware, memory_bandwidth_bytes_per_s=q.hardware.memory_bandwidth_bytes_per_s / 4)
    a = layer_features_batch([q])[0]
    b = layer_features_batch([q._replace(hardware=slow)])[0]
    mem = FEATURE_NAMES.index("log_memory_ms")
    assert b[mem] == pytest.approx(a[mem] + np.log(4), abs=1e-5)
    assert b[FEATURE_NAMES.index("log_compute_ms")] == a[FEATURE_NAMES.index("log_compute_ms")]
    assert b[FEATURE_NAMES.index("log_flops")] == a[FEATURE_NAMES.index("log_flops")]


def test_forward_pass_ignores_optimizer() -> None:
    q = _conv()._replace(pass_="forward", optimizer="none")
    f = layer_features_batch([q])[0]
    assert f[FEATURE_NAMES.index("is_train")] == 0.0
    assert all(f[FEATURE_NAMES.index(n)] == 0.0 for n in FEATURE_NAMES if n.startswith("opt_"))


def test_rejects_bad_raw_shape_and_pass() -> None:
    with pytest.raises(ValueError):
        features_from_raw(np.zeros((2, len(RAW_FIELDS) - 1)))
    with pytest.raises(ValueError):
        layer_features_batch([_conv()._replace(pass_="backward")])


def test_tf_padding_output_sizes() -> None:
    assert tf_conv_output_size(7, 3, 2, "same") == 4
    assert tf_conv_output_size(7, 3, 2, "valid") == 3
    assert tf_conv_output_size(5, 5, 1, "valid") == 1


def test_dense_layer_macs_and_geometry() -> None:
    layer = justus_dense_layer(batch=8, in_features=100, out_features=30, activation="none")
    cost = layer_cost(layer)
    assert cost.forward_macs == 8 * 100 * 30
    assert cost.params == 100 * 30 + 30
    f = layer_features(
        layer=layer,
        cost=cost,
        hardware=load_catalog()["k40"],
        pass_="forward",
        optimizer="none",
        precision="fp32",
    )
    assert f[FEATURE_NAMES.index("log_c_in")] == pytest.approx(np.log(100))
    assert f[FEATURE_NAMES.index("log_batch")] == pytest.approx(np.log(8))


@needs_data
def test_loader_vectorised_features_equal_row_by_row_layer_features(justus_db: str) -> None:
    """The database loader's rows equal layer_features of the same CSV row rebuilt by hand."""
    data = load_from_database(justus_db, sources=("justus2018",), sample_per_file=40, seed=3)
    catalog = load_catalog()
    assert len(data) == 400
    assert np.isfinite(data.features).all()
    by_file = {}
    for f in data.files:
        with gzip.open(DATA_DIR / f.name, "rt", newline="") as fh:
            by_file[f.name] = list(csv.DictReader(fh))
    from sqlalchemy import create_engine, select

    from app.measurements.models import Measurement

    engine = create_engine(justus_db)
    with engine.connect() as conn:
        where = {
            int(i): (c["source_file"], c["source_row"])
            for i, c in conn.execute(
                select(Measurement.id, Measurement.context).where(Measurement.id.in_(data.measurement_id.tolist()))
            )
        }
    engine.dispose()
    for i in range(len(data)):
        name, row_idx = where[int(data.measurement_id[i])]
        row = by_file[name][row_idx]
        if name.startswith("conv"):
            layer = justus_conv_layer(batch=int(row["batch_size"]), size=int(row["input_size"]),
                                      kernel=int(row["kernel_size"]), stride=int(row["stride"]),
                                      c_in=int(row["in_channels"]), c_out=int(row["out_channels"]),
                                      padding=row["padding"], use_bias=row["use_bias"] == "True",
                                      activation=row["activation"])  # fmt: skip
        else:
            layer = justus_dense_layer(
                batch=int(row["batch_size"]),
                in_features=int(row["in_features"]),
                out_features=int(row["out_features"]),
                activation=row["activation"],
            )
        assert data.layers[i] == layer
        gpu = data.gpu[i]
        assert catalog[gpu] == data.hardware[gpu]  # the stored spec is the catalog's
        one = layer_features(layer=layer, cost=layer_cost(layer), hardware=catalog[gpu], pass_=row["pass"],
                             optimizer=row["optimizer"], precision="fp32", stack="tf1-session")  # fmt: skip
        np.testing.assert_array_equal(one, data.features[i])
        assert data.time_ms[i] == float(row["time_ms_median"])


def test_split_keeps_a_configuration_on_one_side() -> None:
    config = np.array(["a", "b", "a", "c", "d", "b", "e", "a"] * 5)
    split = split_by_config(config, seed=1)
    for key in np.unique(config):
        assert len(np.unique(split[config == key])) == 1
    assert set(np.unique(split)) <= {0, 1, 2}


def test_v3_floor_and_stack_features() -> None:
    """The v3 anchor is the physics floor at the precision, and the stack moves only its own columns."""
    from app.core.features import feature_index, floor_ms_from_raw, raw_quantities
    from app.core.precision import physics_floor_ms

    hw = load_catalog()["a100-sxm4-80gb"]
    layer = justus_dense_layer(batch=512, in_features=4096, out_features=4096, activation="none")
    cost = layer_cost(layer)
    kw = {"layer": layer, "cost": cost, "hardware": hw, "pass_": "forward", "optimizer": "none"}
    fp32 = np.asarray([raw_quantities(**kw, precision="fp32")])
    fp16 = np.asarray([raw_quantities(**kw, precision="fp16")])
    assert floor_ms_from_raw(fp32)[0] == pytest.approx(physics_floor_ms(layer, cost, hw, "fp32", "forward"))
    assert floor_ms_from_raw(fp16)[0] < floor_ms_from_raw(fp32)[0] / 10  # tensor cores: 312 vs 19.5 TFLOP/s
    eager = layer_features(**kw, precision="fp32")
    tf1 = layer_features(**kw, precision="fp32", stack="tf1-session")
    differ = np.nonzero(eager != tf1)[0]
    assert [FEATURE_NAMES[i] for i in differ] == ["stack_tf1_session"]
    # a library called from C++ queues its kernels back to back, like a CUDA-graph replay: no launch gaps
    for stack in ("cuda-library", "pytorch-cuda-graph"):
        gapless = layer_features(**kw, precision="fp32", stack=stack)
        assert [FEATURE_NAMES[i] for i in np.nonzero(eager != gapless)[0]] == ["stack_kernel_time"], stack
    assert layer_features(**kw, precision="fp32", stack="pytorch-compiled")[feature_index("stack_kernel_time")] == 0
    # wave quantisation: 4 x 32 output tiles of 128 x 128 over 108 SMs = 1.19 waves, 59 % of the last wave used
    assert eager[feature_index("log_tiles")] == pytest.approx(np.log(4 * 32))
    assert eager[feature_index("wave_efficiency")] == pytest.approx(128 / 108 / 2)


def test_v4_per_sm_ratios_are_the_same_on_a_gpu_with_twice_the_sms() -> None:
    """The v4 hardware columns are per-SM, per-cycle ratios: a GPU with twice the SMs, peak, bandwidth and L2
    at the same clock has the same ones, while its absolute columns move; the wave-quantised floor counts
    the idle SMs of the last wave."""
    from app.core.features import feature_index

    hw = load_catalog()["a100-sxm4-80gb"]
    double = dataclasses.replace(
        hw, compute_units=2 * hw.compute_units, peak_flops_per_s={k: 2 * v for k, v in hw.peak_flops_per_s.items()},
        memory_bandwidth_bytes_per_s=2 * hw.memory_bandwidth_bytes_per_s, l2_cache_bytes=2 * (hw.l2_cache_bytes or 0),
    )  # fmt: skip
    layer = justus_dense_layer(batch=512, in_features=4096, out_features=4096, activation="none")
    q = FeatureInput(layer, layer_cost(layer), hw, "forward", "none", "fp32")
    a, b = layer_features_batch([q, q._replace(hardware=double)])
    for name in ("hw_log_flops_per_sm_cycle", "hw_log_bytes_per_sm_cycle", "hw_log_l2_per_sm"):
        assert b[feature_index(name)] == pytest.approx(a[feature_index(name)], abs=1e-5)
    assert b[feature_index("hw_log_op_peak_flops_per_s")] == pytest.approx(
        a[feature_index("hw_log_op_peak_flops_per_s")] + np.log(2), abs=1e-5
    )
    # A100 fp32: 19.5 TFLOP/s over 108 SMs at 1410 MHz = 128 FLOPs per SM per cycle (64 FP32 cores, FMA)
    assert np.exp(a[feature_index("hw_log_flops_per_sm_cycle")]) == pytest.approx(128, rel=0.01)
    # 128 tiles over 108 SMs: 2 waves where 1.19 would do; over 216 SMs one wave of 0.59
    waves = 4 * 32 / 108
    assert a[feature_index("log_wave_floor_ms")] == pytest.approx(
        a[feature_index("log_floor_ms")] + np.log(2 / waves), abs=1e-5
    )
    assert b[feature_index("log_wave_floor_ms")] == pytest.approx(
        b[feature_index("log_floor_ms")] + np.log(1 / (waves / 2)), abs=1e-5
    )
    # one output element per SM per cycle: 512 x 4096 elements over 108 SMs x 1410 MHz, in ms
    assert np.exp(a[feature_index("log_sm_cycle_ms")]) == pytest.approx(512 * 4096 / (108 * 1410e6) * 1e3, rel=1e-4)


def test_a_gemm_on_a_transposed_a_is_featurised_as_the_same_product() -> None:
    """``Transpose`` then ``Gemm(transA=1)`` is x (N, 784) · W (784, 10), as a plain ``Gemm`` is: its A is stored
    (K, M), and the features read K=784 as the batch and M as the input features (the batch of 64 as K)."""
    from onnx import TensorProto, helper, numpy_helper

    from app.core.ir import OpKind
    from app.core.onnx_import import import_onnx

    w = numpy_helper.from_array(np.full((784, 10), 0.5, np.float32), "w")

    def model(transposed: bool) -> bytes:
        nodes = ([helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                  helper.make_node("Gemm", ["xt", "w"], ["y"], transA=1)] if transposed
                 else [helper.make_node("Gemm", ["x", "w"], ["y"])])
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 784])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()

    hw = load_catalog()["a100-sxm4-40gb"]
    rows = []
    for transposed in (False, True):
        gemm = next(la for la in import_onnx(model(transposed), batch_size=64).layers if la.kind is OpKind.GEMM)
        rows.append(layer_features(layer=gemm, cost=layer_cost(gemm), hardware=hw, pass_="forward",
                                   optimizer="none", precision="fp32"))
    same = [i for i, n in enumerate(FEATURE_NAMES) if n != "needs_input_grad"]  # the Transpose makes it inner
    assert rows[1][same].tobytes() == rows[0][same].tobytes()
