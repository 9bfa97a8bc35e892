"""Parsers of the public measured data sets in ``../shared/data`` into :class:`MeasurementRecord` s.

Pure: no database, no web framework. Each ``iter_*`` function returns a :class:`RecordStream`, an iterator
of records over one file that also counts what it read and what it skipped (per device and reason), so a
caller can always say why a row did not become a measurement. Nothing is dropped silently.

Formats and provenance (``../shared/data/README.md``):

* ``justus2018/{conv,dense}_<GPU>.csv.gz`` (:func:`iter_justus`) — Justus et al. 2018, CDECatapult/
  ml-performance-prediction @ e649f32; TensorFlow 1.x, fp32; one layer per row, timed as the median
  wall time per iteration over 5 repetitions of 50 iterations (TF session overhead included), either a
  forward pass (``optimizer == "none"``) or one training step (forward + backward + optimizer update).
* ``deepbench/deepbench_{gemm,conv,rnn,allreduce}.csv`` (:func:`iter_deepbench_gemm`,
  :func:`iter_deepbench_conv`, :func:`iter_deepbench_rnn`, :func:`iter_deepbench_allreduce`) — Baidu
  DeepBench @ da81ba78, vendor-library kernels (cuDNN 6-7 / cuBLAS, CUDA 8-10); times in ms.

Record conventions:

* ``config`` holds the layer description. Layers the JSON layer vocabulary of
  :mod:`app.core.json_import` can express are ``{"input_shape": [...], "layer": {"op": ...}}`` (one
  sample, no batch axis; ``import_json({"input_shape": c["input_shape"], "layers": [c["layer"]]},
  batch_size=record.batch_size)`` rebuilds the layer). The others keep the same ``{"layer": {"op": ...}}``
  shape with their own fields: a bare GEMM ``{"op": "matmul", "m", "n", "k", "a_trans", "b_trans"}``
  (C[m×n] = op(A)[m×k]·op(B)[k×n]) and an all-reduce ``{"op": "allreduce", "size_floats", "size_bytes",
  "n_ranks", "n_nodes"}``. GEMM and all-reduce records have ``batch_size`` 1 (no batch axis).
* ``pass_`` uses :class:`app.core.vocab.Pass`: ``forward``,
  ``backward`` (DeepBench RNN: weight gradients), ``backward_input`` (gradient w.r.t. the input),
  ``backward_weight`` (gradient w.r.t. the weights) and ``train_step`` (forward + backward + update).
  An all-reduce has no passes; its one execution is recorded as ``forward``.
* ``software_stack`` (:class:`app.core.vocab.SoftwareStack`) and ``granularity``
  (:class:`app.core.vocab.Granularity`) are set on every record: Justus ``tf1-session``/``layer``,
  DeepBench ``cuda-library``/``kernel``, NeuSight and Vidur ``pytorch-eager``/``kernel``.
* ``context`` always has ``source_file`` (file name in its data set folder) and ``source_row`` (0-based
  data row), plus ``source_column`` where one row holds several ops (Vidur): with ``source`` and
  ``pass_`` they are the natural key that makes re-imports idempotent (see
  :func:`app.measurements.service.import_records`). It also names the upstream repository and commit,
  the upstream file, ``framework`` and ``framework_version``, ``timing`` (how the time was taken), the
  original device name and precision label.
"""

from __future__ import annotations

import csv
import gzip
import math
import re
import zlib
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.core.vocab import Granularity, SoftwareStack
from app.hardware.catalog import load_catalog

SOURCE_JUSTUS = "justus2018"
SOURCE_DEEPBENCH = "deepbench"
SOURCE_NEUSIGHT = "neusight"
SOURCE_VIDUR = "vidur"
SOURCE_PROFILER = "profiler"
#: Profiler rows posted through ``POST /v1/measurements`` (``layercast profile --upload``): the same row format
#: as :data:`SOURCE_PROFILER`, another source so that a re-import of a local shard never replaces them.
SOURCE_PROFILER_UPLOAD = "profiler-upload"
#: Sources whose ``config`` is a profiler layer configuration (rebuilt by ``LayerConfig.from_row``).
PROFILER_SOURCES: tuple[str, ...] = (SOURCE_PROFILER, SOURCE_PROFILER_UPLOAD)
#: Sources written only by an importer; a reported measurement (``POST /v1/measurements``) may not use them.
IMPORT_SOURCES: tuple[str, ...] = (SOURCE_JUSTUS, SOURCE_DEEPBENCH, SOURCE_NEUSIGHT, SOURCE_VIDUR, SOURCE_PROFILER)

