"""``layercast worker``: run :func:`app.training.retrain.run_retrain` when asked
(``POST /v1/predictors/retrain`` records a ``requested`` run), when ``min_new_measurements`` arrived past
the production version's watermark, or every ``interval_s``; one run at a time across every process.

The one-run guarantee (:func:`retrain_lock`): on PostgreSQL a session-level ``pg_try_advisory_lock`` held on
a dedicated connection for the whole run (released by the server if the worker dies); on SQLite a row of
``lease_locks`` taken only when absent or expired, with a lease of ``lease_s`` (a crashed worker's lease
runs out). A worker that does not get the lock skips the tick. Crash-safe because a run only changes the
production row in its last transaction (:mod:`app.training.retrain`).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from app.db import make_engine, make_sessionmaker, utcnow
from app.measurements.models import Measurement
from app.predictors import service
from app.predictors.models import LeaseLock, RetrainRun
from app.training.retrain import RetrainConfig, build_parser, config_from_args, run_retrain

logger = logging.getLogger("layercast.worker")

LOCK_NAME = "retrain"
#: Key of the PostgreSQL advisory lock (any fixed 64-bit integer; "lcretrain" in ASCII, truncated).
ADVISORY_KEY = 0x6C6372657472


@contextmanager
def retrain_lock(engine: Engine, *, lease_s: float = 6 * 3600) -> Iterator[bool]:
    """Yield True while this process holds the retrain lock, False when another process does (see module
    docstring). The lock is released on exit."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": ADVISORY_KEY}).scalar())
            conn.commit()
            try:
                yield got
            finally:
                if got:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": ADVISORY_KEY})
                    conn.commit()
        return
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    factory = make_sessionmaker(engine)
    now = utcnow()
    got = False
    try:
        with factory.begin() as session:
            session.execute(delete(LeaseLock).where(LeaseLock.name == LOCK_NAME, LeaseLock.expires_at < now))
            session.add(LeaseLock(name=LOCK_NAME, holder=holder, expires_at=now + timedelta(seconds=lease_s)))
        got = True
    except IntegrityError:
        got = False
    try:
        yield got
    finally:
        if got:
            with factory.begin() as session:
                session.execute(delete(LeaseLock).where(LeaseLock.name == LOCK_NAME, LeaseLock.holder == holder))


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """When to run: a ``requested`` run always; else ``min_new_measurements`` stored past production's
    watermark; else ``interval_s`` since the last finished run (None: never on a schedule)."""

    min_new_measurements: int = 1000
    interval_s: float | None = 24 * 3600
    poll_s: float = 30.0


def _due(engine: Engine, wcfg: WorkerConfig) -> tuple[str | None, int | None]:
    """``(trigger, requested run id)`` of the run that is due now, ``(None, None)`` when none is."""
    with make_sessionmaker(engine)() as session:
        requested = session.scalars(select(RetrainRun.id).where(RetrainRun.status == "requested")
                                    .order_by(RetrainRun.id).limit(1)).first()  # fmt: skip
        if requested is not None:
            return "api", int(requested)
        prod = service.production(session)
        mark = None if prod is None else prod.watermark_measurement_id
        new = session.scalar(select(func.count(Measurement.id)).where(Measurement.id > (mark or 0)))
        if prod is not None and mark is not None and int(new or 0) >= wcfg.min_new_measurements:
            return "new_measurements", None
        if wcfg.interval_s is not None:
            last = session.scalar(select(func.max(RetrainRun.finished_at)))  # UTCDateTime: aware
            if last is None or (utcnow() - last).total_seconds() >= wcfg.interval_s:
                return "schedule", None
    return None, None


def run_once(*, database_url: str, store_dir: Path, cfg: RetrainConfig, wcfg: WorkerConfig,
             retrain: Callable[..., dict[str, Any]] = run_retrain) -> dict[str, Any] | None:  # fmt: skip
    """One worker tick: take the lock, run what is due; returns the run (None: not due or locked).
    A failed run is recorded by the retrain and logged here; the worker goes on."""
    engine = make_engine(database_url)
    try:
        with retrain_lock(engine) as got:
            if not got:
                logger.info("another worker holds the retrain lock")
                return None
            trigger, run_id = _due(engine, wcfg)
            if trigger is None:
                return None
            try:
                return retrain(database_url=database_url, store_dir=store_dir, cfg=cfg, trigger=trigger,
                               run_id=run_id)  # fmt: skip
            except Exception:
                logger.exception("retrain run failed (production unchanged)")
                if run_id is not None:  # never pick a broken request up again and again
                    with make_sessionmaker(engine).begin() as session:
                        session.execute(update(RetrainRun).where(RetrainRun.id == run_id,
                                                                 RetrainRun.status == "requested")
                                        .values(status="failed", finished_at=utcnow()))  # fmt: skip
                return {"status": "failed", "trigger": trigger}
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """``layercast worker [--once] [--min-new N] [--interval-s S] [--poll-s S] <retrain options>``."""
    from app.config import Settings

    parser = build_parser()
    parser.prog = "layercast worker"
    parser.add_argument("--once", action="store_true", help="one tick, then exit")
    d = WorkerConfig()
    parser.add_argument("--min-new", type=int, default=d.min_new_measurements)
    parser.add_argument("--interval-s", type=float, default=d.interval_s)
    parser.add_argument("--poll-s", type=float, default=d.poll_s)
    a: argparse.Namespace = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    settings = Settings()
    wcfg = WorkerConfig(min_new_measurements=a.min_new, interval_s=a.interval_s, poll_s=a.poll_s)
    while True:
        run_once(database_url=a.database_url or settings.database_url, store_dir=a.store or settings.artifact_store_dir,
                 cfg=config_from_args(a), wcfg=wcfg)  # fmt: skip
        if a.once:
            return 0
        time.sleep(a.poll_s)
