"""CPU seed loader: every kept row rebuilds and featurises like the serving path."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from app.core.costs import layer_cost
from app.core.features import FEATURE_NAMES, layer_features
from app.core.hardware import HardwareSpec
from app.profiler import iter_rows
from app.profiler.sampler import LayerConfig
from app.training.seed import hardware_from_dict, hardware_to_dict, load_seed_layers, split_by_hash

CPU = HardwareSpec(id="local", name="test CPU", vendor="x", kind="cpu", peak_flops_per_s={"fp32": 3e11},
                   memory_bytes=16e9, memory_bandwidth_bytes_per_s=2e10, compute_units=2, boost_clock_mhz=2600,
                   l2_cache_bytes=2**21, vector_width_bits=512)  # fmt: skip


def test_loader_rows_equal_layer_features(seed_dir: Path) -> None:
    data = load_seed_layers(seed_dir, hardware=CPU)
    assert len(data) > 500 and data.features.shape[1] == len(FEATURE_NAMES)
    assert np.isfinite(data.features).all()
    assert set(np.unique(data.pass_)) == {"forward", "train_step"}
    assert (data.features[:, FEATURE_NAMES.index("is_cpu")] == 1).all()
    rows = list(iter_rows(seed_dir / "layers_cpu.jsonl"))
    by_id = {r["config_id"]: r for r in rows}
    for i in range(0, len(data), 97):
        r = by_id[data.config[i]]
        (layer,) = LayerConfig.from_row(r).to_layers("fp32")
        f = layer_features(layer=layer, cost=layer_cost(layer), hardware=CPU, pass_=str(data.pass_[i]),
                           optimizer=str(data.optimizer[i]), precision="fp32")  # fmt: skip
        np.testing.assert_array_equal(f, data.features[i])


def test_hash_split_is_stable_when_the_dataset_grows() -> None:
    keys = np.array([f"k{i}" for i in range(500)])
    a = split_by_hash(keys, seed=0)
    b = split_by_hash(np.concatenate([keys, [f"new{i}" for i in range(300)]]), seed=0)
    assert (a == b[:500]).all()
    assert 0.6 < (a == 0).mean() < 0.8


def test_hardware_snapshot_round_trip() -> None:
    assert hardware_from_dict(hardware_to_dict(CPU)) == CPU
