"""``layercast import profiler`` stores rows against the machine that measured them, never against the
importing machine's ``local`` (whose bandwidth and peak would then featurise another CPU's timings)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from app.core.hardware import hardware_from_dict
from app.hardware import local
from app.hardware.catalog import spec_from_dict
from app.hardware.models import Hardware
from app.measurements.cli import main
from app.measurements.importers import ImportFormatError
from app.measurements.models import Measurement
from app.measurements.profiler_rows import MachineContext, machine_of, read_machine_spec
from app.profiler.timing import record_machine
from app.training.dataset import load_from_database, snapshot_targets
from tests.helpers import REPO

SEED = REPO / "data" / "seed"
SEED_ID = "cpu-amd-epyc-2c-avx512"
#: The CPU the shipped predictor's CPU head trained on (models/layer-time-mlp-3.json).
SNAPSHOT = hardware_from_dict(json.loads((REPO / "models" / "layer-time-mlp-3.json").read_text())
                              ["training_hardware"]["local"])
INTEL = local.LocalCpuIdentity(name="Intel(R) Xeon(R) Processor", vector_width_bits=512, logical_cpus=2)
EPYC = local.LocalCpuIdentity(name="AMD EPYC", vector_width_bits=512, logical_cpus=2)


@pytest.fixture
def on_intel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The importing machine is another CPU than the seed campaign's (detection monkeypatched)."""
    monkeypatch.setattr(local, "local_cpu_identity", lambda: INTEL)


def _stored(url: str) -> tuple[dict[str, int], dict[str, dict]]:
    with Session(create_engine(url)) as s:
        counts = dict(s.execute(select(Measurement.hardware_id, func.count()).group_by(Measurement.hardware_id)).all())
        specs = {i: spec for i, spec in s.execute(select(Hardware.id, Hardware.spec)).all()}
    return counts, specs


def _shards_only(tmp_path: Path) -> Path:
    d = tmp_path / "shards"
    d.mkdir()
    for p in SEED.glob("*.jsonl.gz"):
        shutil.copy(p, d / p.name)
    return d


def test_seed_rows_get_the_measuring_machines_spec(tmp_path: Path, on_intel: None) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert main(["profiler", "--data-dir", str(SEED), "--database-url", url, "--limit", "5"]) == 0
    counts, specs = _stored(url)
    assert set(counts) == {SEED_ID} and "local" not in specs  # the importer's CPU is not seeded
    stored = spec_from_dict(specs[SEED_ID])
    assert stored.name == "AMD EPYC" and stored.kind == "cpu" and stored.compute_units == SNAPSHOT.compute_units == 2
    assert stored.memory_bandwidth_bytes_per_s == SNAPSHOT.memory_bandwidth_bytes_per_s
    assert stored.vector_width_bits == SNAPSHOT.vector_width_bits == 512
    assert stored.peak_flops_per_s == SNAPSHOT.peak_flops_per_s
    # what training reads: the rows are featurised with that spec
    rows = load_from_database(url, sources=("profiler",), hardware_kinds=("cpu",))
    assert set(rows.gpu) == {SEED_ID} and rows.hardware[SEED_ID].memory_bandwidth_bytes_per_s == 27961622775.487885
    # evaluation of the shipped artifact (snapshot under 'local') finds the rows and featurises them the same
    targets = snapshot_targets(url, SNAPSHOT)
    assert set(targets) == {"local", SEED_ID}
    again = load_from_database(url, sources=("profiler",), hardware_kinds=("cpu",), specs=targets)
    np.testing.assert_array_equal(again.features, rows.features)
    # re-importing is idempotent; the same id with another spec is refused, nothing changed
    assert main(["profiler", "--data-dir", str(SEED), "--database-url", url, "--limit", "5"]) == 0
    other = {**specs[SEED_ID], "memory_bandwidth_bytes_per_s": 5.6e9}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["profiler", "--data-dir", str(SEED), "--database-url", url, "--limit", "5",
                 "--hardware-spec", str(tmp_path / "other.json")]) == 1
    assert _stored(url) == (counts, specs)


