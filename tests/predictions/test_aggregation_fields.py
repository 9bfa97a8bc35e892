"""POST /v1/predictions: data parallel, input pipeline, eval passes, checkpoints, energy, money and CO2 on
a real ResNet-50 export (app/core/aggregate.py through the API)."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from app.core.collectives import Link, Topology, bucketed_allreduce
from app.core.energy import IDLE_FRACTION_OF_TDP
from app.hardware.catalog import load_catalog
from tests.helpers import light_model


@pytest.fixture
def resnet_id(client: TestClient) -> str:
    upload = ("resnet50.onnx", light_model("resnet50"), "application/octet-stream")
    r = client.post("/v1/graphs", files={"file": upload})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _predict(client: TestClient, **body) -> dict:
    r = client.post("/v1/predictions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_data_parallel_splits_the_batch_and_all_reduces_the_gradients(client: TestClient, resnet_id: str) -> None:
    one = _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-80gb", batch_size=32, optimizer="adam")
    eight = _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-80gb", batch_size=256, device_count=8,
                     optimizer="adam")
    it = eight["iteration"]
    assert eight["batch_size"] == 256 and it["device_count"] == 8 and it["per_device_batch_size"] == 32
    # each device runs the 32-sample step of the single-device answer
    assert math.isclose(it["layers_ms"], one["iteration"]["time_ms"], rel_tol=1e-9)
    # ... and holds DDP's gradient buckets besides: one more fp32 copy of the gradients, in 25 MiB buckets that
    # the allocator rounds to 2 MiB each (the gradients are rounded tensor by tensor)
    m1, m8 = one["memory"], eight["memory"]
    buckets = m8["ddp_gradient_buckets_bytes"]
    assert m1["ddp_gradient_buckets_bytes"] == 0
    assert m8["total_bytes"] - m1["total_bytes"] == buckets
    assert 4 * eight["totals"]["params"] <= buckets <= m8["gradients_bytes"] + it["allreduce_buckets"] * 2 * 2**20
    assert abs(buckets - m8["gradients_bytes"]) <= 0.05 * m8["gradients_bytes"]
    assert {k: v for k, v in m8.items() if k not in ("total_bytes", "ddp_gradient_buckets_bytes", "fits",
                                                     "largest_batch_size_that_fits")} == \
        {k: v for k, v in m1.items() if k not in ("total_bytes", "ddp_gradient_buckets_bytes", "fits",
                                                  "largest_batch_size_that_fits")}
    assert m8["largest_batch_size_that_fits"] < m1["largest_batch_size_that_fits"]
    assert "DDP gradient buckets, gradient_as_bucket_view=False (PyTorch default)" in eight["assumptions"]["memory"]
    assert "DDP" not in one["assumptions"]["memory"]
    assert it["gradient_bytes"] == eight["memory"]["gradients_bytes"] >= eight["totals"]["params"] * 4
    link = load_catalog()["a100-sxm4-80gb"].link()
    assert link is not None and link.kind == "nvlink"
    expected = bucketed_allreduce(it["gradient_bytes"], Topology(nodes=1, devices_per_node=8, intra=link),
                                  backward_ms=it["backward_ms"])
    assert math.isclose(it["allreduce_ms"], expected.total_ms, rel_tol=1e-9)
    assert math.isclose(it["allreduce_exposed_ms"], expected.exposed_ms, rel_tol=1e-9)
    assert it["allreduce_buckets"] == expected.buckets >= 4  # ~100 MB of ResNet-50 gradients in 25 MiB buckets
    assert math.isclose(it["time_ms"], it["layers_ms"] + it["allreduce_exposed_ms"], rel_tol=1e-9)
    assert 0 < it["scaling_efficiency"] < 1
    assert math.isclose(it["scaling_efficiency"], it["layers_ms"] / it["time_ms"], rel_tol=1e-9)
    assert math.isclose(it["samples_per_s"], 256 / (it["time_ms"] / 1e3), rel_tol=1e-9)
    assert one["iteration"]["scaling_efficiency"] == 1.0 and one["iteration"]["allreduce_ms"] == 0.0
    assert "ring all-reduce" in eight["assumptions"]["data_parallel"]


def test_ddp_buckets_on_a_cpu_are_exactly_the_gradient_bytes(client: TestClient, resnet_id: str) -> None:
    """A CPU rounds no allocation: 4 devices at the global batch 64 hold exactly one more copy of the gradients
    than one device at its per-device batch 16; inference wraps nothing in DDP."""
    body = {"graph_id": resnet_id, "hardware_id": "local", "optimizer": "adam"}
    one = _predict(client, **body, batch_size=16)["memory"]
    four = _predict(client, **body, batch_size=64, device_count=4, nodes=4)["memory"]
    assert four["total_bytes"] - one["total_bytes"] == four["gradients_bytes"] == four["ddp_gradient_buckets_bytes"]
    served = _predict(client, **body, batch_size=64, device_count=4, nodes=4, mode="inference")["memory"]
    assert served["ddp_gradient_buckets_bytes"] == 0
    assert served == _predict(client, **body, batch_size=16, mode="inference")["memory"]


def test_pcie_exposes_more_communication_than_nvlink(client: TestClient, resnet_id: str) -> None:
    body = {"graph_id": resnet_id, "batch_size": 64, "device_count": 4}
    nvlink = _predict(client, hardware_id="a100-sxm4-80gb", **body)["iteration"]
    pcie = _predict(client, hardware_id="a100-pcie-80gb", **body)["iteration"]
    assert pcie["allreduce_ms"] > 5 * nvlink["allreduce_ms"]
    assert pcie["scaling_efficiency"] < nvlink["scaling_efficiency"]


def test_inference_on_several_devices_needs_no_all_reduce(client: TestClient, resnet_id: str) -> None:
    it = _predict(client, graph_id=resnet_id, hardware_id="t4", batch_size=16, device_count=2,
                  mode="inference")["iteration"]
    assert it["gradient_bytes"] == 0 and it["allreduce_ms"] == 0 and it["scaling_efficiency"] == 1.0
    assert it["per_device_batch_size"] == 8


def test_one_device_per_node_needs_no_interconnect(client: TestClient, resnet_id: str) -> None:
    """A CPU lists no interconnect: 4 of them in one node are refused, one per node over the network is a ring."""
    body = {"graph_id": resnet_id, "hardware_id": "local", "batch_size": 32, "device_count": 4}
    assert client.post("/v1/predictions", json={**body, "nodes": 2}).json()["error"]["code"] == "no_interconnect"
    it = _predict(client, **body, nodes=4)["iteration"]
    assert it["per_device_batch_size"] == 8 and it["allreduce_ms"] > 0


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"hardware_id": "a100-sxm4-80gb", "batch_size": 30, "device_count": 8}, "validation_error"),
        ({"hardware_id": "a100-sxm4-80gb", "batch_size": 32, "num_devices": 8}, "validation_error"),
        ({"hardware_id": "a100-sxm4-80gb", "batch_size": 32, "device_count": 0}, "validation_error"),
        ({"hardware_id": "a100-sxm4-80gb", "batch_size": 32, "checkpoint_every_epochs": 1}, "validation_error"),
        ({"hardware_id": "local", "batch_size": 32, "device_count": 2}, "no_interconnect"),
    ],
)
def test_bad_data_parallel_requests_are_422(client: TestClient, resnet_id: str, extra: dict, code: str) -> None:
    r = client.post("/v1/predictions", json={"graph_id": resnet_id, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("extra", [{"price_usd_per_hour": 3.0}, {"grid_gco2_per_kwh": 400.0},
                                   {"price_usd_per_hour": 3.0, "dataset_size": 50_000}])
def test_a_price_or_grid_intensity_without_a_job_is_422_not_ignored(client: TestClient, resnet_id: str,
                                                                      extra: dict) -> None:
    """Both apply to the job only (cost_usd, co2_kg): without epochs there is none, and the answer used to
    drop them without a word, as if the caller had not asked for a cost."""
    r = client.post("/v1/predictions", json={"graph_id": resnet_id, "hardware_id": "a100-sxm4-80gb",
                                             "batch_size": 32, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "validation_error" and "needs 'epochs'" in r.json()["error"]["message"]


def test_input_pipeline_eval_passes_and_checkpoints(client: TestClient, resnet_id: str) -> None:
    base = {"graph_id": resnet_id, "hardware_id": "v100-sxm2-16gb", "batch_size": 32, "optimizer": "adam",
            "dataset_size": 10_000, "epochs": 4}
    plain = _predict(client, **base)
    t = plain["iteration"]["time_ms"]
    # a loader that needs twice the compute time bounds the step when it overlaps, adds when it does not
    rate = 32 / (2 * t / 1e3)
    slow = _predict(client, **base, loading_samples_per_s=rate)["iteration"]
    assert math.isclose(slow["time_ms"], 2 * t, rel_tol=1e-9)
    assert math.isclose(slow["input_exposed_ms"], t, rel_tol=1e-9)
    serial = _predict(client, **base, loading_samples_per_s=rate, loading_overlapped=False)["iteration"]
    assert math.isclose(serial["time_ms"], 3 * t, rel_tol=1e-9)
    full = _predict(client, **base, eval_size=1000, checkpoint_every_epochs=2, checkpoint_write_bytes_per_s=1e9)
    ep, job, mem = full["epoch"], full["job"], full["memory"]
    assert ep["eval_iterations"] == math.ceil(1000 / 32)
    assert math.isclose(ep["eval_s"], ep["eval_iterations"] * full["iteration"]["forward_ms"] / 1e3, rel_tol=1e-9)
    assert math.isclose(ep["time_s"], plain["epoch"]["time_s"] + ep["eval_s"], rel_tol=1e-9)
    assert job["checkpoints"] == 2
    # the file torch.save writes: fp32 weights + Adam's two fp32 states, without the allocator's rounding
    assert job["checkpoint_bytes"] == full["totals"]["params"] * 4 * 3
    assert job["checkpoint_bytes"] <= mem["weights_bytes"] + mem["optimizer_state_bytes"]
    assert math.isclose(job["checkpoint_s"], 2 * job["checkpoint_bytes"] / 1e9, rel_tol=1e-9)
    assert math.isclose(job["time_s"], 4 * ep["time_s"] + job["checkpoint_s"], rel_tol=1e-9)


def test_checkpoint_bytes_are_the_file_not_the_gpu_footprint(client: TestClient) -> None:
    """A checkpoint (weights + optimizer state, as torch.save writes them) is as large on every device: it was
    taken from the GPU footprint with the caching allocator's 512 B block rounding, so on an A100 a 172-parameter
    MLP with Adam checkpointed 6,144 B (each of its four tensors rounded up to 512 B, three copies) and 2,064 B
    on the CPU (``local``), whose allocator does not round."""
    graph = {"input_shape": [16], "layers": [{"op": "linear", "out_features": 8}, {"op": "relu"},
                                             {"op": "linear", "out_features": 4}]}
    params = 16 * 8 + 8 + 8 * 4 + 4
    body = {"graph": graph, "batch_size": 32, "optimizer": "adam", "dataset_size": 3200, "epochs": 2,
            "checkpoint_every_epochs": 1, "checkpoint_write_bytes_per_s": 1e9}
    answers = {hw: _predict(client, **body, hardware_id=hw) for hw in ("a100-sxm4-40gb", "h100-sxm", "local")}
    for hw, answer in answers.items():
        assert answer["totals"]["params"] == params, hw
        assert answer["job"]["checkpoint_bytes"] == params * 4 + 2 * params * 4, hw  # weights + Adam's m and v
        assert math.isclose(answer["job"]["checkpoint_s"], 2 * answer["job"]["checkpoint_bytes"] / 1e9, rel_tol=1e-12)
    gpu = answers["a100-sxm4-40gb"]["memory"]
    assert gpu["weights_bytes"] > params * 4  # the footprint itself keeps the allocator's rounding
    sgd = _predict(client, **{**body, "optimizer": "sgd"}, hardware_id="a100-sxm4-40gb")
    assert sgd["job"]["checkpoint_bytes"] == params * 4  # no optimizer state


def test_a_tiny_fraction_of_an_epoch_is_one_whole_iteration(client: TestClient, resnet_id: str) -> None:
    """``epochs: 1e-9`` answered a ResNet-50 job of 1.5e-6 s, far below one iteration: a job runs whole
    iterations (at least one), in the prediction and in the job estimates a scheduler reads; whole epochs keep
    epochs x epoch. The rounding is in the schema's description of epochs."""
    base = {"graph_id": resnet_id, "hardware_id": "a100-sxm4-40gb", "batch_size": 64, "dataset_size": 50_000}
    tiny = _predict(client, **base, epochs=1e-9)
    assert tiny["job"]["iterations"] == 1
    assert math.isclose(tiny["job"]["time_s"], tiny["iteration"]["time_ms"] / 1e3, rel_tol=1e-9)
    assert math.isclose(tiny["job"]["time_s_p90"], tiny["iteration"]["time_ms_p90"] / 1e3, rel_tol=1e-9)
    estimate = client.post("/v1/job-estimates", json={"jobs": [{**base, "epochs": 1e-9}]}).json()["estimates"][0]
    assert math.isclose(estimate["p50_s"], tiny["job"]["time_s"], rel_tol=1e-9)
    half = _predict(client, **base, epochs=0.5)["job"]
    assert half["iterations"] == math.ceil(25_000 / 64)  # the last partial iteration runs
    two = _predict(client, **base, epochs=2)
    assert two["job"]["iterations"] == 2 * two["epoch"]["iterations_per_epoch"] == 2 * math.ceil(50_000 / 64)
    assert math.isclose(two["job"]["time_s"], 2 * two["epoch"]["time_s"], rel_tol=1e-9)
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("PredictionCreate", "JobSpec", "ComparisonCreate"):
        assert "whole iterations" in schema[name]["properties"]["epochs"]["description"], name


