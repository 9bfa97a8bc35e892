"""Measurement use cases: import public data sets, record a reported measurement, list measurements.

Keyword-only arguments after the session; functions ``flush()`` and never ``commit()`` (the request or
the caller owns the transaction, STYLE.md §3). Errors are :mod:`app.errors` domain errors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from datetime import UTC
from typing import Any

from sqlalchemy.orm import Session

from app.errors import HardwareNotFound, InvalidRequest
from app.hardware.service import get_spec
from app.measurements.importers import IMPORT_SOURCES, MeasurementRecord, RecordStream
from app.measurements.models import Measurement
from app.measurements.repository import MeasurementRepository
from app.measurements.schemas import ImportReport, MeasurementCreate, MeasurementList, MeasurementRead
from app.measurements.validation import check_plausible

MAX_PAGE = 1000


def _file_key(record: MeasurementRecord) -> tuple[str, str, Any]:
    """``(source, source_file, source_row)`` of an imported record; ``ValueError`` when absent."""
    ctx = record.context
    if not isinstance(ctx.get("source_file"), str) or not ctx["source_file"] or "source_row" not in ctx:
        raise ValueError(
            f"imported records need context['source_file'] and context['source_row'] (source {record.source!r})"
        )
    return record.source, ctx["source_file"], ctx["source_row"]


def import_records(
    session: Session, *, records: Iterable[MeasurementRecord], batch_size: int = 5000
) -> ImportReport:
    """Store imported ``records`` (e.g. a :class:`~app.measurements.importers.RecordStream`); idempotent.

    Records are grouped by source file (consecutive records with the same ``(source,
    context["source_file"])``). A file's records are all read and checked before anything is written;
    then every row stored by an earlier import of that file is deleted and the new ones are inserted in
    chunks of ``batch_size``. So re-importing a file replaces its rows instead of duplicating them, and a
    file that fails to parse (:class:`~app.measurements.importers.ImportFormatError` from the stream)
    leaves its stored rows untouched. Rows of other sources (reported measurements) are never touched.
    Flushes, does not commit: the caller's transaction decides (roll it back after an error if files
    before the bad one must not stay imported either).

    When ``records`` is a :class:`RecordStream`, its ``rows_read`` and skip counts are in the report.

    Raises :class:`app.errors.HardwareNotFound` (a record's ``hardware_id`` is not stored: seed the
    catalog first), ``ValueError`` (a record without ``source_file``/``source_row``, a duplicate natural
    key ``(source, source_file, source_row, source_column, pass)``, a non-positive time, or ``batch_size`` < 1).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    repo = MeasurementRepository(session)
    known = repo.hardware_ids()
    cleared: set[tuple[str, str]] = set()
    files: list[str] = []
    by_hardware: Counter[str] = Counter()
    replaced = imported = 0

    def write(key: tuple[str, str], rows: list[dict[str, Any]]) -> None:
        nonlocal replaced, imported
        if key not in cleared:
            replaced += repo.delete_source_file(source=key[0], source_file=key[1])
            cleared.add(key)
        for start in range(0, len(rows), batch_size):
            imported += repo.bulk_insert(rows[start : start + batch_size])

    group_key: tuple[str, str] | None = None
    group: list[dict[str, Any]] = []
    group_hw: Counter[str] = Counter()
    seen: set[tuple[Any, ...]] = set()
    for record in records:
        source, source_file, source_row = _file_key(record)
        if record.hardware_id not in known:
            raise HardwareNotFound(
                f"hardware {record.hardware_id!r} is not stored; seed the catalog before importing",
                detail={"hardware_id": record.hardware_id, "source_file": source_file},
            )
        if not (math.isfinite(record.time_ms_median) and record.time_ms_median > 0):
            raise ValueError(f"{source_file} row {source_row}: time_ms_median must be positive")
        natural = (source, source_file, source_row, record.context.get("source_column"), record.pass_)
        if natural in seen:
            raise ValueError(f"duplicate measurement {natural}")
        seen.add(natural)
        if (source, source_file) != group_key:
            if group_key is not None:
                write(group_key, group)
                by_hardware.update(group_hw)
            group_key, group, group_hw = (source, source_file), [], Counter()
            if source_file not in files:
                files.append(source_file)
        group.append(record.to_row())
        group_hw[record.hardware_id] += 1
    if group_key is not None:
        write(group_key, group)
        by_hardware.update(group_hw)
    session.flush()

    report = ImportReport(
        source_files=files,
        imported=imported,
        replaced=replaced,
        imported_by_hardware=dict(sorted(by_hardware.items())),
    )
    if isinstance(records, RecordStream):
        report = report.merge(skip_report(records))
    return report


