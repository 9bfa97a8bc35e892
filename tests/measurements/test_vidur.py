"""Vidur parsers on the real files in ../shared/data/vidur (read in place)."""

from __future__ import annotations

import csv
import gzip
from collections import Counter
from pathlib import Path

import pytest

from app.core.json_import import import_json
from app.core.vocab import Granularity, SoftwareStack
from app.hardware.catalog import load_catalog
from app.measurements.importers import ImportFormatError
from app.measurements.vidur import (
    VIDUR_COMPUTE_HARDWARE_IDS,
    VIDUR_COMPUTE_OPS,
    VIDUR_NETWORK_DEVICES,
    iter_vidur_compute,
    iter_vidur_network,
    vidur_files,
)
from tests.helpers import SHARED_DATA

VIDUR = SHARED_DATA / "vidur"


def _csv_rows(path: Path, n: int) -> list[dict[str, str]]:
    with gzip.open(path, "rt", newline="") as fh:
        return [row for _, row in zip(range(n), csv.DictReader(fh), strict=False)]


def test_devices_map_to_catalog_entries() -> None:
    catalog = set(load_catalog())
    assert set(VIDUR_COMPUTE_HARDWARE_IDS.values()) <= catalog
    assert {hw for hw, _ in VIDUR_NETWORK_DEVICES.values()} <= catalog
    assert [p.name for p, _ in vidur_files(VIDUR)] == [
        "compute_mlp_a100.csv.gz", "compute_mlp_a40.csv.gz", "network_all_reduce.csv.gz", "network_send_recv.csv.gz",
    ]


def test_a40_compute_counts() -> None:
    stream = iter_vidur_compute(VIDUR / "compute_mlp_a40.csv.gz")
    records = list(stream)
    assert stream.rows_read == 5481 and not stream.skipped
    # ten ops per row; phi-2 (261 rows) has no post-attention norm
    assert len(records) == stream.records == 5481 * 10 - 261
    assert Counter(r.context["source_column"] for r in records)["post_attention_layernorm"] == 5481 - 261
    assert {r.hardware_id for r in records} == {"a40"}
    assert {(r.precision, r.software_stack, r.granularity) for r in records} == {
        ("fp16", SoftwareStack.PYTORCH_EAGER, Granularity.KERNEL)
    }
    keys = {(r.context["source_row"], r.context["source_column"]) for r in records}
    assert len(keys) == len(records)  # the natural key is unique


def test_compute_row_field_by_field() -> None:
    path = VIDUR / "compute_mlp_a100.csv.gz"
    (row,) = _csv_rows(path, 1)  # Qwen-72B, 4096 tokens, TP 1
    records = {r.context["source_column"]: r for r in iter_vidur_compute(path, limit=1)}
    assert list(records) == list(VIDUR_COMPUTE_OPS)
    for op, rec in records.items():
        assert rec.time_ms_median == float(row[f"time_stats.{op}.median"])
        assert rec.time_ms_std == pytest.approx(float(row[f"time_stats.{op}.std"]))
        assert rec.context["time_ms_min"] == float(row[f"time_stats.{op}.min"])
        assert rec.batch_size == 4096 and rec.config["model"] == "Qwen/Qwen-72B"
        assert rec.hardware_id == "a100-pcie-80gb" and "hardware_note" in rec.context
    assert records["attn_pre_proj"].time_ms_median == 7.306
    e, f = 8192, 24576  # n_embd, n_expanded_embd; 64 heads and 64 KV heads of 128
    assert records["attn_pre_proj"].config["layer"] == {"op": "linear", "out_features": 3 * e, "bias": False}
    assert records["mlp_up_proj"].config["layer"]["out_features"] == 2 * f  # gated: gate and up fused
    assert records["mlp_down_proj"].config["input_shape"] == [f]
    assert records["mlp_act"].config["layer"] == {"op": "elementwise", "fn": "silu_and_mul", "shape": [4096, 2 * f]}
    assert records["input_layernorm"].config["norm"] == "rmsnorm"
    assert records["emb"].config["layer"]["num_embeddings"] == 152064 and records["emb"].repetitions == 21
    # the JSON-expressible configs rebuild into the IR layer that ran
    up = records["mlp_up_proj"]
    (layer,) = import_json({"input_shape": up.config["input_shape"], "layers": [up.config["layer"]]},
                           batch_size=up.batch_size).layers
    assert layer.inputs[0].shape == (4096, e) and layer.outputs[0].shape == (4096, 2 * f)


