"""``layercast`` command line (stdlib argparse).

Subcommands::

    layercast serve [--host 127.0.0.1] [--port 8000] [--workers N] [--reload]   migrate, then run the API
    layercast migrate [--revision head]                            apply migrations
    layercast downgrade REVISION                                   revert migrations ("base" drops all)
    layercast train|evaluate|finetune|profile ...                  predictor work (needs the train extra)
    layercast retrain|worker ...                                   gated retraining (app.training.retrain/worker)
    layercast import justus|deepbench                              import public measurements
    layercast hardware list                                        print the built-in hardware catalog
    layercast keys create NAME --scope S [--scope S]               make an API key (shown once; app.auth)
    layercast keys list | keys revoke KEY_ID                       list keys (no secrets) / revoke one
    layercast predict|compare|gate MODEL.onnx --hardware ID ...    cost predictions for CI (app.estimates.cli)
    layercast version                                              print the version

Only the delegated training/profiling commands may import torch, and only when they run. Settings come
from the environment
(``LAYERCAST_*``, see :class:`app.config.Settings`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from app.config import Settings


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layercast", description="Predict the cost of deep neural networks on hardware."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="apply migrations and run the REST API")
    serve.add_argument("--host", default=None, help="bind address (default $LAYERCAST_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default $LAYERCAST_PORT or 8000)")
    serve.add_argument("--reload", action="store_true", help="restart on code changes (development)")
    serve.add_argument("--workers", type=_positive_int, default=1,
                       help="uvicorn worker processes (default 1); each holds its own analysis cache and "
                            "predictor, all share the database")

    migrate = sub.add_parser("migrate", help="apply database migrations")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")

    downgrade = sub.add_parser("downgrade", help="revert database migrations")
    downgrade.add_argument("revision", help='target revision, e.g. "base" to drop every table')

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=f"{help_text}; `layercast {name} --help` for its options", add_help=False)

    hardware = sub.add_parser("hardware", help="hardware catalog")
    hw_sub = hardware.add_subparsers(dest="hardware_command", required=True, metavar="ACTION")
    hw_sub.add_parser("list", help="print the built-in hardware catalog")

    keys = sub.add_parser("keys", help="API keys (app.auth): create, list, revoke")
    keys.add_argument("--database-url", default=None, help="database (default $LAYERCAST_DATABASE_URL)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key and print it (it is shown only once)")
    create.add_argument("name", help="who or what uses the key (e.g. ci-pipeline)")
    create.add_argument("--scope", action="append", required=True, dest="scopes",
                        help="read, graphs, measurements, hardware or admin (repeat for several)")
    keys_sub.add_parser("list", help="list keys: id, name, scopes, created, revoked")
    revoke = keys_sub.add_parser("revoke", help="revoke a key (requests with it answer 401 from then on)")
    revoke.add_argument("key_id", help="the key's public id (second part of lck_<id>_<secret>)")

    sub.add_parser("version", help="print the version")

    from app.estimates.cli import add_parsers

    add_parsers(sub)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    """Migrate once, then run uvicorn (``--workers N`` processes; ``--reload`` allows one only)."""
    import uvicorn

    if args.reload and args.workers > 1:
        print("layercast serve: --reload runs one process; drop --workers", file=sys.stderr)
        return 2

    from app.observability import configure_logging

    configure_logging(settings.log_level, settings.log_format)

    from app.migrate import upgrade_unless_current

    upgrade_unless_current(settings.database_url)
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=args.host or settings.host,
        port=args.port or settings.port,
        reload=args.reload,
        workers=args.workers,
        log_level=settings.log_level,
        log_config=None,  # keep configure_logging's handlers (JSON lines by default)
        access_log=False,  # app.observability.RequestContext writes the access line, with the request id
    )
    return 0


#: Subcommands whose arguments all belong to another module's ``main(argv)`` (imported only when run,
#: so that torch is loaded by the training and profiling commands alone).
DELEGATED: dict[str, tuple[str, str]] = {
    "train": ("app.training.train", "train a predictor from scratch (needs the train extra)"),
    "evaluate": ("app.training.evaluate", "evaluate the shipped predictor against baselines; writes a report"),
    "retrain": ("app.training.retrain", "train a candidate on all measurements, promote it only if not worse"),
    "worker": ("app.training.worker", "run retrains when requested, on new measurements or a schedule"),
    "finetune": ("app.training.finetune", "fine-tune the predictor to a new device from a few measurements"),
    "profile": ("app.profiler.run", "measure per-layer times on this machine with torch (train extra)"),
    "import": ("app.measurements.cli", "import public measurements (justus, deepbench, neusight, vidur)"),
}


def _delegate(command: str, argv: list[str]) -> int:
    import importlib

    module_name, _ = DELEGATED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            print(f"layercast {command} needs torch: pip install -e '.[train]'", file=sys.stderr)
        else:
            print(f"layercast {command} is unavailable: {exc}", file=sys.stderr)
        return 2
    return int(module.main(argv) or 0)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """Plain-text table with left-aligned columns sized to their widest cell."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _hardware_list() -> int:
    from app.hardware.catalog import load_catalog

    catalog = load_catalog()
    specs = list(catalog.values()) if isinstance(catalog, dict) else list(catalog)
    rows = []
    for spec in specs:
        peak = getattr(spec, "peak_flops_per_s", {}) or {}
        fp32 = peak.get("fp32") if hasattr(peak, "get") else None
        bandwidth = getattr(spec, "memory_bandwidth_bytes_per_s", None)
        memory = getattr(spec, "memory_bytes", None)
        rows.append((
            spec.id,
            spec.name,
            getattr(spec, "kind", ""),
            None if fp32 is None else fp32 / 1e12,
            None if bandwidth is None else bandwidth / 1e9,
            None if memory is None else memory / 2**30,
            getattr(spec, "compute_units", None),
        ))
    headers = ("id", "name", "kind", "fp32_tflops", "bandwidth_gb_per_s", "memory_gib", "compute_units")
    print(format_table(rows, headers))
    return 0


