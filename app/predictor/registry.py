"""Versioned predictor registry: ``models/`` holds ``<name>-<version>.onnx`` + ``.json`` pairs and a
``CURRENT`` file naming the active ``<name>-<version>`` stem.

:func:`load_predictor` returns a :class:`CompositePredictor` that routes each query to the learned ONNX
model when it applies (:meth:`LearnedPredictor.applies`) and to the roofline fallback otherwise (with
the fallback constants stored in the same metadata). Every estimate says which method produced it, and
every estimate, whichever method produced it, passes through :func:`app.predictor.table.clamp_to_floors`: no served
forward, backward or update time is below its physics floor (DESIGN.md, "Never faster than physics").
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.core.costs import LayerCost
from app.core.hardware import HardwareSpec, spec_fingerprint
from app.core.ir import Layer
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery
from app.predictor.metadata import ArtifactMetadata, verify_sha256
from app.predictor.onnx_model import LearnedPredictor, read_metadata
from app.predictor.roofline import RooflineConstants, RooflinePredictor
from app.predictor.table import Estimates, LayerTable, Setting, clamp_to_floors, estimate_queries, scatter

CURRENT_FILE = "CURRENT"

#: Settings (device, mode, optimizer, precision, stack) whose roofline-fallback rows a layer table remembers.
FALLBACK_SETTINGS = 32


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
    """Learned model where it applies, roofline fallback elsewhere, every answer clamped to its physics floor
    (:func:`app.predictor.table.clamp_to_floors`); ``version`` = ``<name>-<version>``."""

    def __init__(self, learned: LearnedPredictor, fallback: RooflinePredictor) -> None:
        self.learned = learned
        self.fallback = fallback
        self.version = learned.version

    def _route(self, table: LayerTable, hw_kind: str) -> tuple[np.ndarray, dict[int, str]]:
        """Rows of ``table`` the learned model serves on a ``hw_kind`` device, and why the others are not
        (once per table, device kind and predictor version)."""

        def build() -> tuple[np.ndarray, dict[int, str]]:
            reasons = {i: r for i, (layer, cost) in enumerate(zip(table.layers, table.costs, strict=True))
                       if (r := self.learned.applies(_probe(layer, cost, hw_kind))) is not None}
            learned = np.asarray([i for i in range(len(table)) if i not in reasons], dtype=np.intp)
            return learned, reasons

        found = table.memo(("route", self.version, hw_kind), build)
        assert isinstance(found, tuple)
        return found

    def _fallback(self, table: LayerTable, rows: np.ndarray, reasons: dict[int, str], s: Setting) -> Estimates:
        """Roofline-fallback estimates of ``rows`` (a ``fallback: <reason>`` note first), remembered per table
        for the last :data:`FALLBACK_SETTINGS` settings (the fallback is deterministic for one version). Rows
        equal in all the fallback reads (:meth:`_fallback_groups`) are estimated once and share the answer: the
        distinct rows' :class:`Estimates` taken row by row (the figures :meth:`Estimates.from_list` of every
        row's estimate has, without a Python object per row). Shared between calls: never mutated."""
        if not len(rows):
            return Estimates.from_list([])
        memo = table.memo(("fallback", self.version), OrderedDict)
        assert isinstance(memo, OrderedDict)
        key = (spec_fingerprint(s.hardware), s.mode, s.optimizer, s.precision, s.software_stack, rows.tobytes())
        found = memo.get(key)
        if found is None:
            at = table.rescaled(s.precision).costs
            group = self._fallback_groups(table, reasons, s)[rows]
            distinct = list(dict.fromkeys(group.tolist()))  # one representative row each, in first-seen order
            queries = [LayerTimeQuery(layer=table.layers[i], cost=table.costs[i], hardware=s.hardware, mode=s.mode,
                                      optimizer=s.optimizer, precision=s.precision, software_stack=s.software_stack)
                       for i in distinct]
            estimates = self.fallback.estimate(queries, at_precision=[at[i] for i in distinct])
            each = dataclasses.replace(Estimates.from_list(estimates), notes=[
                (f"fallback: {reasons[i]}", *e.notes) for i, e in zip(distinct, estimates, strict=True)])
            pos = {i: j for j, i in enumerate(distinct)}
            found = each.take(np.asarray([pos[g] for g in group.tolist()], dtype=np.intp).reshape(len(rows)))
            memo[key] = found
            while len(memo) > FALLBACK_SETTINGS:
                memo.popitem(last=False)
        else:
            memo.move_to_end(key)
        return found  # type: ignore[no-any-return]

    def _fallback_groups(self, table: LayerTable, reasons: dict[int, str], s: Setting) -> np.ndarray:
        """For each row of ``table``, the first row whose fallback answer is the same ``[N]``: a twin
        (:meth:`LayerTable.twins`: equal but for the layer's name, so equal in every input of
        :meth:`RooflinePredictor.estimate`) with the same fallback reason. Once per table and version; a
        transformer's repeated blocks collapse to one row each."""

        def build() -> np.ndarray:
            first: dict[tuple[object, ...], int] = {}
            return np.asarray([first.setdefault((reasons.get(i), twin), i) for i, twin in enumerate(table.twins())],
                              dtype=np.intp).reshape(len(table))  # fmt: skip

        found = table.memo(("fallback-groups", self.version, s.hardware.kind), build)
        assert isinstance(found, np.ndarray)
        return found

    def estimate_tables(self, items: Sequence[tuple[LayerTable, np.ndarray, Setting]]) -> list[Estimates]:
        """Estimates of rows ``idx`` of each ``(table, idx, setting)``, each clamped to its physics floor; the
        learned rows of every item go through one ``session.run``, the others through the roofline fallback
        (with a ``fallback: <reason>`` note). Raises ``ValueError`` for an unknown mode."""
        learned_items, fallback_parts = [], []
        for table, idx, s in items:
            learned_rows, reasons = self._route(table, s.hardware.kind)
            wanted = np.zeros(len(table), dtype=bool)
            wanted[idx] = True
            lrn = learned_rows[wanted[learned_rows]]
            fb = np.setdiff1d(idx, lrn, assume_unique=True) if len(reasons) else np.zeros(0, dtype=np.intp)
            learned_items.append((table, lrn, s))
            fallback_parts.append((fb, self._fallback(table, fb, reasons, s)))
        learned = self.learned.estimate_tables(learned_items)
        out = []
        for (table, idx, s), (_, lrn, _), (fb, fb_est), lrn_est in zip(
                items, learned_items, fallback_parts, learned, strict=True):
            pos = np.full(len(table), -1, dtype=np.intp)
            pos[idx] = np.arange(len(idx))
            merged = scatter(len(idx), [(pos[lrn], lrn_est), (pos[fb], fb_est)])
            out.append(clamp_to_floors(table, idx, s, merged))
        return out

    def estimate(self, queries: Sequence[LayerTimeQuery]) -> list[LayerTimeEstimate]:
        """One estimate per query, in order, each clamped to its physics floor (:meth:`estimate_tables` over
        the queries grouped by setting). Raises ``ValueError`` for an unsupported layer (``cost.supported``
        False) or an unknown mode."""
        for q in queries:
            if not q.cost.supported:
                raise ValueError(f"layer {q.layer.name!r} ({q.layer.op_type}) is unsupported; do not estimate it")
        return estimate_queries(queries, self.estimate_tables)


def _probe(layer: Layer, cost: LayerCost, hw_kind: str) -> LayerTimeQuery:
    """A query on a placeholder device of ``hw_kind``: :meth:`LearnedPredictor.applies` reads only the layer,
    its cost and the device kind (the routing is memoised per table and kind)."""
    return LayerTimeQuery(layer=layer, cost=cost, hardware=_KIND_DEVICE[hw_kind], mode="inference", optimizer="none")


_KIND_DEVICE: dict[str, HardwareSpec] = {
    k: HardwareSpec(id=f"probe-{k}", name=f"{k} probe", vendor="probe", kind=k, memory_bytes=1.0,
                    memory_bandwidth_bytes_per_s=1.0, peak_flops_per_s={"fp32": 1.0}, compute_units=1)
    for k in ("gpu", "cpu")
}


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
