"""Measurement use cases on a migrated SQLite file with the built-in catalog seeded (no app started)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.config import Settings
from app.core.vocab import Granularity, SoftwareStack
from app.db import make_engine, make_sessionmaker
from app.errors import HardwareNotFound, InvalidRequest
from app.hardware.service import seed_builtin
from app.measurements import service
from app.measurements.importers import (
    ImportFormatError,
    MeasurementRecord,
    iter_deepbench_conv,
    iter_deepbench_rnn,
    iter_justus,
)
from app.measurements.models import Measurement
from app.measurements.repository import MeasurementFilter
from app.measurements.schemas import MeasurementBatchCreate, MeasurementBatchRead, MeasurementCreate, MeasurementList
from app.migrate import upgrade
from tests.helpers import SHARED_DATA

JUSTUS_K80 = SHARED_DATA / "justus2018" / "dense_Tesla_K80.csv.gz"
DEEPBENCH = SHARED_DATA / "deepbench"


@pytest.fixture
def session(settings: Settings) -> Iterator[Session]:
    """A session on this test's migrated SQLite file, catalog seeded and committed; rolled back after."""
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    with factory.begin() as seeding:
        seed_builtin(seeding, include_local=False)
    db = factory()
    try:
        yield db
    finally:
        db.rollback()
        db.close()
        engine.dispose()


def _count(session: Session, **where: str) -> int:
    stmt = select(func.count()).select_from(Measurement)
    for key, value in where.items():
        stmt = stmt.where(getattr(Measurement, key) == value)
    return int(session.scalar(stmt) or 0)


def _head(src: Path, dst: Path, n: int, *, extra: str = "") -> Path:
    """The header and first ``n`` rows of gzip CSV ``src`` written to ``dst`` (plus ``extra`` lines)."""
    with gzip.open(src, "rt", newline="") as fh:
        lines = [next(fh) for _ in range(n + 1)]
    with gzip.open(dst, "wt", newline="") as out:
        out.write("".join(lines) + extra)
    return dst


def _reported(**overrides: object) -> MeasurementCreate:
    body = {
        "hardware_id": "a100-sxm4-40gb", "source": "ci", "op_kind": "conv", "pass": "forward",
        "software_stack": "pytorch-eager", "granularity": "layer", "batch_size": 32,
        "config": {"input_shape": [3, 32, 32], "layer": {"op": "conv2d", "out_channels": 8, "kernel_size": 3}},
        "time_ms_median": 1.5, "context": {"framework": "torch 2.5", "driver": "550.54"},
    }
    if overrides.get("op_kind") == "gemm" and "config" not in overrides:  # a layer of the kind it says it is
        body["config"] = {"input_shape": [512], "layer": {"op": "linear", "out_features": 64}}
    body.update(overrides)
    return MeasurementCreate.model_validate(body)


def test_import_justus_file_counts_and_is_idempotent(session: Session) -> None:
    report = service.import_records(session, records=iter_justus(JUSTUS_K80, limit=2000), batch_size=700)
    assert report.rows_read == 2000 and report.imported == 2000 and report.skipped == 0
    assert report.replaced == 0
    assert report.imported_by_hardware == {"k80": 2000}
    assert report.source_files == ["dense_Tesla_K80.csv.gz"]
    assert _count(session, source="justus2018", hardware_id="k80") == 2000
    row = session.scalars(select(Measurement).order_by(Measurement.id).limit(1)).one()
    assert row.context["source_row"] == 0 and row.repetitions == 5 and row.measured_at is not None

    again = service.import_records(session, records=iter_justus(JUSTUS_K80, limit=2000))
    assert again.imported == 2000 and again.replaced == 2000
    assert _count(session, source="justus2018") == 2000


