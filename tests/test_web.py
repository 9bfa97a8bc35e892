"""The web page at ``/``: form, prediction, charts, CSV, upload, errors; no outside host referenced; and the
whole page end to end in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, through Selenium)
against the app served by uvicorn on a free port."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.helpers import light_model, seq_matmul_onnx, serve

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"

SMALL_CNN = {
    "name": "small-cnn", "input_shape": [3, 32, 32],
    "layers": [{"op": "conv2d", "out_channels": 8, "kernel_size": 3, "padding": 1}, {"op": "relu"},
               {"op": "flatten"}, {"op": "linear", "out_features": 10}],
}


def test_empty_page_has_the_form(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for field in ("graph_id", "hardware_id", "batch_size", "precision", "optimizer", "software_stack", "dims",
                  "device_count", "nodes", "dataset_size", "epochs"):
        assert f'name="{field}"' in page.text
    assert 'value="p100"' in page.text
    assert not re.search(r"(src|href)=\"https?://", page.text), "the page must not load anything from outside"


def test_the_memory_table_of_a_data_parallel_page_lists_the_ddp_buckets(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    params = {"graph_id": graph["id"], "hardware_id": "a100-sxm4-80gb", "batch_size": 16}
    memory = re.compile(r'<table id="memory">.*?</table>', re.S)
    one = memory.search(client.get("/", params=params).text)
    four = memory.search(client.get("/", params={**params, "device_count": 4}).text)
    assert one and four
    assert "DDP gradient buckets" in four.group(0) and "DDP gradient buckets" not in one.group(0)


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
    # the graph's layers, then the training loss: total_ms sums to the iteration's layer time
    assert [r["name"] for r in rows] == [layer["name"] for layer in api["layers"]] + ["loss/cross_entropy"]
    assert float(rows[0]["total_ms"]) == api["layers"][0]["total_ms"]
    assert float(rows[-1]["total_ms"]) == api["iteration"]["loss_ms"] > 0
    assert math.isclose(sum(float(r["total_ms"] or 0) for r in rows), api["iteration"]["layers_ms"], rel_tol=1e-6)
    # the loss row carries its cost as the layer rows do, so the FLOP columns sum to the answer's totals
    assert rows[-1]["op_type"] == "SoftmaxCrossEntropyLoss" and rows[-1]["method"] == api["totals"]["loss"]["method"]
    for key in ("forward_flops", "backward_flops"):
        assert sum(int(r[key]) for r in rows) == api["totals"][key] > 0, key
    assert int(rows[-1]["bytes_written"]) == api["totals"]["loss"]["bytes_written"] > 0


def test_bad_parameters_are_shown_with_their_code(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    missing = client.get("/", params={"graph_id": "0" * 64, "hardware_id": "p100"})
    assert missing.status_code == 404 and 'data-code="graph_not_found"' in missing.text
    uneven = client.get("/", params={"graph_id": graph["id"], "hardware_id": "p100", "batch_size": 5,
                                     "device_count": 2})
    assert uneven.status_code == 422 and 'data-code="validation_error"' in uneven.text
    hostile = client.get("/", params={"graph_id": "<script>x</script>", "hardware_id": "p100"})
    assert "<script>x" not in hostile.text


def test_the_page_spreads_more_than_a_node_of_devices_over_nodes(client: TestClient) -> None:
    """More than 8 devices in a node is refused (too_many_devices_per_node); the page had no nodes field, so
    it could not ask for 16 GPUs at all. Its answer and comparison are the API's for the same fields."""
    graph_id = client.post("/v1/graphs", json=SMALL_CNN).json()["id"]
    base = {"graph_id": graph_id, "hardware_id": "a100-sxm4-80gb", "batch_size": 64, "device_count": 16}
    crammed = client.get("/", params=base)
    assert crammed.status_code == 422 and 'data-code="too_many_devices_per_node"' in crammed.text
    page = client.get("/", params={**base, "nodes": 2, "dataset_size": 6400, "epochs": 1})
    assert page.status_code == 200, page.text
    api = client.post("/v1/predictions", json={**base, "nodes": 2}).json()
    assert f"{api['iteration']['time_ms']:.4g}" in page.text
    assert 'id="comparison-error"' not in page.text
    row = client.get("/ui/comparison.csv", params={**base, "nodes": 2, "dataset_size": 6400, "epochs": 1})
    assert row.status_code == 200 and "a100-sxm4-80gb" in row.text, row.text


