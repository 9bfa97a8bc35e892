"""Parser of the NeuSight kernel timings (``../shared/data/neusight/train_<family>_<gpu>.csv.gz``).

Source: sitar-lab/NeuSight @ 6945927d (MIT), the train split of the ASPLOS '25 data set (Lee, Phanishayee,
Mahajan, "Forecasting GPU Performance for Deep Learning Training and Inference"); see the folder's
README. One PyTorch op call per row, forward only, FP32 with TF32 off (``torch.backends.cudnn.allow_tf32 =
False``; matmul TF32 is off by default in torch 2.1): precision :data:`NEUSIGHT_PRECISION`
(``fp32-strict``, no tensor cores). ``Latency`` (ms) is the mean of the 5 fastest of 25 calls, each timed
between two CUDA events (:data:`NEUSIGHT_REPETITIONS`); PyTorch 2.1.0+cu121 / cuDNN 8902 on NVIDIA (from
the row), PyTorch 2.4.1 on AMD (from the upstream folder name ``p2.4.1``).

Every record: ``source`` ``neusight``, ``pass_`` ``forward``, ``software_stack`` ``pytorch-eager``,
``granularity`` ``kernel``, ``optimizer`` ``none``. ``config`` per family (shapes without the batch axis
where the JSON layer vocabulary of :mod:`app.core.json_import` expresses the op, ``batch_size`` = B):

======================== ============== =====================================================================
family / ``OPName``      ``op_kind``    ``config``
======================== ============== =====================================================================
bmm                      ``matmul``     ``{"layer": {"op": "matmul", "a": [B, M, N], "b": [B, N, K]}}``
                                        (``torch.bmm``, two activations; output ``[B, M, K]``)
linear                   ``gemm``       ``{"input_shape": [M, N], "layer": {"op": "linear",
                                        "out_features": K, "bias": true}}``
conv                     ``conv``       ``{"input_shape": [C_in, S, S], "layer": {"op": "conv2d",
                                        "out_channels": C_out, "kernel_size": k, "stride": s, "padding": p,
                                        "bias": false}, "data_layout": "NCHW"}``
relu, gelu, tanh         ``activation`` ``{"input_shape": [H], "layer": {"op": "relu"|"gelu"|"tanh"}}`` (GELU:
                                        ``nn.GELU()``, exact erf form)
add, mul, pow, div       ``elementwise`` ``{"layer": {"op": "elementwise", "fn": "add"|..., "shape": [B, H],
(addu, mulu, powu, divu)                "operand": "tensor"|"scalar"}}``: two ``[B, H]`` tensors, or one and
                                        a Python scalar in (0, 1] for the ``…u`` ops
ln                       ``norm``       ``{"input_shape": [H], "layer": {"op": "layernorm"}}``
softmax                  ``softmax``    ``{"input_shape": [H], "layer": {"op": "softmax"}}`` (last dim)
======================== ============== =====================================================================

``context`` keeps the launched kernel: ``kernel_name``, ``grid`` and ``block`` (``[x, y, z]``),
``kernels`` (every kernel the call launched, when the file lists more than ``kernel_name``), NeuSight's derived
``warps_per_sm``/``blocks_per_sm`` (NVIDIA files), plus the versions, the device name and the source
location. Skips (counted per ``Device``): a device without a catalog id (:data:`NEUSIGHT_HARDWARE_IDS`),
a missing or non-positive latency. A row whose ``OPName`` does not belong to the file's family, or a
malformed number, is an :class:`~app.measurements.importers.ImportFormatError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from app.core.vocab import Granularity, Pass, SoftwareStack
from app.hardware.catalog import load_catalog
from app.measurements.importers import (
    SOURCE_NEUSIGHT,
    ImportFormatError,
    MeasurementRecord,
    RecordStream,
    _int,
    _optional_float,
    _rows,
    _stream,
    _time,
)

NEUSIGHT_UPSTREAM = "sitar-lab/NeuSight@6945927d"
NEUSIGHT_PRECISION = "fp32-strict"  # TF32 off for matmuls and cuDNN (README: "No tensor cores are used")
NEUSIGHT_REPETITIONS = 25  # CUDA-event-timed calls per shape; Latency = mean of the 5 fastest
NEUSIGHT_TIMING = "CUDA events around one op call; mean of the 5 fastest of 25 calls, no L2 flush"
NEUSIGHT_FAMILIES: tuple[str, ...] = ("bmm", "linear", "conv", "elementwise", "ln", "softmax")

#: NeuSight ``Device`` column (``torch.cuda.get_device_name()``) → hardware catalog id.
NEUSIGHT_HARDWARE_IDS: dict[str, str] = {
    "Tesla P4": "p4",
    "Tesla P100-PCIE-16GB": "p100",
    "Tesla T4": "t4",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "AMD Instinct MI100": "mi100",
    "AMD Instinct MI210": "mi210",
}

_COMMON = ("OPName", "Latency", "Device", "Kernel Name", "Grid x", "Grid y", "Grid z", "Block x", "Block y",
           "Block z", "gpu", "source_file")
_SHAPES: dict[str, tuple[str, ...]] = {
    "bmm": ("B", "M", "N", "K"),
    "linear": ("B", "M", "N", "K"),
    "conv": ("B", "Input_Channel", "Output_Channel", "Kernel_Szie", "Input_Size", "Stride", "Padding"),
    "elementwise": ("B", "H"),
    "ln": ("B", "H"),
    "softmax": ("B", "H"),
}
_BINARY = {"add": "add", "mul": "mul", "pow": "pow", "div": "div",
           "addu": "add", "mulu": "mul", "powu": "pow", "divu": "div"}
_ACTIVATIONS = ("relu", "gelu", "tanh")
_TORCH_IN_PATH = re.compile(r"/p(\d+\.\d+\.\d+)/")

Builder = Callable[[str, Mapping[str, str], str, int], tuple[str, int, dict[str, Any]]]


def _bmm(op: str, row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any]]:
    b, m, n, k = (_int(row, c, name, line) for c in ("B", "M", "N", "K"))
    return "matmul", b, {"layer": {"op": "matmul", "a": [b, m, n], "b": [b, n, k]}}


def _linear(op: str, row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any]]:
    b, m, n, k = (_int(row, c, name, line) for c in ("B", "M", "N", "K"))
    return "gemm", b, {"input_shape": [m, n], "layer": {"op": "linear", "out_features": k, "bias": True}}


def _conv(op: str, row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any]]:
    b = _int(row, "B", name, line)
    c_in, c_out = _int(row, "Input_Channel", name, line), _int(row, "Output_Channel", name, line)
    kernel, size = _int(row, "Kernel_Szie", name, line), _int(row, "Input_Size", name, line)
    stride, pad = _int(row, "Stride", name, line), _int(row, "Padding", name, line, minimum=0)
    if kernel > size + 2 * pad:
        raise ImportFormatError(f"{name}: line {line}: kernel {kernel} larger than padded input {size}+2·{pad}")
    layer = {"op": "conv2d", "out_channels": c_out, "kernel_size": kernel, "stride": stride, "padding": pad,
             "bias": False}
    return "conv", b, {"input_shape": [c_in, size, size], "layer": layer, "data_layout": "NCHW"}


def _elementwise(op: str, row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any]]:
    b, h = _int(row, "B", name, line), _int(row, "H", name, line)
    if op in _ACTIVATIONS:
        return "activation", b, {"input_shape": [h], "layer": {"op": op}}
    if op not in _BINARY:
        raise ImportFormatError(f"{name}: line {line}: OPName {op!r} is not an elementwise op of NeuSight")
    operand = "scalar" if op.endswith("u") else "tensor"
    return "elementwise", b, {"layer": {"op": "elementwise", "fn": _BINARY[op], "shape": [b, h], "operand": operand}}


def _row_op(op_kind: str, json_op: str) -> Builder:
    def build(op: str, row: Mapping[str, str], name: str, line: int) -> tuple[str, int, dict[str, Any]]:
        b, h = _int(row, "B", name, line), _int(row, "H", name, line)
        return op_kind, b, {"input_shape": [h], "layer": {"op": json_op}}

    return build


_BUILDERS: dict[str, tuple[frozenset[str], Builder]] = {
    "bmm": (frozenset({"bmm"}), _bmm),
    "linear": (frozenset({"linear"}), _linear),
    "conv": (frozenset({"conv"}), _conv),
    "elementwise": (frozenset({*_BINARY, *_ACTIVATIONS}), _elementwise),
    "ln": (frozenset({"ln"}), _row_op("norm", "layernorm")),
    "softmax": (frozenset({"softmax"}), _row_op("softmax", "softmax")),
}


def neusight_family(path: str | Path) -> str:
    """The op family of a NeuSight file name ``train_<family>_<gpu>.csv.gz``.

    Raises :class:`ImportFormatError` for another name or an unknown family.
    """
    parts = Path(path).name.split("_")
    if len(parts) < 3 or parts[0] != "train" or parts[1] not in NEUSIGHT_FAMILIES:
        raise ImportFormatError(
            f"{Path(path).name}: a NeuSight file is named train_<family>_<gpu>.csv.gz, family in {NEUSIGHT_FAMILIES}"
        )
    return parts[1]


def _versions(row: Mapping[str, str]) -> dict[str, Any]:
    """Framework and library versions: from the row (NVIDIA) or the upstream folder name (AMD)."""
    torch = row.get("Torch Version", "").strip()
    if torch.startswith("p"):
        version: str | None = torch[1:]
    else:
        match = _TORCH_IN_PATH.search(row["source_file"])
        version = match[1] if match else None
    cuda = row.get("CUDA Version", "").strip()
    cudnn = row.get("CUDNN Version", "").strip()
    if version is not None and cuda:
        version = f"{version}+{cuda}"
    out: dict[str, Any] = {"framework": "PyTorch", "framework_version": version}
    if cudnn:
        out["cudnn_version"] = cudnn
    if not cuda:
        out["runtime_note"] = "ROCm version not recorded upstream" if "AMD" in row["Device"] else "CUDA not recorded"
    return out


def _kernel_context(row: Mapping[str, str], name: str, line: int) -> dict[str, Any]:
    kernels = [k for k in row.get("Kernels", "").split(";") if k.strip()]
    ctx: dict[str, Any] = {
        "kernel_name": row["Kernel Name"],
        "grid": [_int(row, f"Grid {a}", name, line) for a in "xyz"],
        "block": [_int(row, f"Block {a}", name, line) for a in "xyz"],
    }
    if kernels and kernels != [row["Kernel Name"].lower()]:  # the list only when it says more than the name
        ctx["kernels"] = kernels
    for col, key in (("Warps per SM", "warps_per_sm"), ("Blocks per SM", "blocks_per_sm")):
        value = _optional_float(row, col)
        if value is not None:
            ctx[key] = value
    return ctx


def iter_neusight(path: str | Path, *, limit: int | None = None) -> RecordStream:
    """Records of one NeuSight file ``train_<family>_<gpu>.csv.gz`` (see the module docstring).

    ``limit`` reads only the first ``limit`` rows. Raises ``FileNotFoundError`` (no file) and, while
    iterating, :class:`ImportFormatError` (bad name, missing columns, malformed row, an op of another
    family).
    """
    p = Path(path)
    family = neusight_family(p)
    ops, build = _BUILDERS[family]

    def parse(stream: RecordStream) -> Iterator[MeasurementRecord]:
        catalog = set(load_catalog())
        name = stream.source_file
        for index, line, row in _rows(stream, (*_COMMON, *_SHAPES[family]), limit):
            op = row["OPName"].strip()
            if op not in ops:
                raise ImportFormatError(f"{name}: line {line}: OPName {op!r} is not in family {family!r}")
            op_kind, batch, config = build(op, row, name, line)
            device = row["Device"].strip()
            hardware_id = stream.in_catalog(device, NEUSIGHT_HARDWARE_IDS.get(device), catalog)
            if hardware_id is None:
                continue
            time = _time(row, "Latency", name, line)
            if isinstance(time, str):
                stream.skip(device, time)
                continue
            context: dict[str, Any] = {
                "source_file": name,
                "source_row": index,
                "upstream": NEUSIGHT_UPSTREAM,
                "upstream_file": row["source_file"],
                "device_name": device,
                "op_name": op,
                **_versions(row),
                "timing": NEUSIGHT_TIMING,
                "precision": "FP32, TF32 off (torch.backends.cudnn.allow_tf32 = False; matmul TF32 off by default)",
                **_kernel_context(row, name, line),
            }
            yield MeasurementRecord(
                hardware_id=hardware_id,
                source=SOURCE_NEUSIGHT,
                op_kind=op_kind,
                pass_=Pass.FORWARD.value,
                optimizer="none",
                precision=NEUSIGHT_PRECISION,
                software_stack=SoftwareStack.PYTORCH_EAGER,
                granularity=Granularity.KERNEL,
                batch_size=batch,
                config=config,
                time_ms_median=time,
                time_ms_std=None,
                repetitions=NEUSIGHT_REPETITIONS,
                context=context,
            )

    return _stream(SOURCE_NEUSIGHT, p, parse)


def neusight_files(data_dir: str | Path, *, families: tuple[str, ...] = NEUSIGHT_FAMILIES) -> list[Path]:
    """The NeuSight CSVs of ``data_dir`` for ``families``, sorted by name.

    Raises ``FileNotFoundError`` when there are none and ``ValueError`` for an unknown family.
    """
    unknown = set(families) - set(NEUSIGHT_FAMILIES)
    if unknown:
        raise ValueError(f"unknown NeuSight families {sorted(unknown)}; known: {NEUSIGHT_FAMILIES}")
    d = Path(data_dir)
    paths = sorted(p for fam in families for p in d.glob(f"train_{fam}_*.csv.gz"))
    if not paths:
        raise FileNotFoundError(f"no NeuSight CSVs (train_<family>_<gpu>.csv.gz) under {d}")
    return paths
