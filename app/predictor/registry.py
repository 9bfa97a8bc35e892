"""Versioned predictor registry: ``models/`` holds ``<name>-<version>.onnx`` + ``.json`` pairs and a
``CURRENT`` file naming the active ``<name>-<version>`` stem.

:func:`load_predictor` returns a :class:`CompositePredictor` that routes each query to the learned ONNX
model when it applies (:meth:`LearnedPredictor.applies`) and to the roofline fallback otherwise (with
the fallback constants stored in the same metadata). Every estimate says which method produced it, and
every estimate, whichever method produced it, passes through :func:`clamp_to_physics_floor`: no served
forward, backward or update time is below its physics floor (DESIGN.md, "Never faster than physics").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.core.precision import floors_by_pass_ms
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery
from app.predictor.metadata import ArtifactMetadata, verify_sha256
from app.predictor.onnx_model import LearnedPredictor, read_metadata
from app.predictor.roofline import RooflineConstants, RooflinePredictor

CURRENT_FILE = "CURRENT"


@dataclass(frozen=True, slots=True)
class ModelVersion:
    """One artifact in a models directory; ``test_mape_pct`` from its metadata (None if absent)."""

    stem: str
    name: str
    version: str
    current: bool
    test_mape_pct: float | None
    created_unix_s: int | None


def clamp_to_physics_floor(query: LayerTimeQuery, est: LayerTimeEstimate) -> LayerTimeEstimate:
    """``est`` with each pass raised to at least its physics floor (ms), the floor recorded on it.

    Floors per pass from :func:`app.core.precision.floors_by_pass_ms` (``physics_floor_ms`` of each pass)
    at the query's precision: forward
    always; backward and the optimizer update (``query.optimizer``) in training mode. The interval moves
    with the point estimate: ``p10 >= Σ floors`` and ``p90 >= total``. A raised pass is named in
    ``notes`` and ``floor_clamped`` is set. Raises what ``physics_floor_ms`` raises (unsupported cost,
    :class:`~app.core.precision.PrecisionNotSupported`).
    """
    q = query
    f_floor, b_floor, u_floor = floors_by_pass_ms(
        q.layer, q.cost, q.hardware, q.precision, training=q.mode == "training", optimizer=q.optimizer)
    floor_sum = f_floor + b_floor + u_floor
    raised = [
        name
        for name, value, floor in (
            ("forward", est.forward_ms, f_floor),
            ("backward", est.backward_ms, b_floor),
            ("update", est.update_ms, u_floor),
        )
        if value < floor
    ]
    fwd, bwd, upd = max(est.forward_ms, f_floor), max(est.backward_ms, b_floor), max(est.update_ms, u_floor)
    total = fwd + bwd + upd
    notes = est.notes
    if raised:
        notes = (*notes, f"raised to the physics floor ({', '.join(raised)}): {floor_sum:.4g} ms in all")
    return LayerTimeEstimate(
        forward_ms=fwd,
        backward_ms=bwd,
        update_ms=upd,
        total_ms_p10=min(max(est.total_ms_p10, floor_sum), total),
        total_ms_p90=max(est.total_ms_p90, total),
        method=est.method,
        out_of_distribution=est.out_of_distribution,
        notes=notes,
        physics_floor_ms=floor_sum,
        floor_clamped=bool(raised),
    )


class CompositePredictor:
    """Learned model where it applies, roofline fallback elsewhere, every answer clamped to its physics floor
    (:func:`clamp_to_physics_floor`); ``version`` = ``<name>-<version>``."""

    def __init__(self, learned: LearnedPredictor, fallback: RooflinePredictor) -> None:
        self.learned = learned
        self.fallback = fallback
        self.version = learned.version

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query, in order, each clamped to its physics floor; the learned queries go through
        one ``session.run``.

        Raises ``ValueError`` for an unsupported layer (``cost.supported`` False) or an unknown mode.
        """
        learned_idx: list[int] = []
        fallback_idx: list[int] = []
        reasons: dict[int, str] = {}
        for i, q in enumerate(queries):
            if not q.cost.supported:
                raise ValueError(f"layer {q.layer.name!r} ({q.layer.op_type}) is unsupported; do not estimate it")
            reason = self.learned.applies(q)
            if reason is None:
                learned_idx.append(i)
            else:
                fallback_idx.append(i)
                reasons[i] = reason
        out: list[LayerTimeEstimate | None] = [None] * len(queries)
        for i, est in zip(learned_idx, self.learned.estimate([queries[i] for i in learned_idx]), strict=True):
            out[i] = est
        for i, est in zip(fallback_idx, self.fallback.estimate([queries[i] for i in fallback_idx]), strict=True):
            out[i] = LayerTimeEstimate(
                forward_ms=est.forward_ms,
                backward_ms=est.backward_ms,
                update_ms=est.update_ms,
                total_ms_p10=est.total_ms_p10,
                total_ms_p90=est.total_ms_p90,
                method=est.method,
                out_of_distribution=est.out_of_distribution,
                notes=(f"fallback: {reasons[i]}", *est.notes),
            )
        return [clamp_to_physics_floor(q, e) for q, e in zip(queries, out, strict=True) if e is not None]


