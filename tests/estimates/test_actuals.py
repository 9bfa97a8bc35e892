"""POST /v1/job-estimates/actuals as a scheduler uses it: retries with an ``Idempotency-Key``, reports that
store nothing, jobs the memory model says do not fit, dates and the plausibility bounds of measurements."""

from __future__ import annotations

import json
import threading
from typing import Any

from fastapi.testclient import TestClient

A100 = "a100-sxm4-40gb"


def _job(graph_id: str, **kw: object) -> dict[str, Any]:
    return {"graph_id": graph_id, "hardware_id": A100, "batch_size": 64, "dataset_size": 50_000, "epochs": 2, **kw}


def _p50(client: TestClient, job: dict[str, Any]) -> float:
    r = client.post("/v1/job-estimates", json={"jobs": [job]})
    assert r.status_code == 200, r.text
    return float(r.json()["estimates"][0]["p50_s"])


def _report(client: TestClient, *actuals: dict[str, Any], key: str | None = None) -> Any:
    return client.post("/v1/job-estimates/actuals", json={"actuals": list(actuals)},
                       headers={"Idempotency-Key": key} if key else {})  # fmt: skip


def _stored(client: TestClient) -> int:
    return int(client.get("/v1/measurements", params={"source": "scheduler"}).json()["total"])


def test_a_retried_report_is_stored_once(client: TestClient, mlp_id: str) -> None:
    """A scheduler that retries a report (timeout, lost answer) stored it twice: the count of actuals went
    up and the p90 narrowed on one job. With an ``Idempotency-Key`` it behaves as ``POST /v1/measurements``:
    the same body answers the first answer again, another body is a 409."""
    job = _job(mlp_id)
    p50 = _p50(client, job)
    body = {"actuals": [{**job, "measured_s": 1.3 * p50, "context": {"job_id": "81723"}}]}
    first = client.post("/v1/job-estimates/actuals", json=body, headers={"Idempotency-Key": "slurm-81723"})
    assert first.status_code == 201, first.text
    assert first.json()["recorded"] == 1 and first.json()["replayed"] is False
    assert "Idempotent-Replayed" not in first.headers
    # the same report, keys in another order and other whitespace: the first answer again, nothing stored
    reordered = {"actuals": [dict(reversed(body["actuals"][0].items()))]}
    again = client.post("/v1/job-estimates/actuals", content=json.dumps(reordered, indent=2),
                        headers={"Idempotency-Key": "slurm-81723", "content-type": "application/json"})
    assert again.status_code == 201, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert again.headers["Idempotent-Replayed"] == "true"
    assert _stored(client) == 1
    estimate = client.post("/v1/job-estimates", json={"jobs": [job]}).json()["estimates"][0]
    assert estimate["actuals"] == 1
    # another report under the key: refused as measurements refuse it, nothing stored
    other = _report(client, {**job, "measured_s": 1.1 * p50}, key="slurm-81723")
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused", other.text
    bad = _report(client, {**job, "measured_s": 1.1 * p50}, key="x" * 256)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_idempotency_key"
    assert _stored(client) == 1
    # one key, one request: a measurement batch under a key an actuals report used is another body
    row = {"hardware_id": A100, "op_kind": "iteration", "pass": "train_step", "software_stack": "pytorch-eager",
           "granularity": "iteration", "batch_size": 64, "config": {"model": "mlp"}, "time_ms_median": 10.0}
    reused = client.post("/v1/measurements", json={"measurements": [row]}, headers={"Idempotency-Key": "slurm-81723"})
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused"
    # without a key a report is stored each time it is sent, as before
    assert _report(client, {**job, "measured_s": 1.1 * p50}).json()["recorded"] == 1
    assert _report(client, {**job, "measured_s": 1.1 * p50}).json()["recorded"] == 1
    assert _stored(client) == 3
    documented = client.get("/openapi.json").json()["paths"]["/v1/job-estimates/actuals"]["post"]
    assert "idempotency_key_reused" in documented["responses"]["409"]["description"]
    assert any(p["name"] == "idempotency-key" for p in documented["parameters"])


def test_concurrent_retries_of_one_report_store_once(client: TestClient, mlp_id: str) -> None:
    """Four copies of one report sent at once under one key (a scheduler's retry racing the first send):
    the key is claimed before anything is stored, so one stores and the others answer its answer."""
    job = _job(mlp_id)
    p50 = _p50(client, job)
    answers: list[Any] = []
    barrier = threading.Barrier(4)

    def send() -> None:
        barrier.wait()
        answers.append(_report(client, *[{**job, "measured_s": p50 * (1 + k / 100)} for k in range(5)], key="burst"))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [201] * 4, [a.text for a in answers]
    assert sum(not a.json()["replayed"] for a in answers) == 1
    assert len({tuple(i["measurement_id"] for i in a.json()["actuals"]) for a in answers}) == 1
    assert _stored(client) == 5


