"""Project schema base (STYLE.md §7), the error document listed in every route's ``responses=``, and the
validated field types every schema uses for user input:

* :data:`Name` / :data:`Identifier` (≤ 64 characters: graph and hardware ids) / :data:`Text`: text
  without lone surrogates (not encodable as UTF-8: SQLite and the JSON
  encoder fail on them), NUL (PostgreSQL ``text`` refuses it) or other control characters (``Text``
  allows tab and newlines);
* :data:`Int32`, :data:`PositiveInt32`: strict integers (``true`` is not 1, ``2.0`` is not 2) in the
  range of the ``INTEGER`` columns they are stored in (−2³¹ … 2³¹−1);
* :data:`JsonObject`: a free-form JSON object whose strings are valid text and numbers finite
  (PostgreSQL ``json``/``jsonb`` refuse NUL and unpaired surrogates; NaN is not JSON);
* :data:`OffsetQuery`: a page offset bounded to the int64 the database compares it with.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from fastapi import Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

INT32_MAX = 2**31 - 1
_NAME_BAD = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_TEXT_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def _checker(pattern: re.Pattern[str], what: str):  # noqa: ANN202 - returns a pydantic validator
    def check(value: str) -> str:
        bad = pattern.search(value)
        if bad is not None:
            raise ValueError(f"{what} must not contain U+{ord(bad.group()):04X} (control character or lone surrogate)")
        return value

    return check


def check_text(value: str) -> str:
    """``value`` unchanged; ``ValueError`` for NUL, lone surrogates and controls other than tab/newlines."""
    return _checker(_TEXT_BAD, "text")(value)


def check_name(value: str) -> str:
    """``value`` unchanged; ``ValueError`` for control characters (NUL included) and lone surrogates."""
    return _checker(_NAME_BAD, "a name")(value)


def clean_name(value: str) -> str:
    """``value`` without the characters :func:`check_name` refuses, at most 200 characters (for names
    taken from a file name rather than given by the client)."""
    return _NAME_BAD.sub("", value)[:200]


Name = Annotated[str, StringConstraints(min_length=1, max_length=200), AfterValidator(_checker(_NAME_BAD, "a name"))]
Identifier = Annotated[
    str, StringConstraints(max_length=64), AfterValidator(_checker(_NAME_BAD, "an id"))
]
Text = Annotated[str, StringConstraints(max_length=10_000), AfterValidator(check_text)]
Int32 = Annotated[int, Field(strict=True, ge=-(2**31), le=INT32_MAX)]
PositiveInt32 = Annotated[int, Field(strict=True, gt=0, le=INT32_MAX)]


def _check_json(value: dict[str, Any]) -> dict[str, Any]:
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, sub in item.items():
                check_text(key)
                stack.append(sub)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            check_text(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError("numbers must be finite (NaN and infinities are not JSON)")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_check_json)]
OffsetQuery = Annotated[int, Query(ge=0, le=2**63 - 1, description="rows to skip")]
#: Most rows one page of a list endpoint holds (``GET /v1/graphs``, ``GET /v1/measurements``).
MAX_PAGE = 1000


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
