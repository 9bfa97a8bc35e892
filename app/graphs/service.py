"""Graph import and storage: content-addressed, validated before anything is stored."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from sqlalchemy.orm import Session

from app.core.analysis import GraphAnalysis, analyze
from app.core.ir import Graph
from app.core.json_import import import_json
from app.core.onnx_import import import_onnx
from app.errors import GraphNotFound, InvalidGraph, InvalidRequest
from app.graphs.models import StoredGraph
from app.graphs.repository import GraphRepository


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    """Canonical UTF-8 encoding of a JSON graph (sorted keys, no whitespace): equal graphs hash equal."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def content_id(content: bytes) -> str:
    """Graph id: hex sha256 of the stored content."""
    return hashlib.sha256(content).hexdigest()


def build_graph(
    content: bytes, source_format: str, *, batch_size: int, dims: Mapping[str, int] | None = None, name: str = ""
) -> Graph:
    """Import stored content (``onnx`` bytes or canonical ``json``) into the IR at ``batch_size``.

    Raises :class:`InvalidGraph`, :class:`UnboundDimension`, or :class:`InvalidRequest` for a
    non-positive batch size.
    """
    if batch_size <= 0:
        raise InvalidRequest(f"batch_size must be positive, got {batch_size}", detail={"batch_size": batch_size})
    return _build_cached(content, source_format, batch_size, tuple(sorted((dims or {}).items())), name)


@lru_cache(maxsize=64)
def _build_cached(
    content: bytes, source_format: str, batch_size: int, dims: tuple[tuple[str, int], ...], name: str
) -> Graph:
    # Graphs are immutable (frozen dataclasses), so sharing a cached import between requests is safe;
    # repeated requests for the same graph give identical numbers.
    if source_format == "onnx":
        return import_onnx(content, batch_size=batch_size, dims=dict(dims), name=name or None)
    if source_format == "json":
        try:
            doc = json.loads(content)
        except ValueError as exc:
            raise InvalidGraph(f"stored JSON graph does not parse: {exc}") from exc
        return import_json(doc, batch_size=batch_size)
    raise InvalidGraph(f"unknown source format {source_format!r}")


def summarize(analysis: GraphAnalysis) -> dict[str, Any]:
    """JSON-ready summary (the ``GraphSummary`` schema) of an analysis."""
    g = analysis.graph
    return {
        "batch_size": g.batch_size,
        "dims": dict(g.dims),
        "layer_count": analysis.layer_count,
        "op_counts": analysis.op_counts,
        "params": analysis.params,
        "forward_macs": analysis.forward_macs,
        "forward_flops": analysis.forward_flops,
        "backward_flops": analysis.backward_flops,
        "unsupported": [{"op_type": u.op_type, "count": u.count, "reason": u.reason} for u in analysis.unsupported],
        "totals_exclude_unsupported": bool(analysis.unsupported),
        "warnings": list(g.warnings),
    }


def create_graph(
    session: Session,
    *,
    content: bytes,
    source_format: str,
    name: str,
    batch_size: int = 1,
    dims: Mapping[str, int] | None = None,
) -> tuple[StoredGraph, bool]:
    """Validate, analyse and store a graph by content hash.

    Returns ``(row, created)``; an identical upload returns the stored row with ``created=False`` and
    changes nothing. The graph is fully imported before anything is written, so a graph that fails
    (:class:`InvalidGraph`, :class:`UnboundDimension`) leaves the database untouched.
    """
    gid = content_id(content)
    repo = GraphRepository(session)
    existing = repo.get(gid)
    if existing is not None:
        return existing, False
    graph = build_graph(content, source_format, batch_size=batch_size, dims=dims, name=name)
    summary = summarize(analyze(graph))
    row = StoredGraph(
        id=gid,
        name=(name or graph.name)[:200],
        source_format=source_format,
        size_bytes=len(content),
        content=content,
        summary=summary,
    )
    return repo.add(row), True


def get_graph(session: Session, *, graph_id: str) -> StoredGraph:
    """The stored graph ``graph_id``; raises :class:`GraphNotFound` (404)."""
    row = GraphRepository(session).get(graph_id)
    if row is None:
        raise GraphNotFound(f"no graph with id '{graph_id}'", detail={"graph_id": graph_id})
    return row


def list_graphs(session: Session, *, limit: int = 100, offset: int = 0) -> tuple[list[StoredGraph], int]:
    """A page of stored graphs, newest first, and the total count."""
    repo = GraphRepository(session)
    return list(repo.list(limit=limit, offset=offset)), repo.count()


def graph_layers(
    session: Session, *, graph_id: str, batch_size: int, dims: Mapping[str, int] | None = None
) -> tuple[StoredGraph, GraphAnalysis]:
    """Per-layer analytical costs of a stored graph at ``batch_size``."""
    row = get_graph(session, graph_id=graph_id)
    graph = build_graph(row.content, row.source_format, batch_size=batch_size, dims=dims, name=row.name)
    return row, analyze(graph)
