"""The trainer's one data source: stored measurements (the ``measurements`` table) as featurised rows.

``layercast train``, ``evaluate``, ``finetune`` and retraining all read the measurement database through
:func:`load_training_rows`; the files themselves are parsed once, by the importers of
:mod:`app.measurements` (``layercast import justus|deepbench|neusight|vidur|profiler``). Each stored
measurement becomes, when its layer can be rebuilt:

* a :class:`~app.core.ir.Layer` (:func:`record_layer`: the JSON layer vocabulary of
  :mod:`app.core.json_import` where the config uses it, else the source's shape record);
* the :class:`~app.core.hardware.HardwareSpec` stored with its hardware row;
* pass, optimizer, precision, software stack, granularity and the measured median time in ms;
* a configuration key (:func:`config_key`) without the device, optimizer and precision, so a split by
  key never puts one configuration on both sides;
* the feature row of :mod:`app.core.features` (``raw_quantities`` → ``features_from_raw``), the same
  function the API serves with.

Rows that cannot be used are counted in :attr:`TrainingRows.skipped` by ``(source, reason)``, never
dropped silently: a pass the features do not model, a config no builder knows (collectives), a profiler
config that rebuilds into several IR layers (fused attention), an op the cost
model does not support, or a NULL software stack (reported rows stored before migration 0002).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from sqlalchemy import Text, select, type_coerce
from sqlalchemy.orm import Session

from app.core.costs import layer_cost
from app.core.features import RAW_FIELDS, features_from_raw, raw_quantities
from app.core.hardware import HardwareSpec
from app.core.ir import ConvAttrs, GemmAttrs, Layer, OpKind, Tensor
from app.core.json_import import import_json
from app.core.precision import Precision
from app.core.shape_records import shape_record_layer
from app.core.vocab import Granularity
from app.errors import InvalidGraph
from app.hardware.catalog import spec_from_dict
from app.hardware.models import Hardware
from app.measurements.importers import PROFILER_SOURCES, SOURCE_JUSTUS, SOURCE_PROFILER, SOURCE_VIDUR
from app.measurements.models import Measurement

#: Passes the feature function models (``app.core.features.PASSES``).
FEATURE_PASSES: tuple[str, ...] = ("forward", "train_step")
#: What ``layercast train`` reads by default: the sources predictor v2 was trained on.
DEFAULT_SOURCES: tuple[str, ...] = (SOURCE_JUSTUS, SOURCE_PROFILER)

SKIP_PASS = "pass_not_featurised"
SKIP_NO_BUILDER = "no_layer_builder"
SKIP_MULTI_LAYER = "config_is_several_layers"
SKIP_UNSUPPORTED = "cost_unsupported"
SKIP_BAD_CONFIG = "config_does_not_rebuild"
SKIP_NO_STACK = "software_stack_missing"
#: A measurement at a precision the cost model has no peaks for (DeepBench's int8 kernels).
SKIP_PRECISION = "precision_not_modelled"
#: A measurement whose arithmetic ran at another precision than its operands are stored in (``config``
#: ``math_precision``: DeepBench's P100 "16 bit inputs, 32 bit math" kernels, stored fp16): no served precision
#: is fp16 storage with fp32 math, and as fp16 rows (featurised with the fp16 peak) they teach that fp16 runs no
#: faster than fp32.
#: (Only the DeepBench importer writes the key; a database imported before it existed keeps those rows as fp16
#: until ``layercast import deepbench`` runs again.)
SKIP_MATH = "math_precision_not_modelled"

_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}  # every other precision: float32 tensors


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One imported file as the loader saw it: ``rows_read`` stored measurements, ``rows_kept`` loaded.

    ``sha256`` is a digest of the loaded rows (measurement id and time, in id order): the training-data
    watermark of the artifact metadata.
    """

    name: str
    rows_read: int
    rows_kept: int
    sha256: str


