"""Fixtures of the training tests: a tiny profiler shard built from real sampler configurations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from app.core.costs import layer_cost
from app.profiler.sampler import sample_configs


@pytest.fixture(scope="session")
def seed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``layers_cpu.jsonl`` of 400 sampled configurations with synthetic times (roofline-like + noise)."""
    d = tmp_path_factory.mktemp("seed")
    rng = np.random.default_rng(0)
    with (d / "layers_cpu.jsonl").open("w") as fh:
        for cfg in sample_configs(400, seed=3):
            layers = cfg.to_layers()
            flops = sum(layer_cost(la).forward_flops for la in layers)
            nbytes = sum(layer_cost(la).forward_bytes for la in layers)
            fwd = 0.005 + flops / 40e9 * 1e3 + nbytes / 8e9 * 1e3
            t = {
                "forward": {"median_ms": fwd * rng.lognormal(0, 0.05)},
                "train_step": {"median_ms": 3 * fwd * rng.lognormal(0, 0.05)},
            }
            row = {"schema": 1, **cfg.row_fields("fp32"), "precision": "fp32", "status": "ok", "timings": t}
            fh.write(json.dumps(row) + "\n")
    return d


@pytest.fixture(scope="session")
def training_db(tmp_path_factory: pytest.TempPathFactory, seed_dir: Path) -> str:
    """SQLite URL with Justus rows (first 300 per file) and the synthetic CPU shard of :func:`seed_dir`
    imported, the way ``layercast train`` expects its data."""
    from tests.conftest import JUSTUS_ROWS_PER_FILE
    from tests.helpers import import_measurements

    url = f"sqlite:///{tmp_path_factory.mktemp('training-db') / 'measurements.db'}"
    import_measurements(url, "justus", "--limit", str(JUSTUS_ROWS_PER_FILE))
    import_measurements(url, "profiler", "--data-dir", str(seed_dir))
    return url
