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

``hardware_id`` is given by the caller: the rows name their CPU or GPU (``context.device_name``,
``cpu_model``, ``logical_cpus``, ``cpu_capability``) but not a catalog entry. Which entry is the job of
:func:`app.measurements.cli.resolve_profiler_hardware`: the spec of the *measuring* machine, from the shard
folder's ``hardware.json`` (:data:`HARDWARE_FILE`, written by the profiler; :func:`read_machine_spec`), a
given spec or catalog id, or ``local`` only when the importing machine is the one that measured
(:func:`machine_of`, :func:`mismatches`). Skips (counted per ``context.device``): rows whose
``status`` is not ``ok`` (``profiler_error``), unparsable lines (``unparsable_line``, e.g. a torn last
line of an interrupted campaign), passes without a positive median.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from app.core.hardware import HardwareSpec
from app.core.vocab import Granularity, Pass, SoftwareStack
from app.hardware.catalog import InvalidHardwareSpec, spec_from_dict
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
#: Spec of the machine that measured a folder's shards (``app.hardware.catalog.spec_to_dict`` JSON).
HARDWARE_FILE = "hardware.json"
#: ``torch.backends.cpu.get_cpu_capability()`` → the SIMD width (bits) it implies; others are not compared.
_CAPABILITY_BITS = {"AVX512": 512, "AVX2": 256, "SVE256": 256}


@dataclass(frozen=True)
class MachineContext:
    """Identity of the machine that measured a shard, from its rows' ``context``.

    ``device`` ``cpu``/``cuda``; ``cpu_model`` the ``/proc/cpuinfo`` model name; ``logical_cpus``
    ``os.cpu_count()``; ``cpu_capability`` torch's SIMD level (``AVX512``, ``AVX2``, ``DEFAULT``...);
    ``device_name`` the GPU's name on CUDA rows (the CPU model otherwise).
    """

    device: str
    cpu_model: str
    logical_cpus: int | None
    cpu_capability: str | None
    device_name: str

    @classmethod
    def from_context(cls, ctx: Mapping[str, Any]) -> MachineContext:
        """From a row's ``context`` (:func:`app.profiler.timing.device_context`); missing fields ``?``/None."""
        logical = ctx.get("logical_cpus")
        return cls(
            device=str(ctx.get("device", "?")), cpu_model=str(ctx.get("cpu_model", "?")),
            logical_cpus=int(logical) if logical is not None else None,
            cpu_capability=str(ctx["cpu_capability"]) if ctx.get("cpu_capability") else None,
            device_name=str(ctx.get("device_name", ctx.get("cpu_model", "?"))),
        )

    def derived_id(self) -> str:
        """Hardware id of this CPU built from its context, e.g. ``cpu-amd-epyc-2c-avx512``
        (slug of the model name, logical CPUs, SIMD level)."""
        slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)", "", self.cpu_model.lower())).strip("-")
        parts = ["cpu", slug or "unknown"]
        if self.logical_cpus:
            parts.append(f"{self.logical_cpus}c")
        if self.cpu_capability:
            parts.append(self.cpu_capability.lower())
        return "-".join(parts)

    def describe(self) -> str:
        """One line for error messages: ``AMD EPYC, 2 logical CPUs, AVX512``."""
        if self.device != "cpu":
            return f"{self.device_name} ({self.device}) on host {self.cpu_model}"
        return f"{self.cpu_model}, {self.logical_cpus} logical CPUs, {self.cpu_capability}"


def machine_of(paths: Iterable[str | Path], *, limit: int | None = None) -> MachineContext | None:
    """The one machine that measured every ``ok`` row of ``paths`` (``None`` when no file has an ``ok`` row
    with a context). Reads every line (the first ``limit`` of each file when given). Raises
    :class:`ImportFormatError` when the rows name two machines (shards of several machines in one folder:
    import them from separate folders)."""
    seen: dict[MachineContext, str] = {}
    for path in paths:
        stream = _stream(SOURCE_PROFILER, path, lambda s: iter(()))
        for _, row in _json_lines(stream, limit):
            ctx = row.get("context")
            if row.get("status") != "ok" or not isinstance(ctx, Mapping):
                continue
            seen.setdefault(MachineContext.from_context(ctx), Path(path).name)
    if len(seen) > 1:
        names = "; ".join(f"{m.describe()} ({f})" for m, f in seen.items())
        raise ImportFormatError(f"the shards were measured on {len(seen)} machines: {names}; "
                                "import each machine's shards from its own folder")
    return next(iter(seen), None)


def mismatches(
    machine: MachineContext, *, kind: str, name: str, vector_width_bits: int | None, logical_cpus: int | None = None,
) -> list[str]:  # fmt: skip
    """Why a device (``kind``, model ``name``, SIMD width in bits, logical CPUs when known; a stored spec
    has physical cores only) is not the machine that measured ``machine``'s rows; empty when it is.
    Compared: kind, model name, the SIMD width that ``cpu_capability`` implies (when known) and the
    logical CPUs. A GPU context only needs a GPU device (GPU rows name their catalog entry)."""
    if machine.device != "cpu":
        return [] if kind == "gpu" else [f"the rows were measured on a GPU ({machine.device_name})"]
    out = []
    if kind != "cpu":
        out.append(f"kind {kind} (the rows were measured on a CPU)")
    if name != machine.cpu_model:
        out.append(f"model {name!r} (rows: {machine.cpu_model!r})")
    bits = _CAPABILITY_BITS.get(machine.cpu_capability or "")
    if bits is not None and vector_width_bits is not None and vector_width_bits != bits:
        out.append(f"{vector_width_bits}-bit vectors (rows: {machine.cpu_capability}, {bits}-bit)")
    if logical_cpus is not None and machine.logical_cpus is not None and logical_cpus != machine.logical_cpus:
        out.append(f"{logical_cpus} logical CPUs (rows: {machine.logical_cpus})")
    return out


def spec_mismatches(spec: HardwareSpec, machine: MachineContext) -> list[str]:
    """:func:`mismatches` of a stored or given spec."""
    return mismatches(machine, kind=spec.kind, name=spec.name, vector_width_bits=spec.vector_width_bits)


def read_machine_spec(path: str | Path) -> HardwareSpec:
    """The spec in ``path`` (:data:`HARDWARE_FILE` JSON, :func:`app.hardware.catalog.spec_to_dict` format).
    Raises ``FileNotFoundError`` and :class:`ImportFormatError` for unreadable JSON or an invalid spec."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        return spec_from_dict(data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, InvalidHardwareSpec) as exc:
        raise ImportFormatError(f"{p.name}: not a hardware spec: {exc}") from exc


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