def current_stem(models_dir: Path) -> str:
    """The stem named by ``models_dir/CURRENT``; raises ``FileNotFoundError`` if it is missing or empty."""
    path = Path(models_dir) / CURRENT_FILE
    stem = path.read_text().strip() if path.is_file() else ""
    if not stem:
        raise FileNotFoundError(f"no active model: {path} missing or empty")
    return stem


def load_predictor(models_dir: Path, *, stem: str | None = None, threads: int = 1) -> CompositePredictor:
    """Load the active (or the given ``stem``) model of ``models_dir`` behind the routing composite.

    Raises ``FileNotFoundError`` when ``CURRENT``, the metadata or the ONNX file is missing, and
    ``ValueError`` when the artifact's feature list does not match :mod:`app.core.features`.
    """
    models_dir = Path(models_dir)
    stem = stem or current_stem(models_dir)
    meta = read_metadata(models_dir / f"{stem}.json")
    learned = LearnedPredictor(models_dir / meta["onnx_file"], meta, threads=threads)
    fallback = RooflinePredictor(RooflineConstants.from_dict(meta["roofline"]), version=f"{stem}+roofline")
    return CompositePredictor(learned, fallback)


def load_from_store(store_dir: Path, meta: ArtifactMetadata, *, threads: int = 1) -> CompositePredictor:
    """Load the registered version ``meta`` from the artifact store ``store_dir`` behind the composite.

    The ONNX file (``store_dir / meta.onnx_file``) is checked against ``meta.sha256`` first. Raises
    ``FileNotFoundError`` when it is missing, :class:`app.predictor.metadata.ChecksumMismatch` when it is
    torn or altered, and ``ValueError`` when its feature list is not that of :mod:`app.core.features`.
    """
    onnx_path = Path(store_dir) / meta.onnx_file
    verify_sha256(onnx_path, meta.sha256)
    learned = LearnedPredictor(onnx_path, meta.training, threads=threads)
    fallback = RooflinePredictor(RooflineConstants.from_dict(meta.training["roofline"]),
                                 version=f"{meta.version}+roofline")  # fmt: skip
    return CompositePredictor(learned, fallback)


def list_versions(models_dir: Path) -> list[ModelVersion]:
    """Every ``*.json`` artifact metadata in ``models_dir`` with an ONNX file next to it, oldest first."""
    models_dir = Path(models_dir)
    try:
        active = current_stem(models_dir)
    except FileNotFoundError:
        active = None
    found: list[ModelVersion] = []
    for path in sorted(models_dir.glob("*.json")):
        try:
            meta = read_metadata(path)
        except ValueError:
            continue
        if "onnx_file" not in meta or not (models_dir / meta["onnx_file"]).is_file():
            continue
        mape = meta.get("metrics_test", {}).get("learned", {}).get("mape_pct")
        if mape is None:  # v2 metadata: held-out GPU (Justus) rows
            mape = meta.get("metrics_test_summary", {}).get("gpu", {}).get("mape_pct")
        found.append(
            ModelVersion(
                stem=path.stem,
                name=str(meta.get("name")),
                version=str(meta.get("version")),
                current=path.stem == active,
                test_mape_pct=mape,
                created_unix_s=meta.get("created_unix_s"),
            )
        )
    return sorted(found, key=lambda v: (v.created_unix_s or 0, v.stem))
