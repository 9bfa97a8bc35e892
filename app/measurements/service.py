"""Measurement use cases: import public data sets, ingest reported batches (atomic, idempotent), list
measurements and stream them as CSV.

Keyword-only arguments after the session; functions ``flush()`` and never ``commit()`` (the request or
the caller owns the transaction, STYLE.md §3). Errors are :mod:`app.errors` domain errors.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from app.core.hardware import HardwareSpec
from app.core.vocab import Granularity
from app.errors import Conflict, HardwareNotFound, InvalidRequest, LayercastError, TooManyItems
from app.graphs.repository import GraphRepository
from app.hardware.service import get_spec
from app.measurements.importers import IMPORT_SOURCES, MeasurementRecord, RecordStream
from app.measurements.models import Measurement, MeasurementBatch
from app.measurements.repository import MeasurementFilter, MeasurementRepository
from app.measurements.schemas import (
    MAX_BATCH,
    ImportReport,
    MeasurementBatchCreate,
    MeasurementBatchRead,
    MeasurementCreate,
    MeasurementList,
    MeasurementRead,
    RowError,
)
from app.measurements.validation import field_problems
from app.schemas import MAX_PAGE


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

    Each record is checked by :func:`app.measurements.validation.field_problems`, the rule set of
    ``POST /v1/measurements`` (an imported source is no reserved source here): a record with a problem is
    not stored but counted in the report's ``refused``, ``refused_by_reason`` (``code/field`` of its first
    problem) and ``refused_examples`` (the first such record of each reason: file, row, message).

    When ``records`` is a :class:`RecordStream`, its ``rows_read`` and skip counts are in the report.

    Raises :class:`app.errors.HardwareNotFound` (a record's ``hardware_id`` is not stored: seed the
    catalog first), ``ValueError`` (a record without ``source_file``/``source_row``, a duplicate natural
    key ``(source, source_file, source_row, source_column, pass)``, a non-positive time, or ``batch_size`` < 1).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    repo = MeasurementRepository(session)
    known = repo.hardware_ids()
    graph_repo = GraphRepository(session)
    specs: dict[str, HardwareSpec] = {}
    now = datetime.now(UTC)
    cleared: set[tuple[str, str]] = set()
    files: list[str] = []
    by_hardware: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    examples: dict[str, str] = {}
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
        if record.hardware_id not in specs:
            specs[record.hardware_id] = get_spec(session, hardware_id=record.hardware_id)
        problems = field_problems(record, spec=specs[record.hardware_id], graph_exists=graph_repo.exists, now=now)
        if problems:  # not stored, as the API would not store it; counted, never dropped silently
            first = problems[0]
            reason = f"{first.code}/{first.field}"
            refused[reason] += 1
            examples.setdefault(reason, f"{source_file} row {source_row}: {first.message}")
            continue
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
        refused=sum(refused.values()),
        refused_by_reason=dict(sorted(refused.items())),
        refused_examples=dict(sorted(examples.items())),
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


class InvalidMeasurements(LayercastError):
    """Rows of a batch that the schema accepts but the database cannot (nothing of the batch is stored)."""

    status_code = 422
    code = "invalid_measurements"


class InvalidIdempotencyKey(LayercastError):
    status_code = 422
    code = "invalid_idempotency_key"


class IdempotencyKeyReused(Conflict):
    """The ``Idempotency-Key`` was used before with another body."""

    code = "idempotency_key_reused"


#: Longest accepted ``Idempotency-Key`` (a UUID is 36 characters) and its alphabet (printable ASCII).
MAX_KEY_LENGTH = 255
_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
#: Bad rows named in one ``invalid_measurements`` answer (the count says how many there were).
MAX_ROW_ERRORS = 100


def batch_sha256(data: BaseModel) -> str:
    """SHA-256 (hex) of a request body's canonical JSON: the validated fields by their JSON names, keys sorted,
    so two bodies that differ only in key order or whitespace are the same batch (and bodies of two routes,
    whose top-level fields differ, never are)."""
    canonical = json.dumps(data.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


#: ``source`` of the whole-job rows ``POST /v1/job-estimates/actuals`` records (``app.estimates.service``): only
#: that route may store job rows of it, since later job estimates are calibrated by them (against the
#: ``predicted_s`` it records, after its plausibility check).
ACTUALS_SOURCE = "scheduler"


def _row_errors(session: Session, repo: MeasurementRepository, rows: Sequence[MeasurementCreate]) -> list[RowError]:
    """Every row a stored measurement cannot be made of: a reserved import source (``reserved_source``: the
    API's own rule, an import writes those sources), then the problems of
    :func:`app.measurements.validation.field_problems`, the rule set ``layercast import`` applies too (a layer
    config that is no layer, an unknown device or graph, a time the device cannot have taken, a configuration
    it cannot run...)."""
    known = repo.hardware_ids()
    graph_repo = GraphRepository(session)
    specs: dict[str, HardwareSpec] = {}
    errors: list[RowError] = []
    now = datetime.now(UTC)
    for i, row in enumerate(rows):
        if row.source in IMPORT_SOURCES:
            errors.append(RowError(index=i, code="reserved_source", field="source",
                                   message=f"source {row.source!r} is reserved for imported data sets"))  # fmt: skip
        elif row.source == ACTUALS_SOURCE and row.granularity == Granularity.JOB:
            errors.append(RowError(index=i, code="reserved_source", field="source", message=(
                f"job rows of source {ACTUALS_SOURCE!r} calibrate job estimates: report them through "
                "POST /v1/job-estimates/actuals, which checks them against the model")))
        if row.hardware_id in known and row.hardware_id not in specs:
            specs[row.hardware_id] = get_spec(session, hardware_id=row.hardware_id)
        for p in field_problems(reported_record(row), spec=specs.get(row.hardware_id), graph_exists=graph_repo.exists,
                                now=now):  # fmt: skip
            errors.append(RowError(index=i, code=p.code, field=p.field, message=p.message))
    return errors


def stored_key(idempotency_key: str, submitter: str | None) -> str:
    """The ``measurement_batches`` key of a client's ``Idempotency-Key``: SHA-256 (hex) of the submitting API
    key's id and the key, so two callers' keys never meet (no replay of, or 409 on, another caller's batch)."""
    return hashlib.sha256(f"{submitter or ''}\n{idempotency_key}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class IdempotentRequest:
    """A write sent with an ``Idempotency-Key``: the client's key, its stored form (:func:`stored_key`) and
    the digest of the body (:func:`batch_sha256`)."""

    idempotency_key: str
    stored: str
    digest: str


def idempotent_request(idempotency_key: str | None, *, submitter: str | None,
                       body: BaseModel) -> IdempotentRequest | None:  # fmt: skip
    """The :class:`IdempotentRequest` of ``body`` sent with ``idempotency_key`` by the API key id ``submitter``
    (None without a key). Raises :class:`InvalidIdempotencyKey` (422) for a key that is not 1 to
    :data:`MAX_KEY_LENGTH` printable ASCII characters."""
    if idempotency_key is None:
        return None
    if not _KEY.match(idempotency_key):
        raise InvalidIdempotencyKey(f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
                                    detail={"length": len(idempotency_key)})  # fmt: skip
    return IdempotentRequest(idempotency_key=idempotency_key, stored=stored_key(idempotency_key, submitter),
                             digest=batch_sha256(body))


def _same_body(row: MeasurementBatch, request: IdempotentRequest) -> MeasurementBatch:
    if row.request_sha256 != request.digest:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was used with another body; use a new key for a new batch",
            detail={"idempotency_key": request.idempotency_key})
    return row


def stored_batch(session: Session, request: IdempotentRequest | None) -> MeasurementBatch | None:
    """The batch stored before under ``request``'s key, to be answered again (None: no key, or a new one).
    Raises :class:`IdempotencyKeyReused` (409) when the key was stored with another body."""
    if request is None:
        return None
    row = MeasurementRepository(session).batch(request.stored)
    return None if row is None else _same_body(row, request)


def claim_batch(session: Session, request: IdempotentRequest) -> tuple[MeasurementBatch, bool]:
    """Claim ``request``'s key (in a savepoint) before its write stores anything, so two concurrent requests
    with one key store once: ``(row, True)``, the new row (no ids yet) for the caller to fill in and flush; or
    ``(row, False)``, the row of the request that committed the key first, to be answered again. Raises
    :class:`IdempotencyKeyReused` (409) when that one had another body."""
    repo = MeasurementRepository(session)
    claim = MeasurementBatch(idempotency_key=request.stored, request_sha256=request.digest, measurement_ids=[])
    if repo.add_batch(claim):
        return claim, True
    winner = repo.batch(request.stored)
    assert winner is not None  # the conflict was this key's committed row
    return _same_body(winner, request), False


def _replay(row: MeasurementBatch, idempotency_key: str) -> MeasurementBatchRead:
    ids = [int(i) for i in row.measurement_ids]
    return MeasurementBatchRead(count=len(ids), ids=ids, idempotency_key=idempotency_key, replayed=True)


def create_measurements(
    session: Session, *, data: MeasurementBatchCreate, idempotency_key: str | None = None,
    submitter: str | None = None,
) -> MeasurementBatchRead:
    """Store every measurement of ``data`` or none, recorded as sent by the API key id ``submitter``;
    returns their ids in batch order.

    With ``idempotency_key`` (scoped to ``submitter``: :func:`stored_key`): a batch stored before under the key
    with the same body (:func:`batch_sha256`) is answered again (``replayed``, nothing stored), one with
    another body raises :class:`IdempotencyKeyReused` (409); two concurrent requests with one key store once
    (the key is claimed in a savepoint first: :func:`claim_batch`; the loser replays the winner's answer once
    it committed). Raises :class:`InvalidIdempotencyKey` (422: not 1-255 printable ASCII characters) and
    :class:`InvalidMeasurements` (422, ``detail.errors``: a :class:`RowError` per bad row, at most
    :data:`MAX_ROW_ERRORS`, plus ``invalid_rows`` and ``rows``) and :class:`app.errors.TooManyItems` (413) over
    :data:`app.measurements.schemas.MAX_BATCH` rows. ``measured_at`` is stored in UTC. Flushes.
    """
    if len(data.measurements) > MAX_BATCH:
        raise TooManyItems(f"{len(data.measurements)} measurements exceed the limit of {MAX_BATCH} per call; "
                           "split them", detail={"count": len(data.measurements), "limit": MAX_BATCH})
    request = idempotent_request(idempotency_key, submitter=submitter, body=data)
    seen = stored_batch(session, request)
    if request is not None and seen is not None:
        return _replay(seen, request.idempotency_key)
    repo = MeasurementRepository(session)
    errors = _row_errors(session, repo, data.measurements)
    if errors:
        raise InvalidMeasurements(
            f"{len({e.index for e in errors})} of {len(data.measurements)} rows cannot be stored "
            f"(first: row {errors[0].index}, {errors[0].code}); nothing was stored",
            detail={"errors": [e.model_dump() for e in errors[:MAX_ROW_ERRORS]],
                    "invalid_rows": len({e.index for e in errors}), "rows": len(data.measurements)})  # fmt: skip
    claim: MeasurementBatch | None = None
    if request is not None:
        claim, won = claim_batch(session, request)
        if not won:
            return _replay(claim, request.idempotency_key)
    ids = repo.insert_returning_ids([{**reported_record(m).to_row(), "submitter": submitter}
                                     for m in data.measurements])  # fmt: skip
    if claim is not None:
        claim.measurement_ids = ids
        session.flush()
    return MeasurementBatchRead(count=len(ids), ids=ids, idempotency_key=idempotency_key)


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


def checked_filters(filters: MeasurementFilter) -> MeasurementFilter:
    """``filters`` unchanged; :class:`app.errors.InvalidRequest` (422) for an empty time window."""
    if filters.measured_from and filters.measured_to and filters.measured_from >= filters.measured_to:
        raise InvalidRequest("measured_from must be before measured_to",
                             detail={"measured_from": filters.measured_from.isoformat(),
                                     "measured_to": filters.measured_to.isoformat()})  # fmt: skip
    return filters


def list_measurements(
    session: Session, *, filters: MeasurementFilter, limit: int = 100, offset: int = 0, cursor: int | None = None
) -> MeasurementList:
    """One page (by ascending id) of the measurements matching ``filters``, with the total and the cursor of
    the next page: rows after id ``cursor`` when given, else from ``offset``.

    Raises :class:`app.errors.InvalidRequest` (422) unless ``1 <= limit <= MAX_PAGE``, ``offset >= 0`` and
    ``cursor >= 0``, or when both a cursor and an offset are given, or the time window is empty
    (:func:`checked_filters`).
    """
    if not 1 <= limit <= MAX_PAGE or offset < 0 or (cursor is not None and cursor < 0):
        raise InvalidRequest(f"need 1 <= limit <= {MAX_PAGE}, offset >= 0 and cursor >= 0",
                             detail={"limit": limit, "offset": offset, "cursor": cursor})  # fmt: skip
    if cursor is not None and offset:
        raise InvalidRequest("page by cursor or by offset, not both", detail={"offset": offset, "cursor": cursor})
    filters = checked_filters(filters)
    repo = MeasurementRepository(session)
    rows = repo.list(filters, limit=limit, offset=offset, after_id=cursor)
    items = [MeasurementRead.model_validate(row) for row in rows]
    return MeasurementList(items=items, count=len(items), total=repo.count(filters), limit=limit, offset=offset,
                           next_cursor=items[-1].id if len(items) == limit else None)  # fmt: skip


#: Columns of the CSV export, in order (``config`` and ``context`` as JSON text).
CSV_COLUMNS = ("id", "hardware_id", "source", "op_kind", "pass", "optimizer", "precision", "software_stack",
               "granularity", "batch_size", "time_ms_median", "time_ms_std", "repetitions", "measured_at",
               "created_at", "config", "context")  # fmt: skip
#: Rows read per query while streaming the CSV export.
CSV_CHUNK = 1000


def _csv_line(row: Measurement) -> list[Any]:
    def iso(t: datetime | None) -> str:
        return "" if t is None else t.isoformat()

    return [row.id, row.hardware_id, row.source, row.op_kind, row.pass_, row.optimizer, row.precision,
            row.software_stack or "", row.granularity or "", row.batch_size, repr(row.time_ms_median),
            "" if row.time_ms_std is None else repr(row.time_ms_std),
            "" if row.repetitions is None else row.repetitions,
            iso(row.measured_at), iso(row.created_at), json.dumps(row.config, sort_keys=True),
            json.dumps(row.context, sort_keys=True)]  # fmt: skip


def export_csv(factory: sessionmaker[Session], *, filters: MeasurementFilter) -> Iterator[str]:
    """The measurements matching ``filters`` as CSV text (RFC 4180, header :data:`CSV_COLUMNS`), by ascending
    id, in chunks of :data:`CSV_CHUNK` rows: each chunk is read by keyset (``id >`` the last one) in its own
    short session, so an export of millions of rows holds neither a transaction nor the rows in memory.
    Rows stored while it streams may appear if their id is above the chunk being read."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    yield buf.getvalue()
    last: int | None = None
    while True:
        with factory() as session:
            rows = MeasurementRepository(session).list(filters, limit=CSV_CHUNK, after_id=last)
            buf.seek(0)
            buf.truncate()
            for row in rows:
                writer.writerow(_csv_line(row))
        if not rows:
            return
        last = int(rows[-1].id)
        yield buf.getvalue()
        if len(rows) < CSV_CHUNK:
            return
