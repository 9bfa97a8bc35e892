"""POST /v1/comparisons: one job on many devices, money, energy, the Pareto front and a batch sweep."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

JOB = {"batch_size": 256, "dataset_size": 100_000, "epochs": 2}


def _compare(client: TestClient, graph_id: str, **kw: object) -> dict:
    r = client.post("/v1/comparisons", json={"graph_id": graph_id, **JOB, **kw})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_rows_money_energy_and_data_parallel(client: TestClient, resnet_id: str, node: str, lonely: str) -> None:
    body = _compare(client, resnet_id, hardware_ids=[node, lonely, "k80", "nope"], device_counts=[1, 8],
                    precision="fp16", grid_gco2_per_kwh=400)
    rows = {(r["hardware_id"], r["device_count"]): r for r in body["rows"]}
    assert set(rows) == {(node, 1), (node, 8), (lonely, 1)}
    unavailable = {(u["hardware_id"], u["device_count"]): u["code"] for u in body["unavailable"]}
    assert unavailable == {(lonely, 8): "no_interconnect",  # no interconnect listed: said, not dropped
                           ("k80", 1): "precision_not_supported", ("k80", 8): "precision_not_supported",
                           ("nope", 1): "hardware_not_found", ("nope", 8): "hardware_not_found"}
    one, eight = rows[node, 1], rows[node, 8]
    single = client.post("/v1/predictions", json={"graph_id": resnet_id, "hardware_id": node, "precision": "fp16",
                                                  **JOB}).json()
    assert one["job_s"] == pytest.approx(single["job"]["time_s"], rel=1e-9)
    assert one["cost_usd"] == pytest.approx(one["job_s"] / 3600 * 4.1)  # device-hours x the listed price
    assert eight["cost_usd"] == pytest.approx(8 * eight["job_s"] / 3600 * 4.1)
    assert eight["per_device_batch_size"] == 32 and eight["allreduce_exposed_ms"] > 0
    assert one["job_s"] / 8 < eight["job_s"] < one["job_s"] and 0 < eight["scaling_efficiency"] < 1
    assert rows[lonely, 1]["cost_usd"] is None and rows[lonely, 1]["pareto"] is False  # dominated: no price
    for r in (one, eight):  # between all devices idle and all at TDP for the whole job
        tdp, idle, n = 400.0, 60.0, r["device_count"]
        assert n * idle * r["job_s"] < r["energy_j"] < n * tdp * r["job_s"]
        assert r["co2_kg"] == pytest.approx(r["energy_j"] / 3.6e6 * 400 / 1e3)
    assert one["largest_batch_size_that_fits"] > 256 and one["fits"]


def test_pareto_front_and_sorting(client: TestClient, resnet_id: str, node: str) -> None:
    body = _compare(client, resnet_id, device_counts=[1, 8], sort_by="energy_j",
                    price_usd_per_hour={"h100-sxm": 6.0, "a100-sxm4-80gb": 3.0, "v100-sxm2-16gb": 1.5})
    rows = body["rows"]
    stored = {h["id"] for h in client.get("/v1/hardware").json()["items"]}
    assert {r["hardware_id"] for r in rows} | {u["hardware_id"] for u in body["unavailable"]} == stored
    energies = [r["energy_j"] for r in rows if r["energy_j"] is not None]
    assert energies == sorted(energies)
    assert next(r for r in rows if r["hardware_id"] == "h100-sxm")["cost_usd"] == pytest.approx(
        next(r for r in rows if r["hardware_id"] == "h100-sxm")["job_s"] / 3600 * 6.0)

    def key(r: dict) -> tuple[float, float, float]:
        inf = float("inf")
        return (r["job_s"], inf if r["cost_usd"] is None else r["cost_usd"],
                inf if r["energy_j"] is None else r["energy_j"])

    fitting = [r for r in rows if r["fits"]]
    for r in rows:
        dominated = any(all(x <= y for x, y in zip(key(o), key(r), strict=True)) and key(o) != key(r)
                        for o in fitting)
        assert r["pareto"] == (r["fits"] and not dominated), r["hardware_id"]
    fastest = min(fitting, key=lambda r: r["job_s"])
    assert fastest["pareto"]
    by_job = _compare(client, resnet_id, hardware_ids=["p100", "v100-sxm2-16gb", "a100-sxm4-40gb"])["rows"]
    assert [r["job_s"] for r in by_job] == sorted(r["job_s"] for r in by_job)


def test_batch_sweep(client: TestClient, resnet_id: str) -> None:
    body = _compare(client, resnet_id, hardware_ids=["v100-sxm2-16gb"],
                    sweep={"hardware_id": "v100-sxm2-16gb", "batch_sizes": [512, 8, 2048, 32, 128]})
    sweep = body["sweep"]
    assert [s["batch_size"] for s in sweep] == [8, 32, 128, 512, 2048]  # ascending, whatever the order given
    assert sweep[0]["time_per_sample_ms"] > sweep[2]["time_per_sample_ms"]  # larger batches amortise
    peaks = [s["peak_memory_bytes"] for s in sweep]
    assert peaks == sorted(peaks)
    assert sweep[0]["fits"] and not sweep[-1]["fits"]  # 2,048 ResNet-50 samples overflow 16 GB
    largest = body["rows"][0]["largest_batch_size_that_fits"]
    assert all(s["fits"] == (s["batch_size"] <= largest) for s in sweep)


def test_a_batch_size_given_twice_in_the_sweep_is_a_422_naming_it(client: TestClient, resnet_id: str) -> None:
    """It used to answer the same sweep row twice."""
    r = client.post("/v1/comparisons", json={"graph_id": resnet_id, **JOB, "hardware_ids": ["p100"],
                                             "sweep": {"hardware_id": "p100", "batch_sizes": [64, 8, 32, 8, 64, 8]}})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "duplicate_batch_sizes" and error["detail"]["duplicates"] == [8, 64]
    assert "8, 64" in error["message"]


def test_gpu_only_stack_lists_cpus_as_unavailable_like_a_missing_precision(client: TestClient,
                                                                           resnet_id: str) -> None:
    body = _compare(client, resnet_id, hardware_ids=["local", "p100"], software_stack="pytorch-cuda-graph")
    assert [r["hardware_id"] for r in body["rows"]] == ["p100"]
    [u] = body["unavailable"]
    assert (u["hardware_id"], u["device_count"], u["code"]) == ("local", 1, "stack_not_supported")
    assert "pytorch-cuda-graph" in u["reason"] and "CPU" in u["reason"]
    # the sweep is on one named device: it fails the call, as a precision that device lacks does
    r = client.post("/v1/comparisons", json={"graph_id": resnet_id, **JOB, "hardware_ids": ["p100"],
                                             "software_stack": "pytorch-cuda-graph",
                                             "sweep": {"hardware_id": "local", "batch_sizes": [8]}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "stack_not_supported", r.text


def test_errors(client: TestClient, resnet_id: str) -> None:
    r = client.post("/v1/comparisons", json={"graph_id": "0" * 64, **JOB})
    assert r.status_code == 404 and r.json()["error"]["code"] == "graph_not_found"
    r = client.post("/v1/comparisons", json={"graph_id": resnet_id, **JOB, "sort_by": "price"})
    assert r.status_code == 422


def test_rows_over_several_nodes(client: TestClient, resnet_id: str) -> None:
    body = _compare(client, resnet_id, hardware_ids=["a100-sxm4-80gb"], device_counts=[8, 16, 12, 20],
                    devices_per_node=8, inter_node_bandwidth_bytes_per_s=100e9, inter_node_latency_s=5e-6,
                    sort_by="hardware_id", batch_size=480)
    rows = {r["device_count"]: r for r in body["rows"]}
    assert {n: r["nodes"] for n, r in rows.items()} == {8: 1, 12: 2, 16: 2}  # 12: 2 nodes x 6
    assert [(u["device_count"], u["code"]) for u in body["unavailable"]] == [(20, "validation_error")]  # 3 x 6.67
    for n, r in rows.items():  # each row is the POST /v1/predictions answer for that layout
        single = client.post("/v1/predictions", json={
            "graph_id": resnet_id, "hardware_id": "a100-sxm4-80gb", **JOB, "batch_size": 480, "device_count": n,
            "nodes": r["nodes"],
            **({"inter_node_bandwidth_bytes_per_s": 100e9, "inter_node_latency_s": 5e-6} if r["nodes"] > 1 else {}),
        }).json()
        assert r["job_s"] == pytest.approx(single["job"]["time_s"], rel=1e-9)
    assert rows[16]["scaling_efficiency"] < rows[8]["scaling_efficiency"]


def test_prices_for_devices_not_compared_and_an_empty_device_list_are_422(client: TestClient, resnet_id: str) -> None:
    # a typo'd id used to be ignored: its device silently kept the catalog price
    r = client.post("/v1/comparisons", json={"graph_id": resnet_id, **JOB, "hardware_ids": ["a100-sxm4-40gb"],
                                             "price_usd_per_hour": {"a100-sxm4-40gb": 2.0, "a100-sxm4-40g": 1.0}})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["detail"]["unknown_price_ids"] == ["a100-sxm4-40g"]
    assert "'a100-sxm4-40g'" in error["message"]
    # omitted hardware_ids = every stored device: a price for a device no one stores is refused too
    r = client.post("/v1/comparisons", json={"graph_id": resnet_id, **JOB, "price_usd_per_hour": {"no-such": 1.0}})
    assert r.status_code == 422 and r.json()["error"]["detail"]["unknown_price_ids"] == ["no-such"]
    # an explicit empty list is not "every device"
    r = client.post("/v1/comparisons", json={"graph_id": resnet_id, **JOB, "hardware_ids": []})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    # a price for a compared device applies
    rows = _compare(client, resnet_id, hardware_ids=["a100-sxm4-40gb"],
                    price_usd_per_hour={"a100-sxm4-40gb": 2.0})["rows"]
    assert rows[0]["cost_usd"] == pytest.approx(rows[0]["job_s"] / 3600 * 2.0)


def test_a_repeated_device_or_device_count_is_one_row(client: TestClient, resnet_id: str) -> None:
    # a repeated device count used to answer the same row twice, both marked Pareto (ids were de-duplicated)
    rows = _compare(client, resnet_id, hardware_ids=["t4", "a100-sxm4-40gb", "t4"], device_counts=[2, 1, 2])["rows"]
    assert sorted((r["hardware_id"], r["device_count"]) for r in rows) == [
        ("a100-sxm4-40gb", 1), ("a100-sxm4-40gb", 2), ("t4", 1), ("t4", 2)]


def test_a_graph_with_no_costable_layer_has_no_rows(client: TestClient, custom_op_id: str) -> None:
    """Its rows were 0 s, $0 and on the Pareto front; every pair is unavailable with the reason instead."""
    body = _compare(client, custom_op_id, hardware_ids=["a100-sxm4-40gb", "h100-sxm"])
    assert body["rows"] == []
    assert [(u["hardware_id"], u["code"]) for u in body["unavailable"]] == [
        ("a100-sxm4-40gb", "no_costed_layers"), ("h100-sxm", "no_costed_layers")]


def test_more_devices_in_a_node_than_a_node_holds_are_unavailable_rows(client: TestClient, resnet_id: str) -> None:
    """A count over 8 in one node used to be answered as one NVLink ring of that many GPUs; its rows are
    unavailable with the code and the nodes it needs, the other rows answered."""
    body = _compare(client, resnet_id, hardware_ids=["a100-sxm4-80gb", "h100-sxm"], device_counts=[8, 16])
    assert sorted((r["hardware_id"], r["device_count"]) for r in body["rows"]) == [
        ("a100-sxm4-80gb", 8), ("h100-sxm", 8)]
    assert sorted((u["hardware_id"], u["device_count"], u["code"]) for u in body["unavailable"]) == [
        ("a100-sxm4-80gb", 16, "too_many_devices_per_node"), ("h100-sxm", 16, "too_many_devices_per_node")]
    assert all(u["detail"]["nodes_needed"] == 2 and "2 nodes" in u["reason"] for u in body["unavailable"])
    # devices_per_node above what a node holds: the rows that would put more than 8 in a node are unavailable
    body = _compare(client, resnet_id, hardware_ids=["a100-sxm4-80gb"], device_counts=[4, 32],
                    devices_per_node=16)
    assert [r["device_count"] for r in body["rows"]] == [4]
    [u] = body["unavailable"]
    assert (u["device_count"], u["code"], u["detail"]["devices_per_node"], u["detail"]["nodes_needed"]) == (
        32, "too_many_devices_per_node", 16, 4)
    # the default catalog comparison does not fail as a whole either
    everything = _compare(client, resnet_id, device_counts=[16])
    assert everything["rows"] == [] and everything["unavailable"]
    assert {u["code"] for u in everything["unavailable"]} == {"too_many_devices_per_node"}


def test_dims_that_do_not_bind_the_graph_are_a_422_not_a_table_of_refusals(client: TestClient) -> None:
    """The dims are the request's, the same on every device: a missing or misspelt one used to answer 200 with no
    rows and every device ``unavailable`` for that one reason, though the route documents it as a 422 (and its
    sweep already raised it)."""
    from tests.helpers import seq_matmul_onnx

    r = client.post("/v1/graphs", params={"dims": "seq=64"}, content=seq_matmul_onnx(),
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    graph_id = r.json()["id"]
    devices = {"hardware_ids": ["a100-sxm4-40gb", "t4"], "device_counts": [1, 2]}
    for dims, code in (({}, "unbound_dimension"), ({"seq": 64, "sq": 64}, "unknown_dimension"),
                       ({"seq": 64, "batch": 8}, "dims_names_batch_axis")):
        r = client.post("/v1/comparisons", json={"graph_id": graph_id, **JOB, **devices, "dims": dims})
        assert r.status_code == 422 and r.json()["error"]["code"] == code, (dims, r.text)
    # also when every row fails before it binds (an unknown device, a count over a node, bf16 on a K80)
    for rows in ({"hardware_ids": ["nope-gpu"]}, {"hardware_ids": ["t4"], "device_counts": [16]},
                 {"hardware_ids": ["k80"], "precision": "bf16"}):
        r = client.post("/v1/comparisons", json={"graph_id": graph_id, **JOB, **rows, "dims": {}})
        assert r.status_code == 422 and r.json()["error"]["code"] == "unbound_dimension", (rows, r.text)
    body = _compare(client, graph_id, **devices, dims={"seq": 64})
    assert len(body["rows"]) == 4 and body["unavailable"] == []


def test_a_data_parallel_row_holds_the_ddp_buckets_its_prediction_does(client: TestClient, resnet_id: str,
                                                                      node: str) -> None:
    body = _compare(client, resnet_id, hardware_ids=[node], device_counts=[8])
    row = body["rows"][0]
    single = client.post("/v1/predictions", json={"graph_id": resnet_id, "hardware_id": node, "device_count": 8,
                                                  **JOB}).json()["memory"]
    assert single["ddp_gradient_buckets_bytes"] > 0
    assert row["peak_memory_bytes"] == single["total_bytes"]
    assert row["largest_batch_size_that_fits"] == single["largest_batch_size_that_fits"]
