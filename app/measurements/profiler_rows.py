"""Parser of the profiler's JSONL shards (``data/seed/layers_*.jsonl[.gz]``, ``e2e_*.jsonl[.gz]``).

The files are written by :mod:`app.profiler.run` (one layer configuration × precision per line) and
:mod:`app.profiler.e2e` (one whole model × batch size × precision per line); ``data/seed/README.md``
describes the campaign. This module reads them without importing the profiler (the measurements domain
sits below it). Every record: ``source`` ``profiler``, ``software_stack`` ``pytorch-eager``, one record
per timed pass in the row's ``timings`` (:class:`app.core.vocab.Pass`), ``optimizer`` the row's for the
training passes (``train_forward``, ``backward``, ``update``, ``train_step``...) and ``none`` for the
inference ``forward``; ``time_ms_median``/``time_ms_std``/``repetitions`` from the pass's
``median_ms``/``std_ms``/``n``; ``context`` = the row's measurement context (device, threads, framework
version, clocks) plus ``q1_ms``/``q3_ms``/``min_ms`` of the pass, ``load_avg_1m`` and the source location;
``measured_at`` from the row.

* Layer rows (:func:`iter_profiler_layers`): ``granularity`` ``layer``, ``op_kind`` the row's IR kind,
  ``config`` the profiler's configuration fields (``config_id``, ``family``, ``op``, ``origin``,
  ``graph`` — a JSON layer-list document — or ``shapes``, ``needs_input_grad``) from which
  :meth:`app.profiler.sampler.LayerConfig.from_row` rebuilds the layer.
* Whole-iteration rows (:func:`iter_profiler_e2e`): ``granularity`` ``iteration``, ``op_kind``
  ``iteration``, ``config`` = ``arch``, ``builder``, ``builder_config``, ``seed``, ``params`` and the
  ``onnx`` export recipe (how to rebuild the graph).

``hardware_id`` is given by the caller: the rows name their CPU or GPU (``context.device_name``) but not a
catalog entry; the CPU seed data set is ``local``. Skips (counted per ``context.device``): rows whose
``status`` is not ``ok`` (``profiler_error``), unparsable lines (``unparsable_line``, e.g. a torn last
line of an interrupted campaign), passes without a positive median.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from app.core.vocab import Granularity, Pass, SoftwareStack
from app.measurements.importers import (
    SKIP_MISSING_TIME,
    SKIP_NON_POSITIVE_TIME,
    SOURCE_PROFILER,
    ImportFormatError,
    MeasurementRecord,
    RecordStream,
    _stream,
)

SKIP_PROFILER_ERROR = "profiler_error"
SKIP_UNPARSABLE = "unparsable_line"
SKIP_UNKNOWN_PASS = "unknown_pass"
#: Row format written by app.profiler.run / app.profiler.e2e (their field ``schema``).
PROFILER_ROW_SCHEMA = 1

_LAYER_CONFIG_FIELDS = ("config_id", "family", "op", "origin", "input_shape", "graph", "shapes", "needs_input_grad")
_E2E_CONFIG_FIELDS = ("arch", "source", "builder", "builder_config", "seed", "params", "onnx")
_PASSES = frozenset(p.value for p in Pass)


def _json_lines(stream: RecordStream, limit: int | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line index, object)`` of a ``.jsonl``/``.jsonl.gz`` file; a bad line is a counted skip."""
    opener: Any = gzip.open if stream.path.suffix == ".gz" else open
    try:
        with opener(stream.path, "rt", encoding="utf-8") as fh:
            for index, line in enumerate(fh):
                if limit is not None and index >= limit:
                    return
                if not line.strip():
                    continue
                stream.rows_read += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    stream.skip("?", SKIP_UNPARSABLE)
                    continue
                if not isinstance(obj, dict):
                    stream.skip("?", SKIP_UNPARSABLE)
                    continue
                yield index, obj
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ImportFormatError(f"{stream.path.name}: unreadable: {exc}") from exc