#: Justus ``gpu`` column → hardware catalog id (app/hardware/catalog.toml explains the board choices).
JUSTUS_GPU_IDS: dict[str, str] = {
    "Tesla K40": "k40",
    "Tesla K80": "k80",
    "Tesla M60": "m60",
    "GTX 1080 Ti": "gtx-1080-ti",
    "Tesla P100": "p100",
}

JUSTUS_UPSTREAM = "CDECatapult/ml-performance-prediction@e649f32"
JUSTUS_FRAMEWORK = "TensorFlow"
JUSTUS_FRAMEWORK_VERSION = "1.x"
JUSTUS_REPETITIONS = 5  # repetitions of 50 iterations each (shared/data/README.md)
JUSTUS_ITERATIONS_PER_REPETITION = 50
DEEPBENCH_UPSTREAM = "baidu-research/DeepBench@da81ba78"
DEEPBENCH_FRAMEWORK = "cuDNN / cuBLAS (DeepBench kernels)"
DEEPBENCH_FRAMEWORK_VERSION = "cuDNN 6-7, CUDA 8-10"

# --- skip reasons (stable strings: they appear in import reports) ---
SKIP_UNKNOWN_DEVICE = "unknown_device"
SKIP_NOT_IN_CATALOG = "hardware_not_in_catalog"
SKIP_MISSING_TIME = "missing_time"
SKIP_NON_POSITIVE_TIME = "non_positive_time"
SKIP_UNKNOWN_PRECISION = "unknown_precision"

#: DeepBench ``platform`` column → hardware catalog id. DeepBench does not say which P100 board it used
#: (PCIe or SXM2); the catalog has only the PCIe 16 GB card, so P100 rows map there with a note.
DEEPBENCH_HARDWARE_IDS: dict[str, str] = {
    "NV_P100": "p100",
    "NV_1080Ti": "gtx-1080-ti",
    "NV_TitanXp": "titan-xp",
}
DEEPBENCH_HARDWARE_NOTES: dict[str, str] = {
    "NV_P100": "DeepBench does not name the P100 board (PCIe or SXM2); mapped to catalog p100 (PCIe 16 GB)",
}
#: DeepBench platforms known to have no catalog entry; their rows are skipped as ``hardware_not_in_catalog``.
DEEPBENCH_NOT_IN_CATALOG: dict[str, str] = {
    "NV_TitanX": "NVIDIA GTX Titan X (Maxwell)",
    "NV_TitanX_Pascal": "NVIDIA Titan X (Pascal)",
    "NV_M40": "NVIDIA Tesla M40",
    "AMD_MI25": "AMD Radeon Instinct MI25",
    "AMD_VegaFE": "AMD Vega Frontier Edition",
    "IA_KNL7250": "Intel Xeon Phi 7250",
    "Raspberry_Pi_3": "Raspberry Pi 3",
    "iPhone_6": "Apple iPhone 6",
    "iPhone_7": "Apple iPhone 7",
}

_FP16_PSEUDO = "16 bit inputs, 32 bit multiplication, 32 bit addition"
_INT8_SERVER = "GEMM, Conv: Int8 multiplication, 32 bit accumulation"
_INT8_DEVICE = "Int8 inputs 32 bit math"
_MISSING = frozenset({"", "na", "n/a", "nan", "none", "-", "--"})
_DATE_IN_NAME = re.compile(r"(20\d{2})(\d{2})(\d{2})")


class ImportFormatError(ValueError):
    """A source file cannot be read as its format: missing columns, a malformed row, bad compression.

    The message names the file and the line (1-based, header = line 1).
    """


@dataclass(frozen=True, slots=True)
class MeasurementRecord:
    """One measured time, ready to become a :class:`app.measurements.models.Measurement` row.

    Units: ``time_ms_median``/``time_ms_std`` in milliseconds; ``batch_size`` in samples.
    ``config``/``context`` are JSON-safe dicts (see the module docstring).
    """

    hardware_id: str
    source: str
    op_kind: str
    pass_: str
    optimizer: str
    precision: str
    software_stack: SoftwareStack
    granularity: Granularity
    batch_size: int
    config: dict[str, Any]
    time_ms_median: float
    time_ms_std: float | None
    repetitions: int | None
    context: dict[str, Any]
    measured_at: datetime | None = None

    def to_row(self) -> dict[str, Any]:
        """Keyword arguments of :class:`app.measurements.models.Measurement` (attribute names)."""
        return {
            "hardware_id": self.hardware_id,
            "source": self.source,
            "op_kind": self.op_kind,
            "pass_": self.pass_,
            "optimizer": self.optimizer,
            "precision": self.precision,
            "software_stack": self.software_stack.value,
            "granularity": self.granularity.value,
            "batch_size": self.batch_size,
            "config": self.config,
            "time_ms_median": self.time_ms_median,
            "time_ms_std": self.time_ms_std,
            "repetitions": self.repetitions,
            "context": self.context,
            "measured_at": self.measured_at,
        }


