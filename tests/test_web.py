"""The web page at ``/``: form, prediction, charts, CSV, upload, errors; no outside host referenced."""

from __future__ import annotations

import csv
import io
import re

from fastapi.testclient import TestClient

from tests.helpers import light_model

SMALL_CNN = {
    "name": "small-cnn", "input_shape": [3, 32, 32],
    "layers": [{"op": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1}, {"op": "relu"},
               {"op": "flatten"}, {"op": "linear", "out_features": 10}],
}


def test_empty_page_has_the_form(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for field in ("graph_id", "hardware_id", "batch_size", "precision", "device_count", "dataset_size", "epochs"):
        assert f'name="{field}"' in page.text
    assert 'value="p100"' in page.text
    assert not re.search(r"(src|href)=\"https?://", page.text), "the page must not load anything from outside"


def test_prediction_page_charts_and_csv(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    params = {"graph_id": graph["id"], "hardware_id": "p100", "batch_size": 16, "dataset_size": 1600, "epochs": 2}
    page = client.get("/", params=params)
    assert page.status_code == 200, page.text
    text = page.text
    api = client.post("/v1/predictions", json={k: v for k, v in params.items()}).json()
    assert f"{api['iteration']['time_ms']:.4g}" in text  # the totals are the API's
    assert f"{api['job']['time_s']:.4g}" in text
    timed = [layer for layer in api["layers"] if layer["total_ms"]]
    assert text.count('<rect class="forward"') == len(timed)
    assert text.count('<rect class="backward"') == sum(1 for layer in timed if layer["backward_ms"])
    assert text.count('<circle class="layer"') == sum(1 for layer in timed if layer["forward_flops"] > 0
                                                      and layer["operational_intensity_flops_per_byte"] > 0)
    assert 'id="memory"' in text and 'id="roofline"' in text
    href = re.search(r'id="csv" href="([^"]+)"', text)
    assert href
    csv_response = client.get(href.group(1).replace("&amp;", "&"))
    assert csv_response.status_code == 200 and csv_response.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(csv_response.text)))
    assert [r["name"] for r in rows] == [layer["name"] for layer in api["layers"]]
    assert float(rows[0]["total_ms"]) == api["layers"][0]["total_ms"]


def test_bad_parameters_are_shown_with_their_code(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    missing = client.get("/", params={"graph_id": "0" * 64, "hardware_id": "p100"})
    assert missing.status_code == 404 and 'data-code="graph_not_found"' in missing.text
    uneven = client.get("/", params={"graph_id": graph["id"], "hardware_id": "p100", "batch_size": 5,
                                     "device_count": 2})
    assert uneven.status_code == 422 and 'data-code="validation_error"' in uneven.text
    hostile = client.get("/", params={"graph_id": "<script>x</script>", "hardware_id": "p100"})
    assert "<script>x" not in hostile.text


def test_upload_from_the_page_redirects_to_the_graph(client: TestClient) -> None:
    response = client.post("/ui/graphs", files={"file": ("resnet50.onnx", light_model("resnet50"))},
                           follow_redirects=False)
    assert response.status_code == 303
    graph_id = response.headers["location"].split("graph_id=")[1]
    assert client.get(f"/v1/graphs/{graph_id}").json()["name"] == "resnet50.onnx"
    page = client.get(response.headers["location"])
    assert f'value="{graph_id}" selected' in page.text and 'id="totals"' in page.text
    bad = client.post("/ui/graphs", files={"file": ("x.onnx", b"not onnx")})
    assert bad.status_code == 422 and 'data-code="invalid_graph"' in bad.text
