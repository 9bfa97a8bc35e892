"""Project-wide API schema base (STYLE.md §7): inputs forbid unknown fields."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Schema(BaseModel):
    """Base of every API schema: unknown fields are rejected with a 422."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ErrorBody(Schema):
    code: str
    message: str
    detail: dict[str, Any] = {}


class ErrorResponse(Schema):
    """The problem document every 4xx/5xx answer uses: ``{"error": {"code", "message", "detail"}}``."""

    error: ErrorBody