@dataclass(slots=True)
class TrainingRows:
    """Featurised training rows; every array has length N, in measurement-id order.

    ``gpu`` is the hardware id of each row (CPUs too; the name is the trainer's); ``family`` the op
    family (Justus ``conv``/``dense``, the profiler's family, ``<source>:<op>`` for the kernel sources);
    ``config`` the split key (:func:`config_key`); ``raw`` ``[N, len(RAW_FIELDS)]`` float64 and
    ``features`` ``[N, F]`` float32 from :mod:`app.core.features`; ``time_ms`` the measured median (ms);
    ``layers`` the rebuilt IR layer of each row and ``hardware`` the spec of each hardware id.
    """

    family: np.ndarray
    gpu: np.ndarray
    pass_: np.ndarray
    optimizer: np.ndarray
    time_ms: np.ndarray
    config: np.ndarray
    raw: np.ndarray
    features: np.ndarray
    source: np.ndarray
    precision: np.ndarray
    software_stack: np.ndarray
    granularity: np.ndarray
    op_kind: np.ndarray
    measurement_id: np.ndarray
    layers: list[Layer] = field(default_factory=list)
    files: list[SourceFile] = field(default_factory=list)
    hardware: dict[str, HardwareSpec] = field(default_factory=dict)
    skipped: Counter[tuple[str, str]] = field(default_factory=Counter)

    def __len__(self) -> int:
        return int(self.time_ms.shape[0])

    @property
    def precisions(self) -> np.ndarray:
        """Precision of every row (kept for the trainer's callers)."""
        return self.precision

    def _arrays(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in ("layers", "files", "hardware", "skipped")]

    def subset(self, mask: np.ndarray) -> TrainingRows:
        """Rows selected by a boolean mask or an index array (``files``/``hardware``/``skipped`` kept)."""
        idx = np.arange(len(self))[mask]
        arrays = {name: getattr(self, name)[idx] for name in self._arrays()}
        layers = [self.layers[i] for i in idx] if self.layers else []
        return TrainingRows(**arrays, layers=layers, files=self.files, hardware=self.hardware, skipped=self.skipped)

    @staticmethod
    def concat(parts: Sequence[TrainingRows]) -> TrainingRows:
        """Rows of ``parts`` one after the other (files and hardware merged, skip counts summed)."""
        names = parts[0]._arrays()
        arrays = {}
        for name in names:
            values = [getattr(p, name) for p in parts]
            arrays[name] = np.concatenate([v.astype(str) if v.dtype.kind in "USO" else v for v in values])
        skipped: Counter[tuple[str, str]] = Counter()
        for p in parts:
            skipped.update(p.skipped)
        return TrainingRows(
            **arrays,
            layers=[la for p in parts for la in p.layers] if all(p.layers or not len(p) for p in parts) else [],
            files=[f for p in parts for f in p.files],
            hardware={k: v for p in parts for k, v in p.hardware.items()},
            skipped=skipped,
        )


# ------------------------------------------------------------------------------------ record -> layer


def tf_conv_output_size(size: int, kernel: int, stride: int, padding: str) -> int:
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


def justus_conv_layer(*, batch: int, size: int, kernel: int, stride: int, c_in: int, c_out: int, padding: str,
                      use_bias: bool, activation: str, name: str = "conv") -> Layer:  # fmt: skip
    """Layer IR of a Justus 2018 convolution (TensorFlow 1.x): input NHWC ``(N, S, S, C_in)``, weight
    ``(C_out, C_in, k, k)`` (+ bias), output ``(N, O, O, C_out)`` with ``O`` from :func:`tf_conv_output_size`;
    the attrs' ``activation`` is the activation fused after the layer."""
    out = tf_conv_output_size(size, kernel, stride, padding)
    weights: tuple[Tensor, ...] = (Tensor(f"{name}.weight", (c_out, c_in, kernel, kernel)),)
    if use_bias:
        weights += (Tensor(f"{name}.bias", (c_out,)),)
    return Layer(
        name=name, op_type="Conv", kind=OpKind.CONV,
        inputs=(Tensor(f"{name}.x", (batch, size, size, c_in)),),
        outputs=(Tensor(f"{name}.y", (batch, out, out, c_out)),),
        weights=weights,
        attrs=ConvAttrs(
            weight_shape=weights[0].shape, kernel_shape=(kernel, kernel), strides=(stride, stride), pads=(0, 0, 0, 0),
            dilations=(1, 1), auto_pad="SAME_UPPER" if padding == "same" else "VALID",  # TF "same" pads the end more
            activation=activation,
        ),
    )  # fmt: skip


