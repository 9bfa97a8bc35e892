"""Loaders of the kernel-level GPU training data: NeuSight (fp32 PyTorch kernels) and Vidur (fp16 LLM ops).

Both return :class:`app.training.justus.JustusData` (the trainer's row container), built like the Justus
loader: every row becomes a :class:`~app.core.ir.Layer`, is costed with :func:`app.core.costs.layer_cost`
and featurised with :func:`app.core.features.raw_quantities` against the catalog spec of its GPU, with
its precision and software stack (:data:`app.core.features.STACKS`). ``family`` is ``"<source>:<op>"``
(:func:`source_of` reads the source back); ``config`` keys the shape without the GPU, so one shape never
sits on both sides of a split.

* **NeuSight** (``../shared/data/neusight``, Lee et al. ASPLOS 2025): one PyTorch 2.1 op call per row,
  forward, ``torch.backends.cudnn.allow_tf32 = False`` and TF32 matmul off, so precision
  ``fp32-strict``; CUDA-event timed single calls: stack ``pytorch-eager``. ``Latency`` in ms.
* **Vidur** (``../shared/data/vidur``, Agrawal et al. MLSys 2024): the non-attention ops of one decoder
  block in fp16 at ``num_tokens`` tokens and a simulated tensor-parallel degree; the time is the sum of
  the op's GPU kernel durations under Kineto: stack ``pytorch-eager`` featurised with
  ``launch_gaps=False`` (no launch gaps in the time), precision ``fp16``, median of 20 repeats.

These loaders build the trainer's layer IR from the CSVs; ``app.measurements.neusight``/``vidur`` parse the
same files into measurement records for the database. Once the trainer reads the database
(``layercast train`` from measurements), these two loaders go.

Data are read in place. ``per_file`` keeps a seeded, stratified subset (rows per file and op) so that
training stays within minutes on two cores.
"""

from __future__ import annotations

import csv
import gzip
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from app.core.costs import layer_cost
from app.core.features import features_from_raw, raw_quantities
from app.core.hardware import HardwareSpec
from app.core.ir import ConvAttrs, GemmAttrs, Layer, OpKind, Tensor
from app.training.justus import JustusData, JustusFile, _sha256, load_hardware_catalog

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
NEUSIGHT_DIR = SHARED_DATA / "neusight"
VIDUR_DIR = SHARED_DATA / "vidur"

#: NeuSight ``gpu`` column → catalog id.
NEUSIGHT_GPUS: dict[str, str] = {
    "P4": "p4",
    "P100-PCIe-16GB": "p100",
    "T4": "t4",
    "A100-PCIe-40GB": "a100-pcie-40gb",
    "A100-PCIe-80GB": "a100-pcie-80gb",
    "MI100": "mi100",
    "MI210": "mi210",
}
#: Vidur ``device_sku`` → catalog id (Vidur's a100 data serve its A100 80 GB DGX nodes).
VIDUR_GPUS: dict[str, str] = {"a100": "a100-sxm4-80gb", "a40": "a40"}

_BINARY = {"add": "Add", "mul": "Mul", "pow": "Pow", "div": "Div"}
_UNARY_SCALAR = {"addu": "Add", "mulu": "Mul", "powu": "Pow", "divu": "Div"}
_ACT = {"relu": "Relu", "gelu": "Gelu", "tanh": "Tanh"}

VIDUR_OPS: tuple[str, ...] = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


def source_of(family: np.ndarray) -> np.ndarray:
    """Source of each row from its ``family``: ``neusight``/``vidur`` (prefix), ``justus`` (``conv``/``dense``)
    or ``cpu`` (every other family: the profiler's)."""
    fam = np.asarray(family).astype(str)
    out = np.full(len(fam), "cpu", dtype=object)
    out[np.char.startswith(fam, "neusight:")] = "neusight"
    out[np.char.startswith(fam, "vidur:")] = "vidur"
    out[np.isin(fam, ["conv", "dense"])] = "justus"
    return out.astype(str)


def _t(name: str, shape: Sequence[int], dtype: str = "float32") -> Tensor:
    return Tensor(name, tuple(int(v) for v in shape), dtype)


