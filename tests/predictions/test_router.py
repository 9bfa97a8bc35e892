"""HTTP tests of POST /v1/predictions: the walking skeleton's end-to-end path."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from tests.helpers import light_model

IMAGENET = 1_281_167


@pytest.fixture
def resnet_id(client: TestClient) -> str:
    upload = ("resnet50.onnx", light_model("resnet50"), "application/octet-stream")
    r = client.post("/v1/graphs", files={"file": upload})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _predict(client: TestClient, **body):
    return client.post("/v1/predictions", json=body)


def test_resnet50_training_on_p100_per_layer_iteration_epoch(client: TestClient, resnet_id: str) -> None:
    r = _predict(client, graph_id=resnet_id, hardware_id="p100", batch_size=64, mode="training",
                 optimizer="momentum", dataset_size=IMAGENET, epochs=90)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["layers"]) > 50
    assert body["predictor_version"]
    it = body["iteration"]
    assert it["time_ms"] > 0 and it["time_ms_p10"] <= it["time_ms"] <= it["time_ms_p90"]
    assert math.isclose(it["time_ms"], it["forward_ms"] + it["backward_ms"] + it["update_ms"], rel_tol=1e-9)
    assert it["backward_ms"] > it["forward_ms"] * 0.5  # backward is roughly twice forward for convs
    # per-layer rows and the loss layer after them add up to the iteration
    assert it["loss_ms"] > 0
    assert math.isclose(sum(row["total_ms"] for row in body["layers"]) + it["loss_ms"], it["time_ms"], rel_tol=1e-6)
    ep = body["epoch"]
    assert ep["iterations_per_epoch"] == math.ceil(IMAGENET / 64)
    assert math.isclose(ep["time_s"], ep["iterations_per_epoch"] * it["time_ms"] / 1e3, rel_tol=1e-9)
    assert math.isclose(body["job"]["time_s"], 90 * ep["time_s"], rel_tol=1e-9)
    methods = {row["method"] for row in body["layers"]}
    assert "learned" in methods  # convs and the FC layer on a training GPU
    conv_rows = [row for row in body["layers"] if row["op_type"] == "Conv"]
    assert all(row["method"] == "learned" for row in conv_rows)
    # predictor v3 learned element-wise ops on GPUs (NeuSight); batch norm has no GPU measurements
    relu = [row for row in body["layers"] if row["op_type"] == "Relu"]
    bn = [row for row in body["layers"] if row["op_type"] == "BatchNormalization"]
    assert relu and all(row["method"] == "learned" for row in relu)
    assert bn and all(row["method"] == "roofline" for row in bn)
    # a ResNet-50 step at batch 64 on a P100 takes on the order of 100-1000 ms (MLPerf-era reports ~250 ms)
    assert 50 < it["time_ms"] < 5000
    # fp32 weights, each tensor rounded up to the CUDA caching allocator's 512-B blocks
    assert 0 <= body["memory"]["weights_bytes"] - body["totals"]["params"] * 4 <= 512 * len(
        [row for row in body["layers"] if row["params"]]) * 2
    assert body["totals"]["layers_unsupported"] == 0


def test_inference_has_no_backward_or_update(client: TestClient, resnet_id: str) -> None:
    body = _predict(client, graph_id=resnet_id, hardware_id="p100", batch_size=8, mode="inference").json()
    assert body["iteration"]["backward_ms"] == 0 and body["iteration"]["update_ms"] == 0
    assert body["optimizer"] == "none"
    assert body["epoch"] is None and body["job"] is None


def test_larger_batch_costs_more_and_faster_gpu_is_faster(client: TestClient, resnet_id: str) -> None:
    t = {}
    for hw, batch in (("k80", 32), ("p100", 32), ("p100", 128), ("a100-sxm4-40gb", 32)):
        r = _predict(client, graph_id=resnet_id, hardware_id=hw, batch_size=batch)
        assert r.status_code == 200, r.text
        t[hw, batch] = r.json()["iteration"]["time_ms"]
    assert t["p100", 128] > t["p100", 32]
    assert t["k80", 32] > t["p100", 32] > t["a100-sxm4-40gb", 32]


def test_cpu_local_uses_the_learned_cpu_head(client: TestClient) -> None:
    graph = {"input_shape": [64], "layers": [{"op": "linear", "out_features": 32}, {"op": "relu"}]}
    r = _predict(client, graph=graph, hardware_id="local", batch_size=16)
    assert r.status_code == 200, r.text
    assert {row["method"] for row in r.json()["layers"]} == {"learned"}  # both families are in the CPU seed data
    assert all(row["total_ms"] > 0 for row in r.json()["layers"])


def test_inline_custom_hardware(client: TestClient) -> None:
    graph = {"input_shape": [3, 32, 32], "layers": [{"op": "conv2d", "out_channels": 8, "kernel_size": 3}]}
    hw = {"id": "my-gpu", "name": "My GPU", "vendor": "ACME", "kind": "gpu",
          "peak_flops_per_s": {"fp32": 20e12}, "memory_bytes": 16e9, "memory_bandwidth_bytes_per_s": 1e12,
          "compute_units": 64, "boost_clock_mhz": 1500, "l2_cache_bytes": 6 * 2**20}
    r = _predict(client, graph=graph, hardware=hw, batch_size=4)
    assert r.status_code == 200, r.text
    assert r.json()["hardware_id"] == "my-gpu"
    # an inline price is the request's: its source used to read "catalog"
    priced = _predict(client, graph=graph, hardware={**hw, "price_usd_per_hour": 1.25}, batch_size=4,
                      dataset_size=400, epochs=1)
    assert priced.status_code == 200, priced.text
    job = priced.json()["job"]
    assert (job["price_usd_per_hour"], job["price_source"]) == (1.25, "request.hardware")


def _stored_spec(client: TestClient, hardware_id: str) -> dict:
    stored = client.get(f"/v1/hardware/{hardware_id}").json()
    return {k: v for k, v in stored.items() if k not in ("builtin", "owner") and v is not None}


@pytest.mark.parametrize("hardware_id", ["a100-sxm4-80gb", "local", "my-stored-gpu"])
def test_inline_hardware_under_a_stored_id_must_equal_it(client: TestClient, hardware_id: str) -> None:
    """An inline spec named like a catalog, local or stored custom device used to be costed as given: two
    answers under one hardware_id. It must be that device; any field that differs is a 422 naming it."""
    if hardware_id == "my-stored-gpu":
        custom = {**_stored_spec(client, "t4"), "id": hardware_id, "name": "Stored GPU", "price_usd_per_hour": 0.5}
        custom.pop("sources", None)
        assert client.post("/v1/hardware", json=custom).status_code == 201
    graph = {"input_shape": [64], "layers": [{"op": "linear", "out_features": 32}, {"op": "relu"}]}
    job = {"graph": graph, "batch_size": 8, "dataset_size": 80, "epochs": 1}
    spec = _stored_spec(client, hardware_id)
    by_id = _predict(client, hardware_id=hardware_id, **job).json()
    same = _predict(client, hardware={**spec, "sources": {}}, **job)
    assert same.status_code == 200, same.text
    assert same.json()["iteration"] == by_id["iteration"] and same.json()["job"] == by_id["job"]
    changed = {**spec, "name": "Not the stored one", "memory_bandwidth_bytes_per_s": spec[
        "memory_bandwidth_bytes_per_s"] * 2}
    r = _predict(client, hardware=changed, **job)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "conflicting_hardware"
    assert error["detail"]["hardware_id"] == hardware_id
    assert error["detail"]["fields"] == ["memory_bandwidth_bytes_per_s", "name"]


def test_unsupported_op_is_listed_and_totals_say_so(client: TestClient) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Hardmax", ["h"], ["y"])],
                          "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    gid = client.post("/v1/graphs", content=model.SerializeToString(),
                      headers={"content-type": "application/octet-stream"}).json()["id"]
    body = _predict(client, graph_id=gid, hardware_id="p100", batch_size=2).json()
    assert body["unsupported"][0]["op_type"] == "Hardmax" and body["unsupported"][0]["count"] == 1
    assert body["totals"]["totals_exclude_unsupported"] is True
    row = next(r for r in body["layers"] if r["op_type"] == "Hardmax")
    assert row["method"] == "unsupported" and row["total_ms"] is None
    assert any("Hardmax" in w for w in body["warnings"])


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_graph_with_no_costable_layer_is_refused_in_both_modes(client: TestClient, mode: str) -> None:
    """A 0 s iteration (in training the loss alone) would pass a CI gate and top a ranking: the prediction, a
    batch item and a job are refused with no_costed_layers naming the ops, as comparisons are; the graph's layer
    table still says why each layer has no formula."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph([helper.make_node("Hardmax", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    gid = client.post("/v1/graphs", content=model.SerializeToString(),
                      headers={"content-type": "application/octet-stream"}).json()["id"]
    r = _predict(client, graph_id=gid, hardware_id="p100", batch_size=2, mode=mode)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "no_costed_layers" and r.json()["error"]["detail"]["op_types"] == ["Hardmax"]
    item = {"graph_id": gid, "hardware_id": "p100", "batch_size": 2, "mode": mode}
    batch = client.post("/v1/predictions/batch", json={"items": [item, {**item, "graph_id": None, "graph": {
        "name": "mlp", "input_shape": [8], "layers": [{"op": "linear", "out_features": 4}]}}]}).json()["items"]
    assert batch[0]["error"]["code"] == "no_costed_layers" and batch[1]["error"] is None
    layers = client.get(f"/v1/graphs/{gid}/layers", params={"batch_size": 2})
    assert layers.status_code == 200 and layers.json()["layers"], layers.text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"hardware_id": "p100", "batch_size": 0}, 422, "validation_error"),
        ({"hardware_id": "p100", "batch_size": -4}, 422, "validation_error"),
        ({"hardware_id": "no-such-gpu", "batch_size": 8}, 404, "hardware_not_found"),
        ({"hardware_id": "p100", "batch_size": 8, "mode": "sleeping"}, 422, "validation_error"),
        ({"hardware_id": "p100", "batch_size": 8, "colour": "red"}, 422, "validation_error"),
    ],
)
def test_bad_requests_get_4xx_codes(client: TestClient, resnet_id: str, body: dict, status: int, code: str) -> None:
    r = _predict(client, graph_id=resnet_id, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_unknown_graph_id_is_404(client: TestClient) -> None:
    r = _predict(client, graph_id="f" * 64, hardware_id="p100", batch_size=8)
    assert r.status_code == 404 and r.json()["error"]["code"] == "graph_not_found"


def test_unbound_symbolic_dimension_is_422_naming_it(client: TestClient) -> None:
    from tests.helpers import seq_matmul_onnx

    content = seq_matmul_onnx()
    up = client.post("/v1/graphs", content=content, headers={"content-type": "application/octet-stream"})
    assert up.status_code == 422 and up.json()["error"]["code"] == "unbound_dimension"
    assert up.json()["error"]["detail"]["dimension"] == "seq"
    ok = client.post("/v1/graphs", content=content, params={"dims": "seq=32"},
                     headers={"content-type": "application/octet-stream"})
    assert ok.status_code == 201, ok.text
    # the upload's dims bind its summary only, and the upload says so
    assert ok.json()["summary"]["dims"]["seq"] == 32
    assert any("summary only" in n and "own dims" in n for n in ok.json()["notices"]), ok.json()["notices"]
    r = _predict(client, graph_id=ok.json()["id"], hardware_id="p100", batch_size=8)
    # a prediction that leaves seq unbound is refused, naming what the upload bound it to, never guessed
    error = r.json()["error"]
    assert r.status_code == 422 and error["code"] == "unbound_dimension" and error["detail"]["dimension"] == "seq"
    assert error["detail"]["upload_value"] == 32 and 'e.g. "dims": {"seq": 32}' in error["message"]
    layers = client.get(f"/v1/graphs/{ok.json()['id']}/layers", params={"batch_size": 8})
    assert layers.status_code == 422 and layers.json()["error"]["detail"]["upload_value"] == 32
    assert "dims=seq=32 in a query" in layers.json()["error"]["message"]  # the GET route's own syntax
    r = _predict(client, graph_id=ok.json()["id"], hardware_id="p100", batch_size=8, dims={"seq": 64})
    assert r.status_code == 200
    assert r.json()["totals"]["forward_macs"] == 8 * 64 * 16 * 4


def test_a_prediction_at_a_binding_the_graph_does_not_hold_is_422(client: TestClient) -> None:
    """A Reshape baked at seq 16 (a traced export) on a graph stored with a symbolic seq: a prediction at seq 64
    was answered with an "inconsistent at this binding" warning and the later layers costed at seq 16."""
    from tests.helpers import baked_seq_reshape_onnx

    up = client.post("/v1/graphs", content=baked_seq_reshape_onnx(seq=16), params={"dims": "seq=16"},
                     headers={"content-type": "application/octet-stream"})
    assert up.status_code == 201, up.text
    r = _predict(client, graph_id=up.json()["id"], hardware_id="p100", batch_size=1, dims={"seq": 64})
    error = r.json()["error"]
    assert r.status_code == 422 and error["code"] == "invalid_graph", r.text
    assert error["detail"]["node"] == "split_heads" and error["detail"]["input_shape"] == [1, 64, 8]
    # a baked leading 1 at another batch is still read as the batch axis (rewritten, with a warning)
    four = _predict(client, graph_id=up.json()["id"], hardware_id="p100", batch_size=4, dims={"seq": 16})
    assert four.status_code == 200 and any("Reshape 'split_heads'" in w for w in four.json()["warnings"]), four.text
    ok = _predict(client, graph_id=up.json()["id"], hardware_id="p100", batch_size=1, dims={"seq": 16})
    assert ok.status_code == 200, ok.text
    assert not any("Reshape" in w for w in ok.json()["warnings"])


def test_memory_footprint_by_precision_and_largest_batch(client: TestClient, resnet_id: str) -> None:
    fp32 = _predict(client, graph_id=resnet_id, hardware_id="v100-sxm2-16gb", batch_size=32, optimizer="adam").json()
    mixed = _predict(client, graph_id=resnet_id, hardware_id="v100-sxm2-16gb", batch_size=32, optimizer="adam",
                     precision="fp16").json()
    m32, m16 = fp32["memory"], mixed["memory"]
    params = fp32["totals"]["params"]
    # fp32 weights (the master copy under autocast) and gradients, 512-B allocator blocks on a GPU
    assert 4 * params <= m32["weights_bytes"] == m32["gradients_bytes"] == m16["weights_bytes"] < 4 * params * 1.01
    assert m32["weight_copies_bytes"] == 0
    assert 2 * params * 0.99 < m16["weight_copies_bytes"] <= m16["weights_bytes"] / 2
    assert m32["optimizer_state_bytes"] == m16["optimizer_state_bytes"] == 2 * m32["weights_bytes"]  # Adam, fp32
    assert m16["activations_bytes"] < 0.6 * m32["activations_bytes"]
    assert m32["runtime_bytes"] == m16["runtime_bytes"] >= 300 * 2**20  # CUDA context + cuBLAS workspace
    assert m32["total_bytes"] == sum(m32[k] for k in ("weights_bytes", "weight_copies_bytes", "optimizer_state_bytes",
                                                     "activations_bytes", "backward_transient_bytes", "runtime_bytes"))
    assert m16["largest_batch_size_that_fits"] > m32["largest_batch_size_that_fits"] > 32
    big = m32["largest_batch_size_that_fits"] + 1
    over = _predict(client, graph_id=resnet_id, hardware_id="v100-sxm2-16gb", batch_size=big, optimizer="adam").json()
    assert over["memory"]["fits"] is False
    assert any("exceeds" in w for w in over["warnings"])


def test_resnet50_mixed_precision_batch_256_fits_a_16_gb_v100(client: TestClient, resnet_id: str) -> None:
    """The public-benchmark configuration of issue 7: ResNet-50, batch 256, AMP, SGD momentum, V100 16 GB."""
    r = _predict(client, graph_id=resnet_id, hardware_id="v100-sxm2-16gb", batch_size=256, optimizer="momentum",
                 precision="fp16").json()
    assert r["memory"]["fits"] is True and r["memory"]["largest_batch_size_that_fits"] >= 256


def test_activation_checkpointing_option(client: TestClient, resnet_id: str) -> None:
    body = {"graph_id": resnet_id, "hardware_id": "v100-sxm2-16gb", "batch_size": 128, "optimizer": "momentum"}
    plain = _predict(client, **body).json()["memory"]
    ck = _predict(client, **body, activation_checkpointing=True).json()
    assert plain["activation_checkpointing"] is False and ck["memory"]["activation_checkpointing"] is True
    assert ck["memory"]["activations_bytes"] < 0.5 * plain["activations_bytes"]
    assert ck["memory"]["largest_batch_size_that_fits"] > plain["largest_batch_size_that_fits"]
    assert any("recomputes the forward pass" in w for w in ck["warnings"])
    bad = _predict(client, **body, mode="inference", activation_checkpointing=True)
    assert bad.status_code == 422 and "activation_checkpointing" in bad.text


def test_eval_mode_export_warning_only_when_training(client: TestClient, resnet_id: str) -> None:
    train = _predict(client, graph_id=resnet_id, hardware_id="p100", batch_size=8, mode="training").json()
    infer = _predict(client, graph_id=resnet_id, hardware_id="p100", batch_size=8, mode="inference").json()
    assert any(w.startswith("eval-mode export") for w in train["warnings"])
    assert not any(w.startswith("eval-mode export") for w in infer["warnings"])


def test_repeated_predictions_are_identical(client: TestClient, resnet_id: str) -> None:
    body = {"graph_id": resnet_id, "hardware_id": "p100", "batch_size": 16}
    first, second = _predict(client, **body).json(), _predict(client, **body).json()
    assert first == second


def test_optimizer_choices_match_the_cost_model() -> None:
    import typing

    from app.core.costs import OPTIMIZERS
    from app.predictions.schemas import Optimizer

    assert set(typing.get_args(Optimizer)) == set(OPTIMIZERS)


def test_per_layer_roofline_bound_and_intensity(client: TestClient, resnet_id: str) -> None:
    body = _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-40gb", batch_size=32, mode="inference").json()
    rows = {r["op_type"]: r for r in body["layers"]}
    conv, relu = rows["Conv"], rows["Relu"]
    assert conv["bound"] == "compute" and relu["bound"] == "memory"
    assert conv["operational_intensity_flops_per_byte"] > 50 > 1 > relu["operational_intensity_flops_per_byte"]
    peak, bw = 19.5e12, 1555e9  # A100 40 GB datasheet: fp32 19.5 TFLOP/s, 1555 GB/s
    expected_relu_ms = max(relu["forward_flops"] / peak, (relu["bytes_read"] + relu["bytes_written"]) / bw) * 1e3
    assert relu["roofline_ms"] == pytest.approx(expected_relu_ms, rel=1e-6)


def test_precision_the_device_lacks_is_a_422_not_a_silent_fp32_answer(client: TestClient, resnet_id: str) -> None:
    r = _predict(client, graph_id=resnet_id, hardware_id="v100-sxm2-16gb", batch_size=8, precision="bf16")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "precision_not_supported"
    assert err["detail"]["missing_peak"] == "bf16" and "fp16" in err["detail"]["available_peaks"]
    assert _predict(client, graph_id=resnet_id, hardware_id="t4", batch_size=8, precision="tf32").status_code == 422


@pytest.mark.parametrize("stack", ["pytorch-cuda-graph", "cuda-library"])
def test_gpu_only_stack_on_a_cpu_is_a_422_not_a_silent_answer(client: TestClient, resnet_id: str, stack: str) -> None:
    r = _predict(client, graph_id=resnet_id, hardware_id="local", batch_size=8, software_stack=stack)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "stack_not_supported"
    assert err["detail"] == {"software_stack": stack, "hardware_id": "local", "hardware_kind": "cpu",
                             "supported_kinds": ["gpu"]}
    assert stack in err["message"] and "CPU" in err["message"]
    inline_cpu = {"id": "my-cpu", "name": "my CPU", "vendor": "x", "kind": "cpu", "compute_units": 8,
                  "memory_bytes": 64 * 2**30, "memory_bandwidth_bytes_per_s": 100e9, "peak_flops_per_s": {"fp32": 2e12}}
    r = _predict(client, graph_id=resnet_id, hardware=inline_cpu, batch_size=8, software_stack=stack)
    assert r.status_code == 422 and r.json()["error"]["code"] == "stack_not_supported", r.text
    # the same stack on a GPU is answered
    r = _predict(client, graph_id=resnet_id, hardware_id="p100", batch_size=8, software_stack=stack)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stack", ["pytorch-eager", "pytorch-compiled", "tf1-session"])
def test_stacks_that_run_on_cpus_are_answered_there(client: TestClient, resnet_id: str, stack: str) -> None:
    r = _predict(client, graph_id=resnet_id, hardware_id="local", batch_size=8, software_stack=stack)
    assert r.status_code == 200, r.text


def test_answer_names_its_precision_semantics_and_floors(client: TestClient, resnet_id: str) -> None:
    bodies = {
        p: _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-40gb", batch_size=64, precision=p).json()
        for p in ("fp32", "fp32-strict", "tf32", "bf16")
    }
    assert {b["precision"] for b in bodies.values()} == set(bodies)
    assert "TF32" in bodies["fp32"]["precision_semantics"] and "autocast" in bodies["bf16"]["precision_semantics"]
    for body in bodies.values():
        for row in body["layers"]:
            if row["total_ms"] is not None:
                assert row["total_ms"] >= row["physics_floor_ms"] * (1 - 1e-9) > 0 or row["physics_floor_ms"] == 0
    # Convolutions under default fp32 use TF32 tensor cores on Ampere, under fp32-strict they do not
    def conv_roof(p: str) -> float:
        return sum(r["roofline_ms"] for r in bodies[p]["layers"] if r["op_type"] == "Conv")
    assert conv_roof("fp32") < conv_roof("fp32-strict") / 4
    # mixed precision moves 16-bit activations: a memory-bound Relu's roofline halves
    relu = [next(r for r in bodies[p]["layers"] if r["op_type"] == "Relu") for p in ("fp32", "bf16")]
    assert relu[1]["roofline_ms"] == pytest.approx(relu[0]["roofline_ms"] / 2, rel=1e-6)


def test_answer_says_which_software_stack_it_assumed(client: TestClient, resnet_id: str) -> None:
    default = _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-40gb", batch_size=1, mode="inference")
    graphs = _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-40gb", batch_size=1, mode="inference",
                      software_stack="pytorch-cuda-graph")
    assert default.json()["software_stack"] == "pytorch-eager"
    assert graphs.json()["software_stack"] == "pytorch-cuda-graph"
    # fallback (streaming) layers pay a smaller fixed cost per kernel under CUDA graphs
    def relu_ms(body: dict) -> float:
        return sum(r["total_ms"] for r in body["layers"] if r["op_type"] == "Relu")
    assert relu_ms(graphs.json()) < relu_ms(default.json())
    bad = _predict(client, graph_id=resnet_id, hardware_id="a100-sxm4-40gb", batch_size=1, software_stack="jax")
    assert bad.status_code == 422