@dataclass(eq=False)
class RecordStream(Iterator[MeasurementRecord]):
    """Lazy records of one source file, with the counts of what was read and skipped.

    ``rows_read``: data rows read so far (a DeepBench conv row gives up to three records);
    ``records``: records yielded so far; ``skipped``: ``(device, reason) -> measurements`` not turned
    into records (``device`` is the file's own device name). Counts are final once the stream is
    exhausted. Iterating raises :class:`ImportFormatError` for a malformed file.
    """

    source: str
    path: Path
    rows_read: int = 0
    records: int = 0
    skipped: Counter[tuple[str, str]] = field(default_factory=Counter)
    _it: Iterator[MeasurementRecord] | None = field(default=None, repr=False)

    @property
    def source_file(self) -> str:
        """The file name, as stored in each record's ``context["source_file"]``."""
        return self.path.name

    def skip(self, device: str, reason: str, n: int = 1) -> None:
        """Count ``n`` measurements of ``device`` not imported for ``reason``."""
        self.skipped[(device, reason)] += n

    def in_catalog(self, device: str, hardware_id: str | None, catalog: Container[str], n: int = 1) -> str | None:
        """``hardware_id`` (the catalog id a source's device name maps to) if the catalog has it; otherwise
        ``None`` after counting ``n`` measurements of ``device`` as skipped (:data:`SKIP_UNKNOWN_DEVICE` when
        the name maps to no id, :data:`SKIP_NOT_IN_CATALOG` when the id is not in ``catalog``)."""
        if hardware_id is None:
            self.skip(device, SKIP_UNKNOWN_DEVICE, n)
            return None
        if hardware_id not in catalog:
            self.skip(device, SKIP_NOT_IN_CATALOG, n)
            return None
        return hardware_id

    def __iter__(self) -> RecordStream:
        return self

    def __next__(self) -> MeasurementRecord:
        if self._it is None:
            raise StopIteration
        record = next(self._it)
        self.records += 1
        return record


def _stream(
    source: str, path: str | Path, parse: Callable[[RecordStream], Iterator[MeasurementRecord]]
) -> RecordStream:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such data file: {p}")
    stream = RecordStream(source=source, path=p)
    stream._it = parse(stream)
    return stream


# ------------------------------------------------------------------------------------------ parsing


def _rows(
    stream: RecordStream, required: Iterable[str], limit: int | None
) -> Iterator[tuple[int, int, dict[str, str]]]:
    """Yield ``(row index, line number, row)`` of a CSV (gzip when the name ends in ``.gz``).

    Checks the header for ``required`` columns and every row for its field count; counts
    ``stream.rows_read``. Raises :class:`ImportFormatError` naming the file and line.
    """
    path = stream.path
    opener: Any = gzip.open if path.suffix == ".gz" else open
    line = 1
    try:
        with opener(path, "rt", newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None:
                raise ImportFormatError(f"{path.name}: empty file, no header")
            missing = [c for c in required if c not in reader.fieldnames]
            if missing:
                raise ImportFormatError(f"{path.name}: missing columns {missing} (header: {reader.fieldnames})")
            width = len(reader.fieldnames)
            for index, row in enumerate(reader):
                if limit is not None and index >= limit:
                    return
                line = reader.line_num
                if None in row or any(v is None for v in row.values()):
                    raise ImportFormatError(f"{path.name}: line {line}: expected {width} fields")
                stream.rows_read += 1
                yield index, line, row
    except (OSError, EOFError, UnicodeDecodeError, csv.Error, zlib.error) as exc:  # bad gzip, truncated, binary junk
        raise ImportFormatError(f"{path.name}: unreadable after line {line}: {exc}") from exc


def _int(row: Mapping[str, str], col: str, name: str, line: int, *, minimum: int = 1) -> int:
    """Integer column (``"32"`` or ``"32.0"``) ≥ ``minimum``; :class:`ImportFormatError` otherwise."""
    raw = row[col].strip()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value) or value < minimum:
        raise ImportFormatError(f"{name}: line {line}: column {col!r} must be an integer ≥ {minimum}, got {raw!r}")
    return int(value)


def _optional_int(row: Mapping[str, str], col: str, name: str, line: int) -> int | None:
    return None if row.get(col, "").strip() == "" else _int(row, col, name, line)


