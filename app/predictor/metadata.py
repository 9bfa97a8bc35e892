"""Typed metadata of a predictor artifact, written by training (:mod:`app.training.retrain`) and read by
serving (:mod:`app.predictor.registry`), plus the artifact store's file primitives.

One :class:`ArtifactMetadata` per registered version lives in ``predictor_versions.metadata``. It holds
what the registry needs to trust and compare a version (schema version, feature list, training-data
watermark, hyper-parameters, held-out metrics, the ONNX file's SHA-256) and, under ``training``, the
trainer's full JSON (:func:`app.training.train.write_artifact`), which :class:`LearnedPredictor` reads.

The artifact store is a directory every replica can read (a shared volume). Files are written
atomically (:func:`write_atomic`: temporary file in the same directory, ``fsync``, ``rename``, ``fsync``
of the directory), so a crash leaves either the old state or the complete new file, never a torn one;
every load re-checks the SHA-256 (:func:`verify_sha256`). Pure: no FastAPI, no database, no torch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: Version of the :class:`ArtifactMetadata` layout; bump when a field changes meaning.
SCHEMA_VERSION = 1


class Watermark(BaseModel):
    """The newest measurement a version could have trained on: ``max_measurement_id`` and its
    ``max_created_at`` in the database at the start of training, and ``rows`` featurised rows used.
    All None for an artifact trained before the registry existed (the shipped seed)."""

    model_config = ConfigDict(extra="forbid")

    max_measurement_id: int | None = None
    max_created_at: datetime | None = None
    rows: int | None = None


class RatioStatsModel(BaseModel):
    """Stored :class:`app.estimates.calibration.RatioStats` of one calibration group: ``n`` clipped
    ln(actual / predicted) ratios, their sum and sum of squares."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(ge=0)
    total: float
    total_sq: float = Field(ge=0)


class JobCalibrationFit(BaseModel):
    """The whole-job calibration refit by a retrain (:func:`app.estimates.service.refit_job_calibration`): for
    every recorded job actual with id up to ``watermark_measurement_id``, the version's own prediction of the
    job, summarised per :class:`app.estimates.calibration.CalibrationGroup` under its ``key`` (the JSON array
    ``[graph_id, hardware_id, precision, software_stack, device_count, nodes]``; refits stored before groups had
    a setting used ``"<graph_id>|<hardware_id>"``, and before the stack was part of it the five-element array
    without it: serving applies neither). Serving adds the actuals recorded after
    the watermark against the same version. ``evaluation``: leave-one-out whole-job errors with and without it."""

    model_config = ConfigDict(extra="forbid")

    watermark_measurement_id: int | None = None
    groups: dict[str, RatioStatsModel] = Field(default_factory=dict)
    evaluation: dict[str, Any] = Field(default_factory=dict)


class ArtifactMetadata(BaseModel):
    """Metadata of one predictor version (see the module docstring).

    ``metrics``: held-out metrics as ``{split: {"overall": {...}, "by_source": {name: {...}},
    "by_hardware": {...}, "by_precision": {...}}}`` where each leaf is
    :func:`app.training.metrics.metrics` (``n``, ``mape_pct``...). ``onnx_file`` is relative to the store.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    name: str
    version: str = Field(description="registry key, `<name>-<version>` of the trainer")
    onnx_file: str
    sha256: str = Field(min_length=64, max_length=64)
    weights_file: str | None = Field(default=None, description="torch weights (.weights.npz) in the store, the "
                                     "base of a fine-tune; None for a version registered without them")
    weights_sha256: str | None = Field(default=None, min_length=64, max_length=64)
    feature_names: list[str]
    watermark: Watermark = Field(default_factory=Watermark)
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    job_calibration: JobCalibrationFit = Field(default_factory=JobCalibrationFit)
    training: dict[str, Any] = Field(description="the trainer's JSON metadata (read by LearnedPredictor)")

    @classmethod
    def from_training(
        cls,
        training: Mapping[str, Any],
        *,
        sha256: str,
        weights_sha256: str | None = None,
        watermark: Watermark | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> ArtifactMetadata:
        """Wrap the trainer's JSON metadata. ``metrics`` default to its per-source test metrics
        (``metrics_test_summary``) as the ``train_test`` split; ``weights_file`` is the trainer's, recorded
        only with its ``weights_sha256``. Raises ``KeyError`` when ``training`` lacks ``name``, ``version``,
        ``onnx_file`` or ``feature_names``."""
        recipe = dict((training.get("model") or {}).get("recipe") or {})
        default_metrics = {"train_test": {"by_source": dict(training.get("metrics_test_summary") or {})}}
        return cls(
            name=str(training["name"]),
            version=f"{training['name']}-{training['version']}",
            onnx_file=str(training["onnx_file"]),
            sha256=sha256,
            weights_file=str(training["weights_file"]) if weights_sha256 and training.get("weights_file") else None,
            weights_sha256=weights_sha256 if training.get("weights_file") else None,
            feature_names=[str(n) for n in training["feature_names"]],
            watermark=watermark or Watermark(),
            hyperparameters=recipe,
            metrics=dict(metrics) if metrics is not None else default_metrics,
            training=dict(training),
        )


class ChecksumMismatch(ValueError):
    """An artifact file's SHA-256 differs from the one registered for it (torn or tampered file)."""


def sha256_file(path: Path, *, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of the file at ``path``; raises ``FileNotFoundError`` when it is missing."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise :class:`ChecksumMismatch` unless ``path`` hashes to ``expected`` (``FileNotFoundError`` if absent)."""
    actual = sha256_file(path)
    if actual != expected:
        raise ChecksumMismatch(f"{path}: sha256 {actual} != registered {expected}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one: a temporary file in the
    same directory, flushed and ``fsync``-ed, ``os.replace``-d over ``path`` (atomic on POSIX within one
    file system), then the directory ``fsync``-ed so the rename survives a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
