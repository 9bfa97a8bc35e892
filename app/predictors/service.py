"""Predictor versions in the database: register, list, promote, roll back, seed, and the hot-swapping
holder a running API serves from.

Lifecycle: a version is registered as ``candidate`` (by :mod:`app.training.retrain`); promoting it makes
it ``production`` and the former production ``retired`` in one transaction (the partial unique index of
``predictor_versions`` rejects a second production row, so two concurrent promotions cannot both win).
Rolling back the production version retires it and restores the version promoted before it. Running
APIs pick the change up through :class:`PredictorHolder` within ``predictor_poll_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.db import utcnow
from app.errors import Conflict, NotFoundError
from app.measurements.models import PredictorVersion
from app.predictor.metadata import ArtifactMetadata, sha256_file, write_atomic
from app.predictor.onnx_model import read_metadata
from app.predictor.registry import CompositePredictor, current_stem, load_from_store
from app.predictors.models import RetrainRun

logger = logging.getLogger("layercast.predictors")

CANDIDATE, PRODUCTION, RETIRED = "candidate", "production", "retired"
STATUSES = (CANDIDATE, PRODUCTION, RETIRED)


class PredictorVersionNotFound(NotFoundError):
    code = "predictor_version_not_found"


class NotProduction(Conflict):
    code = "not_production"


class NoPreviousVersion(Conflict):
    code = "no_previous_version"


# ------------------------------------------------------------------------------------------- queries


def list_versions(session: Session, *, status: str | None = None) -> list[PredictorVersion]:
    """Registered versions, newest first, optionally of one ``status``."""
    stmt = select(PredictorVersion).order_by(PredictorVersion.created_at.desc(), PredictorVersion.version.desc())
    if status is not None:
        stmt = stmt.where(PredictorVersion.status == status)
    return list(session.scalars(stmt))


def get_version(session: Session, version: str) -> PredictorVersion:
    """The row of ``version``; raises :class:`PredictorVersionNotFound` (404)."""
    row = session.get(PredictorVersion, version)
    if row is None:
        raise PredictorVersionNotFound(f"predictor version {version!r} is not registered", detail={"version": version})
    return row


def production(session: Session) -> PredictorVersion | None:
    """The production version, or None when none is registered."""
    return session.scalars(select(PredictorVersion).where(PredictorVersion.status == PRODUCTION)).first()


def metadata_of(row: PredictorVersion) -> ArtifactMetadata:
    """The typed metadata of a row (raises ``pydantic.ValidationError`` on a malformed row)."""
    return ArtifactMetadata.model_validate(row.metadata_)


# ------------------------------------------------------------------------------------------- changes


def register(session: Session, meta: ArtifactMetadata, *, status: str = CANDIDATE) -> PredictorVersion:
    """Add ``meta`` as a new version with ``status`` (flushed, not committed). Raises
    :class:`app.errors.Conflict` (409) when the version is already registered."""
    if session.get(PredictorVersion, meta.version) is not None:
        raise Conflict(f"predictor version {meta.version!r} is already registered", detail={"version": meta.version})
    row = PredictorVersion(
        version=meta.version, artifact_path=meta.onnx_file, sha256=meta.sha256,
        metadata_=meta.model_dump(mode="json"), status=status, schema_version=meta.schema_version,
        watermark_measurement_id=meta.watermark.max_measurement_id,
        promoted_at=utcnow() if status == PRODUCTION else None,
    )  # fmt: skip
    session.add(row)
    session.flush()
    return row


def _make_production(session: Session, row: PredictorVersion, *, stamp: bool) -> None:
    current = production(session)
    if current is not None and current.version != row.version:
        current.status = RETIRED
        session.flush()  # the old row leaves the one-production index before the new one enters it
    row.status = PRODUCTION
    if stamp:
        row.promoted_at = utcnow()
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent promotion won the race
        raise Conflict("another promotion committed first; retry", detail={"version": row.version}) from exc


def promote(session: Session, version: str) -> PredictorVersion:
    """Make ``version`` production, retiring the former one (no-op when it already is). Raises
    :class:`PredictorVersionNotFound` (404) or :class:`app.errors.Conflict` (409, a concurrent promotion)."""
    row = get_version(session, version)
    if row.status != PRODUCTION:
        _make_production(session, row, stamp=True)
        logger.info("promoted predictor %s", version)
    return row


def rollback(session: Session, version: str) -> PredictorVersion:
    """Retire the production ``version`` and restore the version promoted last before it; returns the
    restored row. Raises :class:`PredictorVersionNotFound` (404), :class:`NotProduction` (409) when
    ``version`` is not production and :class:`NoPreviousVersion` (409) when none was promoted before it."""
    row = get_version(session, version)
    if row.status != PRODUCTION:
        raise NotProduction(f"{version!r} is {row.status}, not production", detail={"version": version})
    stmt = select(PredictorVersion).where(
        PredictorVersion.version != version, PredictorVersion.promoted_at.is_not(None))
    if row.promoted_at is not None:
        stmt = stmt.where(PredictorVersion.promoted_at < row.promoted_at)
    previous = session.scalars(stmt.order_by(PredictorVersion.promoted_at.desc())).first()
    if previous is None:
        raise NoPreviousVersion(f"no version was promoted before {version!r}", detail={"version": version})
    # promoted_at of the restored row is kept, so a second rollback goes further back, not forth
    _make_production(session, previous, stamp=False)
    logger.info("rolled back predictor %s to %s", version, previous.version)
    return previous


def request_retrain(session: Session) -> RetrainRun:
    """Record a ``requested`` retrain run for a worker (``layercast worker``) to take (flushed)."""
    run = RetrainRun(status="requested", trigger="api", metrics={}, gate={})
    session.add(run)
    session.flush()
    return run


def seed_from_models_dir(session: Session, models_dir: Path, store_dir: Path) -> PredictorVersion | None:
    """When no version is registered: register the artifact named by ``models_dir/CURRENT`` as production
    (its ONNX file and torch weights copied atomically into ``store_dir`` when that is another directory).
    Returns the new row, or None when versions exist already. Raises ``FileNotFoundError`` without
    ``CURRENT`` or its files."""
    if session.scalars(select(PredictorVersion.version).limit(1)).first() is not None:
        return None
    stem = current_stem(models_dir)
    training = read_metadata(Path(models_dir) / f"{stem}.json")
    names = [training["onnx_file"], *([training["weights_file"]] if training.get("weights_file") else [])]
    for name in names:  # the weights are the base of a fine-tune (app.training.retrain)
        source, target = Path(models_dir) / name, Path(store_dir) / name
        if source.resolve() != target.resolve():
            write_atomic(target, source.read_bytes())
    store = Path(store_dir)
    meta = ArtifactMetadata.from_training(
        training, sha256=sha256_file(store / training["onnx_file"]),
        weights_sha256=sha256_file(store / names[1]) if len(names) > 1 else None)  # fmt: skip
    row = register(session, meta, status=PRODUCTION)
    logger.info("registered the shipped predictor %s as production", meta.version)
    return row


# ------------------------------------------------------------------------------------------- serving


class PredictorUnavailable(RuntimeError):
    """No registered predictor version can be loaded: the API refuses to start (the message names each
    version tried and why it failed)."""


class PredictorHolder:
    """The production predictor of a running API, re-read from the database at most every ``poll_s``.

    :meth:`current` is called once at the start of each request (:func:`app.deps.get_predictor`), so a
    request keeps the one reference it got even if a swap happens meanwhile: versions never mix within a
    request. A new production version is loaded from the store (checksum verified) before it replaces
    the old one; if it cannot be loaded (missing or torn file, database down) the old one keeps serving
    and the failure is logged, retried at the next poll. ``clock`` is injectable for tests.

    At start-up (nothing loaded yet), a production version that cannot be loaded is never skipped
    silently: the versions promoted before it are tried newest first, the first that loads is served,
    and an error is logged; :attr:`problem` says what happened (``/readyz`` reports it, status
    ``degraded``) until the production version loads at a later poll. When none loads,
    :class:`PredictorUnavailable` is raised and the API does not start.
    """

    def __init__(self, factory: sessionmaker[Session], store_dir: Path, *, poll_s: float, threads: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._factory = factory
        self._store = Path(store_dir)
        self._poll_s = poll_s
        self._threads = threads
        self._clock = clock
        self._lock = threading.Lock()
        self._predictor: CompositePredictor | None = None
        self._checked_at = float("-inf")
        #: Why the served version is not the production one (None when it is).
        self.problem: str | None = None

    @property
    def loaded(self) -> CompositePredictor | None:
        """The predictor loaded now (None before the first successful load); does not poll."""
        return self._predictor

    def current(self) -> CompositePredictor:
        """The production predictor, refreshed when the last check is ``poll_s`` old. Raises
        ``FileNotFoundError`` only when nothing was ever loaded and no production version can be."""
        if self._predictor is None or self._clock() - self._checked_at >= self._poll_s:
            with self._lock:
                if self._predictor is None or self._clock() - self._checked_at >= self._poll_s:
                    self.refresh()
        assert self._predictor is not None
        return self._predictor

    def refresh(self) -> None:
        """Compare the production row with the loaded version and swap when they differ (see class doc)."""
        self._checked_at = self._clock()
        meta = None
        try:
            with self._factory() as session:
                row = production(session)
                meta = None if row is None else metadata_of(row)
            if meta is None:
                raise FileNotFoundError("no production predictor version is registered")
            if self._predictor is not None and self._predictor.version == meta.version:
                self.problem = None
                return
            new = load_from_store(self._store, meta, threads=self._threads)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if self._predictor is None:
                self._start_with_fallback(meta, reason)
                return
            self.problem = (f"production version {getattr(meta, 'version', '?')} cannot be loaded ({reason}); "
                            f"still serving {self._predictor.version}")
            logger.exception("predictor refresh failed; still serving %s", self._predictor.version)
            return
        old = None if self._predictor is None else self._predictor.version
        self._predictor = new
        self.problem = None
        logger.info("serving predictor %s (was %s)", new.version, old)

    def _start_with_fallback(self, meta: ArtifactMetadata | None, reason: str) -> None:
        """First load failed for production ``meta``: serve the newest earlier promoted version that loads
        (logged as an error, kept in :attr:`problem`), else raise :class:`PredictorUnavailable`."""
        tried = [f"{getattr(meta, 'version', 'production')}: {reason}"]
        with self._factory() as session:
            stmt = select(PredictorVersion).where(PredictorVersion.promoted_at.is_not(None))
            if meta is not None:
                stmt = stmt.where(PredictorVersion.version != meta.version)
            candidates = [metadata_of(r) for r in session.scalars(stmt.order_by(PredictorVersion.promoted_at.desc()))]
        for candidate in candidates:
            try:
                self._predictor = load_from_store(self._store, candidate, threads=self._threads)
            except Exception as exc:  # noqa: BLE001 - each failure is named in the refusal
                tried.append(f"{candidate.version}: {type(exc).__name__}: {exc}")
                continue
            self.problem = (f"production version {getattr(meta, 'version', '?')} cannot be loaded ({reason}); "
                            f"serving the previous good version {candidate.version} instead")
            logger.error("PREDICTOR FALLBACK: %s", self.problem)
            return
        raise PredictorUnavailable("no predictor version can be loaded, refusing to start: " + "; ".join(tried))


def version_summary(row: PredictorVersion) -> dict[str, Any]:
    """The API view of a row (see :class:`app.predictors.schemas.PredictorVersionRead`)."""
    meta = row.metadata_ or {}
    return {
        "version": row.version, "status": row.status, "sha256": row.sha256, "artifact_path": row.artifact_path,
        "schema_version": row.schema_version, "watermark_measurement_id": row.watermark_measurement_id,
        "created_at": row.created_at, "promoted_at": row.promoted_at,
        "feature_names": meta.get("feature_names", []), "hyperparameters": meta.get("hyperparameters", {}),
        "metrics": meta.get("metrics", {}), "watermark": meta.get("watermark", {}),
    }  # fmt: skip
