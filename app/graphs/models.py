"""ORM model of an uploaded model graph, stored by content hash."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Integer, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class StoredGraph(Base):
    """A graph as uploaded: ``content`` is the raw ONNX bytes or the canonical JSON layer list
    (UTF-8); ``id`` is ``sha256`` of that content, so the same upload is stored once."""

    __tablename__ = "graphs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    source_format: Mapped[str] = mapped_column(String(16))  # "onnx" | "json"
    size_bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
