"""Seeded, bounded fuzzing of the request bodies: no input may answer 5xx.

Byte mutations of ONNX files found invalid UTF-8 in names (protobuf returns ``bytes``: a 500 in
sorting/JSON), tensors whose data does not match their dims and unknown element types; type mutations
of every field of the JSON bodies cover integers out of the column range, denormals, NUL, nesting.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

import app.main
from app.config import Settings
from app.migrate import upgrade
from tests.helpers import light_model
from tests.security.test_hostile_inputs import (
    HARDWARE,
    MEASUREMENT,
    onnx_conv_dim_2_31,
    onnx_expand_16384sq,
    onnx_many_nodes,
    prediction,
)

JUNK: list[Any] = [None, True, -1, 0, 2**31, 2**63, 2**64, 1e308, 5e-324, "", "\x00", "\ud800", [], {},
                   [[[[]]]], 1.5, "9" * 5000]


@pytest.fixture(scope="module")
def fuzz_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(database_url=f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}")
    upgrade(settings.database_url)
    with TestClient(app.main.create_app(settings), raise_server_exceptions=False) as client:
        yield client


def test_mutated_onnx_files_never_answer_5xx(fuzz_client: TestClient) -> None:
    rng = random.Random(2026)
    seeds = [light_model("squeezenet"), onnx_many_nodes(3), onnx_expand_16384sq(), onnx_conv_dim_2_31()]
    failures = []
    for k in range(400):
        content = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            content[rng.randrange(len(content))] = rng.randrange(256)
        r = fuzz_client.post("/v1/graphs", content=bytes(content), params={"dims": "N=2"} if k % 2 else {},
                             headers={"content-type": "application/octet-stream"})
        if r.status_code >= 500:
            failures.append((k, r.text[:200]))
    assert failures == []


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/measurements", MEASUREMENT), ("/v1/hardware", HARDWARE), ("/v1/predictions", prediction()),
     ("/v1/graphs", prediction()["graph"])],
    ids=["measurements", "hardware", "predictions", "graphs"],
)
def test_every_field_with_junk_never_answers_5xx(fuzz_client: TestClient, path: str, base: dict[str, Any]) -> None:
    failures = []
    for field in [*base, "extra"]:
        for junk in JUNK:
            mutated = {**base, field: junk}
            if path == "/v1/measurements":  # one row of a batch (the row fields are what is fuzzed)
                mutated = {"measurements": [base, mutated]}
            body = json.dumps(mutated).encode("utf-8", "surrogatepass")
            r = fuzz_client.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                failures.append((field, repr(junk)[:30], r.text[:200]))
            elif field != "extra" and junk in ("\x00", "\ud800") and r.status_code < 300:
                failures.append((field, repr(junk)[:30], f"accepted with {r.status_code}"))
    assert failures == []


@pytest.mark.parametrize("endpoint", ["/v1/job-estimates", "/v1/comparisons", "/v1/predictions/batch"])
def test_estimate_bodies_with_junk_never_answer_5xx(fuzz_client: TestClient, endpoint: str) -> None:
    """The estimate endpoints re-validate their items as predictions internally: a field the outer
    schema accepts but the inner one refuses would be a 500."""
    from tests.security.test_hostile_inputs import json_graph

    gid = fuzz_client.post("/v1/graphs", json=json_graph(name="fuzz")).json()["id"]
    job = {"graph_id": gid, "hardware_id": "a100-sxm4-40gb", "batch_size": 64, "dataset_size": 50_000, "epochs": 2}
    base, wrap = {
        "/v1/job-estimates": (job, lambda b: {"jobs": [b]}),
        "/v1/comparisons": ({**{k: v for k, v in job.items() if k != "hardware_id"},
                             "hardware_ids": ["a100-sxm4-40gb"], "device_counts": [1, 8]}, lambda b: b),
        "/v1/predictions/batch": ({"graph_id": gid, "hardware_id": "a100-sxm4-40gb", "batch_size": 2},
                                  lambda b: {"items": [b]}),
    }[endpoint]
    assert fuzz_client.post(endpoint, json=wrap(base)).status_code == 200
    failures = []
    for field in [*base, "extra"]:
        for junk in [*JUNK, [2**31], [0], [1e308]]:
            body = json.dumps(wrap({**base, field: junk})).encode("utf-8", "surrogatepass")
            r = fuzz_client.post(endpoint, content=body, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                failures.append((field, repr(junk)[:30], r.text[:200]))
    assert failures == []