def test_energy_money_and_co2_are_labelled_estimates(client: TestClient, resnet_id: str) -> None:
    hw = load_catalog()["a100-sxm4-80gb"]
    assert hw.tdp_w is not None and hw.price_usd_per_hour is not None
    body = _predict(client, graph_id=resnet_id, hardware_id=hw.id, batch_size=128, device_count=4,
                    dataset_size=50_000, epochs=2, grid_gco2_per_kwh=400)
    it, job = body["iteration"], body["job"]
    idle = IDLE_FRACTION_OF_TDP * hw.tdp_w
    # every device draws between idle and TDP for the whole step
    step_s = it["time_ms"] / 1e3
    assert 4 * idle * step_s < it["energy_j"] < 4 * hw.tdp_w * step_s
    assert idle < it["average_power_w"] < hw.tdp_w
    ep = body["epoch"]
    assert math.isclose(ep["energy_j"], ep["iterations_per_epoch"] * it["energy_j"], rel_tol=1e-9)
    assert math.isclose(job["energy_j"], 2 * ep["energy_j"], rel_tol=1e-9)
    assert math.isclose(job["energy_kwh"], job["energy_j"] / 3.6e6, rel_tol=1e-9)
    assert math.isclose(job["co2_kg"], job["energy_kwh"] * 0.4, rel_tol=1e-9)
    assert math.isclose(job["device_hours"], 4 * job["time_h"], rel_tol=1e-9)
    assert job["price_usd_per_hour"] == hw.price_usd_per_hour and "list price" in job["price_source"]
    assert math.isclose(job["cost_usd"], job["device_hours"] * hw.price_usd_per_hour, rel_tol=1e-9)
    for key in ("energy", "money", "co2"):
        assert body["assumptions"][key].startswith("ESTIMATE")
    override = _predict(client, graph_id=resnet_id, hardware_id=hw.id, batch_size=128, device_count=4,
                        dataset_size=50_000, epochs=2, price_usd_per_hour=1.5)["job"]
    assert override["price_source"] == "request" and override["co2_kg"] is None
    assert math.isclose(override["cost_usd"], override["device_hours"] * 1.5, rel_tol=1e-9)