def test_rows_of_another_cpu_are_refused_as_local(tmp_path: Path, on_intel: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    shards = _shards_only(tmp_path)  # no hardware.json: the rows' machine is known by its context only
    for extra in ([], ["--hardware-id", "local"]):
        assert main(["profiler", "--data-dir", str(shards), "--database-url", url, "--limit", "5", *extra]) == 1
        err = capsys.readouterr().err
        assert "measured on AMD EPYC, 2 logical CPUs, AVX512, not on this machine (Intel(R) Xeon(R)" in err
        assert "--hardware-spec" in err and SEED_ID in err
    assert not (tmp_path / "m.db").exists()  # refused before the database is touched
    # a spec of another machine, or a catalog device of another kind, is refused too
    xeon = {**json.loads((SEED / "hardware.json").read_text()), "id": "xeon", "name": INTEL.name}
    (tmp_path / "xeon.json").write_text(json.dumps(xeon))
    assert main(["profiler", "--data-dir", str(shards), "--database-url", url, "--limit", "5",
                 "--hardware-spec", str(tmp_path / "xeon.json")]) == 1
    assert "not the machine that measured the rows" in capsys.readouterr().err
    assert main(["profiler", "--data-dir", str(shards), "--database-url", url, "--limit", "5",
                 "--hardware-id", "h200"]) == 1
    assert "kind gpu (the rows were measured on a CPU)" in capsys.readouterr().err
    # the measuring machine's spec given explicitly is accepted
    assert main(["profiler", "--data-dir", str(shards), "--database-url", url, "--limit", "5",
                 "--hardware-spec", str(SEED / "hardware.json")]) == 0
    assert set(_stored(url)[0]) == {SEED_ID}


def test_local_when_this_machine_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "local_cpu_identity", lambda: EPYC)
    monkeypatch.setattr("app.hardware.service.local_cpu_spec",
                        lambda stored: SNAPSHOT)  # the seed of 'local' on the campaign machine
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert main(["profiler", "--data-dir", str(_shards_only(tmp_path)), "--database-url", url, "--limit", "3"]) == 0
    counts, specs = _stored(url)
    assert set(counts) == {"local"} and specs["local"]["name"] == "AMD EPYC"


def test_profiler_writes_the_measuring_machine_and_keeps_one_per_folder(tmp_path: Path) -> None:
    ctx = {"device": "cpu", "cpu_model": local.local_cpu_identity().name, "logical_cpus": 2,
           "cpu_capability": "AVX512" if local.local_cpu_identity().vector_width_bits == 512 else "AVX2"}
    machine = MachineContext.from_context(ctx)
    path = record_machine(tmp_path, ctx)
    assert path == tmp_path / "hardware.json"
    spec = read_machine_spec(path)
    assert spec.id == machine.derived_id() and spec.kind == "cpu" and spec.memory_bandwidth_bytes_per_s > 0
    assert spec.sources["memory_bandwidth_bytes_per_s"].startswith("measured:")
    before = path.read_text()
    assert record_machine(tmp_path, ctx) == path and path.read_text() == before  # resumed: kept
    with pytest.raises(SystemExit, match="describes another machine"):
        record_machine(tmp_path, {**ctx, "cpu_model": ctx["cpu_model"] + " (another model)"})
    assert record_machine(tmp_path / "gpu", {"device": "cuda", "device_name": "NVIDIA H200"}) is None


def test_machine_of_the_seed_and_of_mixed_folders(tmp_path: Path) -> None:
    m = machine_of(sorted(SEED.glob("*.jsonl.gz")), limit=50)
    assert m is not None and m.derived_id() == SEED_ID == read_machine_spec(SEED / "hardware.json").id
    row = {"status": "ok", "context": {"device": "cpu", "cpu_model": "Other", "logical_cpus": 4}}
    (tmp_path / "layers_b.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ImportFormatError, match="measured on 2 machines"):
        machine_of([SEED / "e2e_cpu.jsonl.gz", tmp_path / "layers_b.jsonl"])
