"""Loader of the Justus et al. 2018 per-layer timing data (``../shared/data/justus2018/*.csv.gz``).

Each CSV row is one measured layer: a 2-D convolution (``conv_<GPU>.csv.gz``) or a fully connected
layer (``dense_<GPU>.csv.gz``) on one of five GPUs, timed for a forward pass (``optimizer == "none"``)
or for one training step (forward + backward + update with ``optimizer``). The loader turns every row
into the project's :class:`~app.core.ir.Layer` IR, costs it with :func:`app.core.costs.layer_cost`,
maps the ``gpu`` column to a hardware catalog id and featurises it with
:mod:`app.core.features` (the same code the API uses). Data are read in place, never copied.

Layer IR built for a row (TensorFlow 1.x semantics of the benchmark):

* conv: input NHWC ``(N, S, S, C_in)``; weight ``(C_out, C_in, k, k)`` plus bias ``(C_out,)`` when
  ``use_bias``; output ``(N, O, O, C_out)`` with ``O = ceil(S / stride)`` for ``same`` padding and
  ``O = ceil((S - k + 1) / stride)`` for ``valid`` (TensorFlow ``conv2d``).
* dense: Gemm ``(N, in) × (in, out)`` with weight ``(in, out)`` and bias ``(out,)`` (Keras dense layers
  always have a bias here): ``GemmAttrs(m=N, n=out, k=in)``.
* the attrs' ``activation`` is the activation fused after the layer; ``needs_input_grad`` stays True
  (the benchmark's input is a trainable ``tf.Variable``, and it matches an inner layer at serving).

Rows whose median time is missing or not positive (out-of-memory runs) are dropped.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.core.costs import layer_cost
from app.core.features import features_from_raw, raw_quantities
from app.core.hardware import HardwareSpec
from app.core.ir import ConvAttrs, GemmAttrs, Layer, OpKind, Tensor
from app.hardware.catalog import load_catalog
from app.measurements.importers import JUSTUS_GPU_IDS

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "justus2018"

# ``gpu`` column of the CSVs → hardware catalog id (the importer's mapping).
GPU_IDS: dict[str, str] = JUSTUS_GPU_IDS


def load_hardware_catalog() -> dict[str, HardwareSpec]:
    """The project's hardware catalog (``app.hardware.catalog.load_catalog``)."""
    return dict(load_catalog())


def conv_output_size(size: int, kernel: int, stride: int, padding: str) -> int:
    """Output side of a TensorFlow ``conv2d``: ``ceil(S/s)`` (``same``) or ``ceil((S-k+1)/s)`` (``valid``).

    Raises ``ValueError`` for another padding or a kernel larger than a ``valid`` input.
    """
    if padding == "same":
        return math.ceil(size / stride)
    if padding == "valid":
        if kernel > size:
            raise ValueError(f"valid conv with kernel {kernel} > input {size}")
        return math.ceil((size - kernel + 1) / stride)
    raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")


def conv_layer(
    *,
    batch: int,
    size: int,
    kernel: int,
    stride: int,
    c_in: int,
    c_out: int,
    padding: str,
    use_bias: bool,
    activation: str,
    name: str = "conv",
) -> Layer:
    """Layer IR of one Justus convolution row (NHWC, TensorFlow padding; see module docstring)."""
    out = conv_output_size(size, kernel, stride, padding)
    weights: tuple[Tensor, ...] = (Tensor(f"{name}.weight", (c_out, c_in, kernel, kernel)),)
    if use_bias:
        weights += (Tensor(f"{name}.bias", (c_out,)),)
    return Layer(
        name=name,
        op_type="Conv",
        kind=OpKind.CONV,
        inputs=(Tensor(f"{name}.x", (batch, size, size, c_in)),),
        outputs=(Tensor(f"{name}.y", (batch, out, out, c_out)),),
        weights=weights,
        attrs=ConvAttrs(
            weight_shape=weights[0].shape,
            kernel_shape=(kernel, kernel),
            strides=(stride, stride),
            pads=(0, 0, 0, 0),
            dilations=(1, 1),
            auto_pad="SAME_UPPER" if padding == "same" else "VALID",  # TensorFlow "same" pads the end more
            activation=activation,
        ),
    )


