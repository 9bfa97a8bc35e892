"""Profiler: measured per-layer and per-iteration training times (``layercast profile``).

Modules (torch is imported only inside :mod:`app.profiler.timing`, :mod:`app.profiler.run`,
:mod:`app.profiler.e2e` and :mod:`app.profiler.gpu_bench`, and only when they run; this package root and
:mod:`app.profiler.sampler` are torch-free so the API and the trainer can read the data without it):

* :mod:`app.profiler.sampler` — layer configurations drawn from the shapes real architectures use
  (ResNet, VGG, MobileNet, EfficientNet, ConvNeXt, BERT, GPT-2, ViT, LLaMA-style, LSTM/GRU LMs...) plus a
  small uniform component; the layer description of each is a JSON layer-list spec that
  :func:`app.core.json_import.import_json` accepts (or an explicit shape record for matmul/attention).
* :mod:`app.profiler.timing` — the timing engine (warm-up, repetitions, median/IQR/min; forward,
  backward, optimizer update timed separately; CPU ``perf_counter_ns`` or CUDA events).
* :mod:`app.profiler.run` — the resumable campaign writing one JSON line per (config, precision).
* :mod:`app.profiler.e2e` — whole training iterations of real architectures.
* :mod:`app.profiler.gpu_bench` — one ~8-minute GPU session (kernels in fp32/tf32/bf16 and six whole
  ``torch.nn`` models) written in the same row format.

This module holds the torch-free readers of the files they write (``data/seed/*.jsonl.gz``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
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
