"""Whole-iteration measurements: the architecture set, the JSON models, ONNX rebuild and layer sums."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from app.core.json_import import import_json
from app.profiler import e2e, iter_rows

TINY = e2e.Architecture(
    "tiny_cnn", "build_json",
    {"doc": {"name": "tiny", "input_shape": [3, 8, 8], "layers": [
        {"op": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1}, {"op": "batchnorm"}, {"op": "relu"},
        {"op": "maxpool", "kernel_size": 2}, {"op": "flatten"}, {"op": "linear", "out_features": 3}]}},
    (2, 4), "momentum", "test", layer_sum=True)


def test_architecture_set() -> None:
    assert len(e2e.ARCHITECTURES) >= 6
    assert len({a.name for a in e2e.ARCHITECTURES}) == len(e2e.ARCHITECTURES)
    for a in e2e.ARCHITECTURES:
        assert inspect.isfunction(getattr(e2e, a.builder)) and len(a.batches) >= 3
        if "doc" in a.config:
            g = import_json(a.config["doc"], batch_size=2)
            assert g.layers


def test_json_model_iteration_onnx_and_layer_sum() -> None:
    pytest.importorskip("torch")
    r = e2e.measure_arch(TINY, 2, warmup=1, reps=3, budget_s=5)
    assert r["train_step_ms"] > 0 and set(r["timings"]) == {"forward", "backward", "update", "train_step"}
    onnx = e2e._onnx_record(TINY, 2, 0, {})
    assert onnx["status"] == "ok" and onnx["unsupported"] == {} and onnx["layers"] >= 5
    assert onnx["sha256"] == e2e._onnx_record(TINY, 2, 0, {})["sha256"]  # deterministic rebuild
    ls = e2e._layer_sum(TINY.config["doc"], 2, "momentum", 0.5)
    assert len(ls["layers"]) == 6 and ls["train_step_ms"] > 0
    assert ls["layers"][4] == {"op": "flatten", "forward_ms": 0.0, "train_step_ms": 0.0}


def test_main_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(e2e._BY_NAME, TINY.name, TINY)
    out = tmp_path / "e2e.jsonl"
    argv = ["--out", str(out), "--archs", "tiny_cnn", "--reps", "3", "--warmup", "1", "--max-seconds", "5",
            "--threads", str(torch.get_num_threads())]
    assert e2e.main(argv) == 0
    rows = list(iter_rows(out))
    assert [r["batch_size"] for r in rows] == [2, 4]
    for r in rows:
        assert r["status"] == "ok" and r["builder"] == "app.profiler.e2e:build_json"
        assert r["onnx"]["status"] == "ok" and r["layer_sum"]["train_step_ms"] > 0
        assert r["context"]["framework_version"] == torch.__version__
    assert e2e.main(argv) == 0
    assert len(list(iter_rows(out))) == 2