ATTENTION_LM = {"input_shape": [16, 32], "layers": [
    {"op": "multihead_attention", "num_heads": 4}, {"op": "layernorm"}, {"op": "linear", "out_features": 1000}]}


def test_training_adds_the_loss_layer_on_every_device_and_inference_does_not(client: TestClient) -> None:
    for hw in ("local", "a100-sxm4-40gb"):
        train = _predict(client, graph=ATTENTION_LM, hardware_id=hw, batch_size=8, detail="layers").json()
        it = train["iteration"]
        assert it["loss_ms"] > 0, hw
        # the rows are the graph's layers; the loss layer after them is the named term of layers_ms
        rows = sum(row["total_ms"] for row in train["layers"])
        assert math.isclose(rows + it["loss_ms"], it["layers_ms"], rel_tol=1e-9)
        assert math.isclose(it["forward_ms"] + it["backward_ms"] + it["update_ms"], it["layers_ms"], rel_tol=1e-9)
        assert "cross-entropy" in train["assumptions"]["loss"]
        # the loss is not a graph layer, so its method and out-of-data flag are said here
        assert "estimated by the learned method" in train["assumptions"]["loss"], train["assumptions"]["loss"]
        infer = _predict(client, graph=ATTENTION_LM, hardware_id=hw, batch_size=8, mode="inference").json()
        assert infer["iteration"]["loss_ms"] == 0
        assert math.isclose(sum(r["total_ms"] for r in _predict(client, graph=ATTENTION_LM, hardware_id=hw,
                                                                 batch_size=8, mode="inference",
                                                                 detail="layers").json()["layers"]),
                            infer["iteration"]["layers_ms"], rel_tol=1e-9)


