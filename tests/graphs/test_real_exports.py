"""GPT-2 small as users export it (TorchScript exporter, weights included, tied ``lm_head``), stored
without its weights and as an external-data model uploaded alone. Reuses the session's export."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from fastapi.testclient import TestClient

from app.core.analysis import GraphAnalysis, analyze
from app.core.onnx_import import import_onnx
from tests.core.real_models import exported

pytest.importorskip("torch")
pytest.importorskip("transformers")


VOCAB, WIDTH = 50257, 768


def _post(client: TestClient, content: bytes, **params) -> dict:
    r = client.post(
        "/v1/graphs", content=content, headers={"content-type": "application/octet-stream"}, params=params
    )
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture(scope="module")
def direct() -> GraphAnalysis:
    """GPT-2 imported straight from the exported bytes, weights present."""
    gpt2 = exported("gpt2")
    return analyze(import_onnx(gpt2.onnx_bytes, batch_size=1, dims=gpt2.dims))


def test_gpt2_with_weights_is_stored_without_them(client: TestClient, direct: GraphAnalysis) -> None:
    gpt2 = exported("gpt2")
    assert len(gpt2.onnx_bytes) > 400e6
    body = _post(client, gpt2.onnx_bytes, dims="seq=16")
    storage = body["storage"]
    assert body["size_bytes"] == len(gpt2.onnx_bytes)
    assert storage["weights_stored"] is False
    assert storage["stored_bytes"] < len(gpt2.onnx_bytes) / 100
    assert storage["stripped_weight_bytes"] > 0.95 * len(gpt2.onnx_bytes)
    assert body["summary"]["params"] == direct.params == gpt2.torch_params  # the tied head counted once
    assert body["summary"]["forward_macs"] == direct.forward_macs
    assert body["summary"]["unsupported"] == []
    at4 = client.get(f"/v1/graphs/{body['id']}/layers", params={"batch_size": 4, "dims": "seq=16"}).json()
    assert at4["summary"]["params"] == gpt2.torch_params
    assert at4["summary"]["forward_macs"] == 4 * direct.forward_macs


def test_gpt2_external_data_uploaded_alone(client: TestClient, tmp_path: Path, direct: GraphAnalysis) -> None:
    gpt2 = exported("gpt2")
    path = tmp_path / "gpt2.onnx"
    onnx.save_model(
        onnx.load_model_from_string(gpt2.onnx_bytes), str(path), save_as_external_data=True, location="gpt2.data"
    )
    small = path.read_bytes()
    assert len(small) < 2e6
    body = _post(client, small, dims="seq=16")
    s = body["summary"]
    assert s["unsupported"] == []
    assert s["forward_macs"] == direct.forward_macs
    # the declared dims give every tensor; without values a constant-folded tied copy cannot be
    # told apart from an untied head, so the LM head is at most counted a second time
    assert s["params"] in (gpt2.torch_params, gpt2.torch_params + VOCAB * WIDTH)
    assert body["storage"]["stripped_weight_bytes"] > 0.95 * (tmp_path / "gpt2.data").stat().st_size
