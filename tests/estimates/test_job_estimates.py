"""POST /v1/job-estimates and /actuals: compact scheduler answers, data parallel, calibration that learns."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.core.memory import HEADROOM
from app.estimates.calibration import calibrate
from app.estimates.schemas import MAX_JOBS

A100 = "a100-sxm4-40gb"


def _job(graph_id: str, **kw: object) -> dict[str, object]:
    return {"graph_id": graph_id, "hardware_id": A100, "batch_size": 64, "dataset_size": 50_000, "epochs": 2, **kw}


def _estimate(client: TestClient, jobs: list[dict[str, object]]) -> list[dict[str, object]]:
    r = client.post("/v1/job-estimates", json={"jobs": jobs})
    assert r.status_code == 200, r.text
    return list(r.json()["estimates"])


def test_single_device_p50_is_the_predicted_job_time(client: TestClient, resnet_id: str) -> None:
    est = _estimate(client, [_job(resnet_id), _job(resnet_id, batch_size=4096)])
    single = client.post("/v1/predictions", json=_job(resnet_id)).json()
    assert est[0]["p50_s"] == pytest.approx(single["job"]["time_s"], rel=1e-9)
    assert est[0]["p90_s"] == pytest.approx(single["job"]["time_s_p90"], rel=1e-9)
    assert est[0]["fits"] is True and est[0]["actuals"] == 0
    assert est[1]["fits"] is False  # ResNet-50 at 4,096 samples does not fit in 40 GB
    assert set(est[0]) == {"index", "p50_s", "p90_s", "fits", "actuals", "calibration_factor", "calibration_group",
                           "warnings", "error"}
    assert est[0]["warnings"] == []


def test_a_job_says_what_it_assumed_as_its_prediction_does(client: TestClient, resnet_id: str, node: str) -> None:
    """16 devices on 2 nodes without a network: the default link is assumed and said, in the words of the
    prediction's warning; with both network fields nothing is assumed and nothing said."""
    spread = _job(resnet_id, hardware_id=node, batch_size=1024, device_count=16, nodes=2)
    given = {**spread, "inter_node_bandwidth_bytes_per_s": 50e9, "inter_node_latency_s": 5e-6}
    assumed, told = _estimate(client, [spread, given])
    single = client.post("/v1/predictions", json={**spread, "detail": "summary"}).json()
    network = [w for w in single["warnings"] if "inter-node network assumed" in w]
    assert len(network) == 1 and assumed["warnings"] == network
    assert told["warnings"] == []


RUN = {"activation_checkpointing": True, "iteration_overhead_ms": 3.0, "loading_samples_per_s": 2_000.0,
       "loading_overlapped": False, "eval_size": 10_000, "checkpoint_every_epochs": 1.0,
       "checkpoint_write_bytes_per_s": 1e8}


def test_a_jobs_run_settings_are_the_predictions(client: TestClient, resnet_id: str) -> None:
    """Activation checkpointing, the iteration overhead, the input pipeline, an evaluation set and checkpoint
    writes change a job's estimate exactly as they change POST /v1/predictions' job (the same model); a
    comparison row takes them too, and refuses checkpointing in inference like a prediction."""
    big = _job(resnet_id, batch_size=1024)
    plain, run = _estimate(client, [big, {**big, **RUN}])
    single = client.post("/v1/predictions", json={**big, **RUN, "detail": "summary"}).json()
    assert run["p50_s"] == pytest.approx(single["job"]["time_s"], rel=1e-9)
    assert run["p90_s"] == pytest.approx(single["job"]["time_s_p90"], rel=1e-9)
    assert run["p50_s"] > plain["p50_s"]
    assert plain["fits"] is False and run["fits"] is True  # checkpointing is what makes batch 1024 fit in 40 GB
    compared = client.post("/v1/comparisons", json={
        "graph_id": resnet_id, "batch_size": 1024, "dataset_size": 50_000, "epochs": 2, "hardware_ids": [A100],
        **RUN}).json()
    assert compared["rows"][0]["job_s"] == pytest.approx(single["job"]["time_s"], rel=1e-9)
    assert compared["rows"][0]["fits"] is True
    refused = client.post("/v1/comparisons", json={"graph_id": resnet_id, "batch_size": 64, "mode": "inference",
                                                   "activation_checkpointing": True})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "validation_error"
    # a setting that means nothing alone is refused alone, at parse time, on every path (it was a 500 in a
    # comparison, whose rows are built after parsing)
    for alone in ({"checkpoint_every_epochs": 1.0}, {"checkpoint_write_bytes_per_s": 1e8},
                  {"loading_overlapped": False}):
        for path, body in (("/v1/comparisons", {"graph_id": resnet_id, "batch_size": 64, "dataset_size": 640,
                                                "epochs": 1, "hardware_ids": [A100], **alone}),
                           ("/v1/job-estimates", {"jobs": [{**_job(resnet_id), **alone}]}),
                           ("/v1/predictions", {**_job(resnet_id), **alone})):
            r = client.post(path, json=body)
            assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", (path, alone, r.text)