def test_totals_count_the_loss_layer_the_time_counts_and_name_it(client: TestClient) -> None:
    """In training the time includes the loss layer (loss_ms), so the FLOP totals do too, and name its share;
    after the graph's own softmax the loss is NLL (no second softmax)."""
    probs_lm = {**ATTENTION_LM, "layers": [*ATTENTION_LM["layers"], {"op": "softmax"}]}
    for graph, name, op in ((ATTENTION_LM, "loss/cross_entropy", "SoftmaxCrossEntropyLoss"),
                            (probs_lm, "loss/nll", "NegativeLogLikelihoodLoss")):
        train = _predict(client, graph=graph, hardware_id="a100-sxm4-40gb", batch_size=8, detail="layers").json()
        loss, totals = train["totals"]["loss"], train["totals"]
        assert (loss["name"], loss["op_type"]) == (name, op)
        assert loss["method"] in ("learned", "roofline") and loss["forward_flops"] > 0 and loss["bytes_read"] > 0
        for key in ("forward_flops", "backward_flops"):
            assert totals[key] == sum(row[key] for row in train["layers"]) + loss[key], key
        infer = _predict(client, graph=graph, hardware_id="a100-sxm4-40gb", batch_size=8, mode="inference",
                         detail="layers").json()
        assert infer["totals"]["loss"] is None and infer["iteration"]["loss_ms"] == 0
        assert infer["totals"]["forward_flops"] == sum(row["forward_flops"] for row in infer["layers"])
        assert infer["totals"]["backward_flops"] == 0
    assert loss["forward_flops"] == 8 * 16  # NLL: one per row, where cross-entropy adds 5 per logit


