"""Profiler: measured per-layer and per-iteration training times (``layercast profile``).

Modules (torch is imported only inside :mod:`app.profiler.timing`, :mod:`app.profiler.run` and
:mod:`app.profiler.e2e`, and only when they run; this package root and :mod:`app.profiler.sampler` are
torch-free so the API and the trainer can read the data without it):

* :mod:`app.profiler.sampler` — layer configurations drawn from the shapes real architectures use
  (ResNet, VGG, MobileNet, EfficientNet, ConvNeXt, BERT, GPT-2, ViT, LLaMA-style, LSTM/GRU LMs...) plus a
  small uniform component; the layer description of each is a JSON layer-list spec that
  :func:`app.core.json_import.import_json` accepts (or an explicit shape record for matmul/attention).
* :mod:`app.profiler.timing` — the timing engine (warm-up, repetitions, median/IQR/min; forward,
  backward, optimizer update timed separately; CPU ``perf_counter_ns`` or CUDA events).
* :mod:`app.profiler.run` — the resumable campaign writing one JSON line per (config, precision).
* :mod:`app.profiler.e2e` — whole training iterations of real architectures.

This module holds the torch-free readers of the files they write (``data/seed/*.jsonl.gz``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from app.core.vocab import TIMED_PASSES

#: Version of the row format written by :mod:`app.profiler.run` (field ``schema``).
ROW_SCHEMA = 1

#: Passes of a layer row, in :attr:`row["timings"]` (:class:`app.core.vocab.Pass`): ``forward`` is an
#: inference forward (eval mode, ``torch.no_grad``); ``train_forward``/``backward``/``update`` are the three
#: phases of one training step and ``train_step`` their per-repetition sum; ``backward_input``/
#: ``backward_weight`` are the optional split of the backward.
__all__ = ["ROW_SCHEMA", "TIMED_PASSES", "iter_rows"]


def iter_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a ``.jsonl`` or ``.jsonl.gz`` file, one per line.

    A truncated or unparsable line (an interrupted write) is skipped, never raised: the campaign that
    wrote it re-measures that configuration on resume.
    """
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                yield obj


def measurement_records(row: dict[str, Any], *, hardware_id: str) -> list[dict[str, Any]]:
    """Turn one profiler row into keyword dicts for :class:`app.measurements.models.Measurement`.

    One record per timed pass present in the row (``forward``, ``backward``, ``update``,
    ``train_step``, ...). ``config`` is the row's layer description (graph doc or shape record),
    ``context`` its measurement context plus the quartiles, ``measured_at`` a datetime.
    ``hardware_id`` is the catalog id of the measured device (the row's ``context`` names the CPU/GPU
    but not a catalog entry). Rows whose ``status`` is not ``"ok"`` give no records.
    """
    if row.get("status") != "ok":
        return []
    config = {
        "config_id": row["config_id"], "family": row["family"], "op": row["op"],
        "graph": row.get("graph"), "shapes": row.get("shapes"),
        "needs_input_grad": row.get("needs_input_grad", True),
    }
    out = []
    for pass_, st in (row.get("timings") or {}).items():
        if not st:
            continue
        ctx = dict(row.get("context") or {})
        ctx.update(q1_ms=st.get("q1_ms"), q3_ms=st.get("q3_ms"), min_ms=st.get("min_ms"))
        out.append({
            "hardware_id": hardware_id,
            "source": "profiler",
            "op_kind": row["op_kind"],
            "pass_": pass_,
            "optimizer": row.get("optimizer", "none") if pass_ in ("update", "train_step") else "none",
            "precision": row["precision"],
            "batch_size": row["batch_size"],
            "config": config,
            "time_ms_median": st["median_ms"],
            "time_ms_std": st.get("std_ms"),
            "repetitions": st.get("n"),
            "context": ctx,
            "measured_at": datetime.fromisoformat(row["measured_at"]) if row.get("measured_at") else None,
        })
    return out
