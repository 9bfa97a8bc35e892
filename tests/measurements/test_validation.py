"""Physical plausibility of reported measurements (app.measurements.validation): the bounds, the roofline
floor of a rebuilt layer, real published measurements all accepted, and the API refusing the issue's
poisoned rows (1e-12 ms, 1e300 ms, 18x faster than physics) with nothing stored."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from app.core.limits import Limits, use_limits
from app.core.vocab import Granularity, SoftwareStack
from app.hardware.catalog import load_catalog, spec_from_dict
from app.hardware.models import Hardware
from app.measurements import validation
from app.measurements.importers import MeasurementRecord, iter_justus
from app.measurements.models import Measurement
from app.measurements.validation import (
    FLOOR_TOLERANCE,
    ImplausibleMeasurement,
    InvalidLayerConfig,
    RowProblem,
    check_layer_config,
    check_plausible,
    field_problems,
    floor_ms,
)
from tests.helpers import SHARED_DATA

A100 = load_catalog()["a100-sxm4-40gb"]
CONV: dict[str, Any] = {"input_shape": [64, 56, 56], "layer": {"op": "conv2d", "out_channels": 64, "kernel_size": 3,
                                                             "padding": 1}}
LAYER: dict[str, Any] = {"hardware_id": "a100-sxm4-40gb", "source": "ci", "op_kind": "conv", "pass": "forward",
                         "software_stack": "pytorch-eager", "granularity": "layer", "batch_size": 64, "config": CONV}


def _check(time_ms: float, granularity: str = "layer", config: dict[str, Any] | None = None) -> None:
    check_plausible(time_ms=time_ms, granularity=granularity, config=config or CONV, batch_size=64, spec=A100,
                    precision="fp32", pass_="forward")


def test_floor_of_a_conv_is_its_roofline_time() -> None:
    floor = floor_ms(config=CONV, batch_size=64, spec=A100, precision="fp32", pass_="forward")
    assert floor is not None
    # 2*MACs at the TF32 peak is an upper bound of the floor (Winograd may do fewer FLOPs); bytes/bandwidth a lower one
    macs = 64 * 64 * 56 * 56 * 64 * 9
    assert 2 * macs / A100.peak_flops_per_s["tf32"] * 1e3 >= floor
    assert floor >= 4 * (2 * 64 * 64 * 56 * 56) / A100.memory_bandwidth_bytes_per_s * 1e3
    assert floor_ms(config={"model": "resnet50"}, batch_size=64, spec=A100, precision="fp32", pass_="forward") is None


def test_remembered_rebuilds_keep_each_config_its_own_floor_and_the_active_limits() -> None:
    """The per-process memo of rebuilt layers (a source repeats each configuration) must not hand one
    config's layer to another, nor let a config rebuilt under the default limits pass under stricter ones."""
    wide = {**CONV, "layer": {**CONV["layer"], "out_channels": 128}}
    settings = [(CONV, 64), (wide, 64), (CONV, 128)]

    def floors() -> list[float | None]:
        return [floor_ms(config=c, batch_size=b, spec=A100, precision="fp32", pass_="forward") for c, b in settings]

    validation._rebuilt_cached.cache_clear()
    first = floors()  # each rebuilt once
    again = floors()  # each from the memo
    assert validation._rebuilt_cached.cache_info().hits >= 3
    assert again == first and len(set(first)) == 3 and None not in first
    check_layer_config(op_kind="conv", config=CONV, batch_size=64)  # remembered under the default limits
    with use_limits(Limits(max_tensor_elements=64 * 56 * 56)), pytest.raises(InvalidLayerConfig):
        check_layer_config(op_kind="conv", config=CONV, batch_size=64)  # 64 x 64 x 56 x 56 inputs: over it


@pytest.mark.parametrize(
    ("time_ms", "granularity", "reason"),
    [(1e-12, "layer", "below_minimum"), (1e300, "layer", "above_maximum"), (2e6, "iteration", None),
     (1e8, "iteration", "above_maximum"), (1e10, "job", None), (1e11, "job", "above_maximum")],
)
def test_bounds(time_ms: float, granularity: str, reason: str | None) -> None:
    config = {"model": "resnet50"}  # no floor: only the bounds apply
    if reason is None:
        _check(time_ms, granularity, config)
        return
    with pytest.raises(ImplausibleMeasurement) as info:
        _check(time_ms, granularity, config)
    assert info.value.detail["reason"] == reason


