"""The trainer's database loader: stored measurements → layers, specs and features, like the serving path."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from app.core.costs import layer_cost
from app.core.features import FEATURE_NAMES, layer_features
from app.core.hardware import HardwareSpec, hardware_from_dict, hardware_to_dict
from app.core.ir import GemmAttrs, OpKind
from app.profiler import iter_rows
from app.profiler.sampler import LayerConfig
from app.training.dataset import (
    SKIP_MATH,
    SKIP_NO_BUILDER,
    SKIP_PRECISION,
    config_key,
    iterations_from_database,
    load_from_database,
    record_layer,
    split_by_hash,
)
from tests.helpers import import_measurements

CPU = HardwareSpec(id="local", name="test CPU", vendor="x", kind="cpu", peak_flops_per_s={"fp32": 3e11},
                   memory_bytes=16e9, memory_bandwidth_bytes_per_s=2e10, compute_units=2, boost_clock_mhz=2600,
                   l2_cache_bytes=2**21, vector_width_bits=512)  # fmt: skip


def test_cpu_rows_equal_layer_features(training_db: str, seed_dir: Path) -> None:
    data = load_from_database(training_db, sources=("profiler",), specs={"local": CPU})
    assert len(data) > 500 and data.features.shape[1] == len(FEATURE_NAMES)
    assert np.isfinite(data.features).all()
    assert set(np.unique(data.pass_)) == {"forward", "train_step"}
    assert set(np.unique(data.software_stack)) == {"pytorch-eager"} and set(np.unique(data.granularity)) == {"layer"}
    assert (data.features[:, FEATURE_NAMES.index("is_cpu")] == 1).all()
    by_id = {r["config_id"]: r for r in iter_rows(seed_dir / "layers_cpu.jsonl")}
    for i in range(0, len(data), 97):
        r = by_id[data.config[i]]
        (layer,) = LayerConfig.from_row(r).to_layers("fp32")
        assert data.layers[i] == layer
        f = layer_features(layer=layer, cost=layer_cost(layer), hardware=CPU, pass_=str(data.pass_[i]),
                           optimizer=str(data.optimizer[i]), precision="fp32")  # fmt: skip
        np.testing.assert_array_equal(f, data.features[i])
        assert data.time_ms[i] == r["timings"][str(data.pass_[i])]["median_ms"]


def test_filters_limit_and_sampling(training_db: str) -> None:
    everything = load_from_database(training_db, sources=None)
    gpu = load_from_database(training_db, sources=None, hardware_kinds=("gpu",))
    cpu = load_from_database(training_db, sources=None, hardware_kinds=("cpu",))
    assert len(everything) == len(gpu) + len(cpu) and set(cpu.gpu) == {"local"}
    assert (np.diff(everything.measurement_id) > 0).all()  # id order
    assert len(load_from_database(training_db, sources=("justus2018",), limit=123)) == 123
    sampled = load_from_database(training_db, sources=("justus2018",), sample_per_file=7, seed=1)
    assert len(sampled) == 70 and {f.rows_kept for f in sampled.files} == {7}
    again = load_from_database(training_db, sources=("justus2018",), sample_per_file=7, seed=1)
    np.testing.assert_array_equal(sampled.measurement_id, again.measurement_id)
    assert {f.sha256 for f in sampled.files} == {f.sha256 for f in again.files}
    k80 = load_from_database(training_db, sources=("justus2018",), hardware_ids=("k80",))
    assert set(k80.gpu) == {"k80"} and len(k80) == 600
    with pytest.raises(ValueError, match="no stored measurements"):
        load_from_database(training_db, sources=("neusight",))
    with pytest.raises(ValueError, match="limit must be positive"):
        load_from_database(training_db, limit=0)
    forward = load_from_database(training_db, sources=("profiler",), passes=("forward",))
    assert set(forward.pass_) == {"forward"} and len(forward) == int((cpu.pass_ == "forward").sum())


def test_justus_split_keys_and_families(training_db: str) -> None:
    data = load_from_database(training_db, sources=("justus2018",), hardware_ids=("p100",), limit=5000)
    assert set(data.family) == {"conv", "dense"}
    conv = data.config[data.family == "conv"][0].split("|")
    assert conv[0] == "conv" and len(conv) == 10 and conv[8] in ("True", "False")
    # forward rows carry no optimizer; the training steps of parameter layers keep theirs
    assert set(data.optimizer[data.pass_ == "forward"]) == {"none"}


@pytest.fixture(scope="module")
def kernel_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('kernel-db') / 'measurements.db'}"
    import_measurements(url, "neusight", "--limit", "30")
    import_measurements(url, "vidur", "--limit", "4")
    return url


def test_neusight_and_vidur_rows_rebuild(kernel_db: str) -> None:
    data = load_from_database(kernel_db, sources=("neusight", "vidur"))
    # 30 files x 30 NeuSight rows; Vidur: 2 compute tables x 4 rows x 10 ops; the collectives have no layer
    assert len(data) == 900 + 80
    assert data.skipped == {("vidur", SKIP_NO_BUILDER): 8}
    ns = data.subset(data.source == "neusight")
    assert set(ns.precision) == {"fp32-strict"} and set(ns.granularity) == {"kernel"}
    assert {"neusight:bmm", "neusight:conv", "neusight:add", "neusight:ln", "neusight:softmax"} <= set(ns.family)
    vd = data.subset(data.source == "vidur")
    assert set(vd.precision) == {"fp16"} and {la.inputs[0].dtype for la in vd.layers} == {"float16", "int64"}
    kinds = {la.kind for la in data.layers}
    assert {OpKind.MATMUL, OpKind.GEMM, OpKind.CONV, OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX,
            OpKind.EMBEDDING} <= kinds  # fmt: skip
    assert set(data.hardware) >= {"p4", "t4", "p100", "a100-pcie-40gb", "mi100", "a40"}
    assert np.isfinite(data.features).all()


def test_deepbench_int8_kernels_are_skipped_with_a_reason(tmp_path: Path) -> None:
    """DeepBench's int8 GEMM/conv rows have no peaks in the cost model: the loader skips them by name instead of
    failing the whole load (``layercast train --sources deepbench`` raised ``'int8' is not a valid Precision``)."""
    url = f"sqlite:///{tmp_path / 'deepbench.db'}"
    import_measurements(url, "deepbench")
    data = load_from_database(url, sources=("deepbench",), hardware_kinds=("gpu",))
    assert data.skipped[("deepbench", SKIP_PRECISION)] > 0
    assert "int8" not in set(data.precision) and "fp32" in set(data.precision)
    assert {"deepbench:conv2d", "deepbench:matmul"} <= set(data.family) and np.isfinite(data.features).all()


def test_deepbench_fp16_storage_fp32_math_kernels_are_stored_but_not_trained_on(tmp_path: Path) -> None:
    """DeepBench's only fp16 rows are the P100's "16 bit inputs, 32 bit math" kernels: fp32 arithmetic on
    2-byte operands. As fp16 rows, featurised with the fp16 peak, they taught that fp16 runs no faster than fp32
    (a training run with DeepBench put A100 AMP ResNet-50 at 0.54x of its published throughput); they stay stored,
    as fp16 with ``math_precision`` fp32 in their config, and the loader skips them by that reason."""
    from sqlalchemy import create_engine, select

    from app.measurements.models import Measurement

    url = f"sqlite:///{tmp_path / 'deepbench.db'}"
    import_measurements(url, "deepbench")
    with create_engine(url).connect() as c:
        stored = c.execute(select(Measurement.precision, Measurement.config, Measurement.hardware_id)
                           .where(Measurement.source == "deepbench")).all()
    half = [r for r in stored if r.precision == "fp16"]
    assert half and all(r.config["math_precision"] == "fp32" and r.hardware_id == "p100" for r in half)
    assert not any("math_precision" in r.config for r in stored if r.precision != "fp16")
    data = load_from_database(url, sources=("deepbench",), hardware_kinds=("gpu",))
    assert 0 < data.skipped[("deepbench", SKIP_MATH)] <= len(half)  # the rest skipped before (passes, RNNs)
    assert "fp16" not in set(data.precision)


def test_record_layer_shape_records() -> None:
    bmm = record_layer(source="neusight", config={"layer": {"op": "matmul", "a": [4, 8, 16], "b": [4, 16, 2]}},
                       batch_size=4, precision="fp32-strict")  # fmt: skip
    assert not isinstance(bmm, str)
    assert bmm.kind is OpKind.MATMUL and bmm.outputs[0].shape == (4, 8, 2)
    assert isinstance(bmm.attrs, GemmAttrs)
    assert (bmm.attrs.m, bmm.attrs.n, bmm.attrs.k, bmm.attrs.batch) == (8, 2, 16, (4,))
    pow_scalar = {"layer": {"op": "elementwise", "fn": "pow", "shape": [3, 5], "operand": "scalar"}}
    scalar = record_layer(source="neusight", batch_size=3, precision="fp32-strict", config=pow_scalar)
    assert not isinstance(scalar, str) and len(scalar.inputs) == 1 and scalar.op_type == "Pow"
    silu = record_layer(source="vidur", batch_size=7, precision="fp16",
                        config={"layer": {"op": "elementwise", "fn": "silu_and_mul", "shape": [7, 20]}})
    assert not isinstance(silu, str) and silu.outputs[0].shape == (7, 10) and silu.outputs[0].dtype == "float16"
    deepbench = {"layer": {"op": "matmul", "m": 64, "n": 32, "k": 128, "a_trans": True, "b_trans": False}}
    gemm = record_layer(source="deepbench", batch_size=1, precision="fp32", config=deepbench)
    assert not isinstance(gemm, str) and gemm.inputs[0].shape == (128, 64) and gemm.outputs[0].shape == (64, 32)
    assert layer_cost(gemm).forward_flops == 2 * 64 * 32 * 128
    ar = {"layer": {"op": "allreduce", "size_bytes": 2048, "n_ranks": 2}}
    assert record_layer(source="vidur", config=ar, batch_size=1, precision="fp16") == SKIP_NO_BUILDER
    bad = {"input_shape": [0], "layer": {"op": "relu"}}
    assert record_layer(source="neusight", config=bad, batch_size=1, precision="fp32") == "config_does_not_rebuild"
    a = config_key(source="neusight", config={"layer": {"op": "relu"}, "input_shape": [3]}, batch_size=2)
    assert a == config_key(source="neusight", config={"input_shape": [3], "layer": {"op": "relu"}}, batch_size=2)


def test_vidur_fused_ops_cost_by_hand() -> None:
    """FLOPs and DRAM bytes of Vidur's fused element-wise ops, counted by hand from their definitions (fp16)."""
    silu = record_layer(source="vidur", batch_size=7, precision="fp16",
                        config={"layer": {"op": "elementwise", "fn": "silu_and_mul", "shape": [7, 20]}})
    assert not isinstance(silu, str)
    c = layer_cost(silu)  # SiLU(gate) (5 FLOPs) x up (1) per output: 6 x 70; read 140, write 70 halves
    assert (c.forward_flops, c.forward_bytes_read, c.forward_bytes_written) == (6 * 70, 140 * 2, 70 * 2)
    rope_cfg = {"layer": {"op": "rope", "q_shape": [4, 256], "k_shape": [4, 128], "rotary_dim": 128}}
    rope = record_layer(source="vidur", batch_size=4, precision="fp16", config=rope_cfg)
    assert not isinstance(rope, str)
    c = layer_cost(rope)  # 2 mul + 1 add per rotated element of q and k: 3 x 4 x 384
    assert c.forward_flops == 3 * 4 * 384
    # in place: reads q, k, each token's int64 position and its 128-wide cos/sin row; writes q and k
    assert c.forward_bytes_read == 4 * 384 * 2 + 4 * 8 + 4 * 128 * 2 and c.forward_bytes_written == 4 * 384 * 2
    add3 = {"layer": {"op": "elementwise", "fn": "add", "shape": [4, 8], "operand": "tensor", "operands": 3}}
    add = record_layer(source="vidur", batch_size=4, precision="fp16", config=add3)
    assert not isinstance(add, str)
    c = layer_cost(add)  # a + b + c: 2 adds per output; any kernel reads 3 tensors and writes 1
    assert (c.forward_flops, c.forward_bytes_read, c.forward_bytes_written) == (2 * 32, 3 * 32 * 2, 32 * 2)
    add2 = record_layer(source="vidur", batch_size=4, precision="fp16",
                        config={"layer": {**add3["layer"], "operands": 2}})  # fmt: skip
    assert not isinstance(add2, str) and layer_cost(add2).forward_flops == 32
    bad = {"layer": {**add3["layer"], "operands": 1}}
    assert record_layer(source="vidur", batch_size=4, precision="fp16", config=bad) == "config_does_not_rebuild"


