"""``layercast profile --upload URL``: post a profiler shard's measurements to a running service.

The shard (``layers_*.jsonl[.gz]`` or ``e2e_*.jsonl[.gz]``) is parsed by the one parser of profiler rows
(:mod:`app.measurements.profiler_rows`), so an uploaded row is the row ``layercast import profiler`` would
store, with source :data:`app.measurements.importers.SOURCE_PROFILER_UPLOAD` (a re-import of a local shard
never replaces uploaded rows). Measurements go out in batches of at most
:data:`app.measurements.schemas.MAX_BATCH` through :class:`app.client.Client`, each with an
``Idempotency-Key`` made of the device and the SHA-256 of the batch's rows: running the same upload again
(after a timeout, a crash, a dropped connection, a batch the server refused) stores nothing twice. Upload a
finished shard: batches are cut in row order, so rows appended later (a resumed campaign) would shift the
last batch and store its rows again (``layercast profile --upload`` uploads only once the campaign is done).
Connection failures are retried by the HTTP transport (``retries``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.client import Client
from app.measurements.importers import SOURCE_PROFILER_UPLOAD, MeasurementRecord, RecordStream
from app.measurements.profiler_rows import iter_profiler_e2e, iter_profiler_layers
from app.measurements.schemas import MAX_BATCH


@dataclass(slots=True)
class UploadReport:
    """What an upload did: measurements ``stored`` now, ``replayed`` (already stored by an earlier run of the
    same upload), rows ``skipped`` by the parser per reason, and ``chunks`` posted."""

    stored: int = 0
    replayed: int = 0
    chunks: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


def _payload(record: MeasurementRecord) -> dict[str, Any]:
    """The ``MeasurementCreate`` fields of a parsed profiler record (JSON names)."""
    return {
        "hardware_id": record.hardware_id, "source": SOURCE_PROFILER_UPLOAD, "op_kind": record.op_kind,
        "pass": record.pass_, "optimizer": record.optimizer, "precision": record.precision,
        "software_stack": record.software_stack.value, "granularity": record.granularity.value,
        "batch_size": record.batch_size, "config": record.config, "time_ms_median": record.time_ms_median,
        "time_ms_std": record.time_ms_std, "repetitions": record.repetitions, "context": record.context,
        "measured_at": record.measured_at.isoformat() if record.measured_at is not None else None,
    }  # fmt: skip


def _stream(path: Path, hardware_id: str) -> RecordStream:
    parse = iter_profiler_e2e if path.name.startswith("e2e_") else iter_profiler_layers
    return parse(path, hardware_id=hardware_id)


def upload_shard(path: str | Path, *, client: Client, hardware_id: str, chunk: int = MAX_BATCH,
                 log: Callable[[str], None] = print) -> UploadReport:  # fmt: skip
    """Post every measurement of the shard at ``path``, measured on ``hardware_id`` (a catalog id the server
    stores), in batches of ``chunk`` (see the module docstring).

    Raises ``FileNotFoundError``, :class:`app.measurements.importers.ImportFormatError` (a malformed shard),
    ``ValueError`` (``chunk`` outside 1..MAX_BATCH) and :class:`app.client.LayercastAPIError` for a batch the
    server refuses (e.g. 422 ``invalid_measurements`` with each bad row's index: an unknown ``hardware_id``);
    batches posted before it stay stored, and rerunning the upload after the fix posts only the rest.
    """
    if not 1 <= chunk <= MAX_BATCH:
        raise ValueError(f"chunk must be 1..{MAX_BATCH}, got {chunk}")
    path = Path(path)
    stream = _stream(path, hardware_id)
    report = UploadReport()
    batch: list[dict[str, Any]] = []

    def send() -> None:
        digest = hashlib.sha256(json.dumps(batch, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        key = f"profile:{hardware_id}:{digest}"
        answer = client.report_measurements(batch, idempotency_key=key)
        report.chunks += 1
        if answer.replayed:
            report.replayed += answer.count
        else:
            report.stored += answer.count
        batch.clear()

    for record in stream:
        batch.append(_payload(record))
        if len(batch) == chunk:
            send()
    if batch:
        send()
    for (_device, reason), n in sorted(stream.skipped.items()):
        report.skipped[reason] = report.skipped.get(reason, 0) + n
    log(f"uploaded {path.name}: {report.stored} measurements stored, {report.replayed} already stored, "
        f"{report.chunks} batches, skipped {report.skipped or 'none'}")
    return report


def http_client(server: str, *, api_key: str | None = None, retries: int = 3, timeout_s: float = 120.0) -> Client:
    """A :class:`Client` of ``server`` whose transport retries failed connections ``retries`` times, sending
    ``api_key`` (default ``$LAYERCAST_API_KEY``; measurements need the ``measurements`` scope) as
    ``Authorization: Bearer``."""
    return Client(http=httpx.Client(base_url=server, timeout=timeout_s, transport=httpx.HTTPTransport(retries=retries)),
                  api_key=api_key)  # fmt: skip
