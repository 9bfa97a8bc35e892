"""The served predictor on Baidu DeepBench's fp32 kernels, a source it was never trained on (issue 8).

Usage: ``PYTHONPATH=. python scripts/deepbench_kernels.py [--out reports/deepbench_kernels.md]`` (about 30 s).
It imports ``../shared/data/deepbench`` into a throwaway SQLite database (``layercast import deepbench``: the one
parser of the source), rebuilds each stored fp32 forward convolution and GEMM with the measurement domain's
layer builder (:func:`app.training.dataset.load_from_database`), and answers each one through the shipped
predictor as the API does (:func:`app.predictor.registry.load_predictor`, inference, the row's stack
``cuda-library``, its device: P100, GTX 1080 Ti and TITAN Xp, the catalog GPUs DeepBench timed). Side by side on
the same rows: the same predictor with the GEMM view of pointwise convolutions switched off
(:func:`app.core.features.gemm_view_applies` patched to False everywhere it is read), the pure roofline
(``max(FLOPs / fp32 peak, bytes / bandwidth)``, direct algorithm) and FLOPs at 50 % of the fp32 peak.

DeepBench times cuDNN 6-7 / cuBLAS kernels called from C++ (CUDA 8-10), the fastest algorithm cuDNN offers for
each convolution, on real models' shapes (DeepSpeech, ResNet, VGG, speaker ID: power-of-two channel counts).
Those GPUs are in the training data through other sources (Justus's TF1 layers, NeuSight's PyTorch kernels), so
this is held out by source and shape, not by GPU. The P100 board is not named (``DEEPBENCH_HARDWARE_NOTES``).
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
from app.predictor import onnx_model, table  # noqa: E402
from app.predictor.base import LayerTimeQuery  # noqa: E402
from app.predictor.registry import load_predictor  # noqa: E402
from app.training.dataset import TrainingRows, load_from_database  # noqa: E402

MODELS = REPO / "models"


def family(layer: Layer, fam: str) -> str:
    """The row's group in the table: GEMM, pointwise convolution, other 1x1, 3x3, larger kernels."""
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


def answers(rows: TrainingRows, keep: np.ndarray) -> np.ndarray:
    """p50 forward ms of the kept rows through the shipped predictor (a fresh one, no memo)."""
    predictor = load_predictor(MODELS)
    queries = [LayerTimeQuery(rows.layers[i], layer_cost(rows.layers[i]), rows.hardware[str(rows.gpu[i])],
                              "inference", "none", str(rows.precision[i]),
                              software_stack=SoftwareStack(str(rows.software_stack[i])))
               for i in np.nonzero(keep)[0].tolist()]  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the markdown report here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{d}/deepbench.db"
        env = {**os.environ, "LAYERCAST_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
        for cmd in (["migrate"], ["import", "deepbench"]):
            subprocess.run([sys.executable, "-m", "app.cli", *cmd], check=True, env=env, cwd=REPO,
                           stdout=subprocess.DEVNULL)
        rows = load_from_database(url, sources=("deepbench",), hardware_kinds=("gpu",))
    fams = np.asarray([str(f) for f in rows.family])
    keep = (np.isin(fams, ["deepbench:conv2d", "deepbench:matmul"]) & (rows.precision == "fp32")
            & (rows.pass_ == "forward"))  # fmt: skip
    idx = np.nonzero(keep)[0]
    truth = rows.time_ms[idx].astype(np.float64)
    groups = np.asarray([family(rows.layers[i], fams[i]) for i in idx.tolist()])
    view = answers(rows, keep)
    with gemm_view_off():
        no_view = answers(rows, keep)
    roof, half = [], []
    for i in idx.tolist():
        hw, c = rows.hardware[str(rows.gpu[i])], layer_cost(rows.layers[i])
        peak, bw = hw.peak_for("fp32"), hw.memory_bandwidth_bytes_per_s
        roof.append(max(c.forward_flops / peak, c.forward_bytes / bw) * 1e3)
        half.append(c.forward_flops / (0.5 * peak) * 1e3)
    methods = {"learned (served)": view, "learned, no GEMM view": no_view, "pure roofline": np.asarray(roof),
               "FLOPs at 50 % of peak": np.asarray(half)}
    gpus = ", ".join(sorted({str(g) for g in rows.gpu[idx]}))
    lines = [f"# Served predictor on DeepBench fp32 kernels (never trained on): {len(idx)} rows on {gpus}", "",
             f"Command: `PYTHONPATH=. python scripts/deepbench_kernels.py --out reports/deepbench_kernels.md`; "
             f"predictor {load_predictor(MODELS).version}; forward kernels, stack `cuda-library`, inference. "
             "Ratio = predicted / measured (above 1: too slow).", "",
             *table_md(groups, truth, methods)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
