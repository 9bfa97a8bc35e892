"""Jobs sharing a scenario share its layer sums: each job's iteration, epoch and job figures equal those of
the per-job aggregation that summed every layer of every job (the code this replaced), on a mixed job list."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.core.aggregate import Aggregate, AggregationInput, LayerTime, aggregate, layer_sums
from app.estimates import engine
from app.predictions.schemas import PredictionCreate
from app.predictions.service import aggregation_input, layer_powers
from app.predictor.table import Estimates, LayerTable, Setting

A100, V100 = "a100-sxm4-40gb", "v100-sxm2-16gb"


def layer_times(table: LayerTable, setting: Setting, est: Estimates) -> list[LayerTime]:
    """The replaced per-row path: a :class:`LayerTime` per row of ``est`` with its power."""
    power, _ = layer_powers(table, setting, est)
    powers: list[float | None] = [None] * len(table) if power is None else power.tolist()
    return [LayerTime(forward_ms=f, backward_ms=b, update_ms=u, total_ms_p10=lo, total_ms_p90=hi, power_w=pw)
            for f, b, u, lo, hi, pw in zip(est.forward_ms.tolist(), est.backward_ms.tolist(), est.update_ms.tolist(),
                                           est.total_ms_p10.tolist(), est.total_ms_p90.tolist(), powers, strict=True)]


def _per_job(cache: engine.GraphCache, s: engine.Scenario, times: list[Any]) -> Aggregate:
    """The replaced path: every job summed its own layers (no shared sums)."""
    inp: AggregationInput = aggregation_input(s.request, s.hardware, list(times), cache.footprint(s),
                                              training=s.training)
    assert (inp.sums is None) != s.request.activation_checkpointing  # checkpointing adds the recompute to sums
    return aggregate(inp)


def _close(a: object, b: object, where: str) -> None:
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        for f in dataclasses.fields(a):  # type: ignore[arg-type]
            _close(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b, (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_shared_sums_give_the_per_job_numbers(client: TestClient, session: Session, resnet_id: str, mlp_id: str,
                                              node: str) -> None:
    base = [
        {"graph_id": resnet_id, "hardware_id": A100, "batch_size": 64},
        {"graph_id": resnet_id, "hardware_id": V100, "batch_size": 32, "precision": "fp16", "optimizer": "adam"},
        {"graph_id": mlp_id, "hardware_id": node, "batch_size": 512, "device_count": 8},
        {"graph_id": mlp_id, "hardware_id": A100, "batch_size": 128, "mode": "inference"},
        {"graph_id": resnet_id, "hardware_id": node, "batch_size": 256, "device_count": 4,
         "activation_checkpointing": True},
    ]
    job_terms = [  # job-level terms only: each base scenario recurs with these
        {"dataset_size": 50_000, "epochs": 2},
        {"dataset_size": 1_281_167, "epochs": 90, "eval_size": 50_000, "checkpoint_every_epochs": 5,
         "checkpoint_write_bytes_per_s": 1e9, "grid_gco2_per_kwh": 400},
        {"dataset_size": 10_000, "epochs": 0.5, "loading_samples_per_s": 3000.0, "loading_overlapped": False,
         "iteration_overhead_ms": 1.5, "price_usd_per_hour": 2.5},
        {"dataset_size": 777, "epochs": 3, "loading_samples_per_s": 1e5},
    ]
    requests = [PredictionCreate(**b, **t) for t in job_terms for b in base]
    predictor = client.app.state.predictors.current()  # type: ignore[attr-defined]
    cache = engine.GraphCache(session, predictor)
    scenarios = [cache.scenario(r) for r in requests]
    found = engine.predict_layers(cache, scenarios)
    assert len({id(x) for x in found.sums}) == len(base)  # summed once per scenario, not once per job
    for s, est, sums in zip(scenarios, found.estimates, found.sums, strict=True):
        times = layer_times(s.table, s.setting, est)
        assert sums == layer_sums(times)  # bit for bit, without a LayerTime per layer
        shared = engine.scenario_aggregate(cache, s, sums)
        _close(shared, _per_job(cache, s, times), s.request.graph_id or "")
        assert shared.job is not None and shared.job.time_s > 0


@pytest.mark.parametrize("powered", [True, False])
def test_layer_sums_are_the_sums_of_the_layers(powered: bool) -> None:
    from app.core.aggregate import LayerTime, layer_sums

    layers = [LayerTime(forward_ms=0.1 * i, backward_ms=0.2 * i, update_ms=0.01, total_ms_p10=0.25 * i,
                        total_ms_p90=0.4 * i, power_w=(100.0 + i) if powered or i < 5 else None) for i in range(10)]
    s = layer_sums(layers)
    assert s.forward_ms == pytest.approx(4.5) and s.backward_ms == pytest.approx(9.0)
    assert s.update_ms == pytest.approx(0.1) and s.total_ms_p10 == pytest.approx(0.25 * 45)
    assert s.total_ms_p90 == pytest.approx(0.4 * 45)
    if powered:
        assert s.energy_j == pytest.approx(sum((100 + i) * (0.3 * i + 0.01) / 1e3 for i in range(10)))
        assert s.forward_energy_j == pytest.approx(sum((100 + i) * 0.1 * i / 1e3 for i in range(10)))
    else:
        assert s.energy_j is None and s.forward_energy_j is None
