"""Project schema base (STYLE.md §7) and the error document listed in every route's ``responses=``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Schema(BaseModel):
    """Base of every API schema: unknown fields are rejected (422) instead of silently dropped."""

    model_config = ConfigDict(extra="forbid")


class ErrorBody(Schema):
    """``code``: machine-readable (``hardware_not_found``...); ``message``: for humans; ``detail``: ids."""

    code: str
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


class ErrorResponse(Schema):
    """The JSON body of every error response: :meth:`app.errors.LayercastError.to_problem`, the 422
    validation handler and the catch-all handler of :mod:`app.main`."""

    error: ErrorBody


Problem = ErrorResponse
"""Alias of :class:`ErrorResponse`."""