def dense_layer(*, batch: int, in_features: int, out_features: int, activation: str, name: str = "dense") -> Layer:
    """Layer IR of one Justus dense row: Gemm ``(N, in) × (in, out) + bias``."""
    return Layer(
        name=name,
        op_type="Gemm",
        kind=OpKind.GEMM,
        inputs=(Tensor(f"{name}.x", (batch, in_features)),),
        outputs=(Tensor(f"{name}.y", (batch, out_features)),),
        weights=(
            Tensor(f"{name}.weight", (in_features, out_features)),
            Tensor(f"{name}.bias", (out_features,)),
        ),
        attrs=GemmAttrs(m=batch, n=out_features, k=in_features, activation=activation),
    )


@dataclass(frozen=True, slots=True)
class JustusFile:
    """One source file: name, rows read (before/after dropping bad rows), sha256 of the gz bytes."""

    name: str
    rows_read: int
    rows_kept: int
    sha256: str


@dataclass(slots=True)
class JustusData:
    """Loaded rows, all arrays of length N in file order.

    ``source`` locates each row in its CSV (file index, row index). ``raw`` ``[N, len(RAW_FIELDS)]``
    float64 and ``features`` ``[N, len(FEATURE_NAMES)]`` float32 come
    from :mod:`app.core.features`; ``time_ms`` is the measured median; ``config`` a string key of the
    layer configuration without GPU and optimizer (family, batch, geometry, bias, activation), used to
    split without leaking a configuration across GPUs or optimizers.
    """

    family: np.ndarray  # "conv" | "dense"
    gpu: np.ndarray  # catalog id
    pass_: np.ndarray  # "forward" | "train_step"
    optimizer: np.ndarray
    time_ms: np.ndarray
    config: np.ndarray
    raw: np.ndarray
    features: np.ndarray
    source: np.ndarray  # [N, 2] int64: index into ``files``, row index within that file
    files: list[JustusFile] = field(default_factory=list)
    precision: np.ndarray | None = None  # [N] "fp32"/"bf16"...; None means all fp32

    def __len__(self) -> int:
        return int(self.time_ms.shape[0])

    @property
    def precisions(self) -> np.ndarray:
        """Precision of every row (``"fp32"`` where not recorded)."""
        return self.precision if self.precision is not None else np.full(len(self), "fp32")

    def subset(self, mask: np.ndarray) -> JustusData:
        """Rows selected by a boolean mask or index array (``files`` is kept as is)."""
        return JustusData(
            self.family[mask],
            self.gpu[mask],
            self.pass_[mask],
            self.optimizer[mask],
            self.time_ms[mask],
            self.config[mask],
            self.raw[mask],
            self.features[mask],
            self.source[mask],
            self.files,
            None if self.precision is None else self.precision[mask],
        )

    @staticmethod
    def concat(parts: Sequence[JustusData]) -> JustusData:
        """Rows of ``parts`` one after the other (``files`` concatenated; ``source`` file indices shifted)."""
        offsets = np.cumsum([0] + [len(p.files) for p in parts[:-1]])
        return JustusData(
            np.concatenate([p.family.astype(str) for p in parts]),
            np.concatenate([p.gpu.astype(str) for p in parts]),
            np.concatenate([p.pass_.astype(str) for p in parts]),
            np.concatenate([p.optimizer.astype(str) for p in parts]),
            np.concatenate([p.time_ms for p in parts]),
            np.concatenate([p.config.astype(str) for p in parts]),
            np.concatenate([p.raw for p in parts]),
            np.concatenate([p.features for p in parts]),
            np.concatenate([p.source + np.array([o, 0]) for p, o in zip(parts, offsets, strict=True)]),
            [f for p in parts for f in p.files],
            np.concatenate([p.precisions.astype(str) for p in parts]),
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def row_layer(family: str, row: Mapping[str, str]) -> tuple[Layer, str]:
    """Layer IR and configuration key of one CSV row (``family`` is ``"conv"`` or ``"dense"``).

    Raises ``KeyError``/``ValueError`` for a malformed row.
    """
    batch = int(row["batch_size"])
    act = row["activation"]
    if family == "conv":
        bias = row["use_bias"] == "True"
        args = (
            batch,
            int(row["input_size"]),
            int(row["kernel_size"]),
            int(row["stride"]),
            int(row["in_channels"]),
            int(row["out_channels"]),
            row["padding"],
        )
        layer = conv_layer(
            batch=args[0],
            size=args[1],
            kernel=args[2],
            stride=args[3],
            c_in=args[4],
            c_out=args[5],
            padding=args[6],
            use_bias=bias,
            activation=act,
        )
        return layer, f"conv|{'|'.join(map(str, args))}|{bias}|{act}"
    if family == "dense":
        fin, fout = int(row["in_features"]), int(row["out_features"])
        layer = dense_layer(batch=batch, in_features=fin, out_features=fout, activation=act)
        return layer, f"dense|{batch}|{fin}|{fout}|{act}"
    raise ValueError(f"family must be 'conv' or 'dense', got {family!r}")


def load_justus(
    data_dir: Path | None = None,
    *,
    catalog: Mapping[str, HardwareSpec] | None = None,
    sample: int | None = None,
    seed: int = 0,
    families: Sequence[str] = ("conv", "dense"),
) -> JustusData:
    """Read, build, cost and featurise every row of ``data_dir`` (default :data:`DEFAULT_DATA_DIR`).

    ``sample`` keeps a seeded random subset of that many rows per file (all rows when None).
    ``catalog`` maps ids to specs (default: the project catalog); the five GPU ids of :data:`GPU_IDS`
    must be in it. Raises ``FileNotFoundError`` when no CSV is found and ``KeyError`` for an unknown GPU.
    About 10 s for all 250k rows on one core.
    """
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    catalog = catalog if catalog is not None else load_hardware_catalog()
    paths = sorted(p for fam in families for p in data_dir.glob(f"{fam}_*.csv.gz"))
    if not paths:
        raise FileNotFoundError(f"no Justus CSVs under {data_dir}")
    rng = np.random.default_rng(seed)
    fam_l: list[str] = []
    gpu_l: list[str] = []
    pass_l: list[str] = []
    opt_l: list[str] = []
    time_l: list[float] = []
    cfg_l: list[str] = []
    raw_l: list[tuple[float, ...]] = []
    src_l: list[tuple[int, int]] = []
    files: list[JustusFile] = []
    for path in paths:
        family = path.name.split("_", 1)[0]
        with gzip.open(path, "rt", newline="") as f:
            rows = list(csv.DictReader(f))
        n_read = len(rows)
        if sample is not None and sample < n_read:
            idx = np.sort(rng.choice(n_read, size=sample, replace=False))
        else:
            idx = np.arange(n_read)
        kept = 0
        for i in idx:
            row = rows[i]
            try:
                t = float(row["time_ms_median"])
            except ValueError:
                continue
            if not math.isfinite(t) or t <= 0:
                continue
            gpu_id = GPU_IDS[row["gpu"]]
            hw = catalog[gpu_id]
            layer, cfg = row_layer(family, row)
            cost = layer_cost(layer)
            pass_ = row["pass"]
            opt = row["optimizer"]
            raw_l.append(
                raw_quantities(layer=layer, cost=cost, hardware=hw, pass_=pass_, optimizer=opt, precision="fp32")
            )
            fam_l.append(family)
            gpu_l.append(gpu_id)
            pass_l.append(pass_)
            opt_l.append(opt)
            time_l.append(t)
            cfg_l.append(cfg)
            src_l.append((len(files), int(i)))
            kept += 1
        files.append(JustusFile(path.name, n_read, kept, _sha256(path)))
    raw = np.asarray(raw_l, dtype=np.float64)
    return JustusData(
        family=np.asarray(fam_l),
        gpu=np.asarray(gpu_l),
        pass_=np.asarray(pass_l),
        optimizer=np.asarray(opt_l),
        time_ms=np.asarray(time_l, dtype=np.float64),
        config=np.asarray(cfg_l),
        raw=raw,
        features=features_from_raw(raw),
        source=np.asarray(src_l, dtype=np.int64).reshape(-1, 2),
        files=files,
    )


def split_by_config(
    config: np.ndarray, *, seed: int, fractions: tuple[float, float, float] = (0.7, 0.1, 0.2)
) -> np.ndarray:
    """Assign each row to ``0`` train, ``1`` validation or ``2`` test by its configuration key.

    Distinct keys are shuffled with ``seed`` and cut by ``fractions``, so every row of one layer
    configuration (on any GPU, with any optimizer) lands in the same split. Returns int8 ``[N]``.
    """
    keys, inverse = np.unique(config, return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(keys))
    n_tr = int(round(fractions[0] * len(keys)))
    n_va = int(round(fractions[1] * len(keys)))
    split_of_key = np.full(len(keys), 2, dtype=np.int8)
    split_of_key[order[:n_tr]] = 0
    split_of_key[order[n_tr : n_tr + n_va]] = 1
    return split_of_key[inverse]