def test_data_parallel_is_faster_but_not_linear(client: TestClient, resnet_id: str, node: str) -> None:
    one, eight = _estimate(client, [_job(resnet_id, hardware_id=node, batch_size=512),
                                    _job(resnet_id, hardware_id=node, batch_size=512, device_count=8)])
    assert one["p50_s"] / 8 < eight["p50_s"] < one["p50_s"]  # the all-reduce is not free


def test_per_job_errors(client: TestClient, resnet_id: str, lonely: str) -> None:
    est = _estimate(client, [
        _job(resnet_id, device_count=8, hardware_id=lonely),  # no interconnect listed
        _job(resnet_id, batch_size=63, device_count=2),  # 63 samples do not divide over 2 devices
        _job("f" * 64), _job(resnet_id, hardware_id="k80", precision="bf16"), _job(resnet_id),
    ])
    codes = [(e["error"] or {}).get("code") for e in est]  # type: ignore[union-attr]
    assert codes == ["no_interconnect", "validation_error", "graph_not_found", "precision_not_supported", None]


def test_gpu_only_stack_on_a_cpu_fails_its_job(client: TestClient, resnet_id: str) -> None:
    est = _estimate(client, [_job(resnet_id, hardware_id="local", software_stack="cuda-library"),
                             _job(resnet_id, software_stack="cuda-library")])
    codes = [(e["error"] or {}).get("code") for e in est]  # type: ignore[union-attr]
    assert codes == ["stack_not_supported", None]
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [
        {**_job(resnet_id, hardware_id="local", software_stack="pytorch-cuda-graph"), "measured_s": 100.0}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_actuals", r.text
    assert r.json()["error"]["detail"]["actuals"][0]["error"]["code"] == "stack_not_supported"


def test_devices_are_read_in_one_query_and_unknown_ones_still_fail(client: TestClient, resnet_id: str) -> None:
    from sqlalchemy import event

    devices = ["t4", "v100-sxm2-16gb", A100, "no-such-device"]
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    engine = client.app.state.engine  # type: ignore[attr-defined]
    event.listen(engine, "before_cursor_execute", seen)
    try:
        est = _estimate(client, [_job(resnet_id, hardware_id=d) for d in devices * 25])
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    codes = [(e["error"] or {}).get("code") for e in est[:4]]  # type: ignore[union-attr]
    assert codes == [None, None, None, "hardware_not_found"]
    assert [e["p50_s"] for e in est[:3]] == [e["p50_s"] for e in est[4:7]]
    hardware_reads = [s for s in statements if "FROM hardware" in s]
    assert len(hardware_reads) == 2, hardware_reads  # all devices at once, then the unknown one, once


def test_limit(client: TestClient) -> None:
    r = client.post("/v1/job-estimates", json={"jobs": [_job("x")] * (MAX_JOBS + 1)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_items"


def test_actuals_are_stored_as_job_measurements(client: TestClient, mlp_id: str) -> None:
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [
        {**_job(mlp_id), "measured_s": 30.0, "context": {"scheduler": "slurm", "job": "123"}},
        {**_job("e" * 64), "measured_s": 30.0}]})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["recorded"] == 1 and body["actuals"][1]["error"]["code"] == "graph_not_found"
    first = body["actuals"][0]
    assert first["ratio"] == pytest.approx(30.0 / first["predicted_s"])
    rows = client.get("/v1/measurements", params={"source": "scheduler"}).json()["items"]
    assert len(rows) == 1
    assert rows[0]["granularity"] == "job" and rows[0]["op_kind"] == "job" and rows[0]["time_ms_median"] == 30_000
    assert rows[0]["config"]["graph_id"] == mlp_id and rows[0]["context"]["scheduler"] == "slurm"


def test_calibration_error_falls_with_the_number_of_actuals(client: TestClient, resnet_id: str) -> None:
    """Synthetic clusters: on each of 8 devices every job of this graph really takes a hidden factor (1.7 on
    all) x the model's time x log-normal run-to-run noise (sd 25 %). The error of the estimated median on
    held-out jobs (other batch sizes, dataset sizes and epochs than the recorded ones), averaged over the
    devices, falls as actuals are recorded."""
    rng = np.random.default_rng(7)
    factor, noise = 1.7, 0.25
    devices = ["a100-sxm4-40gb", "v100-sxm2-16gb", "p100", "t4", "h100-sxm", "l4", "a10", "rtx-3090"]
    shapes = [(b, d, e) for b in (32, 64, 128) for d in (20_000, 60_000) for e in (1, 3)]
    held_out = [_job(resnet_id, hardware_id=hw, batch_size=b, dataset_size=d, epochs=e)
                for hw in devices for b, d, e in shapes[::2]]
    training = {hw: [_job(resnet_id, hardware_id=hw, batch_size=b, dataset_size=d, epochs=e)
                     for b, d, e in shapes[1::2]] for hw in devices}
    truth = [e["p50_s"] * factor for e in _estimate(client, held_out)]  # each held-out job's median time
    model_training = {hw: [e["p50_s"] for e in _estimate(client, jobs)] for hw, jobs in training.items()}

    def held_out_error() -> float:
        est = _estimate(client, held_out)
        return float(np.mean([abs(math.log(e["p50_s"] / t)) for e, t in zip(est, truth, strict=True)]))

    errors = {0: held_out_error()}
    recorded = 0
    for n in (2, 20):
        actuals = []
        for k in range(recorded, n):
            for hw in devices:
                i = k % len(training[hw])
                actuals.append({**training[hw][i],
                                "measured_s": model_training[hw][i] * factor * math.exp(rng.normal(0, noise))})
        r = client.post("/v1/job-estimates/actuals", json={"actuals": actuals})
        assert r.status_code == 201, r.text
        assert all(a["actuals"] == n for a in r.json()["actuals"])
        recorded = n
        errors[n] = held_out_error()
    assert errors[0] == pytest.approx(math.log(factor), abs=1e-6)  # uncalibrated: the hidden factor itself
    assert errors[0] > errors[2] > errors[20]
    assert errors[20] < 0.1
    est = _estimate(client, held_out[:1])[0]
    assert est["actuals"] == 20 and est["calibration_factor"] == pytest.approx(factor, rel=0.15)
    assert est["p90_s"] > est["p50_s"]
    other = _estimate(client, [_job(resnet_id, hardware_id="k80")])[0]
    assert other["actuals"] == 0  # calibration is per graph and hardware


def test_calibrate_shrinks_one_actual_less_than_many() -> None:
    one, many = calibrate([math.log(2.0)]), calibrate([math.log(2.0)] * 10)
    assert 1.0 < one.factor < many.factor < 2.0 + 1e-9
    assert many.log_sd < one.log_sd
    assert calibrate([]).factor == 1.0 and calibrate([]).actuals == 0


def test_implausible_actuals_are_refused_and_cannot_poison_later_estimates(client: TestClient, resnet_id: str) -> None:
    """An actual 1e300 s (or 1e-300 s) long is a unit error or an attack: refused per item, nothing stored,
    and the next estimate is the model's own (before: factor 1e289, then an OverflowError 500)."""
    job = _job(resnet_id)
    before = client.post("/v1/job-estimates", json={"jobs": [job]}).json()["estimates"][0]
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [
        {**job, "measured_s": 1e300}, {**job, "measured_s": 1e-300}, {**job, "measured_s": before["p50_s"] * 1.2}]})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["recorded"] == 1
    assert [a["error"]["code"] for a in body["actuals"][:2]] == ["implausible_actual", "implausible_actual"]
    documented = client.get("/openapi.json").json()["paths"]["/v1/job-estimates/actuals"]["post"]["responses"]
    assert "implausible_actual" in documented["422"]["description"]  # the item codes are listed there
    after = client.post("/v1/job-estimates", json={"jobs": [job]})
    assert after.status_code == 200
    est = after.json()["estimates"][0]
    assert est["actuals"] == 1 and 1.0 < est["calibration_factor"] < 1.2
    assert math.isfinite(est["p90_s"]) and est["p90_s"] > est["p50_s"]
    # a refused actual still says how its graph and hardware stand (it said 0 actuals and factor 1.0, as if the
    # stored ones were gone)
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [{**job, "measured_s": 1e300}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_actuals", r.text  # nothing recorded
    refused = r.json()["error"]["detail"]
    assert refused["recorded"] == 0 and refused["actuals"][0]["error"]["code"] == "implausible_actual"
    assert refused["actuals"][0]["actuals"] == 1
    assert refused["actuals"][0]["calibration_factor"] == pytest.approx(est["calibration_factor"], rel=1e-12)


def test_job_rows_of_the_actuals_source_cannot_be_posted_as_measurements(client: TestClient, resnet_id: str) -> None:
    """A job row of source ``scheduler`` with a made-up ``predicted_s`` sent to POST /v1/measurements skipped
    the actuals route's plausibility check and multiplied the next estimate by ~80: it is a reserved source."""
    job = _job(resnet_id)
    before = _estimate(client, [job])[0]
    spoof = {"hardware_id": A100, "source": "scheduler", "op_kind": "job", "pass": "train_step",
             "software_stack": "pytorch-eager", "granularity": "job", "batch_size": 64,
             "config": {**job, "predicted_s": 1e-6, "predictor_version": "layer-time-mlp-5"},
             "time_ms_median": 1e6}
    r = client.post("/v1/measurements", json={"measurements": [spoof]})
    assert r.status_code == 422, r.text
    assert [(e["code"], e["field"]) for e in r.json()["error"]["detail"]["errors"]] == [("reserved_source", "source")]
    after = _estimate(client, [job])[0]
    assert after["actuals"] == 0 and after["p50_s"] == before["p50_s"]
    # iteration rows of that source, and job rows of another, are still ordinary measurements
    for row in ({**spoof, "op_kind": "iteration", "granularity": "iteration", "time_ms_median": 300.0},
                {**spoof, "source": "my-cluster"}):
        assert client.post("/v1/measurements", json={"measurements": [row]}).status_code == 201


def test_calibrate_clips_stored_ratios_that_bypassed_the_check() -> None:
    cal = calibrate([700.0, -700.0, float("nan")])
    assert cal.actuals == 2 and math.isfinite(cal.factor) and math.isfinite(cal.log_sd)
    p50, p90 = cal.p50_p90(1e6, 2e6)
    assert math.isfinite(p90) and p90 >= p50


def test_jobs_over_several_nodes(client: TestClient, resnet_id: str) -> None:
    job = {"graph_id": resnet_id, "hardware_id": "a100-sxm4-80gb", "device_count": 16, "batch_size": 512,
           "dataset_size": 100_000, "epochs": 1}
    r = client.post("/v1/job-estimates", json={"jobs": [job, {**job, "nodes": 2},
                                                       {**job, "nodes": 2, "inter_node_bandwidth_bytes_per_s": 2e9},
                                                       {**job, "nodes": 3}]})
    assert r.status_code == 200, r.text
    crammed, default_net, slow_net, uneven = r.json()["estimates"]
    assert default_net["p50_s"] < slow_net["p50_s"]  # a slower network, a longer job
    assert uneven["error"]["code"] == "validation_error"
    # 16 GPUs in one node: no DGX/HGX node holds them (it was estimated as one 16-rank NVLink ring)
    assert crammed["p50_s"] is None and crammed["error"]["code"] == "too_many_devices_per_node"
    assert crammed["error"]["detail"]["nodes_needed"] == 2 and "2 nodes" in crammed["error"]["message"]
    eight = _estimate(client, [{**job, "device_count": 8, "batch_size": 256}])[0]
    assert eight["error"] is None and eight["p50_s"] > 0


def test_calibration_from_stats_adds_up_to_the_calibration_of_all_ratios() -> None:
    """What a retrain stores (the stats of the actuals up to its watermark) plus the actuals recorded since
    calibrate exactly as all ratios together would."""
    from app.estimates.calibration import RatioStats, calibrate_stats

    ratios = [0.4, 0.55, 0.31, 0.62, 0.47, 9.0]  # the last one is clipped to ln(100), as calibrate does
    whole = calibrate(ratios)
    split = calibrate_stats(RatioStats.of(ratios[:4]).plus(RatioStats.of(ratios[4:])))
    assert split.actuals == whole.actuals == 6
    assert split.factor == pytest.approx(whole.factor, rel=1e-12)
    assert split.log_sd == pytest.approx(whole.log_sd, rel=1e-12)
    assert calibrate_stats(RatioStats()).factor == 1.0


def test_leave_one_out_by_subtraction_equals_recalibrating_the_others() -> None:
    """The retrain's leave-one-out (group stats minus one ratio) calibrates exactly as the other ratios do."""
    from app.estimates.calibration import RatioStats, calibrate_stats

    ratios = [0.4, 0.55, -0.31, 0.62, 9.0]  # 9.0 is clipped in both paths
    whole = RatioStats.of(ratios)
    for i, r in enumerate(ratios):
        by_subtraction = calibrate_stats(whole.minus(RatioStats.of([r])))
        direct = calibrate(ratios[:i] + ratios[i + 1:])
        assert by_subtraction.actuals == direct.actuals == 4
        assert by_subtraction.factor == pytest.approx(direct.factor, rel=1e-9)
        assert by_subtraction.log_sd == pytest.approx(direct.log_sd, rel=1e-9)
    with pytest.raises(ValueError):
        RatioStats.of([0.1]).minus(whole)


def test_numbers_sent_as_strings_are_422_and_json_ints_still_pass(client: TestClient, resnet_id: str) -> None:
    """pydantic's lax mode turned ``"100"`` into 100.0: every float field of a request is strict, like the
    int fields already were; a JSON int for a float field is still a number."""
    job = _job(resnet_id)
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [{**job, "measured_s": "100"}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    assert "measured_s" in r.text
    for path, body in [
        ("/v1/job-estimates", {"jobs": [{**job, "epochs": "2"}]}),
        ("/v1/predictions", {**job, "epochs": "2"}),
        ("/v1/predictions", {**job, "price_usd_per_hour": "2.5"}),
        ("/v1/comparisons", {**job, "hardware_ids": [A100], "price_usd_per_hour": {A100: "2.5"}}),
        ("/v1/measurements", {"measurements": [{
            "hardware_id": A100, "op_kind": "iteration", "pass": "train_step", "software_stack": "pytorch-eager",
            "granularity": "iteration", "batch_size": 64, "config": {"model": "x"}, "time_ms_median": "210.5"}]}),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", (path, r.text)
    ok = client.post("/v1/job-estimates/actuals", json={"actuals": [{**job, "measured_s": 100, "epochs": 2}]})
    assert ok.status_code == 201, ok.text
    assert client.post("/v1/predictions", json={**job, "epochs": 2, "price_usd_per_hour": 3}).status_code == 200


def test_a_graph_with_no_costable_layer_fails_its_job_instead_of_taking_zero_seconds(
        client: TestClient, resnet_id: str, custom_op_id: str) -> None:
    """A job estimate has no warnings to say its time means nothing: a graph none of whose layers has a cost
    formula answered p50 = p90 = 0 s, which a scheduler would pack as free. It is a per-job error now, and
    an actual of it is refused (its ratio to a zero estimate is undefined)."""
    est = _estimate(client, [_job(custom_op_id), _job(resnet_id)])
    assert [(e["error"] or {}).get("code") for e in est] == ["no_costed_layers", None]  # type: ignore[union-attr]
    assert est[0]["p50_s"] is None and est[1]["p50_s"] > 0
    r = client.post("/v1/job-estimates/actuals", json={"actuals": [{**_job(custom_op_id), "measured_s": 100.0}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_actuals", r.text
    assert r.json()["error"]["detail"]["actuals"][0]["error"]["code"] == "no_costed_layers"


def test_a_job_on_several_devices_does_not_share_the_one_device_footprint(client: TestClient,
                                                                          resnet_id: str) -> None:
    """Two jobs of one call that run the same per-device step (64 on one device, 512 over 8) differ in memory by
    DDP's gradient buckets: on a device whose memory lies between the two peaks, only the one-device job fits."""
    from tests.estimates.conftest import _custom

    body = {"graph_id": resnet_id, "hardware_id": A100, "optimizer": "adam"}
    peaks = [client.post("/v1/predictions", json={**body, **kw}).json()["memory"]["total_bytes"]
             for kw in ({"batch_size": 64}, {"batch_size": 512, "device_count": 8})]
    assert peaks[1] > peaks[0]
    tight = _custom(client, id="a100-tight-test", name="A100 with a tight memory (test)",
                    memory_bytes=(peaks[0] + peaks[1]) / 2 / HEADROOM)
    jobs = [_job(resnet_id, hardware_id=tight, optimizer="adam", batch_size=64),
            _job(resnet_id, hardware_id=tight, optimizer="adam", batch_size=512, device_count=8)]
    assert [e["fits"] for e in _estimate(client, jobs)] == [True, False]


def _actual(client: TestClient, jobs: list[dict[str, object]], factor: float) -> list[dict[str, object]]:
    """Record each of ``jobs`` as having taken ``factor`` x its model p50; returns the answers."""
    p50 = [e["p50_s"] for e in _estimate(client, jobs)]
    r = client.post("/v1/job-estimates/actuals",
                    json={"actuals": [{**j, "measured_s": factor * p} for j, p in zip(jobs, p50, strict=True)]})
    assert r.status_code == 201, r.text
    return list(r.json()["actuals"])


def _setting(job: dict[str, object]) -> dict[str, object]:
    return {"graph_id": job["graph_id"], "hardware_id": job["hardware_id"], "precision": job.get("precision", "fp32"),
            "software_stack": job.get("software_stack", "pytorch-eager"), "device_count": job.get("device_count", 1),
            "nodes": job.get("nodes", 1)}


def test_an_actual_calibrates_only_the_jobs_of_its_setting(client: TestClient, resnet_id: str, node: str) -> None:
    """A bf16 job on 4 devices of one node says nothing about fp32, CUDA graphs, one device, other node counts or
    512 devices over 64 nodes: calibration is per (graph, hardware, precision, software_stack, device_count,
    nodes), and every answer names its group. Other batch sizes, dataset sizes, epochs and optimizers of the same
    setting share it."""
    base = _job(resnet_id, hardware_id=node, precision="bf16", device_count=4, batch_size=256)
    same = {**base, "batch_size": 512, "dataset_size": 80_000, "epochs": 3, "optimizer": "adam"}
    others = [{**base, "precision": "fp32"}, {**base, "software_stack": "pytorch-cuda-graph"},
              {**base, "device_count": 1, "batch_size": 64},
              {**base, "nodes": 2}, {**base, "device_count": 512, "nodes": 64, "batch_size": 4096},
              {**base, "device_count": 8}, _job(resnet_id, hardware_id=node)]
    before = _estimate(client, [base, same, *others])
    assert all(e["error"] is None and e["actuals"] == 0 for e in before), before
    [recorded] = _actual(client, [base], 1.5)
    assert recorded["actuals"] == 1 and recorded["calibration_factor"] > 1.2
    assert recorded["calibration_group"] == _setting(base)
    after = _estimate(client, [base, same, *others])
    for job, a in zip([base, same, *others], after, strict=True):
        assert a["calibration_group"] == _setting(job)
    for a in after[:2]:
        assert a["actuals"] == 1 and a["calibration_factor"] == recorded["calibration_factor"]
    assert after[0]["p90_s"] / after[0]["p50_s"] < before[0]["p90_s"] / before[0]["p50_s"]  # narrowed by it
    for b, a in zip(before[2:], after[2:], strict=True):
        assert a["actuals"] == 0 and a["calibration_factor"] == 1.0
        assert (a["p50_s"], a["p90_s"]) == (b["p50_s"], b["p90_s"])


def test_stored_actuals_without_the_setting_fields_count_for_the_default_setting(
        client: TestClient, session, resnet_id: str, node: str) -> None:  # noqa: ANN001
    """A stored actual whose config predates device_count/nodes (as 'nodes' does in rows recorded before it
    existed, when every job ran on one node) counts for device_count 1 on 1 node; one without precision in
    its config for the precision column of its row."""
    from sqlalchemy import select

    from app.measurements.models import Measurement

    four = _job(resnet_id, hardware_id=node, precision="bf16", device_count=4, batch_size=256)
    _actual(client, [four], 1.5)
    [row] = session.scalars(select(Measurement).where(Measurement.source == "scheduler")).all()
    row.config = {k: v for k, v in row.config.items() if k not in ("device_count", "nodes", "precision")}
    session.commit()
    one = {**four, "device_count": 1, "batch_size": 64}
    est_four, est_one, est_fp32 = _estimate(client, [four, one, {**one, "precision": "fp32"}])
    assert est_four["actuals"] == 0 and est_fp32["actuals"] == 0
    assert est_one["actuals"] == 1 and est_one["calibration_group"] == _setting(one)


def test_a_refit_groups_by_setting_and_pooled_groups_of_older_refits_calibrate_nothing(
        client: TestClient, session, resnet_id: str, node: str) -> None:  # noqa: ANN001
    """The retrain's refit summarises every actual in its setting's group; a refit stored before groups had a
    setting ("<graph>|<hardware>", every precision and device count pooled), or before the software stack was
    part of it (five fields), cannot say which jobs its actuals were, so serving does not apply it (the next
    retrain refits those actuals by setting)."""
    from app.estimates.calibration import CalibrationGroup
    from app.estimates.service import refit_job_calibration
    from app.measurements.models import PredictorVersion

    bf16 = _job(resnet_id, hardware_id=node, precision="bf16", device_count=4, batch_size=256)
    fp32 = _job(resnet_id, hardware_id=node)
    _actual(client, [bf16, bf16, fp32], 1.5)
    predictor = client.app.state.predictors.current()  # type: ignore[attr-defined]
    fit = refit_job_calibration(session, predictor, up_to_id=None)
    groups = {CalibrationGroup.from_key(k): g.n for k, g in fit.groups.items()}
    assert groups == {CalibrationGroup(resnet_id, node, "bf16", "pytorch-eager", 4, 1): 2,
                      CalibrationGroup(resnet_id, node, "fp32", "pytorch-eager", 1, 1): 1}
    assert CalibrationGroup.from_key(f"{resnet_id}|{node}") is None
    without_stack = json.dumps([resnet_id, node, "fp32", 1, 1])
    assert CalibrationGroup.from_key(without_stack) is None
    row = session.get(PredictorVersion, predictor.version)
    pooled = {"n": 9, "total": 9 * math.log(3.0), "total_sq": 9 * math.log(3.0) ** 2}
    row.metadata_ = {**row.metadata_, "job_calibration": {
        "watermark_measurement_id": fit.watermark_measurement_id,
        "groups": {f"{resnet_id}|{node}": pooled, without_stack: pooled,
                   CalibrationGroup(resnet_id, node, "bf16", "pytorch-eager", 4, 1).key: fit.groups[
                       CalibrationGroup(resnet_id, node, "bf16", "pytorch-eager", 4, 1).key].model_dump()}}}
    session.commit()
    est_bf16, est_fp32 = _estimate(client, [bf16, fp32])
    assert est_bf16["actuals"] == 2 and est_bf16["calibration_factor"] > 1.2
    assert est_fp32["actuals"] == 0 and est_fp32["calibration_factor"] == 1.0