def test_tensor_parallel_shards_the_projections() -> None:
    path = VIDUR / "compute_mlp_a100.csv.gz"
    rows = _csv_rows(path, 10_000)
    index = next(i for i, r in enumerate(rows)
                 if r["model"] == "meta-llama/Llama-2-70b-hf" and r["num_tensor_parallel_workers"] == "4")
    recs = {r.context["source_column"]: r for r in iter_vidur_compute(path, limit=index + 1)
            if r.context["source_row"] == index}
    # Llama-2-70B: 64 heads, 8 KV heads of 128, n_embd 8192, F 28672; TP 4 -> 16 heads, 2 KV heads per GPU
    assert recs["attn_pre_proj"].config["layer"]["out_features"] == (16 + 2 * 2) * 128
    assert recs["attn_post_proj"].config["input_shape"] == [16 * 128]
    assert recs["mlp_down_proj"].config["input_shape"] == [28672 // 4]
    assert recs["emb"].config["layer"]["num_embeddings"] == 32768 // 4
    assert recs["attn_rope"].config["layer"]["k_shape"][1] == 2 * 128
    assert recs["attn_rope"].config["layer"]["rotary_dim"] == 128  # Vidur: get_rope(head_dim, rotary_dim=head_dim)
    assert recs["add"].config["layer"]["operands"] == 2  # residual + hidden_states


def test_phi2_add_sums_three_tensors() -> None:
    """phi-2 has no post-attention norm: Vidur times ``attn_outputs + feed_forward_hidden_states + residual``
    (``_forward_without_post_attn_norm``), three [T, E] tensors, in its ``add`` range."""
    path = VIDUR / "compute_mlp_a40.csv.gz"
    index = 5220  # the first phi-2 row of the A40 file: 4096 tokens, n_embd 2560
    recs = {r.context["source_column"]: r for r in iter_vidur_compute(path, limit=index + 1)
            if r.context["source_row"] == index}
    assert recs["add"].config["model"] == "microsoft/phi-2" and recs["add"].batch_size == 4096
    assert recs["add"].config["layer"] == {"op": "elementwise", "fn": "add", "shape": [4096, 2560],
                                           "operand": "tensor", "operands": 3}  # fmt: skip


def test_network_counts_and_fields() -> None:
    stream = iter_vidur_network(VIDUR / "network_all_reduce.csv.gz")
    records = list(stream)
    assert stream.rows_read == len(records) == 6958 + 4496 and not stream.skipped
    assert Counter(r.hardware_id for r in records) == {"a100-sxm4-80gb": 6958, "a100-pcie-80gb": 4496}
    row = _csv_rows(VIDUR / "network_all_reduce.csv.gz", 1)[0]
    first = records[0]
    assert first.op_kind == "allreduce" and first.precision == "fp16" and first.batch_size == 1
    assert first.config == {"layer": {"op": "allreduce", "size_bytes": int(row["size"]),
                                      "n_ranks": int(row["num_workers"]),
                                      "devices_per_node": int(row["devices_per_node"]), "n_nodes": 2},
                            "dtype": "float16"}
    assert first.time_ms_median == float(row["time_stats.all_reduce.median"]) and first.repetitions == 3
    sr = iter_vidur_network(VIDUR / "network_send_recv.csv.gz")
    assert Counter(r.hardware_id for r in sr) == {"a100-sxm4-80gb": 1988, "a100-pcie-80gb": 1988, "a40": 1988}


def _write(tmp_path: Path, name: str, rows: list[dict[str, str]]) -> Path:
    path = tmp_path / name
    with gzip.open(path, "wt", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_skips_and_errors(tmp_path: Path) -> None:
    rows = _csv_rows(VIDUR / "compute_mlp_a40.csv.gz", 2)
    rows[0]["time_stats.add.median"] = ""
    rows[1]["device_sku"] = "h100"
    stream = iter_vidur_compute(_write(tmp_path, "compute_mlp_a40.csv.gz", rows))
    assert len(list(stream)) == 9
    assert stream.skipped == {("a40", "missing_time"): 1, ("h100", "unknown_device"): 10}
    rows[1]["device_sku"], rows[1]["n_head"] = "a40", "0"
    with pytest.raises(ImportFormatError, match="column 'n_head'"):
        list(iter_vidur_compute(_write(tmp_path, "compute_mlp_a40.csv.gz", rows)))
    with pytest.raises(ImportFormatError, match="network_all_reduce or network_send_recv"):
        iter_vidur_network(_write(tmp_path, "network_broadcast.csv.gz", rows))