def neusight_layer(op: str, row: Mapping[str, str]) -> tuple[Layer, str]:
    """Layer IR and shape key of one NeuSight row (op = ``OPName``). Raises ``KeyError``/``ValueError``."""
    if op in ("bmm", "linear"):
        b, m, n, k = (int(float(row[c])) for c in ("B", "M", "N", "K"))
        if op == "bmm":
            layer = Layer("bmm", "MatMul", OpKind.MATMUL, (_t("a", (b, m, n)), _t("b", (b, n, k))),
                          (_t("y", (b, m, k)),), attrs=GemmAttrs(m=m, n=k, k=n, batch=(b,)))  # fmt: skip
        else:
            layer = Layer("linear", "Gemm", OpKind.GEMM, (_t("x", (b, m, n)),), (_t("y", (b, m, k)),),
                          weights=(_t("w", (n, k)), _t("bias", (k,))), attrs=GemmAttrs(m=b * m, n=k, k=n))  # fmt: skip
        return layer, f"{op}|{b}|{m}|{n}|{k}"
    if op == "conv":
        b, ci, co, ks, s, st, pad = (int(float(row[c])) for c in (
            "B", "Input_Channel", "Output_Channel", "Kernel_Szie", "Input_Size", "Stride", "Padding"))  # fmt: skip
        o = (s + 2 * pad - ks) // st + 1
        if o < 1:
            raise ValueError("empty conv output")
        attrs = ConvAttrs(
            weight_shape=(co, ci, ks, ks), kernel_shape=(ks, ks), strides=(st, st), pads=(pad,) * 4, dilations=(1, 1)
        )
        layer = Layer("conv", "Conv", OpKind.CONV, (_t("x", (b, ci, s, s)),), (_t("y", (b, co, o, o)),),
                      weights=(_t("w", (co, ci, ks, ks)),), attrs=attrs)  # fmt: skip
        return layer, f"conv|{b}|{ci}|{co}|{ks}|{s}|{st}|{pad}"
    b, h = int(float(row["B"])), int(float(row["H"]))
    x = _t("x", (b, h))
    y = (_t("y", (b, h)),)
    if op in _BINARY:
        layer = Layer(op, _BINARY[op], OpKind.ELEMENTWISE, (x, _t("x2", (b, h))), y)
    elif op in _UNARY_SCALAR:
        layer = Layer(op, _UNARY_SCALAR[op], OpKind.ELEMENTWISE, (x,), y)
    elif op in _ACT:
        layer = Layer(op, _ACT[op], OpKind.ACTIVATION, (x,), y)
    elif op == "ln":
        layer = Layer(op, "LayerNormalization", OpKind.NORM, (x,), y, weights=(_t("g", (h,)), _t("beta", (h,))))
    elif op == "softmax":
        layer = Layer(op, "Softmax", OpKind.SOFTMAX, (x,), y)
    else:
        raise ValueError(f"unknown NeuSight op {op!r}")
    return layer, f"{op}|{b}|{h}"


