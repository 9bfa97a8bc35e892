"""``layercast import {justus,deepbench,neusight,vidur}``: load public measured data sets into the database.

Usage (``argv`` is what follows ``import``)::

    layercast import justus    [--data-dir ../shared/data/justus2018] [--database-url URL] [--limit N]
    layercast import deepbench [--data-dir ../shared/data/deepbench]  [--database-url URL] [--limit N]
                               [--kinds gemm conv rnn allreduce]
    layercast import neusight  [--data-dir ../shared/data/neusight]   [--database-url URL] [--limit N]
                               [--families bmm linear conv elementwise ln softmax]
    layercast import vidur     [--data-dir ../shared/data/vidur]      [--database-url URL] [--limit N]
    layercast import profiler  [--data-dir data/seed] [--hardware-id local] [--database-url URL] [--limit N]

Steps: migrate the database (``app.migrate.upgrade``), seed the built-in hardware catalog
(:func:`app.hardware.service.seed_builtin`; ``local``, this machine's CPU, only for profiler rows
measured on it), import file by file
(:func:`app.measurements.service.import_records`: re-importing replaces a file's rows), commit once at
the end (any error rolls the whole run back), print the report. Exit code 0 on success, 1 when a file is
missing or malformed or a device is not stored.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from app.config import REPO_ROOT, Settings
from app.errors import LayercastError
from app.measurements import importers
from app.measurements.neusight import NEUSIGHT_FAMILIES, iter_neusight, neusight_files
from app.measurements.profiler_rows import profiler_files
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
            p.add_argument("--hardware-id", default="local",
                           help="catalog id of the device the shards were measured on (default local: this CPU)")
    return parser


def _streams(args: argparse.Namespace) -> list[tuple[Path, Callable[..., importers.RecordStream]]]:
    """``(path, parser)`` pairs to import; raises ``FileNotFoundError`` for a missing folder or file."""
    if args.dataset == "justus":
        return [(p, importers.iter_justus) for p in importers.justus_files(args.data_dir)]
    if args.dataset == "neusight":
        return [(p, iter_neusight) for p in neusight_files(args.data_dir, families=tuple(args.families))]
    if args.dataset == "vidur":
        return vidur_files(args.data_dir)
    if args.dataset == "profiler":
        return [(p, partial(parse, hardware_id=args.hardware_id)) for p, parse in profiler_files(args.data_dir)]
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
    from app.hardware.service import seed_builtin
    from app.measurements.service import import_records
    from app.migrate import upgrade
    from app.progress import bar

    url = args.database_url or Settings().database_url
    pairs = _streams(args)
    upgrade(url)
    engine = make_engine(url)
    try:
        with contextmanager(session_scope)(make_sessionmaker(engine)) as session:
            seed_builtin(session, include_local=getattr(args, "hardware_id", None) == "local")
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
    """Human-readable summary: totals, imported per hardware id, skipped per device and reason."""
    lines = [
        f"imported {dataset}: {len(report.source_files)} files, {report.rows_read} rows read, "
        f"{report.imported} measurements imported ({report.replaced} replaced from earlier imports), "
        f"{report.skipped} skipped, {wall_s:.1f} s",
        "imported per hardware:",
        *(f"  {hw:<16} {n}" for hw, n in report.imported_by_hardware.items()),
    ]
    if report.skipped:
        lines.append("skipped per reason: " + ", ".join(f"{r} {n}" for r, n in report.skipped_by_reason.items()))
        lines.append("skipped per device:")
        for device, reasons in report.skipped_by_device.items():
            lines.append(f"  {device:<16} " + ", ".join(f"{r} {n}" for r, n in reasons.items()))
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
