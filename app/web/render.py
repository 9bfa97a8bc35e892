"""Pure HTML/SVG rendering of the web page (no request to any outside host: SVG drawn here, inline CSS and
one inline script, :data:`_PROGRESS_JS`, that shows a progress bar while a form's request runs).

Every value that comes from a user or the database goes through :func:`html.escape`.
"""

from __future__ import annotations

import csv
import io
import math
from html import escape
from typing import Any, get_args

from app.core.vocab import SoftwareStack
from app.estimates.schemas import ComparisonRead, ComparisonRow
from app.hardware.schemas import HardwareRead
from app.predictions.schemas import LayerPrediction, Optimizer, PredictionRead

#: Layers shown in the bar chart (the slowest ones; the CSV has every layer).
MAX_BARS = 40
PASS_COLOURS = {"forward": "#4878d0", "backward": "#ee854a", "update": "#6acc64"}

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5rem;max-width:1100px;color:#222}
form{display:flex;flex-wrap:wrap;gap:.6rem;align-items:end;margin-bottom:1rem}
label{display:flex;flex-direction:column;font-size:.85rem}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.2rem .5rem;text-align:right}
th{background:#f3f3f3}.error{color:#a00;font-weight:bold}svg{background:#fafafa;border:1px solid #ddd}
#progress{display:none;margin:.5rem 0}#progress.busy{display:block}tr.pareto td{font-weight:bold}"""

#: While an upload or a prediction runs (a full-page request, seconds for a large ONNX file or the whole
#: catalog's comparison), show an indeterminate progress bar and the elapsed time, and disable the buttons.
_PROGRESS_JS = """document.querySelectorAll('form').forEach(function(f){f.addEventListener('submit',function(){
var p=document.getElementById('progress'),t=document.getElementById('progress-s'),t0=Date.now();
p.classList.add('busy');f.querySelectorAll('button').forEach(function(b){b.disabled=true;});
setInterval(function(){t.textContent=((Date.now()-t0)/1000).toFixed(1);},100);});});"""
_PROGRESS = ('<div id="progress" role="status"><progress></progress> working… <span id="progress-s">0.0</span> s'
             '</div>')


def _select(name: str, options: list[tuple[str, str]], selected: str | None) -> str:
    items = "".join(
        f'<option value="{escape(value)}"{" selected" if value == selected else ""}>{escape(label)}</option>'
        for value, label in options
    )
    return f'<label>{escape(name)}<select name="{escape(name)}" id="{escape(name)}">{items}</select></label>'


def _text(name: str, value: Any, *, placeholder: str) -> str:
    shown = "" if value is None else escape(str(value))
    return (f'<label>{escape(name)}<input type="text" name="{escape(name)}" id="{escape(name)}" value="{shown}" '
            f'placeholder="{escape(placeholder)}"></label>')


def _number(name: str, value: Any, *, step: str = "1") -> str:
    shown = "" if value is None else escape(str(value))
    return (f'<label>{escape(name)}<input type="number" min="1" step="{step}" name="{escape(name)}" '
            f'id="{escape(name)}" value="{shown}"></label>')


def form(graphs: list[tuple[str, str]], hardware: list[HardwareRead], query: dict[str, Any]) -> str:
    """The upload form (multipart to ``/ui/graphs``) and the parameters form (GET ``/``)."""
    precisions = ["fp32", "fp32-strict", "tf32", "fp16", "bf16"]
    return (
        '<form method="post" action="/ui/graphs" enctype="multipart/form-data">'
        '<label>ONNX file<input type="file" name="file" id="file" accept=".onnx"></label>'
        '<button type="submit" id="upload">Upload</button></form>'
        '<form method="get" action="/">'
        + _select("graph_id", [("", "(choose a stored graph)"), *graphs], query.get("graph_id"))
        + _select("hardware_id", [(h.id, f"{h.id} ({h.name})") for h in hardware], query.get("hardware_id"))
        + _select("mode", [("training", "training"), ("inference", "inference")], query.get("mode"))
        + _select("precision", [(p, p) for p in precisions], query.get("precision"))
        + _select("optimizer", [(o, o) for o in get_args(Optimizer)], query.get("optimizer"))
        + _select("software_stack", [(s.value, s.value) for s in SoftwareStack], query.get("software_stack"))
        + _text("dims", query.get("dims"), placeholder="seq=128")
        + _number("batch_size", query.get("batch_size"))
        + _number("device_count", query.get("device_count"))
        + _number("nodes", query.get("nodes"))
        + _number("dataset_size", query.get("dataset_size"))
        + _number("epochs", query.get("epochs"), step="any")
        + '<button type="submit" id="predict">Predict</button></form>'
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def totals(prediction: PredictionRead) -> str:
    """Table of the iteration, epoch and job totals."""
    it = prediction.iteration
    rows = [
        ("iteration (ms)", _fmt(it.time_ms, 4)), ("p10–p90 (ms)", f"{_fmt(it.time_ms_p10)}–{_fmt(it.time_ms_p90)}"),
        ("forward / backward / update (ms)", f"{_fmt(it.forward_ms)} / {_fmt(it.backward_ms)} / {_fmt(it.update_ms)}"),
        ("samples/s", _fmt(it.samples_per_s, 4)),
        ("epoch (s)", _fmt(prediction.epoch.time_s, 4) if prediction.epoch else "– (give dataset_size)"),
        ("job (s)", _fmt(prediction.job.time_s, 4) if prediction.job else "– (give dataset_size and epochs)"),
        ("predictor", escape(prediction.predictor_version)),
    ]
    body = "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<h2>Totals</h2><table id="totals">{body}</table>'


def memory(prediction: PredictionRead) -> str:
    """Table of the memory breakdown (bytes, MiB)."""
    m = prediction.memory
    parts = [("weights", m.weights_bytes), ("weight copies", m.weight_copies_bytes), ("gradients", m.gradients_bytes),
             ("optimizer state", m.optimizer_state_bytes), ("activations", m.activations_bytes),
             ("backward transient", m.backward_transient_bytes), ("runtime", m.runtime_bytes),
             *([("DDP gradient buckets", m.ddp_gradient_buckets_bytes)] if m.ddp_gradient_buckets_bytes else []),
             ("total (peak)", m.total_bytes)]
    body = "".join(f"<tr><th>{escape(k)}</th><td>{v / 2**20:,.1f} MiB</td></tr>" for k, v in parts)
    fits = "fits" if m.fits else "does NOT fit"
    return (f'<h2>Memory</h2><table id="memory">{body}</table>'
            f"<p>{fits} in {m.device_memory_bytes / 2**30:,.1f} GiB</p>")


def layer_bars(layers: list[LayerPrediction]) -> str:
    """Stacked horizontal bars of forward/backward/update time per layer (the :data:`MAX_BARS` slowest)."""
    timed = sorted((row for row in layers if row.total_ms), key=lambda row: -(row.total_ms or 0.0))[:MAX_BARS]
    if not timed:
        return "<p>No timed layers.</p>"
    width, left, bar_h = 900, 260, 14
    height = 30 + bar_h * len(timed)
    longest = max(row.total_ms or 0.0 for row in timed)
    scale = (width - left - 20) / longest
    parts = [f'<svg id="layer-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for i, layer in enumerate(timed):
        y = 20 + i * bar_h
        x = float(left)
        parts.append(f'<text x="{left - 4}" y="{y + 11}" font-size="10" text-anchor="end">'
                     f"{escape(layer.name[:40])}</text>")
        for name in ("forward", "backward", "update"):
            ms = getattr(layer, f"{name}_ms") or 0.0
            if ms > 0:
                parts.append(f'<rect class="{name}" x="{x:.1f}" y="{y}" width="{ms * scale:.2f}" '
                             f'height="{bar_h - 2}" fill="{PASS_COLOURS[name]}">'
                             f"<title>{escape(layer.name)} {name} {ms:.4g} ms</title></rect>")
                x += ms * scale
    legend = "".join(f'<tspan fill="{c}">■ {n} </tspan>' for n, c in PASS_COLOURS.items())
    parts.append(f'<text x="{left}" y="12" font-size="11">{legend} (ms, slowest {len(timed)} layers)</text></svg>')
    return "<h2>Time per layer</h2>" + "".join(parts)


def roofline(layers: list[LayerPrediction], hardware: HardwareRead, precision: str, *, training: bool) -> str:
    """Log-log roofline of the device (peak FLOP/s at ``precision``, fp32's when the datasheet has no
    separate entry, and memory bandwidth) with one dot per layer at (operational intensity, FLOPs of the
    passes run / predicted time) (Williams, Waterman & Patterson, CACM 2009)."""
    peak = float(hardware.peak_flops_per_s.get(precision) or hardware.peak_flops_per_s["fp32"])  # type: ignore[call-overload]
    bandwidth = float(hardware.memory_bandwidth_bytes_per_s)
    points = [
        (row.operational_intensity_flops_per_byte,
         (row.forward_flops + (row.backward_flops if training else 0)) / (row.total_ms / 1e3), row.name)
        for row in layers if row.total_ms and row.operational_intensity_flops_per_byte > 0 and row.forward_flops > 0
    ]
    ridge = peak / bandwidth
    xs = [p[0] for p in points] + [ridge]
    x_lo, x_hi = math.log10(min(xs)) - 0.5, math.log10(max(xs)) + 0.5
    y_hi = math.log10(peak) + 0.3
    y_lo = min([math.log10(p[1]) for p in points] + [math.log10(bandwidth * 10**x_lo)]) - 0.3
    width, height, pad = 600, 380, 50

    def sx(v: float) -> float:
        return pad + (math.log10(v) - x_lo) / (x_hi - x_lo) * (width - 2 * pad)

    def sy(v: float) -> float:
        return height - pad - (math.log10(v) - y_lo) / (y_hi - y_lo) * (height - 2 * pad)

    x0, x1 = 10**x_lo, 10**x_hi
    roof = f"{sx(x0):.1f},{sy(bandwidth * x0):.1f} {sx(ridge):.1f},{sy(peak):.1f} {sx(x1):.1f},{sy(peak):.1f}"
    dots = "".join(f'<circle class="layer" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#4878d0" fill-opacity=".6">'
                   f"<title>{escape(n)}: {x:.3g} FLOP/B, {y / 1e12:.3g} TFLOP/s</title></circle>"
                   for x, y, n in points)
    return (
        f'<h2>Roofline on {escape(hardware.id)} ({escape(precision)})</h2>'
        f'<svg id="roofline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<polyline points="{roof}" fill="none" stroke="#a00" stroke-width="2"/>{dots}'
        f'<text x="{width / 2}" y="{height - 10}" font-size="11" text-anchor="middle">operational intensity '
        f'(FLOP/byte, log)</text><text x="12" y="{height / 2}" font-size="11" transform="rotate(-90 12 '
        f'{height / 2})" text-anchor="middle">attained FLOP/s (log)</text>'
        f'<text x="{sx(ridge):.1f}" y="{sy(peak) - 6:.1f}" font-size="10">peak {peak / 1e12:.3g} TFLOP/s, '
        f'{bandwidth / 1e9:.3g} GB/s</text></svg>'
    )


def _log_scale(lo: float, hi: float, start: float, end: float) -> Any:
    """Map [lo, hi] (positive) to [start, end] on a log axis, with a margin of 0.1 decade."""
    a, b = math.log10(lo) - 0.1, math.log10(hi) + 0.1
    return lambda v: start + (math.log10(v) - a) / (b - a) * (end - start)


def comparison(read: ComparisonRead) -> str:
    """Scatter of job time (x, log) against cost (y, log), one dot per device × count that fits, the Pareto
    front (``pareto``: over job time, cost and energy) as red dots joined in job-time order, rows without a
    price in a band above the plot (unknown cost counts as worst, as in the front); then the rows as a table.
    """
    rows = [r for r in read.rows if r.fits]
    if not rows:
        return '<h2>Hardware comparison</h2><p id="comparison">No device fits this job.</p>' + _unavailable(read)
    width, height, pad, band = 700, 420, 60, 40
    priced = [r for r in rows if r.cost_usd]
    sx = _log_scale(min(r.job_s for r in rows), max(r.job_s for r in rows), pad, width - 20)
    sy = (_log_scale(min(r.cost_usd or 0 for r in priced), max(r.cost_usd or 0 for r in priced), height - pad,
                     band + 10) if priced else None)

    def y(r: ComparisonRow) -> float:
        return band / 2 if sy is None or not r.cost_usd else float(sy(r.cost_usd))

    dots = "".join(
        f'<circle class="device{" pareto" if r.pareto else ""}" cx="{sx(r.job_s):.1f}" cy="{y(r):.1f}" '
        f'r="{5 if r.pareto else 4}" fill="{"#c00" if r.pareto else "#4878d0"}" fill-opacity=".75">'
        f"<title>{escape(r.hardware_id)} ×{r.device_count}: {r.job_s:.4g} s, "
        f"{'no price' if r.cost_usd is None else f'${r.cost_usd:.4g}'}, {_fmt(r.energy_j)} J</title></circle>"
        f'<text x="{sx(r.job_s) + 6:.1f}" y="{y(r) + 3:.1f}" font-size="9">{escape(r.hardware_id)}'
        f"{f' ×{r.device_count}' if r.device_count > 1 else ''}</text>"
        for r in rows
    )
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.job_s)
    line = " ".join(f"{sx(r.job_s):.1f},{y(r):.1f}" for r in front)
    ticks = ""
    if priced and sy is not None:
        lo, hi = min(r.cost_usd or 0 for r in priced), max(r.cost_usd or 0 for r in priced)
        ticks = "".join(f'<text x="{pad - 4}" y="{sy(v) + 3:.1f}" font-size="9" text-anchor="end">${v:.3g}</text>'
                        for v in sorted({lo, hi}))
    t_lo, t_hi = min(r.job_s for r in rows), max(r.job_s for r in rows)
    ticks += "".join(f'<text x="{sx(v):.1f}" y="{height - pad + 14}" font-size="9" text-anchor="middle">'
                     f"{v:.3g} s</text>" for v in sorted({t_lo, t_hi}))
    svg = (
        f'<svg id="comparison-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<line x1="{pad}" y1="{band}" x2="{width - 20}" y2="{band}" stroke="#bbb" stroke-dasharray="4 3"/>'
        f'<text x="{pad}" y="12" font-size="10">no price (cost unknown)</text>'
        f'<polyline id="pareto-front" points="{line}" fill="none" stroke="#c00" stroke-width="1.5"/>{dots}{ticks}'
        f'<text x="{width / 2}" y="{height - 15}" font-size="11" text-anchor="middle">job time (s, log)</text>'
        f'<text x="14" y="{height / 2}" font-size="11" transform="rotate(-90 14 {height / 2})" '
        f'text-anchor="middle">job cost (USD, log)</text></svg>'
    )
    return (f"<h2>Hardware comparison ({len(rows)} fitting rows; red: Pareto front over time, cost and energy)</h2>"
            + svg + _comparison_table(read) + _unavailable(read))


def _comparison_table(read: ComparisonRead) -> str:
    head = ("device", "devices", "iteration (ms)", "job (s)", "cost (USD)", "energy (kWh)", "fits", "Pareto")
    body = "".join(
        f'<tr class="{"pareto" if r.pareto else ""}"><td>{escape(r.hardware_id)}</td><td>{r.device_count}</td>'
        f"<td>{r.iteration_ms:.4g}</td><td>{r.job_s:.4g}</td><td>{_fmt(r.cost_usd, 4)}</td>"
        f"<td>{_fmt(None if r.energy_j is None else r.energy_j / 3.6e6, 4)}</td><td>{'yes' if r.fits else 'no'}</td>"
        f"<td>{'yes' if r.pareto else ''}</td></tr>"
        for r in read.rows
    )
    return ('<table id="comparison"><tr>' + "".join(f"<th>{h}</th>" for h in head) + f"</tr>{body}</table>")


def _unavailable(read: ComparisonRead) -> str:
    if not read.unavailable:
        return ""
    items = "".join(f"<li>{escape(u.hardware_id)} ×{u.device_count}: {escape(u.code)}</li>" for u in read.unavailable)
    return (f'<details id="unavailable"><summary>{len(read.unavailable)} not comparable</summary><ul>{items}</ul>'
            "</details>")


def comparison_csv(read: ComparisonRead) -> str:
    """Every row of ``read`` as CSV (the ``ComparisonRow`` fields; unknown values empty)."""
    columns = list(ComparisonRow.model_fields)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    for row in read.rows:
        values = row.model_dump()
        writer.writerow(["" if values[c] is None else values[c] for c in columns])
    return out.getvalue()


def layers_csv(prediction: PredictionRead) -> str:
    """Every layer of ``prediction`` as CSV (one header row; times in ms, null times empty), and in training the
    loss after the graph as a last row (``totals.loss``: its name, op type, method, FLOPs and bytes, and
    ``iteration.loss_ms`` as its ``total_ms``; no per-pass times), so that ``total_ms`` sums to
    ``iteration.layers_ms`` and the FLOP columns to ``totals``."""
    columns = ["name", "op_type", "kind", "method", "params", "forward_flops", "backward_flops", "bytes_read",
               "bytes_written", "operational_intensity_flops_per_byte", "bound", "forward_ms", "backward_ms",
               "update_ms", "total_ms", "total_ms_p10", "total_ms_p90"]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    for layer in prediction.layers:
        row = layer.model_dump()
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    if prediction.totals.loss is not None:
        loss = {**prediction.totals.loss.model_dump(), "total_ms": prediction.iteration.loss_ms}
        writer.writerow([loss.get(c, "") for c in columns])
    return out.getvalue()


def page(body: str) -> str:
    """The whole document."""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>layercast</title>'
            f"<style>{_CSS}</style></head><body><h1>layercast</h1>{_PROGRESS}{body}"
            f"<script>{_PROGRESS_JS}</script></body></html>")


def error(code: str, message: str) -> str:
    """An error paragraph carrying the problem code."""
    return f'<p class="error" id="error" data-code="{escape(code)}">{escape(code)}: {escape(message)}</p>'