def _stratified(n: int, keys: Sequence[str], per_file: int | None, rng: np.random.Generator) -> np.ndarray:
    """Indices keeping about ``per_file`` seeded random rows in all, the same share of each key (at most
    ``per_file / distinct keys`` rows of each; all rows when None), sorted."""
    if per_file is None:
        return np.arange(n)
    karr = np.asarray(keys)
    per_key = max(1, per_file // max(1, len(np.unique(karr))))
    keep: list[np.ndarray] = []
    for k in np.unique(karr):
        idx = np.nonzero(karr == k)[0]
        keep.append(idx if len(idx) <= per_key else rng.choice(idx, size=per_key, replace=False))
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def _finish(parts: dict[str, list], files: list[JustusFile]) -> JustusData:
    from app.core.features import RAW_FIELDS

    raw = np.asarray(parts["raw"], dtype=np.float64).reshape(-1, len(RAW_FIELDS))
    n = len(parts["time"])
    return JustusData(
        family=np.asarray(parts["family"], dtype=object).astype(str),
        gpu=np.asarray(parts["gpu"], dtype=object).astype(str),
        pass_=np.full(n, "forward"),
        optimizer=np.full(n, "none"),
        time_ms=np.asarray(parts["time"], dtype=np.float64),
        config=np.asarray(parts["config"], dtype=object).astype(str),
        raw=raw,
        features=features_from_raw(raw),
        source=np.asarray(parts["source"], dtype=np.int64).reshape(-1, 2),
        files=files,
        precision=np.asarray(parts["precision"], dtype=object).astype(str),
    )


def load_neusight(
    data_dir: Path | None = None,
    *,
    catalog: Mapping[str, HardwareSpec] | None = None,
    per_file: int | None = None,
    seed: int = 0,
) -> JustusData:
    """NeuSight rows (module docstring); about ``per_file`` rows kept per file, stratified by op, all when None.

    Rows with a non-positive or missing ``Latency`` are dropped. Raises ``FileNotFoundError`` when the
    directory holds no ``train_*.csv.gz``.
    """
    data_dir = Path(data_dir) if data_dir is not None else NEUSIGHT_DIR
    catalog = catalog if catalog is not None else load_hardware_catalog()
    paths = sorted(data_dir.glob("train_*.csv.gz"))
    if not paths:
        raise FileNotFoundError(f"no NeuSight train_*.csv.gz under {data_dir}")
    rng = np.random.default_rng(seed)
    parts: dict[str, list] = {k: [] for k in ("raw", "family", "gpu", "time", "config", "source", "precision")}
    files: list[JustusFile] = []
    for path in paths:
        with gzip.open(path, "rt", newline="") as f:
            rows = list(csv.DictReader(f))
        idx = _stratified(len(rows), [r["OPName"] for r in rows], per_file, rng)
        kept = 0
        for i in idx:
            row = rows[int(i)]
            try:
                t = float(row["Latency"])
                layer, key = neusight_layer(row["OPName"], row)
            except (KeyError, ValueError):
                continue
            if not math.isfinite(t) or t <= 0:
                continue
            hw = catalog[NEUSIGHT_GPUS[row["gpu"]]]
            cost = layer_cost(layer)
            parts["raw"].append(raw_quantities(layer=layer, cost=cost, hardware=hw, pass_="forward", optimizer="none",
                                               precision="fp32-strict", stack="pytorch-eager"))  # fmt: skip
            parts["family"].append(f"neusight:{row['OPName']}")
            parts["gpu"].append(hw.id)
            parts["time"].append(t)
            parts["config"].append(f"neusight|{key}")
            parts["source"].append((len(files), int(i)))
            parts["precision"].append("fp32-strict")
            kept += 1
        files.append(JustusFile(path.name, len(rows), kept, _sha256(path)))
    return _finish(parts, files)


def vidur_layers(row: Mapping[str, str]) -> dict[str, Layer]:
    """The fp16 layers of one Vidur row (one model, token count and TP degree), keyed by :data:`VIDUR_OPS`.

    Shapes follow Vidur's ``mlp_impl.py`` (``vidur/README.md``): head_dim = n_embd / n_head, QKV width
    ``(n_head + 2 n_kv_head) head_dim / TP``, MLP up width ``k n_expanded / TP`` (k = 2 gated).
    """
    t = int(float(row["num_tokens"]))
    tp = int(float(row["num_tensor_parallel_workers"]))
    nh, nkv = int(float(row["n_head"])), int(float(row["n_kv_head"]))
    e, ff = int(float(row["n_embd"])), int(float(row["n_expanded_embd"]))
    vocab = int(float(row["vocab_size"]))
    gated = row["use_gated_mlp"].strip().lower() == "true"
    hd = e // nh
    qkv = (nh + 2 * nkv) * hd // tp
    up = (2 if gated else 1) * ff // tp
    h = "float16"

    def gemm(name: str, k: int, n: int) -> Layer:
        return Layer(name, "Gemm", OpKind.GEMM, (_t("x", (t, k), h),), (_t("y", (t, n), h),),
                     weights=(_t("w", (k, n), h),), attrs=GemmAttrs(m=t, n=n, k=k))  # fmt: skip

    def norm(name: str) -> Layer:
        return Layer(name, "LayerNormalization", OpKind.NORM, (_t("x", (t, e), h),), (_t("y", (t, e), h),),
                     weights=(_t("g", (e,), h),))  # fmt: skip

    q, k_ = nh * hd // tp, nkv * hd // tp
    act_in = (_t("x", (t, up), h),)
    act_out = (_t("y", (t, ff // tp), h),)
    return {
        "emb": Layer("emb", "Gather", OpKind.EMBEDDING, (_t("ids", (t,), "int64"),), (_t("y", (t, e), h),),
                     weights=(_t("table", (max(vocab // tp, 1), e), h),)),  # fmt: skip
        "input_layernorm": norm("input_layernorm"),
        "attn_pre_proj": gemm("attn_pre_proj", e, qkv),
        "attn_rope": Layer("attn_rope", "RotaryEmbedding", OpKind.ELEMENTWISE,
                           (_t("q", (t, q), h), _t("k", (t, k_), h)), (_t("q2", (t, q), h), _t("k2", (t, k_), h))),
        "attn_post_proj": gemm("attn_post_proj", max(nh * hd // tp, 1), e),
        "post_attention_layernorm": norm("post_attention_layernorm"),
        "mlp_up_proj": gemm("mlp_up_proj", e, up),
        "mlp_act": Layer("mlp_act", "SiLU" if gated else "Gelu", OpKind.ACTIVATION, act_in, act_out),
        "mlp_down_proj": gemm("mlp_down_proj", max(ff // tp, 1), e),
        "add": Layer("add", "Add", OpKind.ELEMENTWISE, (_t("a", (t, e), h), _t("b", (t, e), h)), (_t("y", (t, e), h),)),
    }  # fmt: skip


def load_vidur(
    data_dir: Path | None = None,
    *,
    catalog: Mapping[str, HardwareSpec] | None = None,
    per_file: int | None = None,
    seed: int = 0,
) -> JustusData:
    """Vidur per-op rows (module docstring): one row per op with a positive median; ``per_file`` keeps that
    many (model, tokens, TP) rows per file, seeded. Raises ``FileNotFoundError`` without ``compute_mlp_*``."""
    data_dir = Path(data_dir) if data_dir is not None else VIDUR_DIR
    catalog = catalog if catalog is not None else load_hardware_catalog()
    paths = sorted(data_dir.glob("compute_mlp_*.csv.gz"))
    if not paths:
        raise FileNotFoundError(f"no Vidur compute_mlp_*.csv.gz under {data_dir}")
    rng = np.random.default_rng(seed)
    parts: dict[str, list] = {k: [] for k in ("raw", "family", "gpu", "time", "config", "source", "precision")}
    files: list[JustusFile] = []
    for path in paths:
        with gzip.open(path, "rt", newline="") as f:
            rows = list(csv.DictReader(f))
        idx = _stratified(len(rows), ["all"] * len(rows), per_file, rng)
        kept = 0
        for i in idx:
            row = rows[int(i)]
            try:
                layers = vidur_layers(row)
            except (KeyError, ValueError, ZeroDivisionError):
                continue
            hw = catalog[VIDUR_GPUS[row["device_sku"]]]
            key = f"vidur|{row['model']}|{row['num_tokens']}|{row['num_tensor_parallel_workers']}"
            for op in VIDUR_OPS:
                cell = row.get(f"time_stats.{op}.median", "")
                try:
                    t = float(cell)
                except ValueError:
                    continue
                if not math.isfinite(t) or t <= 0:
                    continue
                layer = layers[op]
                raw = raw_quantities(layer=layer, cost=layer_cost(layer), hardware=hw, pass_="forward",
                                     optimizer="none", precision="fp16", launch_gaps=False)  # fmt: skip
                parts["raw"].append(raw)
                parts["family"].append(f"vidur:{op}")
                parts["gpu"].append(hw.id)
                parts["time"].append(t)
                parts["config"].append(key)
                parts["source"].append((len(files), int(i)))
                parts["precision"].append("fp16")
            kept += 1
        files.append(JustusFile(path.name, len(rows), kept, _sha256(path)))
    return _finish(parts, files)
