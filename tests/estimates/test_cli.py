"""``layercast predict | compare | gate`` offline, against a server (the test client), and the README's CI job."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.cli import main
from app.estimates import cli as ci
from tests.estimates.models import mlp_onnx
from tests.helpers import REPO, light_model

A100 = "a100-sxm4-40gb"


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    paths = {"small": tmp_path / "small.onnx", "wide": tmp_path / "wide.onnx", "resnet": tmp_path / "resnet50.onnx"}
    paths["small"].write_bytes(mlp_onnx(512))
    paths["wide"].write_bytes(mlp_onnx(8192))
    paths["resnet"].write_bytes(light_model("resnet50"))
    return paths


def test_predict_json_matches_the_api_numbers(models: dict[str, Path], client: TestClient,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = ["predict", str(models["resnet"]), "--hardware", A100, "--batch-size", "32",
            "--dataset-size", "10000", "--epochs", "3", "--json"]
    assert main(args) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline["job"]["time_s"] == pytest.approx(3 * offline["epoch"]["time_s"])
    gid = client.post("/v1/graphs", files={"file": ("r.onnx", light_model("resnet50"))}).json()["id"]
    served = client.post("/v1/predictions", json={"graph_id": gid, "hardware_id": A100, "batch_size": 32,
                                                 "dataset_size": 10000, "epochs": 3}).json()
    # the CLI runs the API's own code: same iteration, same job, same layers
    assert offline["iteration"]["time_ms"] == pytest.approx(served["iteration"]["time_ms"], rel=1e-9)
    assert offline["job"]["time_s"] == pytest.approx(served["job"]["time_s"], rel=1e-9)
    assert [r["name"] for r in offline["layers"]] == [r["name"] for r in served["layers"]]


def test_server_backend_gives_the_offline_answer(models: dict[str, Path], client: TestClient,
                                                 tmp_path: Path) -> None:
    backend = ci.ServerBackend("http://testserver")
    backend.client = client  # the TestClient is an httpx.Client on the app
    params = ci.JobParams(batch_size=64, dataset_size=1000, epochs=2)
    served = backend.predict(models["small"], A100, params)
    offline = ci.OfflineBackend(REPO / "models").predict(models["small"], A100, params)
    assert served["job"]["time_s"] == pytest.approx(offline["job"]["time_s"], rel=1e-9)
    with pytest.raises(ci.PredictionFailed) as info:
        backend.predict(models["small"], "no-such-device", params)
    assert info.value.code == "hardware_not_found"


def test_server_backend_uploads_a_symbolic_graph_with_the_requests_dims(client: TestClient, tmp_path: Path) -> None:
    """A graph with a symbolic ``seq`` is uploaded with the request's ``dims`` (without them the upload itself
    is a 422 ``unbound_dimension``), and the server answers what the offline path does."""
    from tests.helpers import seq_matmul_onnx

    model = tmp_path / "seq.onnx"
    model.write_bytes(seq_matmul_onnx())
    backend = ci.ServerBackend("http://testserver")
    backend.client = client
    params = ci.JobParams(batch_size=8, dims=(("seq", 64),))
    served = backend.predict(model, A100, params)
    offline = ci.OfflineBackend(REPO / "models").predict(model, A100, params)
    assert served["totals"]["forward_macs"] == 8 * 64 * 16 * 4 == offline["totals"]["forward_macs"]
    assert served["iteration"]["time_ms"] == pytest.approx(offline["iteration"]["time_ms"], rel=1e-9)


def test_offline_local_says_it_needs_the_server(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # `local` is a device of the service (detected and measured at its start), not of the offline catalog
    assert main(["predict", str(models["small"]), "--hardware", "local", "--batch-size", "8"]) == ci.EXIT_ERROR
    err = capsys.readouterr().err
    assert "hardware_not_found" in err and "--server" in err and "custom hardware" not in err


def test_compare_lists_refusals_with_their_code(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    job = ["--batch-size", "64", "--dataset-size", "6400", "--epochs", "1", "--precision", "bf16", "--json"]
    assert main(["compare", str(models["small"]), "--hardware", f"{A100},k80", *job]) == 0
    rows = {r["hardware_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[A100]["iteration_ms"] > 0 and rows[A100]["fits"] is True and rows[A100]["pareto"] is True
    assert rows["k80"]["error"] == "precision_not_supported"  # Kepler has no bf16: listed, not dropped, exit 0
    # a typo'd id is listed too, but a pipeline must not pass on it
    assert main(["compare", str(models["small"]), "--hardware", f"{A100},nope", *job]) == ci.EXIT_ERROR
    out, err = capsys.readouterr()
    assert {r["hardware_id"]: r.get("error") for r in json.loads(out)} == {A100: None, "nope": "hardware_not_found"}
    assert "hardware_not_found: 'nope'" in err
    assert main(["compare", str(models["small"]), "--hardware", " , ", *job]) == ci.EXIT_ERROR
    assert "names no device" in capsys.readouterr().err
    assert main(["compare", str(models["small"]), "--hardware", A100, "--batch-size", "64"]) == ci.EXIT_ERROR
    assert "--dataset-size and --epochs" in capsys.readouterr().err


def _table(out: str) -> list[dict[str, str]]:
    """The rows of a :func:`app.cli.format_table` table in ``out``, cut at the dash line's column widths."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("---"))
    spans, pos = [], 0
    for dashes in lines[at].split("  "):
        spans.append((pos, pos + len(dashes)))
        pos += len(dashes) + 2
    cut = [[line[a:b].strip() for a, b in spans] for line in lines[at - 1:] if line and not line.startswith("---")]
    rows = []
    for line in cut[1:]:
        if len(line) == len(cut[0]) and line[0] and " " not in line[0] and ":" not in line[0]:
            rows.append(dict(zip(cut[0], line, strict=True)))
    return rows


