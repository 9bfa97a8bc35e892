"""Versioned predictor registry: ``models/`` holds ``<name>-<version>.onnx`` + ``.json`` pairs and a
``CURRENT`` file naming the active ``<name>-<version>`` stem.

:func:`load_predictor` returns a :class:`CompositePredictor` that routes each query to the learned ONNX
model when it applies (:meth:`LearnedPredictor.applies`) and to the roofline fallback otherwise (with
the fallback constants stored in the same metadata). Every estimate says which method produced it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.predictor.base import LayerTimeEstimate, LayerTimeQuery
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


class CompositePredictor:
    """Learned model where it applies, roofline fallback elsewhere; ``version`` = ``<name>-<version>``."""

    def __init__(self, learned: LearnedPredictor, fallback: RooflinePredictor) -> None:
        self.learned = learned
        self.fallback = fallback
        self.version = learned.version

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query, in order; the learned queries go through one ``session.run``.

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
        return [e for e in out if e is not None]


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
