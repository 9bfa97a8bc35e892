"""Memoised predictor answers of POST /v1/predictions (issue 12): a repeat asks the predictor nothing, the
memo is counted against the analysis cache's byte budget, is shared with the batch endpoint, and a swapped
predictor (another version, or another object of the same version) never gets another's answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.deps import get_predictor
from app.graphs.service import analysis_cache

CNN = {"name": "memo-cnn", "input_shape": [3, 32, 32],
       "layers": [{"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"},
                  {"op": "conv2d", "out_channels": 24, "kernel_size": 3, "padding": 1}, {"op": "relu"},
                  {"op": "flatten"}, {"op": "linear", "out_features": 10}]}
REQUEST = {"graph": CNN, "hardware_id": "a100-sxm4-40gb", "batch_size": 32}


class Scaled:
    """The app's predictor under another version, its times multiplied by ``factor``, counting its calls."""

    def __init__(self, inner: Any, *, version: str, factor: float) -> None:
        self.inner, self.version, self.factor, self.calls = inner, version, factor, 0

    def estimate(self, queries: Sequence[Any]) -> Any:
        raise AssertionError("served predictions go through estimate_tables")

    def estimate_tables(self, items: Sequence[Any]) -> Any:
        self.calls += 1
        f = self.factor
        return [dataclasses.replace(e, forward_ms=e.forward_ms * f, backward_ms=e.backward_ms * f,
                                    update_ms=e.update_ms * f, total_ms_p10=e.total_ms_p10 * f,
                                    total_ms_p90=e.total_ms_p90 * f)
                for e in self.inner.estimate_tables(items)]


@pytest.fixture
def swap(client: TestClient) -> Iterator[Any]:
    """``swap(predictor)`` serves ``predictor`` from then on (``dependency_overrides``), as a hot swap would."""
    app: Any = client.app

    def use(predictor: Any) -> None:
        app.dependency_overrides[get_predictor] = lambda: predictor

    yield use
    app.dependency_overrides.pop(get_predictor, None)


def _post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/predictions", json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_repeat_asks_the_predictor_nothing_and_its_memo_is_counted(client: TestClient, swap: Any) -> None:
    current = client.app.state.predictors.current()  # type: ignore[attr-defined]
    p = Scaled(current, version=current.version, factor=1.0)
    swap(p)
    first = _post(client, {**REQUEST, "detail": "layers"})
    held = analysis_cache.nbytes
    assert p.calls == 1
    again = _post(client, {**REQUEST, "detail": "layers"})
    assert p.calls == 1 and again == first  # same numbers, nothing predicted
    _post(client, {**REQUEST, "precision": "fp16"})  # another precision: predicted, and its memo counted
    assert p.calls == 2 and analysis_cache.nbytes > held


def test_a_swapped_predictor_never_gets_another_predictors_answers(client: TestClient, swap: Any) -> None:
    current = client.app.state.predictors.current()  # type: ignore[attr-defined]
    a = Scaled(current, version="memo-a", factor=1.0)
    b = Scaled(current, version="memo-b", factor=2.0)
    a_again = Scaled(current, version="memo-a", factor=3.0)  # same version string, another object (a reload)
    swap(a)
    ra = _post(client, REQUEST)
    swap(b)
    rb = _post(client, REQUEST)
    assert b.calls == 1 and rb["predictor_version"] == "memo-b"
    assert rb["iteration"]["layers_ms"] == pytest.approx(2 * ra["iteration"]["layers_ms"], rel=1e-9)
    swap(a_again)
    rc = _post(client, REQUEST)
    assert a_again.calls == 1
    assert rc["iteration"]["layers_ms"] == pytest.approx(3 * ra["iteration"]["layers_ms"], rel=1e-9)
    swap(a)
    assert _post(client, REQUEST) == ra and a.calls == 1  # a's own memo, untouched by b and a_again


def test_the_batch_endpoint_and_single_predictions_share_the_memo(client: TestClient, swap: Any) -> None:
    current = client.app.state.predictors.current()  # type: ignore[attr-defined]
    p = Scaled(current, version=current.version, factor=1.0)
    swap(p)
    item = {**REQUEST, "batch_size": 16, "mode": "inference"}
    r = client.post("/v1/predictions/batch", json={"items": [item]})
    assert r.status_code == 200, r.text
    assert p.calls == 1
    single = _post(client, item)
    assert p.calls == 1  # answered from what the batch call memoised
    assert single["iteration"]["time_ms"] == pytest.approx(r.json()["items"][0]["summary"]["iteration_ms"], rel=1e-12)
