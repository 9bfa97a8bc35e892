"""``dims`` naming the batch axis is refused everywhere dims bind a graph (``batch_size`` binds that axis).

Before the fix the ``dims`` value won silently: an answer echoed ``batch_size=32`` with the times and the
memory of batch 7.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.cli import main
from app.core.onnx_import import import_onnx
from app.errors import BatchAxisInDims
from app.estimates import cli as ci
from tests.helpers import seq_matmul_onnx

A100 = "a100-sxm4-40gb"
CODE = "dims_names_batch_axis"


def _seq_model() -> bytes:
    """``x[batch, seq, 64] @ w[64, 32]``: a symbolic batch axis and a symbolic sequence axis."""
    return seq_matmul_onnx(64, 32)


@pytest.fixture
def seq_id(client: TestClient) -> str:
    r = client.post("/v1/graphs", content=_seq_model(), params={"dims": "seq=128"},
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _assert_refused(error: dict) -> None:
    """A problem document (or a batch item's ``{code, message}``) refusing dims' ``batch``."""
    assert error["code"] == CODE, error
    assert "batch_size=32" in error["message"] and "'batch'" in error["message"]
    if "detail" in error:
        assert error["detail"]["dimensions"] == ["batch"] and error["detail"]["batch_size"] == 32


def test_import_refuses_dims_naming_the_batch_axis() -> None:
    with pytest.raises(BatchAxisInDims) as info:
        import_onnx(_seq_model(), batch_size=32, dims={"seq": 128, "batch": 7})
    assert info.value.detail["inputs"] == ["x"]
    with pytest.raises(BatchAxisInDims):  # even the same value: one axis, one way to bind it
        import_onnx(_seq_model(), batch_size=32, dims={"seq": 128, "batch": 32})
    # the batch axis still takes batch_size, the other dims still bind
    g = import_onnx(_seq_model(), batch_size=32, dims={"seq": 128})
    assert g.dims == {"batch": 32, "seq": 128}


def test_every_endpoint_refuses_it(client: TestClient, seq_id: str) -> None:
    body = {"graph_id": seq_id, "hardware_id": A100, "batch_size": 32, "dims": {"seq": 128, "batch": 7}}
    r = client.post("/v1/predictions", json=body)
    assert r.status_code == 422, r.text
    _assert_refused(r.json()["error"])
    ok = client.post("/v1/predictions", json={**body, "dims": {"seq": 128}})
    assert ok.status_code == 200, ok.text

    batch = client.post("/v1/predictions/batch", json={"items": [body, {**body, "dims": {"seq": 128}}]})
    assert batch.status_code == 200, batch.text
    items = batch.json()["items"]
    _assert_refused(items[0]["error"])
    assert items[1]["error"] is None

    jobs = client.post("/v1/job-estimates", json={"jobs": [{**body, "dataset_size": 1000, "epochs": 1}]})
    assert jobs.status_code == 200, jobs.text
    _assert_refused(jobs.json()["estimates"][0]["error"])

    layers = client.get(f"/v1/graphs/{seq_id}/layers", params={"batch_size": 32, "dims": "seq=128,batch=7"})
    assert layers.status_code == 422, layers.text
    _assert_refused(layers.json()["error"])


def test_upload_refuses_it(client: TestClient) -> None:
    r = client.post("/v1/graphs", content=_seq_model(), params={"batch_size": 32, "dims": "seq=128,batch=7"},
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 422, r.text
    _assert_refused(r.json()["error"])


def test_cli_predict_refuses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "seq.onnx"
    model.write_bytes(_seq_model())
    argv = ["predict", str(model), "--hardware", A100, "--batch-size", "32", "--dims", "seq=128,batch=7"]
    assert main(argv) == ci.EXIT_ERROR
    assert CODE in capsys.readouterr().err
    assert main([*argv[:-1], "seq=128"]) == ci.EXIT_OK
