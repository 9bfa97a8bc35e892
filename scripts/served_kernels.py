"""The served predictor, as the API calls it, on stored kernel measurements of one source (issue 8).

Usage: ``PYTHONPATH=. python scripts/served_kernels.py --source deepbench|vidur|neusight|justus [--limit N]
[--out FILE]`` (15-60 s). It imports
the source from ``../shared/data`` into a throwaway SQLite database (``layercast import``: the one parser of the
source), rebuilds each stored measurement with the measurement domain's layer builder
(:func:`app.training.dataset.load_from_database`) and answers it through the shipped predictor
(:func:`app.predictor.registry.load_predictor`, inference, the row's device and precision), next to the pure
roofline (``max(FLOPs / peak, bytes / bandwidth)`` at the row's precision, direct algorithm) and FLOPs at 50 % of
that peak, on the same rows. Unlike ``layercast evaluate``, which scores the model's outputs on featurised rows,
this runs the served assembly too (precision semantics, autocast's weight casts, caps, the GEMM view, notes).

* ``deepbench`` (never trained on): Baidu DeepBench's fp32 forward convolutions and GEMMs, cuDNN 6-7 / cuBLAS
  called from C++ (stack ``cuda-library``) on real models' shapes, on the P100, GTX 1080 Ti and TITAN Xp. Those
  GPUs are in the training data through other sources (Justus, NeuSight), so this is held out by source and
  shape, not by GPU; the P100 board is not named (``DEEPBENCH_HARDWARE_NOTES``). One more column: the same
  predictor with the GEMM view of pointwise convolutions switched off (:func:`app.core.features.gemm_view_applies`
  patched to False everywhere it is read).
* ``neusight`` and ``justus`` (trained on, in distribution: the first ``--limit`` rows of each file, default 300,
  forward rows only): the served answer equals the model's on featurised rows there (checked: NeuSight's
  convolutions, every row to the last bit), so these tables show the model's own error on those rows.
* ``vidur`` (trained on: every row, in distribution): Vidur's fp16 LLM-layer ops on the A100 and A40, weights
  stored in fp16 as Vidur ran them, Kineto kernel sums served under ``pytorch-cuda-graph`` (no launch gaps). A
  check of the served assembly against the model's own accuracy (``layercast evaluate``: 6.8 % on the test
  configurations), not of generalisation; ``--limit`` rows per file (default 300).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.core import features  # noqa: E402
from app.core.costs import layer_cost  # noqa: E402
from app.core.features import is_pointwise_conv  # noqa: E402
from app.core.ir import ConvAttrs, Layer  # noqa: E402
from app.core.vocab import SoftwareStack  # noqa: E402
from app.measurements.importers import SOURCE_JUSTUS  # noqa: E402
from app.predictor import onnx_model, table  # noqa: E402
from app.predictor.base import LayerTimeQuery  # noqa: E402
from app.predictor.registry import load_predictor  # noqa: E402
from app.training.dataset import TrainingRows, load_from_database  # noqa: E402

MODELS = REPO / "models"


#: Per source: the families scored, the precision kept, the stack each row is served under (None: the row's own).
SOURCES: dict[str, tuple[tuple[str, ...] | None, str, str | None]] = {
    "deepbench": (("deepbench:conv2d", "deepbench:matmul"), "fp32", None),
    "vidur": (None, "fp16", SoftwareStack.PYTORCH_CUDA_GRAPH.value),
    "neusight": (None, "fp32-strict", None),
    "justus": (None, "fp32", None),
}


def family(layer: Layer, fam: str) -> str:
    """The row's group in the table: DeepBench's GEMM, pointwise convolution, other 1x1, 3x3, larger kernels;
    other sources' own family (``vidur:linear``...)."""
    if not fam.startswith("deepbench:"):
        return fam
    if not fam.endswith("conv2d"):
        return "GEMM"
    if is_pointwise_conv(layer):
        return "conv 1x1, stride 1 (pointwise)"
    k = max(layer.attrs.kernel_shape) if isinstance(layer.attrs, ConvAttrs) else 0
    return "conv 1x1, strided or padded" if k == 1 else "conv 3x3" if k == 3 else "conv 5x5 and larger"


@contextmanager
def gemm_view_off() -> Iterator[None]:
    """The predictor with pointwise convolutions featurised as convolutions (the code before the GEMM view)."""
    off: Callable[[str, str], bool] = lambda hardware_kind, stack: False  # noqa: E731
    with (mock.patch.object(features, "gemm_view_applies", off), mock.patch.object(table, "gemm_view_applies", off),
          mock.patch.object(onnx_model, "gemm_view_applies", off)):  # fmt: skip
        yield


