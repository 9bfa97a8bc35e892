"""ORM model of an uploaded model graph, stored by content hash, without its weight data."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class StoredGraph(Base):
    """A graph as stored.

    ``id``: hex sha256 of the bytes as uploaded (ONNX) or of the canonical JSON layer list, so the same
    upload maps to the same row without being parsed again. ``content``: what the importer re-reads per
    request: for ONNX the model with the data of weight-sized tensors removed (names, dims and dtypes
    kept; :func:`app.core.onnx_weights.strip_weights`), for JSON the canonical layer list; a deferred column,
    loaded only when a request re-imports the graph (an analysis-cache miss), never by lists and reads.
    ``structure_sha256``: sha256 of ``content`` (equal for two uploads that differ only in the values
    of weight-sized tensors; ``None`` for rows stored before migration 0003). ``owner``: the API key that first
uploaded it (:mod:`app.auth`; ``None``: anonymous). ``size_bytes``: the upload's
    size; ``stored_bytes``: ``len(content)``; ``weights_stored``: whether ``content`` still holds weight
    data (only rows from before migration 0003); ``stripped_weight_bytes``: declared bytes of the weight
    data not stored (inline data removed plus external data never read).
    """

    __tablename__ = "graphs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    source_format: Mapped[str] = mapped_column(String(16))  # "onnx" | "json"
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    weights_stored: Mapped[bool] = mapped_column(Boolean, default=False)
    stripped_weight_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    structure_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # read only when re-imported
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)
    owner: Mapped[str | None] = mapped_column(String(32), nullable=True)  # API key id (app.auth), None: anonymous
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