def test_a_busier_layer_draws_more_power(client: TestClient, resnet_id: str) -> None:
    # a bigger batch keeps the GPU busier: higher mean power per device
    small = _predict(client, graph_id=resnet_id, hardware_id="h100-sxm", batch_size=1)["iteration"]
    large = _predict(client, graph_id=resnet_id, hardware_id="h100-sxm", batch_size=128)["iteration"]
    assert large["average_power_w"] > small["average_power_w"]


def test_no_price_or_tdp_is_said_not_zeroed(client: TestClient, resnet_id: str) -> None:
    body = _predict(client, graph_id=resnet_id, hardware_id="rtx-4090", batch_size=16, dataset_size=1000,
                    epochs=1)
    assert body["job"]["cost_usd"] is None and body["job"]["energy_j"] is not None
    assert any("price" in w for w in body["warnings"])
    custom = {"id": "no-tdp", "name": "No TDP", "vendor": "X", "peak_flops_per_s": {"fp32": 10e12},
              "memory_bytes": 16 * 2**30, "memory_bandwidth_bytes_per_s": 500e9, "compute_units": 40,
              "boost_clock_mhz": 1500, "l2_cache_bytes": 6 * 2**20}
    bare = _predict(client, graph_id=resnet_id, hardware=custom, batch_size=2, dataset_size=10, epochs=1)
    assert bare["iteration"]["energy_j"] is None and bare["job"]["energy_kwh"] is None
    assert bare["job"]["cost_usd"] is None
    assert any("tdp_w" in w for w in bare["warnings"])