def justus_dense_layer(*, batch: int, in_features: int, out_features: int, activation: str,
                       name: str = "dense") -> Layer:  # fmt: skip
    """Layer IR of a Justus 2018 dense layer: Gemm ``(N, in) × (in, out) + bias``, ``GemmAttrs(m=N, n=out, k=in)``."""
    return Layer(
        name=name, op_type="Gemm", kind=OpKind.GEMM,
        inputs=(Tensor(f"{name}.x", (batch, in_features)),),
        outputs=(Tensor(f"{name}.y", (batch, out_features)),),
        weights=(Tensor(f"{name}.weight", (in_features, out_features)), Tensor(f"{name}.bias", (out_features,))),
        attrs=GemmAttrs(m=batch, n=out_features, k=in_features, activation=activation),
    )  # fmt: skip


def _justus_layer(config: Mapping[str, Any], batch: int) -> Layer:
    layer, act = config["layer"], str(config.get("activation", "none"))
    if layer["op"] == "conv2d":
        c_in, size, _ = config["input_shape"]
        return justus_conv_layer(batch=batch, size=int(size), kernel=int(layer["kernel_size"]),
                                 stride=int(layer.get("stride", 1)), c_in=int(c_in), c_out=int(layer["out_channels"]),
                                 padding=str(config["tf_padding"]), use_bias=bool(layer.get("bias", True)),
                                 activation=act)  # fmt: skip
    return justus_dense_layer(batch=batch, in_features=int(config["input_shape"][0]),
                              out_features=int(layer["out_features"]), activation=act)  # fmt: skip


def record_layer(*, source: str, config: Mapping[str, Any], batch_size: int, precision: str) -> Layer | str:
    """The IR layer of one stored measurement, or the skip reason (``SKIP_*``) when it has none.

    Justus configs rebuild with the TensorFlow semantics of the benchmark (:func:`justus_conv_layer`,
    :func:`justus_dense_layer`); profiler configs with :meth:`app.profiler.sampler.LayerConfig.to_layers`
    (the importer stores the profiler's row fields); ``{"input_shape", "layer"}`` configs through
    :func:`app.core.json_import.import_json` at ``batch_size`` with tensors in the precision's dtype;
    shape records (``matmul`` with ``a``/``b`` or DeepBench's ``m``/``n``/``k``, ``elementwise``,
    ``rope``) directly. Collectives have no builder (``no_layer_builder``). DeepBench RNN records rebuild
    through the JSON ``lstm``/``gru``/``rnn`` layer, whose cost includes the input projection DeepBench
    does not time (``config["input_projection_timed"]`` is false).
    """
    dtype = _DTYPE.get(precision, "float32")
    try:
        if source == SOURCE_JUSTUS:
            return _justus_layer(config, batch_size)
        if source in PROFILER_SOURCES:
            from app.profiler.sampler import LayerConfig

            layers = LayerConfig.from_row({**config, "batch_size": batch_size}).to_layers(precision)
            return layers[0] if len(layers) == 1 else SKIP_MULTI_LAYER
        layer_spec = config.get("layer")
        if not isinstance(layer_spec, Mapping) or "op" not in layer_spec:
            return SKIP_NO_BUILDER
        if "input_shape" in config:
            doc = {"input_shape": list(config["input_shape"]), "input_dtype": dtype, "layers": [dict(layer_spec)]}
            layers = import_json(doc, batch_size=batch_size).layers
            return layers[0] if len(layers) == 1 else SKIP_MULTI_LAYER
        built = shape_record_layer(layer_spec, dtype)
        return built if built is not None else SKIP_NO_BUILDER
    except (InvalidGraph, KeyError, TypeError, ValueError):
        return SKIP_BAD_CONFIG


def config_key(*, source: str, config: Mapping[str, Any], batch_size: int) -> str:
    """The split key of a configuration: what was run, without device, optimizer, pass and precision.

    Justus: ``conv|batch|size|kernel|stride|c_in|c_out|padding|bias|activation`` or
    ``dense|batch|in|out|activation`` (the keys predictor v1/v2 were split by); profiler: its
    ``config_id``; other sources: ``source|`` + the config as sorted JSON + ``|batch``.
    """
    if source == SOURCE_JUSTUS:
        layer, act = config["layer"], config.get("activation", "none")
        if layer["op"] == "conv2d":
            c_in, size, _ = config["input_shape"]
            return (f"conv|{batch_size}|{size}|{layer['kernel_size']}|{layer.get('stride', 1)}|{c_in}|"
                    f"{layer['out_channels']}|{config['tf_padding']}|{bool(layer.get('bias', True))}|{act}")
        return f"dense|{batch_size}|{config['input_shape'][0]}|{layer['out_features']}|{act}"
    if source in PROFILER_SOURCES and config.get("config_id"):
        return str(config["config_id"])
    return f"{source}|{json.dumps(config, sort_keys=True, separators=(',', ':'))}|{batch_size}"