def _symbolic_seq_graph(client: TestClient) -> str:
    """Upload a MatMul over ``(batch, seq, 16)`` (``seq`` bound on upload only) and return its id."""
    up = client.post("/v1/graphs", content=seq_matmul_onnx(), params={"dims": "seq=8"},
                     headers={"content-type": "application/octet-stream"})
    assert up.status_code == 201, up.text
    return str(up.json()["id"])


def test_the_page_takes_dims_optimizer_and_stack_as_the_api_does(client: TestClient) -> None:
    """A graph with a symbolic sequence length is costed on the page with ``dims``, and the optimizer and
    software stack reach the prediction (the page's totals and CSV are the API's for the same fields)."""
    graph_id = _symbolic_seq_graph(client)
    base = {"graph_id": graph_id, "hardware_id": "p100", "batch_size": 4}
    unbound = client.get("/", params=base)
    assert unbound.status_code == 422 and 'data-code="unbound_dimension"' in unbound.text
    fields = {"optimizer": "adam", "software_stack": "tf1-session"}
    page = client.get("/", params={**base, **fields, "dims": "seq=64"})
    assert page.status_code == 200, page.text
    api = client.post("/v1/predictions", json={**base, **fields, "dims": {"seq": 64}}).json()
    assert api["software_stack"] == "tf1-session" and api["optimizer"] == "adam"
    assert f"{api['iteration']['time_ms']:.4g}" in page.text
    assert 'value="seq=64"' in page.text and '<option value="adam" selected>' in page.text
    href = re.search(r'id="csv" href="([^"]+)"', page.text)
    assert href
    rows = list(csv.DictReader(io.StringIO(client.get(href.group(1).replace("&amp;", "&")).text)))
    assert float(rows[0]["total_ms"]) == api["layers"][0]["total_ms"]
    default = client.post("/v1/predictions", json={**base, "dims": {"seq": 64}}).json()
    assert default["iteration"]["time_ms"] != api["iteration"]["time_ms"]  # the fields changed the answer
    bad = client.get("/", params={**base, "dims": "seq"})
    assert bad.status_code == 422 and 'data-code="invalid_request"' in bad.text and "dims must look like" in bad.text