def _keys(args: argparse.Namespace, settings: Settings) -> int:
    """``layercast keys create|list|revoke`` on the (migrated) database."""
    from app.auth import ApiKeyNotFound, create_key, list_keys, revoke_key
    from app.db import make_engine, make_sessionmaker
    from app.migrate import upgrade

    url = args.database_url or settings.database_url
    upgrade(url)
    engine = make_engine(url, pool_size=1)
    try:
        with make_sessionmaker(engine).begin() as session:
            if args.keys_command == "create":
                try:
                    row, key = create_key(session, name=args.name, scopes=args.scopes)
                except ValueError as exc:
                    print(f"layercast keys create: {exc}", file=sys.stderr)
                    return 2
                print(key)
                print(f"key id {row.id}, scopes {','.join(row.scopes)}: store it now, it is not shown again "
                      "(send it as 'Authorization: Bearer <key>')", file=sys.stderr)
            elif args.keys_command == "list":
                rows = [(k.id, k.name, ",".join(k.scopes), k.created_at.isoformat(timespec="seconds"),
                         k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else "")
                        for k in list_keys(session)]  # fmt: skip
                print(format_table(rows, ("id", "name", "scopes", "created_at", "revoked_at")))
            else:
                try:
                    revoke_key(session, key_id=args.key_id)
                except ApiKeyNotFound as exc:
                    print(f"layercast keys revoke: {exc.message}", file=sys.stderr)
                    return 2
                print(f"revoked {args.key_id}")
    finally:
        engine.dispose()
    return 0


#: Exit status of a command whose output pipe closed early (``layercast hardware list | head -1``): 128 +
#: SIGPIPE (13), what a shell reports for a command SIGPIPE ended.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``layercast`` console script; returns the process exit code.

    Output into a pipe whose reader is gone (``| head -1``) ends the command quietly with
    :data:`EXIT_BROKEN_PIPE`: stdout is flushed before returning (or exiting), so the BrokenPipeError surfaces
    here rather than at interpreter exit, and is then pointed at ``os.devnull`` so the final flush of what is
    still buffered cannot fail again (the recipe of the Python docs, "Note on SIGPIPE" in the signal module).
    argparse's own ``--help`` swallows the error itself and exits 0, as quietly.
    """
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    """:func:`main` without the closed-pipe handling."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:  # everything after the command belongs to it, --help included
        return _delegate(argv[0], argv[1:])
    args = _build_parser().parse_args(argv)
    settings = Settings()

    if args.command == "serve":
        return _serve(args, settings)
    if args.command == "migrate":
        from app.migrate import upgrade

        upgrade(settings.database_url, args.revision)
        return 0
    if args.command == "downgrade":
        from app.migrate import downgrade

        downgrade(settings.database_url, args.revision)
        return 0
    if args.command == "hardware":
        return _hardware_list()
    if args.command == "keys":
        return _keys(args, settings)
    if args.command in ("predict", "compare", "gate"):
        from app.estimates.cli import run

        return run(args)
    if args.command == "version":
        from app.main import service_version

        print(f"layercast {service_version()}")
        return 0
    raise AssertionError(f"unhandled command {args.command!r}")  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