def test_reimport_keeps_other_files_and_reported_rows(session: Session) -> None:
    _create(session, _reported())
    service.import_records(session, records=iter_justus(JUSTUS_K80, limit=50))
    service.import_records(session, records=iter_deepbench_rnn(DEEPBENCH / "deepbench_rnn.csv"))
    n_rnn = _count(session, source="deepbench")
    service.import_records(session, records=iter_justus(JUSTUS_K80, limit=20))
    assert _count(session, source="justus2018") == 20
    assert _count(session, source="deepbench") == n_rnn > 0
    assert _count(session, source="ci") == 1


def test_deepbench_conv_report_counts_skips_per_device(session: Session) -> None:
    report = service.import_records(session, records=iter_deepbench_conv(DEEPBENCH / "deepbench_conv.csv"))
    assert report.rows_read == 1277
    assert report.imported == _count(session, source="deepbench", op_kind="conv")
    assert set(report.imported_by_hardware) == {"p100", "gtx-1080-ti", "titan-xp"}
    assert report.skipped == sum(report.skipped_by_reason.values()) > 0
    assert report.skipped_by_device["NV_M40"] == {"hardware_not_in_catalog": 282}
    assert sum(sum(r.values()) for r in report.skipped_by_device.values()) == report.skipped
    passes = set(session.scalars(select(Measurement.pass_).where(Measurement.source == "deepbench")))
    assert passes == {"forward", "backward_input", "backward_weight"}


def test_corrupt_file_raises_and_leaves_existing_rows(session: Session, tmp_path: Path) -> None:
    path = _head(JUSTUS_K80, tmp_path / "dense_Tesla_K80.csv.gz", 300)
    service.import_records(session, records=iter_justus(path))
    session.commit()
    ids = set(session.scalars(select(Measurement.id)))
    assert len(ids) == 300

    _head(JUSTUS_K80, path, 500, extra="12,oops,7,Tesla K80,none,32,1,1,1,0,x.pkl,none,forward\n")
    with pytest.raises(ImportFormatError, match=r"dense_Tesla_K80\.csv\.gz: line 502: column 'in_features'"):
        service.import_records(session, records=iter_justus(path))
    assert set(session.scalars(select(Measurement.id))) == ids  # nothing of the bad file was written
    session.rollback()
    assert set(session.scalars(select(Measurement.id))) == ids


def _record(**overrides: object) -> MeasurementRecord:
    values: dict[str, object] = {
        "hardware_id": "k80", "source": "justus2018", "op_kind": "gemm", "pass_": "forward", "optimizer": "none",
        "precision": "fp32", "software_stack": SoftwareStack.TF1_SESSION, "granularity": Granularity.LAYER,
        "batch_size": 1, "config": {}, "time_ms_median": 1.0, "time_ms_std": None,
        "repetitions": None, "context": {"source_file": "x.csv", "source_row": 0},
    }
    values.update(overrides)
    return MeasurementRecord(**values)  # type: ignore[arg-type]


def test_import_rejects_bad_records(session: Session) -> None:
    with pytest.raises(HardwareNotFound):
        service.import_records(session, records=[_record(hardware_id="no-such-gpu")])
    with pytest.raises(ValueError, match="source_file"):
        service.import_records(session, records=[_record(context={})])
    with pytest.raises(ValueError, match="duplicate"):
        service.import_records(session, records=[_record(), _record()])
    with pytest.raises(ValueError, match="positive"):
        service.import_records(session, records=[_record(time_ms_median=0.0)])
    assert _count(session) == 0


def test_import_refuses_rows_the_api_refuses_and_reports_them(session: Session) -> None:
    """The rows POST /v1/measurements refuses (app.measurements.validation.field_problems) are not stored by an
    import either: counted per reason, the rest of the file stored; they used to be stored silently."""
    rows = [_record(context={"source_file": "x.csv", "source_row": i}, **bad) for i, bad in enumerate([
        {}, {"time_ms_median": 1e-6}, {"op_kind": "gemmm"}, {"time_ms_std": 1e300}, {"time_ms_median": 2e-6}])]
    report = service.import_records(session, records=rows)
    assert (report.imported, report.refused) == (1, 4)
    assert report.refused_by_reason == {"implausible_measurement/time_ms_median": 2,
                                        "implausible_measurement/time_ms_std": 1, "invalid_layer_config/op_kind": 1}
    assert report.refused_examples["invalid_layer_config/op_kind"].startswith("x.csv row 2: op_kind 'gemmm'")
    assert _count(session) == 1