def test_data_parallel_over_nodes_is_hierarchical(client: TestClient, resnet_id: str) -> None:
    job = {"graph_id": resnet_id, "hardware_id": "a100-sxm4-80gb", "batch_size": 512, "device_count": 16}
    one_node = _predict(client, **{**job, "batch_size": 256, "device_count": 8})  # the most one node holds
    default_net = _predict(client, **job, nodes=2)
    given = _predict(client, **job, nodes=2, inter_node_bandwidth_bytes_per_s=200e9, inter_node_latency_s=5e-6)
    it = default_net["iteration"]
    assert (it["nodes"], it["devices_per_node"]) == (2, 8) and one_node["iteration"]["nodes"] == 1
    link = load_catalog()["a100-sxm4-80gb"].link()
    net = Link(kind="network", bandwidth_bytes_per_s=25e9, step_latency_s=6.6e-6)
    expected = bucketed_allreduce(it["gradient_bytes"], Topology(nodes=2, devices_per_node=8, intra=link,
                                                                 network=net), backward_ms=it["backward_ms"])
    assert math.isclose(it["allreduce_ms"], expected.total_ms, rel_tol=1e-9)
    assert one_node["iteration"]["allreduce_ms"] < given["iteration"]["allreduce_ms"] < it["allreduce_ms"]
    assert any("inter-node network assumed 25 GB/s" in w for w in default_net["warnings"])
    assert not any("inter-node network assumed" in w for w in given["warnings"])
    assert "2 nodes x 8 devices" in default_net["assumptions"]["data_parallel"]
    for bad in ({"nodes": 3}, {"nodes": 1, "inter_node_bandwidth_bytes_per_s": 1e9}):
        r = client.post("/v1/predictions", json={**job, **bad})
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text


