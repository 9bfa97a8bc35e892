"""Progress bars with an ETA for the long commands (``layercast import``, ``profile``, ``train``,
``evaluate``): tqdm on stderr, so the command's own output on stdout stays clean for pipes.

Shown when stderr is a terminal and hidden otherwise (log files, CI); ``LAYERCAST_PROGRESS=1`` forces
them on and ``LAYERCAST_PROGRESS=0`` off. The bar's ``<remaining`` field is the ETA (tqdm's estimate from
the mean rate so far).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: Environment variable that forces the bars on (``1``) or off (``0``).
ENV = "LAYERCAST_PROGRESS"


def enabled() -> bool:
    """Whether bars are drawn: :data:`ENV` when set (``1``/``0``), else whether stderr is a terminal."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def bar(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None, unit: str = "it",
        leave: bool = True) -> tqdm[T]:
    """A tqdm bar over ``iterable`` (or a manual one, advanced with ``.update(n)``) labelled ``desc``;
    ``total`` defaults to ``len(iterable)`` when it has one. ``leave=False`` clears an inner bar when done.
    Close it (or exhaust the iterable) to end the line."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=sys.stderr, disable=not enabled(),
                dynamic_ncols=True, mininterval=0.5)