def test_below_the_floor_is_refused_and_just_above_the_tolerance_is_not() -> None:
    floor = floor_ms(config=CONV, batch_size=64, spec=A100, precision="fp32", pass_="forward")
    assert floor is not None
    _check(floor * FLOOR_TOLERANCE * 1.01)
    with pytest.raises(ImplausibleMeasurement) as info:
        _check(floor / 18)  # the poisoned model was 18x too fast
    assert info.value.detail["reason"] == "below_physics_floor" and info.value.detail["floor_ms"] == floor
    # an iteration is not a layer: no floor from its config
    _check(floor / 18, "iteration")


def test_published_layer_measurements_are_all_plausible(justus_db: str) -> None:
    """Every stored Justus row (3,000: conv and dense layers on 6 GPUs) passes the floor check: the
    tolerance does not refuse real measurements."""
    engine = create_engine(justus_db)
    refused = checked = 0
    with Session(engine) as session:
        specs = {i: spec_from_dict(s) for i, s in session.execute(select(Hardware.id, Hardware.spec))}
        for m in session.scalars(select(Measurement)):
            floor = floor_ms(config=m.config, batch_size=m.batch_size, spec=specs[m.hardware_id],
                             precision=m.precision, pass_=m.pass_, optimizer=m.optimizer)
            checked += floor is not None
            try:
                check_plausible(time_ms=m.time_ms_median, granularity=m.granularity or Granularity.LAYER,
                                config=m.config, batch_size=m.batch_size, spec=specs[m.hardware_id],
                                precision=m.precision, pass_=m.pass_, optimizer=m.optimizer)
            except ImplausibleMeasurement:
                refused += 1
    engine.dispose()
    assert checked > 2000 and refused == 0


def test_the_fastest_published_convolutions_are_plausible() -> None:
    """The two Justus rows furthest under their floor of all 250,000 (P100 7x7 forward convolutions at 0.219x
    and 0.220x: cuDNN's FFT algorithm does fewer FLOPs than the cheapest one the cost model knows) are real;
    the tolerance of 0.25 refused them, so ``layercast import justus`` could not store the data set whole."""
    wanted = {3274, 16262}
    rows = []
    for record in iter_justus(SHARED_DATA / "justus2018" / "conv_Tesla_P100.csv.gz", limit=16263):
        if record.context["source_row"] in wanted:
            rows.append(record)
    assert len(rows) == 2
    p100 = load_catalog()["p100"]
    for r in rows:
        floor = floor_ms(config=r.config, batch_size=r.batch_size, spec=p100, precision=r.precision, pass_=r.pass_)
        assert floor is not None and 0.2 < r.time_ms_median / floor < 0.221
        check_plausible(time_ms=r.time_ms_median, granularity=r.granularity, config=r.config,
                        batch_size=r.batch_size, spec=p100, precision=r.precision, pass_=r.pass_,
                        optimizer=r.optimizer)  # fmt: skip


def test_api_refuses_implausible_rows_and_stores_nothing(client: TestClient) -> None:
    floor = floor_ms(config=CONV, batch_size=64, spec=A100, precision="fp32", pass_="forward")
    assert floor is not None
    rows = [{**LAYER, "time_ms_median": floor * 3}, {**LAYER, "time_ms_median": 1e-12},
            {**LAYER, "time_ms_median": 1e300}, {**LAYER, "time_ms_median": floor / 18}]
    r = client.post("/v1/measurements", json={"measurements": rows})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_measurements"
    errors = r.json()["error"]["detail"]["errors"]
    assert [(e["index"], e["code"], e["field"]) for e in errors] == [
        (i, "implausible_measurement", "time_ms_median") for i in (1, 2, 3)]
    assert client.get("/v1/measurements", params={"source": "ci"}).json()["total"] == 0
    assert client.post("/v1/measurements", json={"measurements": rows[:1]}).status_code == 201


