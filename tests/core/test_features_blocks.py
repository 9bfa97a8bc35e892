"""The feature function computes each kind of feature in one numpy call over all its columns
(:func:`app.core.features.features_from_raw`, issue 12: a fresh device's feature matrix is ~100 numpy calls of
a few rows each). Here it is checked bit for bit against the column-by-column definition it replaced (kept
below as the reference, verbatim but for names): on the raw rows of real layer tables on every catalog device
at every precision, pass and stack, and on random rows (zeros, negatives, values from 1e-13 to 1e17), so a
served or trained feature never changes by a bit."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.analysis import analyze
from app.core.features import (
    ACTIVATIONS,
    EXTRA_KINDS,
    FEATURE_NAMES,
    GEMM_TILE_SMALL,
    LOG_FLOOR,
    RAW_FIELDS,
    TRAINED_OPTIMIZERS,
    _tiles,
    features_from_raw,
    raw_index,
)
from app.core.precision import PrecisionNotSupported
from app.core.vocab import SoftwareStack
from app.graphs.importer import canonical_json
from app.graphs.service import build_graph
from app.hardware.catalog import load_catalog
from app.predictor.table import LayerTable, raw_for
from tests.helpers import light_model

TRANSFORMER = {"name": "blocks", "input_shape": [8, 64],
               "layers": [{"op": "layernorm"}, {"op": "multihead_attention", "num_heads": 4}, {"op": "linear",
                          "out_features": 256}, {"op": "gelu"}, {"op": "linear", "out_features": 64},
                          {"op": "dropout"}, {"op": "softmax"}]}


def _log_ref(x: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(x, LOG_FLOOR))


def reference_features(raw: np.ndarray) -> np.ndarray:
    """The feature matrix as the first versions of :func:`features_from_raw` built it, one column at a time."""
    raw = np.asarray(raw, dtype=np.float64)
    if raw.ndim != 2 or raw.shape[1] != len(RAW_FIELDS):
        raise ValueError(f"raw must have shape [N, {len(RAW_FIELDS)}], got {raw.shape}")

    def c(name: str) -> np.ndarray:
        return raw[:, raw_index(name)]

    peak = c("peak_flops_per_s")
    bw = c("bandwidth_bytes_per_s")
    compute_ms = c("pass_flops") / peak * 1e3
    memory_ms = c("pass_bytes") / bw * 1e3
    update_ms = c("update_bytes") / bw * 1e3
    cols = [
        _log_ref(np.maximum(compute_ms, memory_ms)),
        _log_ref(compute_ms),
        _log_ref(memory_ms),
        _log_ref(update_ms),
        _log_ref(c("pass_flops")),
        _log_ref(c("pass_bytes")),
        _log_ref(c("forward_flops")),
        _log_ref(c("pass_flops")) - _log_ref(c("pass_bytes")),
        np.log1p(np.maximum(c("params"), 0.0)),
        _log_ref(c("batch")),
        c("is_conv"),
        c("is_gemm"),
        _log_ref(c("kernel")),
        _log_ref(c("stride")),
        _log_ref(c("c_in")),
        _log_ref(c("c_out")),
        _log_ref(c("in_spatial")),
        _log_ref(c("out_spatial")),
        c("has_bias"),
        *(c(f"act_{a}") for a in ACTIVATIONS),
        c("is_train"),
        *(c(f"opt_{o}") for o in TRAINED_OPTIMIZERS),
        _log_ref(peak),
        _log_ref(bw),
        _log_ref(c("memory_bytes")),
        _log_ref(c("compute_units")),
        _log_ref(c("clock_mhz")),
        # --- added after v1 ---
        *(c(f"is_{k.value}") for k in EXTRA_KINDS),
        _log_ref(c("groups")),
        ((c("groups") > 1) & (c("groups") == c("c_in"))).astype(np.float64),
        _log_ref(c("seq_len")),
        _log_ref(c("in_elems")),
        _log_ref(c("out_elems")),
        c("needs_input_grad"),
        c("is_half"),
        c("is_cpu"),
        _log_ref(peak) - _log_ref(bw),
        _log_ref(c("l2_cache_bytes")),
        # --- added for v3 ---
        *_v3_ref(raw),
        # --- added for v4 ---
        *_v4_ref(raw),
    ]
    out = np.stack(cols, axis=1).astype(np.float32)
    assert out.shape[1] == len(FEATURE_NAMES)
    return out


def _v3_ref(raw: np.ndarray) -> list[np.ndarray]:
    """The v3 feature columns (see :data:`FEATURE_NAMES`), vectorised over ``raw`` ``[N, len(RAW_FIELDS)]``."""

    def c(name: str) -> np.ndarray:
        return raw[:, raw_index(name)]

    op_peak = c("op_peak_flops_per_s")
    bw = c("bandwidth_bytes_per_s")
    sms = np.maximum(c("compute_units"), 1.0)
    floor = c("floor_ms")
    memory_ms = c("pass_bytes") / bw * 1e3
    m, n = c("gemm_m"), c("gemm_n")
    tiles = _tiles(raw)
    waves = tiles / sms
    return [
        _log_ref(floor),
        _log_ref(c("pass_flops") / op_peak * 1e3),
        _log_ref(floor) - _log_ref(memory_ms),
        _log_ref(op_peak),
        _log_ref(op_peak) - _log_ref(bw),
        (op_peak > c("fp32_peak_flops_per_s") * 1.01).astype(np.float64),
        _log_ref(m),
        _log_ref(n),
        _log_ref(c("gemm_k")),
        _log_ref(tiles),
        _log_ref(waves),
        waves / np.ceil(waves),
        _log_ref(c("pass_flops") / sms),
        _log_ref(c("pass_bytes")) - _log_ref(c("l2_cache_bytes")),
        c("stack_tf1_session"),
        c("stack_kernel_time"),
    ]


def _v4_ref(raw: np.ndarray) -> list[np.ndarray]:
    """The v4 feature columns (see :data:`FEATURE_NAMES`): hardware as per-SM, per-cycle ratios, which stay in
    a narrow range across GPU generations (NeuSight, Lee et al. ASPLOS 2025, predicts per-SM utilisation from
    such ratios so that a new GPU is an interpolation), and the wave-quantised floor (Habitat, Yu et al. ATC
    2021: a kernel of ``w`` waves takes ``ceil(w)`` wave times). Vectorised over ``raw`` ``[N, len(RAW_FIELDS)]``."""

    def c(name: str) -> np.ndarray:
        return raw[:, raw_index(name)]

    sms = np.maximum(c("compute_units"), 1.0)
    waves = _tiles(raw) / sms
    waves_small = _tiles(raw, GEMM_TILE_SMALL) / sms
    sm_hz = np.maximum(c("compute_units"), 1.0) * c("clock_mhz") * 1e6  # SM cycles per second, all SMs
    return [
        _log_ref(c("floor_ms") * np.ceil(waves) / waves),
        _log_ref(c("out_elems") / sm_hz * 1e3),
        _log_ref(c("op_peak_flops_per_s") / sm_hz),
        _log_ref(c("bandwidth_bytes_per_s") / sm_hz),
        _log_ref(c("l2_cache_bytes") / sms),
        _log_ref(waves_small),
        waves_small / np.ceil(waves_small),
    ]


def _table_rows() -> np.ndarray:
    catalog = load_catalog()
    raws = []
    for content, fmt in ((light_model("resnet50"), "onnx"), (canonical_json(TRANSFORMER), "json")):
        analysis = analyze(build_graph(content, fmt, batch_size=16), software_stack=SoftwareStack.PYTORCH_EAGER)
        pairs = analysis.step_layers(True)
        table = LayerTable([p[0] for p in pairs], [p[1] for p in pairs], reference=catalog["a100-sxm4-40gb"])
        for hw in catalog.values():
            for precision in ("fp32", "tf32", "fp16", "bf16", "fp32-strict"):
                for pass_, optimizer in (("forward", "none"), ("train_step", "adam"), ("train_step", "sgd")):
                    for stack in ("pytorch-eager", "tf1-session", "pytorch-cuda-graph"):
                        try:
                            raws.append(raw_for(table, hw, pass_=pass_, optimizer=optimizer, precision=precision,
                                                stack=stack, optimizer_per_params=True))
                        except PrecisionNotSupported:
                            continue
    return np.concatenate(raws)


def _random_rows(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = np.exp(rng.uniform(-30.0, 40.0, size=(n, len(RAW_FIELDS))))
    x = np.where(rng.uniform(size=x.shape) < 0.5, np.round(x), x)  # integers (counts, flags) and not
    return x * rng.choice([0.0, 1.0, -1.0], size=x.shape, p=[0.2, 0.7, 0.1])


@pytest.mark.parametrize("rows", ["tables", "random"])
def test_block_features_equal_the_column_by_column_definition(rows: str) -> None:
    raw = _table_rows() if rows == "tables" else _random_rows(20_000)
    assert len(raw) > 10_000
    with np.errstate(all="ignore"):  # random rows divide by zero and log negatives, both ways alike
        got, ref = features_from_raw(raw), reference_features(raw)
        assert got.dtype == ref.dtype == np.float32 and got.shape == ref.shape == (len(raw), len(FEATURE_NAMES))
        assert got.tobytes() == ref.tobytes()
        for start in range(0, len(raw), 4999):  # short matrices too (a request's few rows)
            few = raw[start:start + 3]
            assert features_from_raw(few).tobytes() == reference_features(few).tobytes()
