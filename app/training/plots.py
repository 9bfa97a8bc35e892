"""Images written next to the reports: the training loss curve (``layercast train``) and the evaluation's
predicted-vs-measured scatter per device (``layercast evaluate``). PNG through matplotlib's Agg canvas
(no display, no pyplot global state); matplotlib comes with the ``train`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def loss_curve(path: Path, curves: Mapping[str, Sequence[float]], *, title: str) -> Path:
    """Write the training loss against the epoch, one line per ``curves`` entry (label → mean loss of each
    epoch, e.g. the pinball loss on ln ms), log y axis, to ``path`` (PNG). Raises ``ValueError`` when no
    curve has a point."""
    if not any(len(c) for c in curves.values()):
        raise ValueError("no loss values to plot")
    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    for label, losses in curves.items():
        if len(losses):
            ax.plot(np.arange(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    ax.set(xlabel="epoch", ylabel="training loss (mean over the epoch)", yscale="log", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, format="png")
    return path


def error_plots(path: Path, *, hardware: Sequence[str] | np.ndarray, measured_ms: np.ndarray,
                predicted_ms: np.ndarray, title: str) -> Path:
    """Write one log-log panel per device of predicted against measured time (ms) with the y = x line and
    the ±10 % band, each panel titled with its row count and MAPE, to ``path`` (PNG). Shapes: three arrays
    of the same length ``[N]``. Raises ``ValueError`` for mismatched lengths or no rows."""
    hw = np.asarray(hardware).astype(str)
    measured, predicted = np.asarray(measured_ms, dtype=float), np.asarray(predicted_ms, dtype=float)
    if not (len(hw) == len(measured) == len(predicted)) or len(hw) == 0:
        raise ValueError(f"need rows of equal length, got {len(hw)}, {len(measured)}, {len(predicted)}")
    devices = sorted(set(hw.tolist()))
    cols = min(4, len(devices))
    rows = math.ceil(len(devices) / cols)
    fig = _figure(3.2 * cols, 3.0 * rows + 0.4)
    fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(devices):]:
        ax.set_visible(False)
    for ax, device in zip(axes.flat, devices, strict=False):
        sel = hw == device
        m, p = measured[sel], predicted[sel]
        ok = (m > 0) & (p > 0) & np.isfinite(p)
        mape = float(np.mean(np.abs(p[ok] - m[ok]) / m[ok]) * 100) if ok.any() else float("nan")
        lo, hi = float(min(m[ok].min(), p[ok].min())), float(max(m[ok].max(), p[ok].max()))
        line = np.array([lo, hi])
        ax.fill_between(line, line * 0.9, line * 1.1, color="#6acc64", alpha=0.3, label="±10 %")
        ax.plot(line, line, color="#a00", linewidth=1, label="y = x")
        ax.scatter(m[ok], p[ok], s=4, alpha=0.4, color="#4878d0")
        ax.set(xscale="log", yscale="log", title=f"{device}: n={int(ok.sum())}, MAPE {mape:.1f} %",
               xlabel="measured (ms)", ylabel="predicted (ms)")
        ax.title.set_fontsize(9)
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.savefig(path, format="png")
    return path