def test_a_cpu_costs_the_attention_core_as_its_parts_and_says_so(client: TestClient) -> None:
    cpu = _predict(client, graph=ATTENTION_LM, hardware_id="local", batch_size=8, detail="layers").json()
    gpu = _predict(client, graph=ATTENTION_LM, hardware_id="a100-sxm4-40gb", batch_size=8, detail="layers").json()
    assert [r["fusion_rule"] for r in gpu["layers"]].count("attention") == 1
    assert "attention" not in [r["fusion_rule"] for r in cpu["layers"]]
    cpu_ops = [r["op_type"] for r in cpu["layers"]]
    assert cpu_ops.count("MatMul") == 2 and "Softmax" in cpu_ops  # Q.K^T, softmax, .V costed one by one
    assert all(r["method"] == "learned" for r in cpu["layers"] if r["op_type"] in ("MatMul", "Softmax"))
    assert "NOT fused" in cpu["assumptions"]["fusion"] and "NOT fused" not in gpu["assumptions"]["fusion"]
    assert "SDPA" in gpu["assumptions"]["fusion"]


def test_activation_checkpointing_costs_the_recomputed_forward(client: TestClient, resnet_id: str) -> None:
    """Checkpointing recomputes the forward pass in backward (torch.utils.checkpoint): the step was answered
    at the plain step's time (the warning said so), so the epoch and job under checkpointing read ~1/3 too
    fast. The recompute is in backward_ms and every total now; the layers' own rows stay one forward each."""
    body = {"graph_id": resnet_id, "hardware_id": "v100-sxm2-16gb", "batch_size": 128, "optimizer": "momentum",
            "dataset_size": 50_000, "epochs": 2}
    plain = _predict(client, **body).json()
    ck = _predict(client, **body, activation_checkpointing=True).json()
    p, c = plain["iteration"], ck["iteration"]
    assert c["forward_ms"] == pytest.approx(p["forward_ms"])
    assert c["backward_ms"] == pytest.approx(p["backward_ms"] + p["forward_ms"])
    assert c["time_ms"] == pytest.approx(p["time_ms"] + p["forward_ms"])
    assert c["time_ms_p10"] > p["time_ms_p10"] and c["time_ms_p90"] > p["time_ms_p90"]
    assert c["energy_j"] > p["energy_j"]
    assert ck["epoch"]["time_s"] == pytest.approx(ck["epoch"]["iterations_per_epoch"] * c["time_ms"] / 1e3)
    assert ck["job"]["time_s"] == pytest.approx(2 * ck["epoch"]["time_s"])
    assert any("included" in w for w in ck["warnings"] if "recomputes the forward pass" in w)


def test_openapi_names_every_code_the_route_answers(client: TestClient) -> None:
    """Each domain error appears in OpenAPI with its literal code (STYLE.md): the 422 of ``dims`` naming no
    dimension of the graph (``unknown_dimension``), or the batch axis (``dims_names_batch_axis``), and a binding
    over a size limit (``limit_exceeded``) were answered but not documented."""
    from tests.helpers import seq_matmul_onnx

    gid = client.post("/v1/graphs", content=seq_matmul_onnx(), params={"dims": "seq=32"},
                      headers={"content-type": "application/octet-stream"}).json()["id"]
    documented = client.get("/openapi.json").json()["paths"]["/v1/predictions"]["post"]["responses"]
    for batch, dims in ((8, {"seq": 8, "sq": 8}), (8, {"seq": 8, "batch": 8}), (10**6, {"seq": 2**20})):
        r = _predict(client, graph_id=gid, hardware_id="p100", batch_size=batch, dims=dims)
        assert r.status_code == 422, r.text
        code = r.json()["error"]["code"]
        assert code in documented["422"]["description"], (code, documented["422"]["description"])