def _time(row: Mapping[str, str], col: str, name: str, line: int) -> float | str:
    """A time in ms, or the skip reason: ``missing_time`` (empty, ``N/A``...) or ``non_positive_time``.

    Any other non-numeric text is corruption: :class:`ImportFormatError`.
    """
    raw = row[col].strip()
    if raw.rstrip("*").lower() in _MISSING:
        return SKIP_MISSING_TIME
    try:
        value = float(raw)
    except ValueError:
        raise ImportFormatError(f"{name}: line {line}: column {col!r} is not a time in ms: {raw!r}") from None
    if math.isnan(value):
        return SKIP_MISSING_TIME
    if not math.isfinite(value) or value <= 0:
        return SKIP_NON_POSITIVE_TIME
    return value


def _optional_float(row: Mapping[str, str], col: str) -> float | None:
    try:
        value = float(row.get(col, "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _choice(row: Mapping[str, str], col: str, allowed: Mapping[str, Any], name: str, line: int) -> Any:
    raw = row[col].strip()
    if raw not in allowed:
        raise ImportFormatError(f"{name}: line {line}: column {col!r} must be one of {sorted(allowed)}, got {raw!r}")
    return allowed[raw]


# ------------------------------------------------------------------------------------------- Justus

_JUSTUS_COMMON = ("batch_size", "gpu", "optimizer", "precision_bits", "time_ms_median", "time_ms_std",
                  "time_ms_min", "time_ms_max", "source_file", "activation", "pass")
_JUSTUS_COLUMNS = {
    "conv": (*_JUSTUS_COMMON, "in_channels", "out_channels", "kernel_size", "input_size", "padding", "stride",
             "use_bias"),
    "dense": (*_JUSTUS_COMMON, "in_features", "out_features"),
}
_JUSTUS_PRECISION = {"32": "fp32", "16": "fp16", "64": "fp64"}


def tf_same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow ``same`` padding of one spatial axis as ``(before, after)`` (the extra pixel goes after).

    Output ``ceil(size / stride)``; total padding ``max((out - 1)·stride + kernel - size, 0)``.
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _justus_conv_config(row: Mapping[str, str], name: str, line: int) -> tuple[int, dict[str, Any]]:
    batch = _int(row, "batch_size", name, line)
    size = _int(row, "input_size", name, line)
    kernel = _int(row, "kernel_size", name, line)
    stride = _int(row, "stride", name, line)
    c_in = _int(row, "in_channels", name, line)
    c_out = _int(row, "out_channels", name, line)
    padding = _choice(row, "padding", {"same": "same", "valid": "valid"}, name, line)
    use_bias = _choice(row, "use_bias", {"True": True, "False": False}, name, line)
    if padding == "valid":
        if kernel > size:
            raise ImportFormatError(f"{name}: line {line}: valid conv with kernel {kernel} > input {size}")
        pads, sym, out = (0, 0), 0, -(-(size - kernel + 1) // stride)
    else:
        pads, out = tf_same_padding(size, kernel, stride), -(-size // stride)
        # symmetric padding of the JSON vocabulary: exact when the total is even; else the one whose
        # output size matches TensorFlow's when stride > 1 (ceil), the smaller one when stride == 1
        total = pads[0] + pads[1]
        sym = total // 2 if total % 2 == 0 or stride == 1 else total // 2 + 1
    layer = {"op": "conv2d", "out_channels": c_out, "kernel_size": kernel, "stride": stride, "padding": sym,
             "bias": use_bias}
    config = {
        "input_shape": [c_in, size, size],
        "layer": layer,
        "activation": row["activation"],
        "data_layout": "NHWC",
        "tf_padding": padding,
        "tf_pads": list(pads),
        "output_hw": [out, out],
    }
    return batch, config


def _justus_dense_config(row: Mapping[str, str], name: str, line: int) -> tuple[int, dict[str, Any]]:
    batch = _int(row, "batch_size", name, line)
    f_in = _int(row, "in_features", name, line)
    f_out = _int(row, "out_features", name, line)
    layer = {"op": "linear", "out_features": f_out, "bias": True}
    return batch, {"input_shape": [f_in], "layer": layer, "activation": row["activation"]}


def _date_in_name(text: str) -> datetime | None:
    """The ``YYYYMMDD`` date in an upstream file name (``benchmark_dense__20181119.pkl``), UTC midnight."""
    match = _DATE_IN_NAME.search(text.rsplit("/", 1)[-1])
    if match is None:
        return None
    try:
        return datetime(int(match[1]), int(match[2]), int(match[3]), tzinfo=UTC)
    except ValueError:
        return None


def iter_justus(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of one Justus et al. 2018 file ``conv_<GPU>.csv.gz`` or ``dense_<GPU>.csv.gz``.

    One record per row: ``op_kind`` ``conv`` (config ``conv2d``, NHWC input, TensorFlow padding kept in
    ``tf_padding``/``tf_pads``; ``layer.padding`` is the closest symmetric padding, ``output_hw`` the true
    output size) or ``gemm`` (config ``linear`` with bias); ``activation`` is fused after the layer.
    ``pass_`` ``forward`` (``optimizer`` ``none``) or ``train_step``; ``precision`` from
    ``precision_bits``; ``time_ms_median``/``time_ms_std`` per iteration in ms over
    :data:`JUSTUS_REPETITIONS` repetitions; ``measured_at`` is the date in the upstream pickle's name.
    The ``gpu`` column maps to a catalog id through :data:`JUSTUS_GPU_IDS`. ``software_stack``
    ``tf1-session``, ``granularity`` ``layer``. ``limit`` reads only the first ``limit`` rows.

    Skips (counted on the stream): unknown GPU, GPU absent from the catalog, missing or non-positive
    median time, unknown precision. Raises ``FileNotFoundError`` (no file) and, while iterating,
    :class:`ImportFormatError` (wrong file name, missing columns, malformed row).
    """
    p = Path(path)
    family = p.name.split("_", 1)[0]
    if family not in _JUSTUS_COLUMNS:
        raise ImportFormatError(f"{p.name}: a Justus file name starts with 'conv_' or 'dense_'")

    def parse(stream: RecordStream) -> Iterator[MeasurementRecord]:
        catalog = set(load_catalog())
        name = stream.source_file
        for index, line, row in _rows(stream, _JUSTUS_COLUMNS[family], limit):
            if family == "conv":
                batch, config = _justus_conv_config(row, name, line)
            else:
                batch, config = _justus_dense_config(row, name, line)
            pass_ = _choice(row, "pass", {"forward": "forward", "train_step": "train_step"}, name, line)
            optimizer = row["optimizer"].strip() or "none"
            if (optimizer == "none") != (pass_ == "forward"):
                raise ImportFormatError(f"{name}: line {line}: pass {pass_!r} contradicts optimizer {optimizer!r}")
            gpu = row["gpu"].strip()
            hardware_id = stream.in_catalog(gpu, JUSTUS_GPU_IDS.get(gpu), catalog)
            if hardware_id is None:
                continue
            precision = _JUSTUS_PRECISION.get(row["precision_bits"].strip())
            if precision is None:
                stream.skip(gpu, SKIP_UNKNOWN_PRECISION)
                continue
            time = _time(row, "time_ms_median", name, line)
            if isinstance(time, str):
                stream.skip(gpu, time)
                continue
            upstream_file = row["source_file"]
            context = {
                "source_file": name,
                "source_row": index,
                "upstream": JUSTUS_UPSTREAM,
                "upstream_file": upstream_file,
                "framework": JUSTUS_FRAMEWORK,
                "framework_version": JUSTUS_FRAMEWORK_VERSION,
                "timing": "wall time per session iteration, median of 5 repetitions of 50 iterations",
                "precision": f"precision_bits={row['precision_bits'].strip()}",
                "device_name": gpu,
                "time_ms_min": _optional_float(row, "time_ms_min"),
                "time_ms_max": _optional_float(row, "time_ms_max"),
                "iterations_per_repetition": JUSTUS_ITERATIONS_PER_REPETITION,
            }
            yield MeasurementRecord(
                hardware_id=hardware_id,
                source=SOURCE_JUSTUS,
                op_kind="conv" if family == "conv" else "gemm",
                pass_=pass_,
                optimizer=optimizer,
                precision=precision,
                software_stack=SoftwareStack.TF1_SESSION,
                granularity=Granularity.LAYER,
                batch_size=batch,
                config=config,
                time_ms_median=time,
                time_ms_std=_optional_float(row, "time_ms_std"),
                repetitions=JUSTUS_REPETITIONS,
                context=context,
                measured_at=_date_in_name(upstream_file),
            )

    return _stream(SOURCE_JUSTUS, p, parse)


# ---------------------------------------------------------------------------------------- DeepBench

_DEEPBENCH_COMMON = ("platform", "gpu_model", "mode", "file", "sheet", "precision")


def deepbench_precision(label: str, *, family: str) -> tuple[str, str | None] | None:
    """Project precision of a DeepBench ``precision`` label, with a note when the label needs one.

    ``Float`` → ``fp32``; the P100 "pseudo-fp16" label (16-bit inputs, 32-bit math) → ``fp16``, its records'
    ``config`` then carrying ``"math_precision": "fp32"`` (the arithmetic they ran); the int8
    labels → ``int8`` — except RNN rows on the server-inference sheet, which DeepBench's README says run
    in fp32 (cuDNN had no int8 RNN) although the sheet's label says int8. ``None`` for an unknown label.
    """
    label = label.strip()
    if label == "Float":
        return "fp32", None
    if label == _FP16_PSEUDO:
        return "fp16", "fp16 inputs/outputs, fp32 math (NVIDIA pseudo-fp16)"
    if label == _INT8_SERVER:
        if family == "rnn":
            return "fp32", "RNN kernels of the inference sheet run in fp32 (DeepBench README)"
        return "int8", "int8 multiply, 32-bit accumulate; inputs padded to multiples of 4 where 'padded'"
    if label == _INT8_DEVICE:
        return "int8", "int8 inputs, 32-bit math"
    return None


def _deepbench_parse(
    stream: RecordStream,
    *,
    family: str,
    columns: tuple[str, ...],
    limit: int | None,
    build: Callable[[Mapping[str, str], str, int], tuple[str, int, dict[str, Any], dict[str, Any]]],
    passes: Callable[[Mapping[str, str]], list[tuple[str, str]]],
) -> Iterator[MeasurementRecord]:
    """Shared loop of the DeepBench files.

    ``build(row, name, line)`` gives ``(op_kind, batch_size, config, extra context)``;
    ``passes(row)`` the ``(time column, pass)`` pairs expected for the row. Each expected pass is one
    measurement: a record, or a skip counted against the row's ``platform``.
    """
    catalog = set(load_catalog())
    name = stream.source_file
    for index, line, row in _rows(stream, (*_DEEPBENCH_COMMON, *columns), limit):
        op_kind, batch, config, extra = build(row, name, line)
        if row["precision"].strip() == _FP16_PSEUDO:
            # stored as fp16 (2-byte operands) but run with fp32 arithmetic: part of the kernel's configuration,
            # read by the training loader, which has no precision for it (app.training.dataset.SKIP_MATH)
            config = {**config, "math_precision": "fp32"}
        expected = passes(row)
        platform = row["platform"].strip()
        hardware_id = DEEPBENCH_HARDWARE_IDS.get(platform)
        if hardware_id is None or hardware_id not in catalog:
            known = platform in DEEPBENCH_NOT_IN_CATALOG or hardware_id is not None
            stream.skip(platform, SKIP_NOT_IN_CATALOG if known else SKIP_UNKNOWN_DEVICE, len(expected))
            continue
        precision = deepbench_precision(row["precision"], family=family)
        if precision is None:
            stream.skip(platform, SKIP_UNKNOWN_PRECISION, len(expected))
            continue
        context: dict[str, Any] = {
            "source_file": name,
            "source_row": index,
            "upstream": DEEPBENCH_UPSTREAM,
            "upstream_file": row["file"],
            "sheet": row["sheet"],
            "mode": row["mode"],
            "framework": DEEPBENCH_FRAMEWORK,
            "framework_version": DEEPBENCH_FRAMEWORK_VERSION,
            "timing": "DeepBench benchmark harness (vendor-library call, ms)",
            "precision": row["precision"],
            "device_name": row["gpu_model"].strip() or platform,
            "platform": platform,
        }
        if precision[1]:
            context["precision_note"] = precision[1]
        if platform in DEEPBENCH_HARDWARE_NOTES:
            context["hardware_note"] = DEEPBENCH_HARDWARE_NOTES[platform]
        context.update(extra)
        std = _optional_float(row, "std_ms")
        for column, pass_ in expected:
            time = _time(row, column, name, line)
            if isinstance(time, str):
                stream.skip(platform, time)
                continue
            yield MeasurementRecord(
                hardware_id=hardware_id,
                source=SOURCE_DEEPBENCH,
                op_kind=op_kind,
                pass_=pass_,
                optimizer="none",
                precision=precision[0],
                software_stack=SoftwareStack.CUDA_LIBRARY,
                granularity=Granularity.KERNEL,
                batch_size=batch,
                config=config,
                time_ms_median=time,
                time_ms_std=std if std is not None and std > 0 else None,
                repetitions=None,
                context=dict(context),  # one dict per record: callers may annotate them independently
            )


_TRANS = {"N": False, "T": True}


def iter_deepbench_gemm(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of ``deepbench_gemm.csv``: one ``forward`` record per row, ``op_kind`` ``gemm``.

    ``config = {"layer": {"op": "matmul", "m", "n", "k", "a_trans", "b_trans"}}`` for
    C[m×n] = op(A)[m×k]·op(B)[k×n] (DeepBench's M, N, K; transposes ``N``/``T`` → booleans);
    ``batch_size`` 1; ``time_ms_median`` is DeepBench's ``time_ms`` (no spread reported). Int8 inference
    rows keep ``padded`` (dimensions padded to multiples of 4) in the context. The P100's "16 bit inputs,
    32 bit math" rows (here and in every DeepBench file) add ``"math_precision": "fp32"`` to ``config``
    (:func:`deepbench_precision`).

    Skips (counted per DeepBench ``platform``): devices without a catalog entry (Titan X Maxwell and
    Pascal, M40, MI25, Vega FE, Xeon Phi, phones, Raspberry Pi), unknown devices or precision labels,
    missing or non-positive times. Raises ``FileNotFoundError``; :class:`ImportFormatError` while iterating.
    """

    def build(row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any], dict[str, Any]]:
        layer = {
            "op": "matmul",
            "m": _int(row, "M", name, line),
            "n": _int(row, "N", name, line),
            "k": _int(row, "K", name, line),
            "a_trans": _choice(row, "a_trans", _TRANS, name, line),
            "b_trans": _choice(row, "b_trans", _TRANS, name, line),
        }
        return "gemm", 1, {"layer": layer}, _padded(row)

    return _stream(SOURCE_DEEPBENCH, path, lambda s: _deepbench_parse(
        s, family="gemm", columns=("M", "N", "K", "a_trans", "b_trans", "time_ms"), limit=limit, build=build,
        passes=lambda _row: [("time_ms", "forward")],
    ))


def _padded(row: Mapping[str, str]) -> dict[str, Any]:
    raw = row.get("padded", "").strip()
    return {} if raw == "" else {"padded": raw not in ("0", "0.0", "False", "false")}


_CONV_PASSES = (("fwd_ms", "forward"), ("bwd_data_ms", "backward_input"), ("bwd_filter_ms", "backward_weight"))


def _conv_passes(row: Mapping[str, str]) -> list[tuple[str, str]]:
    """Training rows expect all three passes; inference rows the forward and any other time given."""
    if row["mode"].strip() == "train":
        return list(_CONV_PASSES)
    return [(col, p) for col, p in _CONV_PASSES if col == "fwd_ms" or row.get(col, "").strip()]


def iter_deepbench_conv(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of ``deepbench_conv.csv``: up to three records per row, ``op_kind`` ``conv``.

    Passes: ``fwd_ms`` → ``forward``, ``bwd_data_ms`` → ``backward_input`` (gradient w.r.t. the input),
    ``bwd_filter_ms`` → ``backward_weight`` (w.r.t. the filter); training rows expect all three (a missing
    one, e.g. ``N/A*``, is a counted ``missing_time`` skip), inference rows only the forward.
    ``config = {"input_shape": [C, H, W], "layer": {"op": "conv2d", "out_channels": K, "kernel_size":
    [R, S], "stride": [stride_h, stride_w], "padding": [pad_h, pad_w], "bias": false}, "data_layout":
    "NCHW"}`` (DeepBench: W, H input width/height, C channels, N batch, K filters, S×R filter w×h);
    ``batch_size`` N. ``fwd_algo`` and ``padded`` go to the context when given.

    Skips and errors as :func:`iter_deepbench_gemm`.
    """

    def build(row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any], dict[str, Any]]:
        layer = {
            "op": "conv2d",
            "out_channels": _int(row, "K", name, line),
            "kernel_size": [_int(row, "R_filter_h", name, line), _int(row, "S_filter_w", name, line)],
            "stride": [_int(row, "stride_h", name, line), _int(row, "stride_w", name, line)],
            "padding": [_int(row, "pad_h", name, line, minimum=0), _int(row, "pad_w", name, line, minimum=0)],
            "bias": False,
        }
        shape = [_int(row, "C", name, line), _int(row, "H", name, line), _int(row, "W", name, line)]
        extra = _padded(row)
        if row.get("fwd_algo", "").strip():
            extra["fwd_algo"] = row["fwd_algo"].strip()
        config = {"input_shape": shape, "layer": layer, "data_layout": "NCHW"}
        return "conv", _int(row, "N", name, line), config, extra

    columns = ("W", "H", "C", "N", "K", "S_filter_w", "R_filter_h", "pad_w", "pad_h", "stride_w", "stride_h",
               "fwd_ms", "bwd_data_ms", "bwd_filter_ms")
    return _stream(SOURCE_DEEPBENCH, path, lambda s: _deepbench_parse(
        s, family="conv", columns=columns, limit=limit, build=build, passes=_conv_passes,
    ))


_RNN_CELLS = {"lstm": "lstm", "gru": "gru", "vanilla": "rnn"}
_RNN_PASSES = (("fwd_ms", "forward"), ("bwd_ms", "backward"), ("bwd_data_ms", "backward_input"),
               ("bwd_weight_ms", "backward_weight"))


def _rnn_passes(row: Mapping[str, str]) -> list[tuple[str, str]]:
    """The forward, and each backward time the row's sheet reports (sheets differ in which they give)."""
    return [(col, p) for col, p in _RNN_PASSES if col == "fwd_ms" or row.get(col, "").strip()]


def iter_deepbench_rnn(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of ``deepbench_rnn.csv``: one record per reported time, ``op_kind`` ``recurrent``.

    Passes: ``fwd_ms`` → ``forward``; ``bwd_ms`` → ``backward`` (DeepBench's backward computes the
    weight updates); ``bwd_data_ms``/``bwd_weight_ms`` → ``backward_input``/``backward_weight`` where a
    sheet splits them (``total_ms`` is their sum and is not stored). ``config = {"input_shape":
    [timesteps, hidden], "layer": {"op": "lstm"|"gru"|"rnn", "hidden_size": hidden}, "timesteps": T,
    "input_projection_timed": false}``: one layer, input size = hidden; DeepBench excludes the input
    projection W·x_t from the time; vanilla RNNs use ReLU (``"nonlinearity": "relu"``). ``batch_size`` N.
    The application (``source`` column) goes to the context when given.

    Skips and errors as :func:`iter_deepbench_gemm`.
    """

    def build(row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any], dict[str, Any]]:
        cell = _choice(row, "cell", _RNN_CELLS, name, line)
        hidden = _int(row, "hidden", name, line)
        steps = _int(row, "timesteps", name, line)
        layer: dict[str, Any] = {"op": cell, "hidden_size": hidden}
        if cell == "rnn":
            layer["nonlinearity"] = "relu"
        config = {"input_shape": [steps, hidden], "layer": layer, "timesteps": steps, "input_projection_timed": False}
        extra = {"application": row["source"].strip()} if row.get("source", "").strip() else {}
        return "recurrent", _int(row, "N", name, line), config, extra

    columns = ("hidden", "N", "timesteps", "cell", "fwd_ms")
    return _stream(SOURCE_DEEPBENCH, path, lambda s: _deepbench_parse(
        s, family="rnn", columns=columns, limit=limit, build=build, passes=_rnn_passes,
    ))


def iter_deepbench_allreduce(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of ``deepbench_allreduce.csv``: one ``forward`` record per row, ``op_kind`` ``allreduce``.

    ``config = {"layer": {"op": "allreduce", "size_floats": n, "size_bytes": 4·n, "n_ranks": r | null,
    "n_nodes": m | null}, "algorithm": ...}`` (fp32 payload; ``n_ranks`` GPUs in one node or ``n_nodes``
    nodes); ``batch_size`` 1; ``time_ms_std`` from ``std_ms`` when positive (0 means not reported).
    ``hardware_id`` is the GPU of the multi-GPU system (topology in the DeepBench README, not per row).

    Skips and errors as :func:`iter_deepbench_gemm`.
    """

    def build(row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any], dict[str, Any]]:
        n = _int(row, "size_floats", name, line)
        layer = {
            "op": "allreduce",
            "size_floats": n,
            "size_bytes": 4 * n,
            "n_ranks": _optional_int(row, "n_ranks", name, line),
            "n_nodes": _optional_int(row, "n_nodes", name, line),
        }
        return "allreduce", 1, {"layer": layer, "algorithm": row["algorithm"].strip()}, {}

    columns = ("size_floats", "n_ranks", "n_nodes", "time_ms", "std_ms", "algorithm")
    return _stream(SOURCE_DEEPBENCH, path, lambda s: _deepbench_parse(
        s, family="allreduce", columns=columns, limit=limit, build=build,
        passes=lambda _row: [("time_ms", "forward")],
    ))


#: DeepBench file name → parser, in import order.
DEEPBENCH_FILES: dict[str, Callable[..., RecordStream]] = {
    "deepbench_gemm.csv": iter_deepbench_gemm,
    "deepbench_conv.csv": iter_deepbench_conv,
    "deepbench_rnn.csv": iter_deepbench_rnn,
    "deepbench_allreduce.csv": iter_deepbench_allreduce,
}


def justus_files(data_dir: str | Path) -> list[Path]:
    """The Justus CSVs of ``data_dir`` (``conv_*.csv.gz`` then ``dense_*.csv.gz``, each sorted).

    Raises ``FileNotFoundError`` when there are none.
    """
    d = Path(data_dir)
    paths = sorted(d.glob("conv_*.csv.gz")) + sorted(d.glob("dense_*.csv.gz"))
    if not paths:
        raise FileNotFoundError(f"no Justus CSVs (conv_*.csv.gz, dense_*.csv.gz) under {d}")
    return paths
