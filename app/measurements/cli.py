"""``layercast import {justus,deepbench,neusight,vidur}``: load public measured data sets into the database.

Usage (``argv`` is what follows ``import``)::

    layercast import justus    [--data-dir ../shared/data/justus2018] [--database-url URL] [--limit N]
    layercast import deepbench [--data-dir ../shared/data/deepbench]  [--database-url URL] [--limit N]
                               [--kinds gemm conv rnn allreduce]
    layercast import neusight  [--data-dir ../shared/data/neusight]   [--database-url URL] [--limit N]
                               [--families bmm linear conv elementwise ln softmax]
    layercast import vidur     [--data-dir ../shared/data/vidur]      [--database-url URL] [--limit N]
    layercast import profiler  [--data-dir data/seed] [--hardware-id ID | --hardware-spec FILE]
                               [--database-url URL] [--limit N]

Profiler rows are stored against the machine that *measured* them (:func:`resolve_profiler_hardware`):
``--hardware-spec FILE`` or the folder's ``hardware.json`` (the measuring machine's spec, written by the
profiler; registered as a device of its own, e.g. ``cpu-amd-epyc-2c-avx512`` for the seed data set),
``--hardware-id ID`` (a catalog or stored device; ``local`` only if this machine measured them), else
``local`` when this machine's CPU is the rows' (model, logical CPUs, SIMD level). Anything else is refused:
featurising another machine's rows with this machine's bandwidth and peak silently corrupts training.

Steps: migrate the database (``app.migrate.upgrade``), seed the built-in hardware catalog
(:func:`app.hardware.service.seed_builtin`; ``local``, this machine's CPU, only for profiler rows
measured on it), register the measuring machine (:func:`app.hardware.service.register_measured`),
import file by file
(:func:`app.measurements.service.import_records`: re-importing replaces a file's rows; each row is checked
by the rule set of ``POST /v1/measurements``, :func:`app.measurements.validation.field_problems`, and one it
refuses is not stored but counted), commit once at the end (any error rolls the whole run back), print the
report (read, imported, skipped and refused rows, why, and the first refused row of each reason). Exit code
0 on success (refused rows included), 1 when a file is missing or malformed or a device is not stored.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from app.config import REPO_ROOT, Settings
from app.core.hardware import HardwareSpec
from app.errors import LayercastError
from app.hardware import local as local_cpu
from app.hardware.local import LOCAL_ID
from app.measurements import importers
from app.measurements.neusight import NEUSIGHT_FAMILIES, iter_neusight, neusight_files
from app.measurements.profiler_rows import (
    HARDWARE_FILE,
    MachineContext,
    machine_of,
    mismatches,
    profiler_files,
    read_machine_spec,
    spec_mismatches,
)
from app.measurements.schemas import ImportReport
from app.measurements.vidur import vidur_files

DEFAULT_DATA_ROOT = REPO_ROOT.parent / "shared" / "data"
DEFAULT_DIRS = {"justus": DEFAULT_DATA_ROOT / "justus2018", "deepbench": DEFAULT_DATA_ROOT / "deepbench",
                "neusight": DEFAULT_DATA_ROOT / "neusight", "vidur": DEFAULT_DATA_ROOT / "vidur",
                "profiler": REPO_ROOT / "data" / "seed"}
DEEPBENCH_KINDS = {"gemm": "deepbench_gemm.csv", "conv": "deepbench_conv.csv", "rnn": "deepbench_rnn.csv",
                   "allreduce": "deepbench_allreduce.csv"}


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``layercast import``."""
    parser = argparse.ArgumentParser(prog="layercast import", description=(__doc__ or "").split("\n", 1)[0])
    sub = parser.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    for name, help_ in (("justus", "Justus et al. 2018 per-layer timings (conv_*/dense_*.csv.gz)"),
                        ("deepbench", "Baidu DeepBench kernel timings (deepbench_*.csv)"),
                        ("neusight", "NeuSight fp32 kernel timings (train_<family>_<gpu>.csv.gz)"),
                        ("vidur", "Vidur fp16 LLM per-op and NCCL collective timings (compute_mlp_*, network_*)"),
                        ("profiler", "the profiler's layer and whole-iteration shards (layers_*, e2e_*.jsonl.gz)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--data-dir", type=Path, default=DEFAULT_DIRS[name],
                       help=f"folder of the files (default {DEFAULT_DIRS[name]})")
        p.add_argument("--database-url", default=None, help="SQLAlchemy URL (default $LAYERCAST_DATABASE_URL)")
        p.add_argument("--limit", type=int, default=None, help="read only the first N rows of each file")
        if name == "deepbench":
            p.add_argument("--kinds", nargs="+", choices=sorted(DEEPBENCH_KINDS), default=list(DEEPBENCH_KINDS),
                           help="which DeepBench files (default all)")
        if name == "neusight":
            p.add_argument("--families", nargs="+", choices=NEUSIGHT_FAMILIES, default=list(NEUSIGHT_FAMILIES),
                           help="which op families (default all)")
        if name == "profiler":
            which = p.add_mutually_exclusive_group()
            which.add_argument("--hardware-id", default=None,
                               help="catalog or stored id of the device that measured the shards ('local' only "
                                    "if this machine did; default: the folder's hardware.json, else local if "
                                    "this CPU matches the rows)")
            which.add_argument("--hardware-spec", type=Path, default=None,
                               help="JSON spec of the measuring machine (hardware.json format), stored under its id")
    return parser


@dataclass(frozen=True)
class ProfilerHardware:
    """Where profiler rows go: ``hardware_id``; ``spec`` to register first (the measuring machine's, from
    a spec file), or None for a catalog/stored id or ``local``; ``machine`` the rows' context (None: no
    ``ok`` row), that a stored id's spec is checked against (:func:`check_stored`)."""

    hardware_id: str
    spec: HardwareSpec | None = None
    machine: MachineContext | None = None


def resolve_profiler_hardware(
    data_dir: Path, files: list[Path], *, hardware_id: str | None, spec_file: Path | None, limit: int | None,
) -> ProfilerHardware:  # fmt: skip
    """The device that measured the profiler shards ``files`` of ``data_dir`` (order of the module
    docstring: ``spec_file``, ``hardware_id``, ``data_dir/hardware.json``, ``local`` if it matches).

    A spec (given or the folder's) and ``local`` are checked against the rows' context
    (:func:`app.measurements.profiler_rows.mismatches`: model name, SIMD width, logical CPUs for
    ``local``); a catalog or stored id is checked once the database is open (:func:`check_stored`).
    Shards whose rows carry no context (hand-made test shards) cannot be checked and go to ``local``.
    Raises ``ValueError`` naming both machines when they differ, for GPU rows without an id, and
    :class:`app.measurements.importers.ImportFormatError` for an unreadable spec file or shards of several
    machines."""
    machine = machine_of(files, limit=limit)
    sidecar = data_dir / HARDWARE_FILE
    if spec_file is None and hardware_id is None and sidecar.is_file():
        spec_file = sidecar
    if spec_file is not None:
        spec = read_machine_spec(spec_file)
        if machine is not None and (why := spec_mismatches(spec, machine)):
            raise ValueError(f"{spec_file} describes {spec.name!r}, not the machine that measured the rows "
                             f"({machine.describe()}): {'; '.join(why)}")
        return ProfilerHardware(spec.id, spec, machine)
    if hardware_id not in (None, LOCAL_ID):
        return ProfilerHardware(hardware_id, None, machine)
    if machine is not None and machine.device != "cpu":
        raise ValueError(f"the rows were measured on {machine.describe()}: give --hardware-id of its catalog entry")
    if machine is not None:
        _check_local(machine)
    return ProfilerHardware(LOCAL_ID, None, machine)


def check_stored(spec: HardwareSpec, target: ProfilerHardware) -> None:
    """Raise ``ValueError`` when the stored device ``spec`` (``--hardware-id``) is not the machine that
    measured ``target``'s rows (kind, model name, SIMD width)."""
    if target.machine is not None and (why := spec_mismatches(spec, target.machine)):
        raise ValueError(f"stored device {spec.id!r} is not the device that measured the rows "
                         f"({target.machine.describe()}): {'; '.join(why)}")


def _check_local(machine: MachineContext) -> None:
    """Raise ``ValueError`` unless this machine's CPU (``local``) is the one that measured the rows."""
    me = local_cpu.local_cpu_identity()
    why = mismatches(machine, kind="cpu", name=me.name, vector_width_bits=me.vector_width_bits,
                     logical_cpus=me.logical_cpus)  # fmt: skip
    if why:
        raise ValueError(
            f"the rows were measured on {machine.describe()}, not on this machine "
            f"({me.name}, {me.logical_cpus} logical CPUs, {me.vector_width_bits}-bit vectors): {'; '.join(why)}. "
            f"Storing them as 'local' would featurise them with this machine's bandwidth and peak. Give "
            f"--hardware-spec FILE (the measuring machine's spec; the profiler writes {HARDWARE_FILE} next to "
            f"its shards) or --hardware-id of a stored device (e.g. {machine.derived_id()!r} once registered)"
        )


def _streams(
    args: argparse.Namespace, target: ProfilerHardware | None = None
) -> list[tuple[Path, Callable[..., importers.RecordStream]]]:
    """``(path, parser)`` pairs to import (profiler rows against ``target``); raises ``FileNotFoundError``
    for a missing folder or file."""
    if args.dataset == "justus":
        return [(p, importers.iter_justus) for p in importers.justus_files(args.data_dir)]
    if args.dataset == "neusight":
        return [(p, iter_neusight) for p in neusight_files(args.data_dir, families=tuple(args.families))]
    if args.dataset == "vidur":
        return vidur_files(args.data_dir)
    if args.dataset == "profiler":
        assert target is not None
        return [(p, partial(parse, hardware_id=target.hardware_id)) for p, parse in profiler_files(args.data_dir)]
    pairs: list[tuple[Path, Callable[..., importers.RecordStream]]] = []
    for kind in args.kinds:
        name = DEEPBENCH_KINDS[kind]
        path = Path(args.data_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"no such data file: {path}")
        pairs.append((path, importers.DEEPBENCH_FILES[name]))
    return pairs


def run_import(args: argparse.Namespace) -> ImportReport:
    """Migrate, seed, import every file of ``args`` in one transaction, and return the merged report."""
    from app.db import make_engine, make_sessionmaker, session_scope
    from app.hardware.service import get_spec, register_measured, seed_builtin
    from app.measurements.service import import_records
    from app.migrate import upgrade
    from app.progress import bar

    url = args.database_url or Settings().database_url
    target: ProfilerHardware | None = None
    if args.dataset == "profiler":
        files = [p for p, _ in profiler_files(args.data_dir)]
        target = resolve_profiler_hardware(Path(args.data_dir), files, hardware_id=args.hardware_id,
                                           spec_file=args.hardware_spec, limit=args.limit)  # fmt: skip
    pairs = _streams(args, target)
    upgrade(url)
    engine = make_engine(url)
    try:
        with contextmanager(session_scope)(make_sessionmaker(engine)) as session:
            seed_builtin(session, include_local=target is not None and target.hardware_id == LOCAL_ID)
            if target is not None and target.spec is not None:
                register_measured(session, spec=target.spec)
            elif target is not None and target.hardware_id != LOCAL_ID:
                check_stored(get_spec(session, hardware_id=target.hardware_id), target)
            report = ImportReport()
            # progress by bytes of the source files (compressed size), so the ETA weighs big files
            progress = bar(desc=f"import {args.dataset}", total=sum(p.stat().st_size for p, _ in pairs), unit="B")
            for path, parse in pairs:
                stream = parse(path, limit=args.limit)
                report = report.merge(import_records(session, records=stream))
                progress.update(path.stat().st_size)
            progress.close()
        return report
    finally:
        engine.dispose()


def format_report(report: ImportReport, *, dataset: str, wall_s: float) -> str:
    """Human-readable summary: totals, imported per hardware id, skipped per device and reason, refused per
    reason with the first refused row of each."""
    lines = [
        f"imported {dataset}: {len(report.source_files)} files, {report.rows_read} rows read, "
        f"{report.imported} measurements imported ({report.replaced} replaced from earlier imports), "
        f"{report.skipped} skipped, {report.refused} refused, {wall_s:.1f} s",
        "imported per hardware:",
        *(f"  {hw:<16} {n}" for hw, n in report.imported_by_hardware.items()),
    ]
    if report.skipped:
        lines.append("skipped per reason: " + ", ".join(f"{r} {n}" for r, n in report.skipped_by_reason.items()))
        lines.append("skipped per device:")
        for device, reasons in report.skipped_by_device.items():
            lines.append(f"  {device:<16} " + ", ".join(f"{r} {n}" for r, n in reasons.items()))
    if report.refused:
        lines.append("refused per reason: " + ", ".join(f"{r} {n}" for r, n in report.refused_by_reason.items()))
        lines.append("first refused row per reason:")
        lines.extend(f"  {r}: {example}" for r, example in report.refused_examples.items())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``layercast import``; returns the exit code (0 ok, 1 import failed, 2 usage)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.limit is not None and args.limit < 1:
        print("layercast import: --limit must be positive", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        report = run_import(args)
    except (FileNotFoundError, importers.ImportFormatError, LayercastError, ValueError) as exc:
        print(f"layercast import {args.dataset}: failed, nothing imported: {exc}", file=sys.stderr)
        return 1
    print(format_report(report, dataset=args.dataset, wall_s=time.perf_counter() - start))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