def test_iterations_come_from_the_database(tmp_path: Path) -> None:
    seed = Path(__file__).resolve().parents[2] / "data" / "seed"
    url = f"sqlite:///{tmp_path / 'm.db'}"
    import_measurements(url, "profiler", "--data-dir", str(seed), "--limit", "3")
    its = iterations_from_database(url)
    with gzip.open(seed / "e2e_cpu.jsonl.gz", "rt") as fh:
        lines = [json.loads(x) for x in fh][:3]
    assert [(r["arch"], r["batch_size"], r["train_step_ms"]) for r in its] == [
        (r["arch"], r["batch_size"], r["train_step_ms"]) for r in lines
    ]
    assert {r["software_stack"] for r in its} == {"pytorch-eager"} and all(r["onnx"] for r in its)
    # the backward and update passes are stored but not featurised: counted, not dropped silently
    backward = load_from_database(url, sources=("profiler",), passes=("forward", "backward", "update"))
    assert backward.skipped[("profiler", "pass_not_featurised")] >= 3 * 2


def test_hash_split_is_stable_when_the_dataset_grows() -> None:
    keys = np.array([f"k{i}" for i in range(500)])
    a = split_by_hash(keys, seed=0)
    b = split_by_hash(np.concatenate([keys, [f"new{i}" for i in range(300)]]), seed=0)
    assert (a == b[:500]).all()
    assert 0.6 < (a == 0).mean() < 0.8


def test_hardware_snapshot_round_trip() -> None:
    assert hardware_from_dict(hardware_to_dict(CPU)) == CPU
