"""Bounds on what one import may cost, so a small hostile file cannot take the service's time or memory.

:class:`Limits` holds them; the API sets the active ones per request from :class:`app.config.Settings`
(:func:`use_limits`), and the importers read them with :func:`current_limits`. Scripts and the trainer
get :data:`DEFAULT_LIMITS`. Crossing a bound raises :class:`app.errors.LimitExceeded` (422) or
:class:`app.errors.GraphTooLarge` (413), whose ``detail`` names the limit, the value and the bound.

Defaults and why: ``max_dim`` 2³¹−1 (the int32 index range of cuDNN/cuBLAS and most kernels); ``max_rank`` 32
(ONNX Runtime's own kernels stop at 8-12; real exports stay under 8); ``max_tensor_elements`` 2⁴⁰ (4 TiB
of fp32: no device holds one tensor that large); ``max_nodes`` 200,000 (GPT-2 XL exports ~10k nodes, a
70B-parameter decoder ~30k); ``max_subgraph_depth`` 8 (If/Loop/Scan nesting); ``max_json_depth`` 64
(every document of the API nests under 10 levels); ``import_timeout_s`` 60 s per import, checked
between nodes and layers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from app.errors import GraphTooLarge, LimitExceeded


@dataclass(frozen=True)
class Limits:
    """Import bounds (see the module docstring for the defaults' sources)."""

    max_nodes: int = 200_000
    max_rank: int = 32
    max_dim: int = 2**31 - 1
    max_tensor_elements: int = 2**40
    max_subgraph_depth: int = 8
    max_json_depth: int = 64
    import_timeout_s: float = 60.0

    def check_nodes(self, count: int, what: str = "nodes") -> None:
        """Raise :class:`GraphTooLarge` (413) when ``count`` nodes/layers exceed ``max_nodes``."""
        if count > self.max_nodes:
            raise GraphTooLarge(what, count, self.max_nodes, f"graph has {count} {what}; the limit is {self.max_nodes}")

    def check_shape(self, shape: tuple[int, ...] | list[int], where: str) -> None:
        """Raise :class:`LimitExceeded` (422) for a rank, a dimension or an element count over the bounds.

        ``shape``: concrete dims (negative ones are the caller's to reject); ``where``: the tensor's name,
        for the message.
        """
        if len(shape) > self.max_rank:
            raise LimitExceeded("tensor_rank", len(shape), self.max_rank,
                                f"tensor '{where}' has rank {len(shape)}; the limit is {self.max_rank}")
        numel = 1
        for d in shape:
            if d > self.max_dim:
                raise LimitExceeded("dimension", int(d), self.max_dim,
                                    f"tensor '{where}' has a dimension of {d}; the limit is {self.max_dim}")
            numel *= max(int(d), 0)
        if numel > self.max_tensor_elements:
            raise LimitExceeded("tensor_elements", numel, self.max_tensor_elements,
                                f"tensor '{where}' has {numel} elements; the limit is {self.max_tensor_elements}")


DEFAULT_LIMITS = Limits()
_current: ContextVar[Limits] = ContextVar("layercast_limits", default=DEFAULT_LIMITS)


def current_limits() -> Limits:
    """The limits of the running request (set by the API middleware), else :data:`DEFAULT_LIMITS`."""
    return _current.get()


@contextmanager
def use_limits(limits: Limits) -> Iterator[None]:
    """Make ``limits`` the active ones inside the ``with`` block (and threads started from it)."""
    token = _current.set(limits)
    try:
        yield
    finally:
        _current.reset(token)


class Deadline:
    """Cooperative time budget of one import: :meth:`check` raises :class:`LimitExceeded`
    (``import_seconds``) once ``seconds`` have passed since construction (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def check(self) -> None:
        elapsed = time.monotonic() - self.start
        if elapsed > self.seconds:
            raise LimitExceeded("import_seconds", round(elapsed, 3), self.seconds,
                                f"import took longer than {self.seconds} s and was stopped")


def json_depth(doc: object, stop_above: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), walked iteratively; the walk
    stops as soon as the depth passes ``stop_above`` (the value returned is then ``stop_above + 1``)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > stop_above:
                return deepest
            stack.extend((v, depth) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def json_bytes_depth_over(body: bytes, limit: int) -> int | None:
    """:func:`json_bytes_depth` of ``body`` when it exceeds ``limit``, else None. The depth is at most the
    number of opening brackets (those inside strings included): a body with no more than ``limit`` of them is
    answered by two ``bytes.count`` calls, without the string-stripping pass and numpy's fixed cost (most of
    the check's time on a ~200-byte prediction request)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    depth = json_bytes_depth(body)
    return depth if depth > limit else None


def json_bytes_depth(body: bytes) -> int:
    """Bracket nesting depth of JSON text without parsing it (strings skipped), in linear time with
    bounded memory per byte, so a body nested 10,000 deep is measured before ``json.loads`` recurses."""
    import re

    import numpy as np

    stripped = re.sub(rb'"[^"\\]*(?:\\.[^"\\]*)*"', b"", body)
    arr = np.frombuffer(stripped, dtype=np.uint8)
    # two comparisons per bracket kind: np.isin costs ~50 us per call even on a 200-byte prediction body
    step = (((arr == ord("[")) | (arr == ord("{"))).astype(np.int32)
            - ((arr == ord("]")) | (arr == ord("}"))).astype(np.int32))
    return int(np.cumsum(step).max()) if step.size else 0


_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'


def _longest_digit_run(data: bytes) -> int:
    """Length of the longest run of ASCII digits in ``data`` (numpy: ~30 ms for 30 MB, where a regular
    expression takes 0.4 s)."""
    import numpy as np

    arr = np.frombuffer(data, dtype=np.uint8)
    edges = np.diff(np.concatenate(([0], ((arr >= 0x30) & (arr <= 0x39)).view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max()) if starts.size else 0


def json_text_problem(body: bytes) -> tuple[int | None, str] | None:
    """Why ``json.loads(body)`` would fail with an error that is not a ``json.JSONDecodeError`` (which FastAPI
    answers with a 400 instead of the 422 ``json_invalid`` of every other malformed body), or None.

    Two such failures: bytes that are not text in the encoding ``json`` detects for them
    (:func:`json.detect_encoding`: UTF-8, or UTF-16/32 by their zero-byte pattern; ``UnicodeDecodeError``),
    and an integer literal of more digits than :func:`sys.get_int_max_str_digits` (Python's 4,300-digit
    guard against quadratic ``int()`` parsing, CVE-2020-10735; ``ValueError``). Returns ``(offset, reason)``:
    the byte offset of the bad bytes, or None for a literal (its offset in the text, strings left out, is not
    one in the body). Linear time: one decode and two regular-expression passes."""
    import json
    import re
    import sys

    encoding = json.detect_encoding(body)
    try:
        text = body.decode(encoding, "surrogatepass")
    except UnicodeDecodeError as exc:
        return exc.start, f"the body is not valid {exc.encoding} text: {exc.reason} at byte {exc.start}"
    limit = sys.get_int_max_str_digits()
    if limit == 0:  # no guard: int() parses any length
        return None
    # an integer literal: digits not part of a fraction or an exponent (a float of any length parses)
    # a run of digits is no longer than the body (the usual case: a prediction request is ~200 bytes, and
    # numpy's fixed cost, ~30 us, is most of this check's time on such bodies)
    if len(body) <= limit or _longest_digit_run(body if encoding.startswith("utf-8")
                                                  else text.encode("utf-8", "surrogatepass")) <= limit:
        return None  # no run of digits that long anywhere (the usual case): strings need not be stripped
    literal = re.compile(r"(?<![0-9.eE+\-])-?[0-9]{" + str(limit + 1) + r",}(?![0-9.eE])")
    found = literal.search(re.sub(_JSON_STRING, '""', text))
    if found is None:
        return None
    digits = len(found.group().lstrip("-"))
    return None, f"an integer literal has {digits} digits; the most that is parsed is {limit}"