def answers(rows: TrainingRows, idx: np.ndarray, stack: str | None) -> np.ndarray:
    """p50 forward ms of rows ``idx`` through the shipped predictor (a fresh one, no memo), each under ``stack``
    (None: its own)."""
    predictor = load_predictor(MODELS)
    queries = [LayerTimeQuery(rows.layers[i], layer_cost(rows.layers[i]), rows.hardware[str(rows.gpu[i])],
                              "inference", "none", str(rows.precision[i]),
                              software_stack=SoftwareStack(stack or str(rows.software_stack[i])))
               for i in idx.tolist()]  # fmt: skip
    return np.asarray([e.forward_ms for e in predictor.estimate(queries)], dtype=np.float64)


def table_md(groups: np.ndarray, truth: np.ndarray, methods: dict[str, np.ndarray]) -> list[str]:
    """One markdown row per group (and all rows): n, then MAPE and median predicted/measured per method."""
    head = "| rows | n | " + " | ".join(f"{m}: MAPE / median ratio" for m in methods) + " |"
    out = [head, "|---|---|" + "---|" * len(methods)]
    for g in [*sorted(set(groups.tolist())), "all"]:
        m = np.ones(len(truth), dtype=bool) if g == "all" else groups == g
        cells = []
        for pred in methods.values():
            r = pred[m] / truth[m]
            cells.append(f"{100 * np.mean(np.abs(r - 1)):.1f} % / {np.median(r):.2f}x")
        name = f"**{g}**" if g == "all" else g
        out.append(f"| {name} | {int(m.sum())} | " + " | ".join(cells) + " |")
    return out


def load(source: str, limit: int | None) -> TrainingRows:
    """The source's stored GPU rows, imported into a throwaway database."""
    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{d}/{source}.db"
        env = {**os.environ, "LAYERCAST_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
        extra = ["--limit", str(limit)] if limit else []
        for cmd in (["migrate"], ["import", source, *extra]):
            subprocess.run([sys.executable, "-m", "app.cli", *cmd], check=True, env=env, cwd=REPO,
                           stdout=subprocess.DEVNULL)
        stored = SOURCE_JUSTUS if source == "justus" else source  # the import command's name vs the stored one
        return load_from_database(url, sources=(stored,), hardware_kinds=("gpu",))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", choices=sorted(SOURCES), default="deepbench")
    p.add_argument("--limit", type=int, default=None,
                   help="rows per imported file (default: every DeepBench row, 300 for the others)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown report here too")
    args = p.parse_args(argv)
    families, precision, stack = SOURCES[args.source]
    limit = args.limit if args.limit is not None else (None if args.source == "deepbench" else 300)
    rows = load(args.source, limit)
    fams = np.asarray([str(f) for f in rows.family])
    keep = (rows.precision == precision) & (rows.pass_ == "forward")
    if families is not None:
        keep &= np.isin(fams, families)
    idx = np.nonzero(keep)[0]
    truth = rows.time_ms[idx].astype(np.float64)
    groups = np.asarray([family(rows.layers[i], fams[i]) for i in idx.tolist()])
    methods = {"learned (served)": answers(rows, idx, stack)}
    if args.source == "deepbench":
        with gemm_view_off():
            methods["learned, no GEMM view"] = answers(rows, idx, stack)
    roof, half = [], []
    for i in idx.tolist():
        hw, c = rows.hardware[str(rows.gpu[i])], layer_cost(rows.layers[i])
        peak, bw = hw.peak_for(precision), hw.memory_bandwidth_bytes_per_s
        roof.append(max(c.forward_flops / peak, c.forward_bytes / bw) * 1e3)
        half.append(c.forward_flops / (0.5 * peak) * 1e3)
    methods |= {"pure roofline": np.asarray(roof), "FLOPs at 50 % of peak": np.asarray(half)}
    gpus = ", ".join(sorted({str(g) for g in rows.gpu[idx]}))
    served = f"stack `{stack}`" if stack else "each row's own stack"
    lines = [f"# Served predictor on {args.source} {precision} kernels: {len(idx)} rows on {gpus}", "",
             f"Command: `PYTHONPATH=. python scripts/served_kernels.py --source {args.source}"
             + (f" --limit {args.limit}" if args.limit is not None else "") + f" --out <this file>`; predictor "
             f"{load_predictor(MODELS).version}; forward, inference, {served}. Ratio = predicted / measured (above "
             "1: too slow). See the script's docstring for what the rows are and whether they were trained on.", "",
             *table_md(groups, truth, methods)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