@pytest.mark.parametrize(("count", "nodes", "needed"), [(16, 1, 2), (9, 1, 3), (20, 1, 4), (32, 2, 4), (72, 1, 9),
                                                         (17, 1, 17)])
def test_more_devices_in_a_node_than_a_node_holds_is_a_422_naming_the_nodes_needed(
        client: TestClient, resnet_id: str, count: int, nodes: int, needed: int) -> None:
    """16 GPUs in one node used to be answered as one 16-rank NVLink ring: no DGX/HGX node holds them."""
    from app.core.collectives import MAX_DEVICES_PER_NODE

    body = {"graph_id": resnet_id, "batch_size": 8 * count, "device_count": count, "nodes": nodes}
    for hw in ({"hardware_id": "a100-sxm4-80gb"}, {"hardware_id": "local"}):  # before the interconnect check
        r = client.post("/v1/predictions", json={**body, **hw})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "too_many_devices_per_node"
        assert error["detail"] == {"device_count": count, "nodes": nodes, "devices_per_node": count // nodes,
                                   "max_devices_per_node": MAX_DEVICES_PER_NODE, "nodes_needed": needed}
        assert f"{needed} nodes" in error["message"]
    # an unknown device is a 404 whatever else is wrong with the request
    r = client.post("/v1/predictions", json={**body, "hardware_id": "no-such-gpu"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "hardware_not_found", r.text
    # the nodes it names are enough, and the count spreads evenly over them
    _predict(client, **{**body, "nodes": needed}, hardware_id="a100-sxm4-80gb")