def skip_report(stream: RecordStream) -> ImportReport:
    """The read and skip counts of a consumed ``stream`` as an :class:`ImportReport` (nothing imported)."""
    by_reason: Counter[str] = Counter()
    by_device: dict[str, dict[str, int]] = {}
    for (device, reason), n in sorted(stream.skipped.items()):
        by_reason[reason] += n
        by_device.setdefault(device, {})[reason] = n
    return ImportReport(
        source_files=[stream.source_file],
        rows_read=stream.rows_read,
        skipped=sum(by_reason.values()),
        skipped_by_reason=dict(sorted(by_reason.items())),
        skipped_by_device=by_device,
    )


def create_measurement(session: Session, *, data: MeasurementCreate, submitter: str | None = None) -> MeasurementRead:
    """Store one reported measurement, recorded as sent by the API key id ``submitter``, and return it
    (``measured_at`` normalised to UTC).

    Raises :class:`app.errors.HardwareNotFound` (404) for an unknown ``hardware_id``,
    :class:`app.errors.InvalidRequest` (422) for a reserved import ``source`` or a non-positive time
    (the schema already rejects the latter over HTTP) and
    :class:`app.measurements.validation.ImplausibleMeasurement` (422) for a time the device cannot have
    taken (:func:`app.measurements.validation.check_plausible`). Flushes.
    """
    if data.source in IMPORT_SOURCES:
        raise InvalidRequest(
            f"source {data.source!r} is reserved for imported data sets", detail={"source": data.source}
        )
    if not (math.isfinite(data.time_ms_median) and data.time_ms_median > 0):
        raise InvalidRequest("time_ms_median must be a positive number of milliseconds",
                             detail={"time_ms_median": data.time_ms_median})
    repo = MeasurementRepository(session)
    spec = get_spec(session, hardware_id=data.hardware_id)
    check_plausible(time_ms=data.time_ms_median, granularity=data.granularity, config=dict(data.config),
                    batch_size=data.batch_size, spec=spec, precision=str(data.precision), pass_=data.pass_.value,
                    optimizer=data.optimizer)  # fmt: skip
    row = repo.add(Measurement(**reported_record(data).to_row(), submitter=submitter))
    return MeasurementRead.model_validate(row)


def reported_record(data: MeasurementCreate) -> MeasurementRecord:
    """The :class:`MeasurementRecord` of a reported measurement: the same record type every importer
    yields, so stored rows have one shape whatever their source (``measured_at`` normalised to UTC)."""
    return MeasurementRecord(
        hardware_id=data.hardware_id,
        source=data.source,
        op_kind=data.op_kind,
        pass_=data.pass_.value,
        optimizer=data.optimizer,
        precision=str(data.precision),
        software_stack=data.software_stack,
        granularity=data.granularity,
        batch_size=data.batch_size,
        config=dict(data.config),
        time_ms_median=data.time_ms_median,
        time_ms_std=data.time_ms_std,
        repetitions=data.repetitions,
        context=dict(data.context),
        measured_at=data.measured_at.astimezone(UTC) if data.measured_at is not None else None,
    )


def list_measurements(
    session: Session,
    *,
    hardware_id: str | None = None,
    source: str | None = None,
    op_kind: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> MeasurementList:
    """One page (by ascending id) of the measurements matching every given filter, with the total.

    Raises :class:`app.errors.InvalidRequest` (422) unless ``1 <= limit <= MAX_PAGE`` and ``offset >= 0``.
    """
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise InvalidRequest(
            f"need 1 <= limit <= {MAX_PAGE} and offset >= 0", detail={"limit": limit, "offset": offset}
        )
    repo = MeasurementRepository(session)
    filters = {"hardware_id": hardware_id, "source": source, "op_kind": op_kind}
    items = [MeasurementRead.model_validate(row) for row in repo.list(**filters, limit=limit, offset=offset)]
    return MeasurementList(items=items, count=len(items), total=repo.count(**filters), limit=limit, offset=offset)