def test_api_refuses_spreads_no_repetitions_have_and_dates_in_the_future(client: TestClient) -> None:
    floor = floor_ms(config=CONV, batch_size=64, spec=A100, precision="fp32", pass_="forward")
    assert floor is not None
    ok = {**LAYER, "time_ms_median": floor * 3}
    soon = (datetime.now(UTC) + timedelta(hours=20)).isoformat()  # inside the allowed clock skew
    late = (datetime.now(UTC) + timedelta(days=2)).isoformat()
    rows = [{**ok, "time_ms_std": 1e300}, {**ok, "time_ms_std": 3e6, "repetitions": 2},
            {**ok, "time_ms_std": 0.5, "repetitions": 1}, {**ok, "measured_at": "2999-01-01T00:00:00Z"},
            {**ok, "measured_at": late}, {**ok, "measured_at": "1970-01-01T00:00:00Z"},
            {**ok, "time_ms_std": 2.5e6, "repetitions": 2, "measured_at": soon},  # within M / sqrt(2): accepted
            {**ok, "time_ms_std": 100 * floor, "repetitions": 11, "measured_at": "2018-03-01T09:00:00+01:00"}]
    r = client.post("/v1/measurements", json={"measurements": rows})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_measurements", r.text
    errors = r.json()["error"]["detail"]["errors"]
    assert [(e["index"], e["code"], e["field"]) for e in errors] == [
        (0, "implausible_measurement", "time_ms_std"), (1, "implausible_measurement", "time_ms_std"),
        (2, "implausible_measurement", "time_ms_std"), (3, "implausible_measurement", "measured_at"),
        (4, "implausible_measurement", "measured_at"), (5, "implausible_measurement", "measured_at")]
    assert "2999" in errors[3]["message"] and "future" in errors[3]["message"]
    assert "1970" in errors[5]["message"] and "Unix epoch" in errors[5]["message"]
    assert client.get("/v1/measurements", params={"source": "ci"}).json()["total"] == 0
    r = client.post("/v1/measurements", json={"measurements": rows[6:]})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(("change", "field"), [
    ({"config": {**CONV, "layer": {**CONV["layer"], "op": "conv2dd"}}}, "config.layer"),
    ({"op_kind": "gemm", "config": {"input_shape": [512], "layer": {"op": "linearr", "out_features": 10}}},
     "config.layer"),
    ({"op_kind": "gemm", "config": {"input_shape": [512], "layer": {"op": "linear", "out_features": -3}}},
     "config.layer"),
    ({"op_kind": "gemm", "config": {"input_shape": [512], "layer": {"op": "linear", "in_features": "x",
                                                                     "out_features": 10}}},
     "config.layer.in_features"),
    ({"config": {**CONV, "layer": {**CONV["layer"], "in_channels": 3}}}, "config.layer.in_channels"),
    # every declared input size the graph importer checks (app.core.json_import.DECLARED_INPUT_SIZES)
    ({"op_kind": "norm", "config": {"input_shape": [16, 64], "layer": {"op": "layernorm", "normalized_shape": 128}}},
     "config.layer.normalized_shape"),
    ({"config": {"layer": CONV["layer"]}}, "config.input_shape"),
    ({"op_kind": "whatever"}, "op_kind"),
    ({"op_kind": "gemm"}, "op_kind"),  # a conv config labelled a GEMM
    # a layer timed as a job took a job's bound (a year), a whole iteration timed as a layer was a layer row
    ({"granularity": "job", "time_ms_median": 3e10}, "granularity"),
    ({"granularity": "iteration"}, "granularity"),
    ({"op_kind": "iteration", "granularity": "layer", "config": {"model": "resnet50"}}, "granularity"),
    ({"op_kind": "job", "granularity": "kernel", "config": {"model": "resnet50"}}, "granularity"),
])
def test_api_refuses_rows_whose_config_is_not_a_layer(client: TestClient, change: dict[str, Any], field: str) -> None:
    """Such rows used to skip the physics floor (no layer, no floor) and be stored for retraining (201)."""
    good = {**LAYER, "time_ms_median": 5.0}
    r = client.post("/v1/measurements", json={"measurements": [good, {**good, **change}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_measurements", r.text
    errors = r.json()["error"]["detail"]["errors"]
    assert [(e["index"], e["code"], e["field"]) for e in errors] == [(1, "invalid_layer_config", field)], errors
    assert client.get("/v1/measurements", params={"source": "ci"}).json()["total"] == 0  # all or none
    # a correct declared size, and rows of other vocabularies or whole iterations, are still stored
    ok = [good, {**good, "config": {**CONV, "layer": {**CONV["layer"], "in_channels": 64}}},
          {**good, "op_kind": "gemm", "config": {"family": "gemm", "shapes": [[64, 512], [512, 10]]}},
          {**good, "op_kind": "iteration", "granularity": "iteration", "config": {"model": "resnet50"}}]
    assert client.post("/v1/measurements", json={"measurements": ok}).status_code == 201


def test_api_accepts_the_shape_records_collectives_and_cpu_precisions_that_are_really_measured(
        client: TestClient) -> None:
    """What the importers and the profiler store of real measurements is a row the API takes too: DeepBench's
    bare GEMM and NeuSight's batched matmul, Vidur's element-wise ops, RoPE and NCCL collectives (configs of the
    importers' shape-record vocabulary, no ``input_shape``), and a bf16 time on a CPU, which PyTorch's CPU
    autocast runs without bf16 arithmetic (the seed profiler shard holds 5,128 such rows); fp8 on a Hopper GPU,
    int8 on a V100 (DP4A, no int8 peak listed) and fp64 anywhere. A shape record of another kind than its
    ``op_kind``, bf16 on a GPU without bf16 arithmetic and fp8 on a GPU without fp8 are still refused."""
    kernel = {**LAYER, "granularity": "kernel", "time_ms_median": 0.5, "hardware_id": "a100-pcie-80gb",
              "precision": "fp16"}
    gemm = {"layer": {"op": "matmul", "m": 5124, "n": 700, "k": 2048, "a_trans": False, "b_trans": False}}
    rows = [{**kernel, "op_kind": "gemm", "config": gemm},
            {**kernel, "op_kind": "matmul", "config": {"layer": {"op": "matmul", "a": [8, 64, 64], "b": [8, 64, 32]}}},
            {**kernel, "op_kind": "elementwise",
             "config": {"layer": {"op": "elementwise", "fn": "silu_and_mul", "shape": [4096, 49152]}}},
            {**kernel, "op_kind": "elementwise",
             "config": {"layer": {"op": "rope", "q_shape": [4096, 8192], "k_shape": [4096, 8192], "rotary_dim": 128}}},
            {**kernel, "op_kind": "allreduce", "batch_size": 1, "config": {"layer": {
                "op": "allreduce", "size_bytes": 2048, "n_ranks": 2, "devices_per_node": 1, "n_nodes": 2}}},
            {**kernel, "op_kind": "send_recv", "batch_size": 1, "config": {"layer": {
                "op": "send_recv", "size_bytes": 2048, "n_ranks": 2, "devices_per_node": 1, "n_nodes": 2}}},
            {**LAYER, "hardware_id": "local", "precision": "bf16", "time_ms_median": 400.0},
            {**LAYER, "hardware_id": "h100-sxm", "precision": "fp8", "time_ms_median": 1.0},
            {**LAYER, "hardware_id": "v100-sxm2-16gb", "precision": "int8", "time_ms_median": 5.0},
            {**LAYER, "hardware_id": "t4", "precision": "fp64", "time_ms_median": 400.0}]
    r = client.post("/v1/measurements", json={"measurements": rows})
    assert r.status_code == 201, r.text
    wrong = [{**kernel, "op_kind": "conv", "config": gemm},
             {**kernel, "op_kind": "gemm", "config": {"layer": {"op": "allreduce", "size_bytes": 2048}}},
             {**LAYER, "hardware_id": "k80", "precision": "bf16", "time_ms_median": 40.0},
             {**LAYER, "hardware_id": "a100-sxm4-40gb", "precision": "fp8", "time_ms_median": 5.0},
             {**LAYER, "hardware_id": "local", "precision": "fp8", "time_ms_median": 400.0}]
    r = client.post("/v1/measurements", json={"measurements": wrong})
    assert r.status_code == 422, r.text
    assert [(e["index"], e["code"], e["field"]) for e in r.json()["error"]["detail"]["errors"]] == [
        (0, "invalid_layer_config", "op_kind"), (1, "invalid_layer_config", "op_kind"),
        (2, "precision_not_supported", "precision"), (3, "precision_not_supported", "precision"),
        (4, "precision_not_supported", "precision")]


def _record(**overrides: Any) -> MeasurementRecord:
    values: dict[str, Any] = {
        "hardware_id": "a100-sxm4-40gb", "source": "ci", "op_kind": "conv", "pass_": "forward", "optimizer": "none",
        "precision": "fp32", "software_stack": SoftwareStack.PYTORCH_EAGER, "granularity": Granularity.LAYER,
        "batch_size": 64, "config": CONV, "time_ms_median": 5.0, "time_ms_std": None, "repetitions": None,
        "context": {},
    }
    return MeasurementRecord(**{**values, **overrides})


def test_shape_records_are_checked_and_held_to_their_floor(client: TestClient) -> None:
    """A shape record carried no check and no floor, so any GEMM time could poison the data: a 65,536-cubed
    matmul in 0.0002 ms (2.8e21 FLOP/s on an A100), a matmul with no fields, negative sizes, a collective
    without its size. Each is refused now; the real records of every public source still import
    (``layercast import``: 0 refused)."""
    kernel = {**LAYER, "granularity": "kernel", "hardware_id": "a100-pcie-80gb", "precision": "fp16"}
    cases = [
        ("gemm", {"op": "matmul", "m": 65536, "n": 65536, "k": 65536}, 0.0002, "implausible_measurement",
         "time_ms_median"),
        ("gemm", {"op": "matmul"}, 1.0, "invalid_layer_config", "config.layer"),
        ("gemm", {"op": "matmul", "m": -3, "n": 4, "k": 4}, 1.0, "invalid_layer_config", "config.layer"),
        ("matmul", {"op": "matmul", "a": [8, 64, 64], "b": [8, 32, 64]}, 1.0, "invalid_layer_config", "config.layer"),
        ("elementwise", {"op": "elementwise", "fn": "add", "shape": [1 << 30]}, 0.001, "implausible_measurement",
         "time_ms_median"),
        ("elementwise", {"op": "elementwise", "fn": "frobnicate", "shape": [8]}, 1.0, "invalid_layer_config",
         "config.layer"),
        ("allreduce", {"op": "allreduce"}, 1.0, "invalid_layer_config", "config.layer"),
    ]
    for op_kind, layer, t, code, field in cases:
        r = client.post("/v1/measurements", json={"measurements": [
            {**kernel, "op_kind": op_kind, "time_ms_median": t, "batch_size": 1, "config": {"layer": layer}}]})
        assert r.status_code == 422, (layer, r.text)
        [error] = r.json()["error"]["detail"]["errors"]
        assert (error["code"], error["field"]) == (code, field), (layer, error)
    assert client.get("/v1/measurements").json()["total"] == 0


def test_field_problems_is_one_rule_set_over_a_record() -> None:
    """The per-row checks of ``POST /v1/measurements`` and ``layercast import``: every problem of a row, the
    device's and the graph's checks given the stored device and graphs."""
    now = datetime.now(UTC)
    stored = {"a" * 64}

    def problems(spec: Any = A100, **overrides: Any) -> list[tuple[str, str]]:
        found = field_problems(_record(**overrides), spec=spec, graph_exists=stored.__contains__, now=now)
        assert all(isinstance(p, RowProblem) and p.message for p in found)
        return [(p.code, p.field) for p in found]

    assert problems() == []
    assert problems(time_ms_median=1e-12) == [("implausible_measurement", "time_ms_median")]
    assert problems(time_ms_std=1e300, measured_at=now + timedelta(days=3)) == [
        ("implausible_measurement", "time_ms_std"), ("implausible_measurement", "measured_at")]
    assert problems(op_kind="gemmm") == [("invalid_layer_config", "op_kind")]  # no layer: nothing more is checked
    assert problems(spec=None) == [("hardware_not_found", "hardware_id")]
    assert problems(precision="bf16", spec=load_catalog()["k80"]) == [("precision_not_supported", "precision")]
    cpu = replace(load_catalog()["k80"], kind="cpu", id="a-cpu")  # no bf16 nor tf32 peak
    assert problems(precision="bf16", spec=cpu, time_ms_median=500.0) == []  # CPU autocast: a real time
    # ... but not one faster than the fp32 arithmetic allows (it had no floor at all)
    assert problems(precision="bf16", spec=cpu, time_ms_median=0.001) == [("implausible_measurement",
                                                                         "time_ms_median")]
    assert problems(precision="tf32", spec=cpu, time_ms_median=500.0) == [("precision_not_supported", "precision")]
    assert problems(software_stack=SoftwareStack.CUDA_LIBRARY, spec=replace(A100, kind="cpu")) == [
        ("stack_not_supported", "software_stack")]
    whole = {"op_kind": "iteration", "granularity": Granularity.ITERATION, "time_ms_median": 200.0}
    assert problems(**whole, config={"graph_id": "a" * 64}) == []
    assert problems(**whole, config={"graph_id": "b" * 64}) == [("graph_not_found", "config.graph_id")]
