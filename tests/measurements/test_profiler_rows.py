"""Parser of the profiler's JSONL shards, on the committed seed data set (data/seed)."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from app.core.vocab import Granularity, SoftwareStack
from app.measurements.importers import ImportFormatError
from app.measurements.profiler_rows import iter_profiler_e2e, iter_profiler_layers, profiler_files

SEED = Path(__file__).resolve().parents[2] / "data" / "seed"


def _lines(path: Path, n: int) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh, strict=False)]


def test_seed_layers_counts_and_skips() -> None:
    stream = iter_profiler_layers(SEED / "layers_cpu.jsonl.gz", hardware_id="local")
    records = list(stream)
    rows = _lines(SEED / "layers_cpu.jsonl.gz", 10_000)
    ok = [r for r in rows if r["status"] == "ok"]
    assert stream.rows_read == len(rows) == 8145 and len(ok) == 8127  # data/seed/README.md
    assert len(records) == sum(len(r["timings"]) for r in ok)
    assert stream.skipped == {("cpu", "profiler_error"): 18}
    assert {(r.software_stack, r.granularity) for r in records} == {(SoftwareStack.PYTORCH_EAGER, Granularity.LAYER)}
    assert Counter(r.precision for r in records if r.pass_ == "forward") == Counter(r["precision"] for r in ok)


def test_layer_record_field_by_field() -> None:
    (row,) = _lines(SEED / "layers_cpu.jsonl.gz", 1)
    records = {r.pass_: r for r in iter_profiler_layers(SEED / "layers_cpu.jsonl.gz", hardware_id="local", limit=1)}
    assert set(records) == set(row["timings"])
    for pass_, rec in records.items():
        st = row["timings"][pass_]
        assert rec.hardware_id == "local" and rec.source == "profiler" and rec.op_kind == row["op_kind"]
        assert rec.time_ms_median == st["median_ms"] and rec.time_ms_std == st["std_ms"] and rec.repetitions == st["n"]
        assert rec.batch_size == row["batch_size"] and rec.precision == row["precision"]
        assert rec.config["graph"] == row["graph"] and rec.config["config_id"] == row["config_id"]
        assert rec.context["threads"] == row["context"]["threads"] and rec.context["q1_ms"] == st["q1_ms"]
        assert rec.context["framework_version"] == "2.13.0+cpu"
        assert rec.measured_at is not None and rec.measured_at.isoformat() == row["measured_at"]
        assert rec.optimizer == ("none" if pass_ == "forward" else row["optimizer"])


def test_e2e_records_are_whole_iterations() -> None:
    stream = iter_profiler_e2e(SEED / "e2e_cpu.jsonl.gz", hardware_id="local")
    records = list(stream)
    assert stream.rows_read == 24 and not stream.skipped
    assert len(records) == 24 * 4 and {r.granularity for r in records} == {Granularity.ITERATION}
    step = [r for r in records if r.pass_ == "train_step"]
    first = _lines(SEED / "e2e_cpu.jsonl.gz", 1)[0]
    assert step[0].time_ms_median == first["train_step_ms"] and step[0].config["arch"] == first["arch"]
    assert step[0].op_kind == "iteration" and step[0].config["onnx"] == first["onnx"]


def test_torn_and_bad_lines(tmp_path: Path) -> None:
    good = json.dumps(_lines(SEED / "layers_cpu.jsonl.gz", 1)[0])
    path = tmp_path / "layers_x.jsonl"
    path.write_text(good + "\n[1, 2]\n" + good[:50] + "\n")
    stream = iter_profiler_layers(path, hardware_id="local")
    assert len(list(stream)) >= 2 and stream.skipped == {("?", "unparsable_line"): 2}
    broken = json.loads(good)
    del broken["batch_size"]
    path.write_text(json.dumps(broken) + "\n")
    with pytest.raises(ImportFormatError, match="missing fields"):
        list(iter_profiler_layers(path, hardware_id="local"))
    assert [p.name for p, _ in profiler_files(SEED)] == ["layers_cpu.jsonl.gz", "e2e_cpu.jsonl.gz"]
    with pytest.raises(FileNotFoundError):
        profiler_files(tmp_path / "none")