def test_a_report_that_records_nothing_is_a_422(client: TestClient, mlp_id: str) -> None:
    """Every item failed (unknown graph, 100x off the estimate): the answer was 201 with ``recorded: 0``, which a
    scheduler checking the status takes as stored. It is a 422 ``invalid_actuals`` now, as a measurement batch
    with bad rows is a 422 ``invalid_measurements``; ``detail`` is the answer a 201 would have been (every item's
    error, and a refused actual's ratio and its graph's calibration), nothing is stored and the key is not
    used up. A report with one recorded item is still a 201 that names the others' errors."""
    job = _job(mlp_id)
    p50 = _p50(client, job)
    failing = [{**_job("e" * 64), "measured_s": 30.0}, {**job, "measured_s": 1e4 * p50}]
    r = _report(client, *failing, key="nightly-7")
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_actuals" and "nothing was stored" in error["message"]
    detail = error["detail"]
    assert detail["recorded"] == 0 and detail["failed"] == 2
    assert [a["error"]["code"] for a in detail["actuals"]] == ["graph_not_found", "implausible_actual"]
    assert detail["actuals"][1]["ratio"] > 100 and detail["actuals"][1]["actuals"] == 0
    assert _stored(client) == 0
    # the key was not claimed by a report that stored nothing: the corrected report under it is stored
    fixed = _report(client, failing[0], {**job, "measured_s": 1.2 * p50}, key="nightly-7")
    assert fixed.status_code == 201, fixed.text
    assert fixed.json()["recorded"] == 1 and fixed.json()["actuals"][0]["error"]["code"] == "graph_not_found"
    assert _stored(client) == 1
    documented = client.get("/openapi.json").json()["paths"]["/v1/job-estimates/actuals"]["post"]["responses"]
    assert "invalid_actuals" in documented["422"]["description"]


def test_an_actual_of_a_job_the_memory_model_says_does_not_fit_is_stored_with_a_warning(
        client: TestClient, resnet_id: str) -> None:
    """ResNet-50 at 4,096 samples on a 40 GB A100 is estimated not to fit (``fits: false``), yet a scheduler
    reports that it ran: the run is real and the memory model is what disagrees, so the actual is stored and
    calibrates as any other (it was, silently), and its item now says that the model disagreed: the estimated
    peak against the device's memory, as POST /v1/predictions words it."""
    big, small = _job(resnet_id, batch_size=4096), _job(resnet_id)
    prediction = client.post("/v1/predictions", json=big).json()
    assert prediction["memory"]["fits"] is False
    peak_gib = prediction["memory"]["total_bytes"] / 2**30
    device_gib = prediction["memory"]["device_memory_bytes"] / 2**30
    r = _report(client, {**big, "measured_s": 1.1 * _p50(client, big)},
                {**small, "measured_s": 1.1 * _p50(client, small)})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["recorded"] == 2 and body["failed"] == 0
    big_item, small_item = body["actuals"]
    assert big_item["error"] is None and big_item["measurement_id"] is not None
    assert len(big_item["warnings"]) == 1, big_item
    warning = big_item["warnings"][0]
    assert f"{peak_gib:.1f} GiB" in warning and f"{device_gib:.1f} GiB" in warning and "stored" in warning
    assert small_item["warnings"] == []
    estimate = client.post("/v1/job-estimates", json={"jobs": [big]}).json()["estimates"][0]
    # it calibrates as the other (one group per graph and device, whatever the batch); memory is as estimated
    assert estimate["actuals"] == 2 and estimate["fits"] is False


def test_actuals_obey_the_bounds_of_job_measurements_and_carry_their_date(client: TestClient, mlp_id: str) -> None:
    """Actuals are stored as job measurements but skipped their checks: a 400-day job (within 100x of a long
    estimate) was stored, while POST /v1/measurements refuses a job row over a year. Both apply one rule set now
    (``app.measurements.validation.field_problems``), and an actual may say when it ran (``measured_at``, at most
    a day ahead of the server's clock, as a measurement), so the ``measured_from``/``measured_to`` filters find
    scheduler rows."""
    long_job = _job(mlp_id, dataset_size=10**12)  # a ~200-day estimate: 400 days is 2x it, not 100x
    p50 = _p50(client, long_job)
    day = 86_400.0
    assert 100 * day < p50 < 365 * day
    r = _report(client, {**long_job, "measured_s": 400 * day},
                {**long_job, "measured_s": 1.1 * p50, "measured_at": "2999-01-01T00:00:00Z"},
                {**long_job, "measured_s": 1.1 * p50, "measured_at": "2026-11-20T10:00:00+01:00"})
    assert r.status_code == 201, r.text
    over_a_year, future, dated = r.json()["actuals"]
    assert over_a_year["error"]["code"] == "implausible_measurement"
    assert over_a_year["error"]["detail"]["field"] == "measured_s" and "measured_s" in over_a_year["error"]["message"]
    assert future["error"]["code"] == "implausible_measurement" and future["error"]["detail"]["field"] == "measured_at"
    assert dated["error"] is None and r.json()["recorded"] == 1
    # the same row sent as a measurement is refused by the same bound
    row = {"hardware_id": A100, "source": "my-cluster", "op_kind": "job", "pass": "train_step",
           "software_stack": "pytorch-eager", "granularity": "job", "batch_size": 64, "config": {"graph_id": mlp_id},
           "time_ms_median": 400 * day * 1e3}
    refused = client.post("/v1/measurements", json={"measurements": [row]}).json()["error"]["detail"]["errors"]
    assert [(e["code"], e["field"]) for e in refused] == [("implausible_measurement", "time_ms_median")]
    # the dated actual is found by the time-window filters, stored in UTC, and its date is not part of the job
    window = client.get("/v1/measurements", params={"source": "scheduler", "measured_from": "2026-11-20T00:00:00Z",
                                                    "measured_to": "2026-11-21T00:00:00Z"}).json()
    assert window["total"] == 1 and window["items"][0]["measured_at"].startswith("2026-11-20T09:00:00")
    assert "measured_at" not in window["items"][0]["config"]
    naive = _report(client, {**long_job, "measured_s": p50, "measured_at": "2026-11-20T10:00:00"})
    assert naive.status_code == 422 and naive.json()["error"]["code"] == "validation_error"