def _family(source: str, op_kind: str, config: Mapping[str, Any], context_op: str | None) -> str:
    if source == SOURCE_JUSTUS:
        return "conv" if op_kind == "conv" else "dense"
    if source in PROFILER_SOURCES:
        return str(config.get("family", op_kind))
    layer = config.get("layer") or {}
    op = context_op or str(layer.get("fn") or layer.get("op") or op_kind)
    return f"{source}:{op}"


# ------------------------------------------------------------------------------------------- loading


def _digest(ids: Iterable[int], times: Iterable[float]) -> str:
    h = hashlib.sha256()
    for i, t in zip(ids, times, strict=True):
        h.update(f"{i}:{t!r};".encode())
    return h.hexdigest()


def load_training_rows(
    session: Session,
    *,
    sources: Sequence[str] | None = DEFAULT_SOURCES,
    hardware_kinds: Sequence[str] | None = None,
    hardware_ids: Sequence[str] | None = None,
    passes: Sequence[str] = FEATURE_PASSES,
    sample_per_file: int | None = None,
    seed: int = 0,
    limit: int | None = None,
    specs: Mapping[str, HardwareSpec] | None = None,
) -> TrainingRows:
    """Featurised rows of the stored measurements that match every filter (``None``: no filter).

    ``sources``: measurement sources (``justus2018``, ``profiler``, ``neusight``, ``vidur``, a reporter);
    ``hardware_kinds``: ``gpu``/``cpu``; ``hardware_ids``: catalog ids; ``passes``: kept passes (others
    are not selected; :data:`FEATURE_PASSES` are the ones the features model). ``sample_per_file`` keeps
    a seeded random subset of that many measurements per imported file (quick runs); ``limit`` keeps the
    first ``limit`` rows by id. ``specs`` featurises the named hardware ids against these specs instead of
    the stored ones (an artifact's training snapshot of ``local``, say). Optimizer of a row without
    parameters, or of a forward pass, is ``none`` (the update of nothing costs nothing). Skipped rows
    are counted in ``skipped`` (module docstring).

    Raises ``ValueError`` when nothing matches (so a trainer never fits on an empty set) and for a
    ``limit``/``sample_per_file`` < 1. About 40-100 µs per row on one core (JSON decode, layer rebuild, cost, features).
    """
    for name, value in (("limit", limit), ("sample_per_file", sample_per_file)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    m = Measurement
    stmt = (
        select(m.id, m.source, m.hardware_id, m.op_kind, m.pass_, m.optimizer, m.precision, m.software_stack,
               m.granularity, m.batch_size, type_coerce(m.config, Text), m.time_ms_median,
               m.context["source_file"].as_string(),
               m.context["op_name"].as_string(), m.context["source_column"].as_string())
        .join(Hardware, Hardware.id == m.hardware_id)
        .where(m.pass_.in_(list(passes)))
        .order_by(m.id)
    )  # fmt: skip
    if sources is not None:
        stmt = stmt.where(m.source.in_(list(sources)))
    if hardware_kinds is not None:
        stmt = stmt.where(Hardware.kind.in_(list(hardware_kinds)))
    if hardware_ids is not None:
        stmt = stmt.where(m.hardware_id.in_(list(hardware_ids)))
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = session.execute(stmt).all()
    if not rows:
        raise ValueError(
            f"no stored measurements match sources={sources}, hardware_kinds={hardware_kinds}, "
            f"hardware_ids={hardware_ids}, passes={passes}: import them first (layercast import ...)"
        )
    per_file: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(rows):
        per_file.setdefault((r[1], r[12] or f"reported:{r[1]}"), []).append(i)
    if sample_per_file is not None:
        rng = np.random.default_rng(seed)
        keep = sorted(int(i) for idx in per_file.values()
                      for i in (idx if len(idx) <= sample_per_file else rng.choice(idx, sample_per_file, replace=False)))  # noqa: E501
        rows = [rows[i] for i in keep]
    stored = {
        hw_id: spec_from_dict(spec)
        for hw_id, spec in session.execute(select(Hardware.id, Hardware.spec).where(
            Hardware.id.in_({r[2] for r in rows}))).all()
    }  # fmt: skip
    stored.update(specs or {})
    return _featurise(rows, stored, per_file_total={k: len(v) for k, v in per_file.items()})


_MODELLED_PRECISIONS = frozenset(p.value for p in Precision)


def _featurise(rows: Sequence[Any], specs: Mapping[str, HardwareSpec], *,
               per_file_total: Mapping[tuple[str, str], int]) -> TrainingRows:  # fmt: skip
    skipped: Counter[tuple[str, str]] = Counter()
    cols: dict[str, list[Any]] = {k: [] for k in (
        "family", "gpu", "pass_", "optimizer", "time_ms", "config", "source", "precision", "software_stack",
        "granularity", "op_kind", "measurement_id")}  # fmt: skip
    raw_l: list[tuple[float, ...]] = []
    layers: list[Layer] = []
    kept_per_file: dict[tuple[str, str], list[tuple[int, float]]] = {}
    # one rebuild, cost, split key and family per distinct (config, batch, precision): Justus repeats each
    # configuration for every GPU and optimizer, the profiler for every pass
    cache: dict[tuple[str, str, int, str, str, str | None], tuple[Layer, Any, str, str] | str] = {}
    for (mid, source, hw_id, op_kind, pass_, optimizer, precision, stack, granularity, batch, config_raw, t,
         source_file, op_name, _column) in rows:  # fmt: skip
        if stack is None:
            skipped[(source, SKIP_NO_STACK)] += 1
            continue
        if pass_ not in FEATURE_PASSES:
            skipped[(source, SKIP_PASS)] += 1
            continue
        if precision not in _MODELLED_PRECISIONS:
            skipped[(source, SKIP_PRECISION)] += 1
            continue
        text = config_raw if isinstance(config_raw, str) else json.dumps(config_raw, sort_keys=True)
        key = (source, text, int(batch), precision, op_kind, op_name)
        built = cache.get(key)
        if built is None:
            config = json.loads(text)
            if config.get("math_precision", precision) != precision:
                cache[key] = SKIP_MATH
                skipped[(source, SKIP_MATH)] += 1
                continue
            layer = record_layer(source=source, config=config, batch_size=int(batch), precision=precision)
            if isinstance(layer, str):
                built = layer
            else:
                cost = layer_cost(layer)
                built = (layer, cost, config_key(source=source, config=config, batch_size=int(batch)),
                         _family(source, op_kind, config, op_name)) if cost.supported else SKIP_UNSUPPORTED
            cache[key] = built
        if isinstance(built, str):
            skipped[(source, built)] += 1
            continue
        layer, cost, split_key, family = built
        opt = optimizer if pass_ == "train_step" and cost.params else "none"
        # the software stack is a feature; Vidur's times sum kernel durations (Kineto): no launch gaps
        raw_l.append(raw_quantities(layer=layer, cost=cost, hardware=specs[hw_id], pass_=pass_, optimizer=opt,
                                    precision=precision, stack=stack, launch_gaps=source != SOURCE_VIDUR))  # fmt: skip
        layers.append(layer)
        for name, value in (
            ("family", family), ("gpu", hw_id), ("pass_", pass_), ("optimizer", opt), ("time_ms", float(t)),
            ("config", split_key), ("source", source), ("precision", precision), ("software_stack", stack),
            ("granularity", granularity), ("op_kind", op_kind), ("measurement_id", int(mid)),
        ):  # fmt: skip
            cols[name].append(value)
        kept_per_file.setdefault((source, source_file or f"reported:{source}"), []).append((int(mid), float(t)))
    raw = np.asarray(raw_l, dtype=np.float64).reshape(-1, len(RAW_FIELDS))
    files = [
        SourceFile(name=name, rows_read=total, rows_kept=len(kept_per_file.get((src, name), [])),
                   sha256=_digest(*zip(*kept_per_file[(src, name)], strict=True)) if (src, name) in kept_per_file
                   else _digest([], []))
        for (src, name), total in per_file_total.items()
    ]  # fmt: skip
    arrays = {k: np.asarray(v, dtype=np.float64 if k == "time_ms" else np.int64 if k == "measurement_id" else str)
              for k, v in cols.items()}  # fmt: skip
    if not arrays["time_ms"].size:
        arrays = {k: v.astype(np.float64 if k == "time_ms" else np.int64 if k == "measurement_id" else str)
                  for k, v in arrays.items()}  # fmt: skip
    return TrainingRows(**arrays, raw=raw, features=features_from_raw(raw), layers=layers, files=files,
                        hardware=dict(specs), skipped=skipped)  # fmt: skip


# -------------------------------------------------------------------------------------------- splits


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


def split_by_hash(
    config: np.ndarray, *, seed: int, fractions: tuple[float, float, float] = (0.7, 0.1, 0.2)
) -> np.ndarray:
    """``0`` train / ``1`` validation / ``2`` test per row from a hash of ``(seed, configuration key)``.

    Unlike :func:`split_by_config` the side of a configuration does not depend on which other
    configurations are present, so a dataset that grows never moves an already-held-out configuration
    into training. Returns int8 ``[N]``.
    """
    keys, inverse = np.unique(np.asarray(config).astype(str), return_inverse=True)
    u = np.array([int(hashlib.sha1(f"{seed}:{k}".encode()).hexdigest()[:12], 16) / 16**12 for k in keys])
    side = np.where(u < fractions[0], 0, np.where(u < fractions[0] + fractions[1], 1, 2)).astype(np.int8)
    return side[inverse]


def load_iterations(
    session: Session, *, sources: Sequence[str] = (SOURCE_PROFILER,), hardware_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Stored whole training iterations (``granularity`` ``iteration``, pass ``train_step``), in id order.

    Each is the iteration's ``config`` (``arch``, ``seed``, ``onnx`` export recipe...) plus
    ``hardware_id``, ``batch_size``, ``precision``, ``optimizer``, ``software_stack`` and
    ``train_step_ms`` (the measured median, ms). Empty when none is stored.
    """
    m = Measurement
    stmt = select(m.hardware_id, m.batch_size, m.precision, m.optimizer, m.software_stack, m.config,
                  m.time_ms_median).where(
        m.granularity == Granularity.ITERATION.value, m.pass_ == "train_step", m.source.in_(list(sources))
    ).order_by(m.id)  # fmt: skip
    if hardware_ids is not None:
        stmt = stmt.where(m.hardware_id.in_(list(hardware_ids)))
    return [
        {**(config or {}), "hardware_id": hw, "batch_size": int(batch), "precision": precision,
         "optimizer": optimizer, "software_stack": stack, "train_step_ms": float(t)}
        for hw, batch, precision, optimizer, stack, config, t in session.execute(stmt).all()
    ]  # fmt: skip


def load_from_database(database_url: str, **filters: Any) -> TrainingRows:
    """:func:`load_training_rows` on a fresh session of ``database_url`` (CLI entry points)."""
    return _with_session(database_url, lambda session: load_training_rows(session, **filters))


def iterations_from_database(database_url: str, **filters: Any) -> list[dict[str, Any]]:
    """:func:`load_iterations` on a fresh session of ``database_url``."""
    return _with_session(database_url, lambda session: load_iterations(session, **filters))


def snapshot_targets(database_url: str, snapshot: HardwareSpec) -> dict[str, HardwareSpec]:
    """Hardware ids whose stored rows an artifact's CPU ``snapshot`` featurises, each mapped to it: the
    snapshot's own id (an artifact trained on ``local``) and every stored CPU device with the same identity
    (model name, cores, vector width; e.g. ``cpu-amd-epyc-2c-avx512``, registered by
    ``layercast import profiler`` from the measuring machine's ``hardware.json``)."""

    def ids(session: Session) -> list[str]:
        stored = session.execute(select(Hardware.id, Hardware.spec).where(Hardware.kind == "cpu")).all()
        key = (snapshot.name, int(snapshot.compute_units), snapshot.vector_width_bits)
        return [i for i, spec in stored
                if (spec.get("name"), int(spec.get("compute_units") or 0), spec.get("vector_width_bits")) == key]

    return {snapshot.id: snapshot, **{i: snapshot for i in _with_session(database_url, ids)}}


def _with_session(database_url: str, call: Any) -> Any:
    from app.db import make_engine, make_sessionmaker

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return call(session)
    finally:
        engine.dispose()


__all__ = ["TrainingRows", "SourceFile", "load_training_rows", "load_from_database", "load_iterations",
           "iterations_from_database", "snapshot_targets", "record_layer", "config_key", "split_by_config",
           "split_by_hash"]