def test_tables_have_no_column_they_leave_empty(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """``predict`` (one device: no Pareto front, a refusal exits 2) has no pareto/error columns; every column
    of its row is filled. ``compare`` fills pareto on every row it could predict."""
    job = ["--batch-size", "64", "--dataset-size", "6400", "--epochs", "1"]
    assert main(["predict", str(models["small"]), "--hardware", A100, *job]) == 0
    (row,) = _table(capsys.readouterr().out)
    assert "pareto" not in row and "error" not in row
    assert row["hardware_id"] == A100 and all(row.values()), row
    assert {"epoch_s", "job_s", "cost_usd", "energy_kwh"} <= set(row)
    # without a job the job columns have no value: left out, not printed empty
    assert main(["predict", str(models["small"]), "--hardware", A100, "--batch-size", "64"]) == 0
    (row,) = _table(capsys.readouterr().out)
    assert not {"epoch_s", "job_s", "cost_usd", "energy_kwh", "pareto", "error"} & set(row), row
    assert {"iteration_ms", "peak_gib", "fits", "largest_batch"} <= set(row) and all(row.values()), row
    assert main(["compare", str(models["small"]), "--hardware", f"{A100},v100-sxm2-16gb,nope", *job]) == ci.EXIT_ERROR
    rows = {r["hardware_id"]: r for r in _table(capsys.readouterr().out)}
    assert set(rows) == {A100, "v100-sxm2-16gb", "nope"}
    assert {rows[h]["pareto"] for h in (A100, "v100-sxm2-16gb")} <= {"True", "False"}
    assert "True" in {rows[h]["pareto"] for h in (A100, "v100-sxm2-16gb")}
    assert rows["nope"]["error"] == "hardware_not_found"


def test_compare_against_a_server_is_one_comparisons_call(models: dict[str, Path], client: TestClient) -> None:
    backend = ci.ServerBackend("http://testserver")
    backend.client = client
    paths: list[str] = []
    client.event_hooks["request"].append(lambda request: paths.append(request.url.path))
    hardware = [A100, "v100-sxm2-16gb", "t4", "k80", "nope"]
    params = ci.JobParams(batch_size=64, dataset_size=6400, epochs=2, precision="fp16", device_count=2,
                          price_usd_per_hour=2.5)
    served = backend.compare(models["resnet"], hardware, params)
    assert paths == ["/v1/graphs", "/v1/comparisons"]  # one upload, one call for every device
    offline = ci.OfflineBackend(REPO / "models").compare(models["resnet"], hardware, params)
    assert len(served["rows"]) >= 3 and any(r["pareto"] for r in served["rows"])
    for key in ("hardware_id", "device_count", "fits", "pareto"):
        assert [r[key] for r in served["rows"]] == [r[key] for r in offline["rows"]]
    for key in ("job_s", "cost_usd", "energy_j"):
        assert [r[key] for r in served["rows"]] == pytest.approx([r[key] for r in offline["rows"]], rel=1e-9)
    for row in served["rows"]:  # the price override reached the server: 2 devices x hours x 2.5 USD
        assert row["cost_usd"] == pytest.approx(2 * 2.5 * row["job_s"] / 3600, rel=1e-6)
    refused = {u["hardware_id"]: u["code"] for u in served["unavailable"]}
    assert refused == {u["hardware_id"]: u["code"] for u in offline["unavailable"]}
    assert refused["nope"] == "hardware_not_found"


def test_gate_fails_on_growth_and_names_the_layer(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--hardware", A100, "--batch-size", "256", "--dataset-size", "100000", "--epochs", "5"]
    ok = main(["gate", str(models["small"]), "--baseline", str(models["small"]), "--max-increase", "5%", *common])
    assert ok == ci.EXIT_OK
    assert capsys.readouterr().out.startswith("ok: job_s")
    code = main(["gate", str(models["wide"]), "--baseline", str(models["small"]), "--max-increase", "5%",
                 *common, "--json"])
    assert code == ci.EXIT_BREACH
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["checks"][0]["increase"] > 0.05
    # the hidden width grew 16x: a Gemm grows most; the list is sorted by growth
    assert report["layers"][0]["name"] in ("fc1", "fc2")
    deltas = [row["delta_ms"] for row in report["layers"]]
    assert deltas == sorted(deltas, reverse=True) and deltas[0] > 0


def test_gate_absolute_epoch_limit(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["gate", str(models["small"]), "--hardware", A100, "--batch-size", "64", "--dataset-size", "50000"]
    assert main([*base, "--max-epoch-s", "1e6"]) == ci.EXIT_OK
    assert main([*base, "--max-epoch-s", "1e-6"]) == ci.EXIT_BREACH
    assert "BREACH: epoch takes" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["gate", "{small}", "--hardware", A100, "--batch-size", "8"],  # no limit
    ["gate", "{small}", "--hardware", A100, "--batch-size", "8", "--max-increase", "5%"],  # no baseline
    ["gate", "{small}", "--hardware", A100, "--batch-size", "8", "--max-epoch-s", "3"],  # no dataset size
    ["predict", "{small}", "--hardware", "k80", "--batch-size", "8", "--precision", "bf16"],
    ["predict", "{small}", "--hardware", A100, "--batch-size", "0"],
    ["predict", "/no/such/file.onnx", "--hardware", A100, "--batch-size", "8"],
])
def test_bad_invocations_exit_2(models: dict[str, Path], argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([a.format(small=models["small"]) for a in argv]) == ci.EXIT_ERROR
    assert capsys.readouterr().err.startswith("layercast")


def test_an_invalid_value_is_named_as_the_api_names_it(models: dict[str, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Offline, a value the request schema refuses says which field and why (not pydantic's help link)."""
    assert main(["predict", str(models["small"]), "--hardware", A100, "--batch-size", "-3"]) == ci.EXIT_ERROR
    err = capsys.readouterr().err
    assert "validation_error: batch_size: Input should be greater than 0" in err and "pydantic.dev" not in err


def test_parse_fraction() -> None:
    assert ci.parse_fraction("5%") == pytest.approx(0.05)
    assert ci.parse_fraction("0.1") == pytest.approx(0.1)
    with pytest.raises(Exception, match="fraction"):
        ci.parse_fraction("five")
    # a bare 5 was 500 %: a gate that never fires for whoever meant 5 %
    assert ci.parse_fraction("150%") == pytest.approx(1.5)
    for bare in ("5", "1", "2.5"):
        with pytest.raises(Exception, match=f"write {re.escape(bare)}%"):
            ci.parse_fraction(bare)


def _readme_ci_block() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh ci-gate\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "README.md must carry exactly one ```sh ci-gate block"
    return blocks[0]


def _run_block(cwd: Path) -> subprocess.CompletedProcess[str]:
    shim = cwd / "bin" / "layercast"  # `layercast` of this checkout, whatever is installed
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m app.cli \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "LAYERCAST_MODELS_DIR": str(REPO / "models")}
    return subprocess.run(["bash", "-c", _readme_ci_block()], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_readme_ci_job_passes_then_fails_on_a_slower_model(tmp_path: Path) -> None:
    (tmp_path / "baseline.onnx").write_bytes(mlp_onnx(512))
    (tmp_path / "model.onnx").write_bytes(mlp_onnx(512))
    passed = _run_block(tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert {r["hardware_id"] for r in json.loads((tmp_path / "compare.json").read_text())} == {
        "v100-sxm2-16gb", A100}
    (tmp_path / "model.onnx").write_bytes(mlp_onnx(8192))  # 16x the hidden width: about twice the job time
    failed = _run_block(tmp_path)
    assert failed.returncode == ci.EXIT_BREACH, failed.stdout + failed.stderr
    assert "BREACH: job_s grew" in failed.stdout and "fc1" in failed.stdout


def test_data_parallel_and_money_gate(models: dict[str, Path], client: TestClient,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    job = ["--hardware", A100, "--batch-size", "256", "--device-count", "8", "--dataset-size", "100000",
           "--epochs", "4", "--price-usd-per-hour", "3.0"]
    assert main(["predict", str(models["resnet"]), *job, "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    gid = client.post("/v1/graphs", files={"file": ("r.onnx", light_model("resnet50"))}).json()["id"]
    served = client.post("/v1/predictions", json={"graph_id": gid, "hardware_id": A100, "batch_size": 256,
                                                 "device_count": 8, "dataset_size": 100000, "epochs": 4,
                                                 "price_usd_per_hour": 3.0}).json()
    assert offline["iteration"]["per_device_batch_size"] == 32
    assert offline["job"]["cost_usd"] == pytest.approx(served["job"]["cost_usd"], rel=1e-9)
    cost = offline["job"]["cost_usd"]
    assert main(["gate", str(models["resnet"]), *job, "--max-usd", str(cost * 1.01)]) == ci.EXIT_OK
    assert main(["gate", str(models["resnet"]), *job, "--max-usd", str(cost * 0.99)]) == ci.EXIT_BREACH
    assert "BREACH: job costs" in capsys.readouterr().out


def test_more_than_a_node_of_devices_needs_nodes(models: dict[str, Path], client: TestClient,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """16 devices in one node are refused (too_many_devices_per_node); --nodes 2 is the way to ask for them, and
    offline it prices the job as the server does."""
    job = ["--hardware", A100, "--batch-size", "512", "--device-count", "16"]
    assert main(["predict", str(models["resnet"]), *job]) != 0
    assert "too_many_devices_per_node" in capsys.readouterr().err
    assert main(["predict", str(models["resnet"]), *job, "--nodes", "2", "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    gid = client.post("/v1/graphs", files={"file": ("r.onnx", light_model("resnet50"))}).json()["id"]
    served = client.post("/v1/predictions", json={"graph_id": gid, "hardware_id": A100, "batch_size": 512,
                                                 "device_count": 16, "nodes": 2}).json()
    assert offline["iteration"]["time_ms"] == pytest.approx(served["iteration"]["time_ms"], rel=1e-9)
    assert offline["iteration"]["allreduce_ms"] > 0
    # a count that does not spread evenly is refused before either backend (a comparison would round it)
    for bad in (["--nodes", "3"], ["--nodes", "0"]):
        for command in ("predict", "compare"):
            assert main([command, str(models["resnet"]), *job, *bad, "--server", "http://127.0.0.1:9"]) == 2
            assert "must spread evenly" in capsys.readouterr().err


def _with_unknown_op(content: bytes, op: str = "Relu") -> bytes:
    """``content`` with its ``op`` nodes replaced by an op of a custom domain that nothing can cost."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto.FromString(content)
    for node in model.graph.node:
        if node.op_type == op:
            node.op_type, node.domain = "Mystery", "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model.SerializeToString()


def test_gate_fails_a_candidate_with_layers_it_cannot_cost(models: dict[str, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    swapped = tmp_path / "swapped.onnx"
    swapped.write_bytes(_with_unknown_op(mlp_onnx(512)))
    common = ["--hardware", A100, "--batch-size", "64", "--dataset-size", "1000"]
    # a Relu swapped for an unknown op is not "faster than the baseline": the gate cannot vouch for it
    argv = ["gate", str(swapped), "--baseline", str(models["small"]), "--max-increase", "5%", *common]
    assert main(argv) == ci.EXIT_UNSUPPORTED
    out = capsys.readouterr().out
    assert "UNSUPPORTED:" in out and "Mystery x1 (relu)" in out and "--allow-unsupported" in out
    assert "ok:" not in out and "warning: " in out and "no cost formula" in out  # the prediction's warnings
    assert main([*argv, "--allow-unsupported"]) == ci.EXIT_OK
    assert "allowed by --allow-unsupported" in capsys.readouterr().out
    assert main([*argv, "--json"]) == ci.EXIT_UNSUPPORTED
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["breaches"] == []
    assert "Mystery" in {u["op_type"] for u in report["unsupported"]}
    assert any("no cost formula" in w for w in report["warnings"])
    # a model none of whose layers can be costed (epoch_s = 0) is refused as the API refuses it (422
    # no_costed_layers), not "ok: epoch_s = 0", even with --allow-unsupported
    only = tmp_path / "only.onnx"
    only.write_bytes(_with_unknown_op(mlp_onnx(512), "Gemm"))
    for allow in ([], ["--allow-unsupported"]):
        assert main(["gate", str(only), *common, "--max-epoch-s", "100", *allow]) == ci.EXIT_ERROR
        assert "no_costed_layers" in capsys.readouterr().err
    # a fully costed candidate still passes without the flag
    assert main(["gate", str(models["small"]), *common, "--max-epoch-s", "100"]) == ci.EXIT_OK
    # a baseline with uncosted layers is under-counted (the growth would be inflated): refused the same way
    back = ["gate", str(models["small"]), "--baseline", str(swapped), "--max-increase", "5%", *common]
    assert main(back) == ci.EXIT_UNSUPPORTED
    out = capsys.readouterr().out
    assert "UNSUPPORTED: baseline: " in out and "Mystery x1 (relu)" in out
    assert main([*back, "--json"]) == ci.EXIT_UNSUPPORTED
    report = json.loads(capsys.readouterr().out)
    assert report["unsupported"] == [] and "Mystery" in {u["op_type"] for u in report["baseline_unsupported"]}


@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "localhost:8000", "ftp://example.invalid"])
@pytest.mark.parametrize("command", ["predict", "gate", "compare"])
def test_an_unreachable_server_is_one_line_and_exit_3(models: dict[str, Path], url: str, command: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # port 9 (discard) refuses on loopback; the others are URLs httpx cannot send to
    argv = [command, str(models["small"]), "--hardware", A100, "--batch-size", "8", "--dataset-size", "100",
            "--epochs", "1", "--server", url]
    if command == "gate":
        argv += ["--max-epoch-s", "100"]
    assert main(argv) == ci.EXIT_UNREACHABLE != ci.EXIT_BREACH
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"layercast {command}: cannot reach --server {url!r}"), lines


def test_a_server_that_is_not_layercast_is_exit_3(models: dict[str, Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    backend = ci.ServerBackend("http://elsewhere")
    backend.client = httpx.Client(base_url="http://elsewhere", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text="<html>hello</html>", headers={"content-type": "text/html"})))
    with pytest.raises(ci.ServerUnreachable, match="not a layercast server|without the service's JSON"):
        backend.predict(models["small"], A100, ci.JobParams(batch_size=8))


@pytest.mark.parametrize(("status", "body", "ctype"), [
    (503, '{"error": {"code": "not_ready", "message": "starting", "detail": {}}}', "application/json"),
    (502, "<html>bad gateway</html>", "text/html"),
    (404, "<html>not found</html>", "text/html"),
])
def test_a_5xx_or_a_non_json_error_is_exit_3_not_a_refused_prediction(models: dict[str, Path], status: int,
                                                                      body: str, ctype: str) -> None:
    """A service that cannot answer now (503) or a proxy's page is no verdict on the model: ServerUnreachable
    (exit 3), not PredictionFailed (exit 2, "refused")."""
    import httpx

    backend = ci.ServerBackend("http://elsewhere")
    backend.client = httpx.Client(base_url="http://elsewhere", transport=httpx.MockTransport(
        lambda request: httpx.Response(status, text=body, headers={"content-type": ctype})))
    with pytest.raises(ci.ServerUnreachable, match=f"answered {status}"):
        backend.predict(models["small"], A100, ci.JobParams(batch_size=8))


def test_a_4xx_problem_document_is_still_a_refused_prediction(models: dict[str, Path]) -> None:
    import httpx

    backend = ci.ServerBackend("http://elsewhere")
    backend.client = httpx.Client(base_url="http://elsewhere", transport=httpx.MockTransport(
        lambda request: httpx.Response(422, json={"error": {"code": "precision_not_supported", "message": "no",
                                                            "detail": {}}})))
    with pytest.raises(ci.PredictionFailed) as info:
        backend.predict(models["small"], A100, ci.JobParams(batch_size=8))
    assert info.value.code == "precision_not_supported"


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("predict", "compare", "gate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "exit codes:" in out and "3  --server unreachable" in out and "1  gate: a limit breached" in out