def test_cli_import_reports_refused_rows(sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.measurements.cli import main

    _head(JUSTUS_K80, tmp_path / "dense_Tesla_K80.csv.gz", 20,
          extra="21,2573,3176,Tesla K80,none,32,1e-9,1e-9,1e-9,0,x_20180907.pkl,tanh,forward\n")
    assert main(["justus", "--database-url", sqlite_url, "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "21 rows read, 20 measurements imported" in out and "1 refused" in out, out
    assert "refused per reason: implausible_measurement/time_ms_median 1" in out, out
    assert "dense_Tesla_K80.csv.gz row 20: time_ms_median 1e-09 ms is below" in out, out


def _create(session: Session, *rows: MeasurementCreate, key: str | None = None,
            submitter: str | None = None) -> MeasurementBatchRead:  # fmt: skip
    return service.create_measurements(session, data=MeasurementBatchCreate(measurements=list(rows)),
                                       idempotency_key=key, submitter=submitter)  # fmt: skip


def test_create_and_list(session: Session) -> None:
    created = _create(session, _reported(), _reported(hardware_id="h100-sxm", op_kind="gemm"))
    assert created.count == 2 and created.ids[0] < created.ids[1]
    service.import_records(session, records=iter_justus(JUSTUS_K80, limit=30))

    def page(**kw: object) -> MeasurementList:
        limit, offset, cursor = kw.pop("limit", 100), kw.pop("offset", 0), kw.pop("cursor", None)
        return service.list_measurements(session, filters=MeasurementFilter(**kw), limit=limit, offset=offset,
                                         cursor=cursor)  # type: ignore[arg-type]  # fmt: skip

    first = page(source="justus2018", limit=10, offset=5)
    assert first.total == 30 and first.count == 10 and first.items[0].context["source_row"] == 5
    assert page(hardware_id="h100-sxm").total == 1
    assert page(source="ci", op_kind="conv").total == 1
    assert page(source="ci", precision="fp32", pass_="forward", granularity="layer").total == 2
    assert page(source="ci", pass_="train_step").total == 0
    # cursor paging walks every row once, in id order
    seen, cursor = [], None
    while True:
        p = page(source="justus2018", limit=7, cursor=cursor)
        seen += [m.id for m in p.items]
        if p.next_cursor is None:
            break
        cursor = p.next_cursor
    assert len(seen) == len(set(seen)) == 30 and seen == sorted(seen)
    for bad in ({"limit": 0}, {"cursor": -1}, {"cursor": 3, "offset": 2}):
        with pytest.raises(InvalidRequest):
            page(**bad)


def test_batch_is_all_or_nothing_and_names_each_bad_row(session: Session) -> None:
    rows = [_reported(), _reported(hardware_id="no-such-gpu"), _reported(), _reported(source="deepbench")]
    with pytest.raises(service.InvalidMeasurements) as err:
        _create(session, *rows)
    detail = err.value.detail
    assert [(e["index"], e["code"], e["field"]) for e in detail["errors"]] == [
        (1, "hardware_not_found", "hardware_id"), (3, "reserved_source", "source")]
    assert detail["invalid_rows"] == 2 and detail["rows"] == 4
    assert _count(session) == 0  # the good rows 0 and 2 were not stored either


def test_idempotency_key_replays_and_refuses_another_body(session: Session) -> None:
    first = _create(session, _reported(), _reported(op_kind="gemm"), key="run-42/chunk-0")
    assert not first.replayed and _count(session) == 2
    again = _create(session, _reported(), _reported(op_kind="gemm"), key="run-42/chunk-0")
    assert again.replayed and again.ids == first.ids and _count(session) == 2
    with pytest.raises(service.IdempotencyKeyReused):
        _create(session, _reported(op_kind="conv"), key="run-42/chunk-0")
    with pytest.raises(service.InvalidIdempotencyKey):
        _create(session, _reported(), key="with space")
    assert _create(session, _reported(op_kind="conv"), key="run-42/chunk-1").count == 1
    assert _count(session) == 3


def test_cli_import_deepbench(sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.measurements.cli import main

    argv = ["deepbench", "--database-url", sqlite_url, "--kinds", "allreduce", "gemm", "--limit", "60"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 files, 120 rows read" in out and "skipped per device:" in out and "IA_KNL7250" in out
    assert main(argv) == 0
    assert "replaced from earlier imports" in capsys.readouterr().out

    assert main(["justus", "--database-url", sqlite_url, "--data-dir", str(tmp_path)]) == 1
    assert "no Justus CSVs" in capsys.readouterr().err


def test_cli_import_neusight_and_vidur_idempotent(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from app.measurements.cli import main

    argv = ["neusight", "--database-url", sqlite_url, "--families", "ln", "softmax", "--limit", "40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "12 files, 480 rows read, 480 measurements imported (0 replaced" in out and "mi210" in out
    assert main(argv) == 0
    assert "480 measurements imported (480 replaced" in capsys.readouterr().out

    assert main(["vidur", "--database-url", sqlite_url, "--limit", "5"]) == 0
    # 2 compute tables x 5 rows x 10 ops + 2 network tables x 5 rows
    assert "4 files, 20 rows read, 110 measurements imported" in capsys.readouterr().out
    assert main(["vidur", "--database-url", sqlite_url, "--limit", "5"]) == 0
    assert "110 measurements imported (110 replaced" in capsys.readouterr().out

    engine = make_engine(sqlite_url)
    try:
        with make_sessionmaker(engine)() as db:
            rows = db.execute(select(Measurement.source, Measurement.software_stack, Measurement.granularity,
                                     Measurement.precision, func.count()).group_by(
                Measurement.source, Measurement.software_stack, Measurement.granularity, Measurement.precision
            )).all()
    finally:
        engine.dispose()
    assert sorted(tuple(r) for r in rows) == [
        ("neusight", "pytorch-eager", "kernel", "fp32-strict", 480),
        ("vidur", "pytorch-eager", "kernel", "fp16", 110),
    ]


def test_reported_measurement_is_a_record_the_trainer_loads(session: Session) -> None:
    from app.training.dataset import load_training_rows

    body = {"input_shape": [256], "layer": {"op": "linear", "out_features": 512, "bias": True}}
    [created_id] = _create(session, _reported(
        op_kind="gemm", config=body, precision="fp32-strict", granularity="kernel", time_ms_median=0.02)).ids
    created = session.get(Measurement, created_id)
    assert created is not None and (created.precision, created.software_stack) == ("fp32-strict", "pytorch-eager")
    assert created.granularity == "kernel"
    rows = load_training_rows(session, sources=("ci",))
    assert len(rows) == 1 and rows.measurement_id[0] == created.id
    (layer,) = rows.layers
    assert layer.inputs[0].shape == (32, 256) and layer.outputs[0].shape == (32, 512)
    assert rows.time_ms[0] == 0.02 and rows.precision[0] == "fp32-strict" and rows.family[0] == "ci:linear"


def test_idempotency_keys_are_scoped_to_the_submitting_api_key(session: Session) -> None:
    """Two callers who happen to pick the same key neither replay nor block each other's batches."""
    mine = _create(session, _reported(), key="nightly-1", submitter="aaaa000011112222")
    theirs = _create(session, _reported(op_kind="gemm"), key="nightly-1", submitter="bbbb000011112222")
    assert not theirs.replayed and theirs.ids != mine.ids and _count(session) == 2
    again = _create(session, _reported(), key="nightly-1", submitter="aaaa000011112222")
    assert again.replayed and again.ids == mine.ids and again.idempotency_key == "nightly-1"
