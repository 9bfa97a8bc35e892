"""The committed seed dataset (``data/seed/``): size, coverage, context, and that every row rebuilds."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from app.core.json_import import import_json
from app.profiler import TIMED_PASSES, iter_rows
from app.profiler.sampler import FAMILY_KIND, LayerConfig

SEED = Path(__file__).resolve().parents[2] / "data" / "seed"
LAYERS = SEED / "layers_cpu.jsonl.gz"
E2E = SEED / "e2e_cpu.jsonl.gz"
CONTEXT_KEYS = ("device", "device_name", "cpu_model", "logical_cpus", "threads", "framework",
                "framework_version", "platform", "bf16_supported", "timer")


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return list(iter_rows(LAYERS))


@pytest.fixture(scope="module")
def ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok"]


def test_files_are_compressed_and_small() -> None:
    assert LAYERS.exists() and E2E.exists() and (SEED / "README.md").exists()
    assert sum(p.stat().st_size for p in SEED.iterdir()) < 10 * 2**20


def test_at_least_5000_distinct_configs_with_forward_and_train_step(ok: list[dict[str, Any]]) -> None:
    fp32 = [r for r in ok if r["precision"] == "fp32"]
    assert all(r["forward_ms"] > 0 and r["train_step_ms"] > 0 for r in fp32)
    assert len({r["config_id"] for r in fp32}) >= 5000
    assert len({r["config_id"] for r in ok}) == len({(r["config_id"], r["precision"]) for r in ok}) - sum(
        r["precision"] != "fp32" for r in ok)  # low-precision rows repeat fp32 configurations


def test_op_families_covered(ok: list[dict[str, Any]]) -> None:
    kinds = Counter(r["op_kind"] for r in ok)
    families = Counter(r["family"] for r in ok if r["precision"] == "fp32")
    assert len(kinds) >= 8
    assert set(families) == set(FAMILY_KIND)
    assert min(families.values()) >= 30
    assert sum(r["precision"] == "bf16" for r in ok) >= 300


def test_every_row_carries_its_context(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        for key in CONTEXT_KEYS:
            assert key in r["context"], key
        assert r["precision"] in ("fp32", "bf16") and r["measured_at"] and r["schema"] == 1
        assert r["context"]["framework"] == "torch" and r["context"]["threads"] >= 1


def test_timing_statistics_are_consistent(ok: list[dict[str, Any]]) -> None:
    for r in ok:
        assert set(r["timings"]) <= set(TIMED_PASSES)
        assert {"forward", "train_forward", "backward", "train_step"} <= set(r["timings"])
        assert ("update" in r["timings"]) == (r["optimizer"] != "none")
        for st in r["timings"].values():
            assert st["min_ms"] <= st["q1_ms"] <= st["median_ms"] <= st["q3_ms"] <= st["max_ms"]
            assert st["n"] >= 2
        assert r["forward_ms"] == r["timings"]["forward"]["median_ms"]


def test_rows_rebuild_into_ir(rows: list[dict[str, Any]]) -> None:
    for r in rows[::7]:
        cfg = LayerConfig.from_row(r)
        assert cfg.config_id == r["config_id"]  # the stored description is exactly what was measured
        if r["graph"] is not None:
            g = import_json(r["graph"], batch_size=r["batch_size"])
            layer = g.layers[0]
        else:
            layer = cfg.to_layers(r["precision"])[0]
        assert layer.kind.value == r["op_kind"]
        assert sum(la.params for la in cfg.to_layers()) == r["params"] or r["status"] != "ok"


def test_e2e_iterations_of_at_least_six_architectures() -> None:
    e2e = [r for r in iter_rows(E2E) if r["status"] == "ok"]
    by_arch: dict[str, set[int]] = {}
    for r in e2e:
        by_arch.setdefault(r["arch"], set()).add(r["batch_size"])
        assert r["train_step_ms"] > 0 and r["builder"].startswith("app.profiler.e2e:")
        assert r["onnx"]["status"] == "ok" and r["onnx"]["layers"] > 0 and not r["onnx"]["unsupported"]
        assert "threads" in r["context"]
        if r["graph"] is not None:
            import_json(r["graph"], batch_size=r["batch_size"])
            assert r["layer_sum"]["train_step_ms"] > 0
    assert len(by_arch) >= 6
    assert all(len(b) >= 3 for b in by_arch.values())