def _records(
    stream: RecordStream, *, hardware_id: str, limit: int | None, granularity: Granularity,
    config_fields: tuple[str, ...], op_kind: str | None,
) -> Iterator[MeasurementRecord]:  # fmt: skip
    name = stream.source_file
    for index, row in _json_lines(stream, limit):
        ctx_row: Mapping[str, Any] = row.get("context") or {}
        device = str(ctx_row.get("device", "?"))
        timings = row.get("timings")
        if row.get("status") != "ok":
            stream.skip(device, SKIP_PROFILER_ERROR, max(1, len(timings or {})))
            continue
        if not isinstance(timings, Mapping) or not timings:
            raise ImportFormatError(f"{name}: line {index + 1}: an ok row without timings")
        missing = [k for k in ("batch_size", "precision", *(() if op_kind else ("op_kind",))) if k not in row]
        if missing:
            raise ImportFormatError(f"{name}: line {index + 1}: missing fields {missing}")
        config = {k: row[k] for k in config_fields if k in row}
        measured_at = datetime.fromisoformat(row["measured_at"]) if row.get("measured_at") else None
        for pass_, st in timings.items():
            if pass_ not in _PASSES:
                stream.skip(device, SKIP_UNKNOWN_PASS)
                continue
            median = (st or {}).get("median_ms")
            if median is None:
                stream.skip(device, SKIP_MISSING_TIME)
                continue
            if not float(median) > 0:
                stream.skip(device, SKIP_NON_POSITIVE_TIME)
                continue
            context = {
                **ctx_row,
                "source_file": name,
                "source_row": index,
                "q1_ms": st.get("q1_ms"),
                "q3_ms": st.get("q3_ms"),
                "min_ms": st.get("min_ms"),
                "load_avg_1m": row.get("load_avg_1m"),
                "row_schema": row.get("schema"),
            }
            yield MeasurementRecord(
                hardware_id=hardware_id,
                source=SOURCE_PROFILER,
                op_kind=op_kind or str(row["op_kind"]),
                pass_=pass_,
                optimizer=str(row.get("optimizer", "none")) if pass_ != Pass.FORWARD else "none",
                precision=str(row["precision"]),
                software_stack=SoftwareStack.PYTORCH_EAGER,
                granularity=granularity,
                batch_size=int(row["batch_size"]),
                config=config,
                time_ms_median=float(median),
                time_ms_std=st.get("std_ms"),
                repetitions=st.get("n"),
                context=context,
                measured_at=measured_at,
            )


def iter_profiler_layers(path: str | Path, *, hardware_id: str, limit: int | None = None) -> RecordStream:
    """Records of one profiler layer shard (``layers_*.jsonl[.gz]``), measured on ``hardware_id``.

    ``limit`` reads only the first ``limit`` lines. Raises ``FileNotFoundError``; while iterating,
    :class:`ImportFormatError` for an unreadable file or an ``ok`` row without its fields.
    """
    return _stream(SOURCE_PROFILER, path, lambda s: _records(
        s, hardware_id=hardware_id, limit=limit, granularity=Granularity.LAYER,
        config_fields=_LAYER_CONFIG_FIELDS, op_kind=None,
    ))


def iter_profiler_e2e(path: str | Path, *, hardware_id: str, limit: int | None = None) -> RecordStream:
    """Records of one profiler whole-iteration shard (``e2e_*.jsonl[.gz]``), measured on ``hardware_id``.

    Errors as :func:`iter_profiler_layers`.
    """
    return _stream(SOURCE_PROFILER, path, lambda s: _records(
        s, hardware_id=hardware_id, limit=limit, granularity=Granularity.ITERATION,
        config_fields=_E2E_CONFIG_FIELDS, op_kind="iteration",
    ))


def profiler_files(data_dir: str | Path) -> list[tuple[Path, Any]]:
    """``(path, parser)`` of the shards of ``data_dir``: ``layers_*`` then ``e2e_*``; a ``.gz`` wins over its
    plain twin. Raises ``FileNotFoundError`` when there are none."""
    d = Path(data_dir)
    out: list[tuple[Path, Any]] = []
    for prefix, parser in (("layers_", iter_profiler_layers), ("e2e_", iter_profiler_e2e)):
        gz = sorted(d.glob(f"{prefix}*.jsonl.gz"))
        plain = [p for p in sorted(d.glob(f"{prefix}*.jsonl")) if p.with_suffix(".jsonl.gz") not in gz]
        out += [(p, parser) for p in gz + plain]
    if not out:
        raise FileNotFoundError(f"no profiler shards (layers_*.jsonl[.gz], e2e_*.jsonl[.gz]) under {d}")
    return out