def test_an_unknown_query_parameter_is_refused_not_ignored(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    params = {"graph_id": graph["id"], "hardware_id": "p100", "batch_size": 4, "precison": "bf16"}
    page = client.get("/", params=params)
    assert page.status_code == 422 and 'data-code="invalid_request"' in page.text and "precison" in page.text
    for path in ("/ui/layers.csv", "/ui/comparison.csv"):
        r = client.get(path, params={**params, "dataset_size": 8, "epochs": 1})
        assert r.status_code == 422, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["detail"]["unknown"] == ["precison"]
    # a parameter given twice is refused too: the page used the last value
    repeated = client.get(f"/?graph_id={graph['id']}&hardware_id=p100&batch_size=4&batch_size=64")
    assert repeated.status_code == 422 and 'data-code="invalid_request"' in repeated.text
    assert "batch_size" in repeated.text and "more than once" in repeated.text


@pytest.mark.parametrize(("field", "typed", "says"), [
    ("batch_size", "abc", "valid integer"), ("batch_size", "0", "greater than or equal to 1"),
    ("device_count", "2.5", "valid integer"), ("dataset_size", "-3", "greater than or equal to 1"),
    ("epochs", "many", "valid number"), ("epochs", "0", "greater than 0"),
    # the request model's bounds, named as the page's field (query.<field>) like every other bad number
    ("epochs", "inf", "finite number"), ("epochs", "1e7", "less than or equal to 1000000"),
    ("dataset_size", str(10**16), "less than or equal to 1000000000000000"),
    ("device_count", "5000", "less than or equal to 4096"),
])
def test_a_bad_typed_number_is_the_pages_message_not_raw_json(client: TestClient, field: str, typed: str,
                                                               says: str) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    page = client.get("/", params={"graph_id": graph["id"], "hardware_id": "p100", field: typed})
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
    assert 'data-code="validation_error"' in page.text and 'id="totals"' not in page.text
    message = re.search(r'<p class="error" id="error"[^>]*>([^<]*)</p>', page.text)
    assert message and f"validation_error: query.{field}: " in message.group(1) and says in message.group(1)
    assert f'name="{field}" id="{field}" value="{typed}"' in page.text  # the form keeps what was typed


def test_empty_number_fields_of_the_form_are_their_defaults(client: TestClient) -> None:
    """The form submits an empty ``dataset_size``/``epochs`` as ``""``: not given, not an error."""
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    page = client.get("/", params={"graph_id": graph["id"], "hardware_id": "p100", "batch_size": "",
                                   "device_count": "", "dataset_size": "", "epochs": ""})
    assert page.status_code == 200 and 'id="totals"' in page.text and 'id="comparison-hint"' in page.text
    assert 'name="batch_size" id="batch_size" value="32"' in page.text


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


def test_a_refused_csv_is_a_problem_document_whatever_refused_it(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    bad_mode = client.get("/ui/layers.csv", params={"graph_id": graph["id"], "hardware_id": "t4", "mode": "train"})
    assert bad_mode.status_code == 422 and bad_mode.headers["content-type"].startswith("application/json")
    error = bad_mode.json()["error"]
    assert error["code"] == "validation_error" and error["detail"]["errors"][0]["loc"] == ["query", "mode"]
    assert error["message"].startswith("request validation failed: query.mode: ")
    no_graph = client.get("/ui/comparison.csv", params={"graph_id": "nope", "dataset_size": 10, "epochs": 1})
    assert no_graph.status_code == 404 and no_graph.json()["error"]["code"] == "graph_not_found"


def test_comparison_on_the_page_and_its_csv(client: TestClient) -> None:
    graph = client.post("/v1/graphs", json=SMALL_CNN).json()
    params = {"graph_id": graph["id"], "hardware_id": "p100", "batch_size": 16, "dataset_size": 1600, "epochs": 2}
    text = client.get("/", params=params).text
    api = client.post("/v1/comparisons", json={k: v for k, v in params.items() if k != "hardware_id"}).json()
    fitting = [r for r in api["rows"] if r["fits"]]
    assert text.count('<circle class="device') == len(fitting) > 1
    assert text.count('<circle class="device pareto"') == sum(r["pareto"] for r in fitting) >= 1
    assert 'id="pareto-front"' in text and 'id="comparison"' in text
    href = re.search(r'id="comparison-csv" href="([^"]+)"', text)
    assert href
    rows = list(csv.DictReader(io.StringIO(client.get(href.group(1).replace("&amp;", "&")).text)))
    assert [(r["hardware_id"], float(r["job_s"]), r["pareto"]) for r in rows] == [
        (r["hardware_id"], r["job_s"], str(r["pareto"])) for r in api["rows"]]
    hint = client.get("/", params={k: v for k, v in params.items() if k != "epochs"}).text
    assert 'id="comparison-hint"' in hint and 'id="comparison-chart"' not in hint


@pytest.fixture
def live_url(app: FastAPI) -> Iterator[str]:
    """The app served by uvicorn on a free local port."""
    with serve(app) as url:
        yield url


def _browser(download_dir: Path) -> object:
    """Headless Chromium driven by chromedriver; skips without them, fails under CI (scripts/test.sh installs
    them there)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        why = f"headless browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                              "download.prompt_for_download": False})
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(download_dir)})
    return driver


def _wait_for(predicate: object, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_page_end_to_end_in_headless_chromium(live_url: str, tmp_path: Path) -> None:
    """Upload an ONNX file on the page, pick a device and a job, see the totals, the stacked per-layer bars,
    the roofline, the comparison with its Pareto front and the memory breakdown; the progress bar shows while
    a form is submitted; download the CSV; every request the browser made went to the app; a screenshot."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    model = tmp_path / "resnet50.onnx"
    model.write_bytes(light_model("resnet50"))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    driver = _browser(downloads)
    try:
        driver.get(live_url + "/")  # type: ignore[attr-defined]
        find = driver.find_element  # type: ignore[attr-defined]
        find(By.ID, "file").send_keys(str(model))
        find(By.ID, "upload").click()
        _wait_for(lambda: "graph_id=" in driver.current_url, "the upload's redirect")  # type: ignore[attr-defined]
        graph_id = driver.current_url.split("graph_id=")[1]  # type: ignore[attr-defined]
        assert Select(find(By.ID, "graph_id")).first_selected_option.get_attribute("value") == graph_id

        Select(find(By.ID, "hardware_id")).select_by_value("a100-sxm4-80gb")
        Select(find(By.ID, "precision")).select_by_value("fp16")
        for name, value in (("batch_size", "64"), ("dataset_size", "128000"), ("epochs", "3")):
            find(By.ID, name).clear()
            find(By.ID, name).send_keys(value)
        # the progress bar: shown on submit (this first submit is held back in the page to look at it)
        assert not find(By.ID, "progress").is_displayed()
        driver.execute_script(  # type: ignore[attr-defined]
            "document.forms[1].addEventListener('submit', e => e.preventDefault(), {once: true})")
        find(By.ID, "predict").click()
        assert find(By.ID, "progress").is_displayed() and not find(By.ID, "predict").is_enabled()
        driver.execute_script("document.forms[1].submit()")  # type: ignore[attr-defined]
        _wait_for(lambda: driver.find_elements(By.ID, "totals"), "the prediction")  # type: ignore[attr-defined]

        totals = find(By.ID, "totals").text
        assert "iteration (ms)" in totals and "job (s)" in totals
        iteration_ms = float(re.search(r"iteration \(ms\) ([0-9.e+-]+)", totals).group(1))  # type: ignore[union-attr]
        assert iteration_ms > 0
        chart = find(By.ID, "layer-chart")
        assert chart.find_elements(By.CSS_SELECTOR, "rect.forward") and chart.find_elements(By.CSS_SELECTOR,
                                                                                            "rect.backward")
        assert len(find(By.ID, "roofline").find_elements(By.CSS_SELECTOR, "circle.layer")) > 10
        comparison = find(By.ID, "comparison-chart")
        assert comparison.find_elements(By.CSS_SELECTOR, "circle.pareto")
        assert len(comparison.find_elements(By.CSS_SELECTOR, "circle.device")) > 5
        assert find(By.ID, "pareto-front").get_attribute("points")
        assert "activations" in find(By.ID, "memory").text
        assert "fp16" in find(By.XPATH, "//h2[contains(., 'Roofline')]").text

        find(By.ID, "csv").click()
        csv_file = downloads / "layers.csv"
        _wait_for(lambda: csv_file.exists() and csv_file.stat().st_size > 0, "the CSV download")
        rows = list(csv.DictReader(io.StringIO(csv_file.read_text())))
        assert len(rows) > 50 and {"name", "forward_ms", "backward_ms", "total_ms"} <= set(rows[0])

        driver.set_window_size(1200, driver.execute_script(  # type: ignore[attr-defined]
            "return document.documentElement.scrollHeight") + 100)
        shot = tmp_path / "web_screenshot.png"
        assert driver.save_screenshot(str(shot))  # type: ignore[attr-defined]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if os.environ.get("LAYERCAST_WEB_SCREENSHOT"):  # regenerate reports/web_screenshot.png
            shutil.copyfile(shot, os.environ["LAYERCAST_WEB_SCREENSHOT"])

        origin = urlparse(live_url).netloc
        requested = {urlparse(json.loads(entry["message"])["message"]["params"]["request"]["url"]).netloc
                     for entry in driver.get_log("performance")  # type: ignore[attr-defined]
                     if json.loads(entry["message"])["message"]["method"] == "Network.requestWillBeSent"}
        assert requested == {origin}, f"the page requested other hosts: {requested - {origin}}"
    finally:
        driver.quit()  # type: ignore[attr-defined]
