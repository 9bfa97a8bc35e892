"""Parsers of the public data sets in ../shared/data (real files, read in place)."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pytest

from app.core.json_import import import_json
from app.hardware.catalog import load_catalog
from app.measurements import importers
from app.measurements.importers import (
    ImportFormatError,
    iter_deepbench_allreduce,
    iter_deepbench_conv,
    iter_deepbench_gemm,
    iter_deepbench_rnn,
    iter_justus,
    tf_same_padding,
)
from tests.helpers import SHARED_DATA

JUSTUS = SHARED_DATA / "justus2018"
DEEPBENCH = SHARED_DATA / "deepbench"


def test_justus_one_file_all_rows_mapped() -> None:
    stream = iter_justus(JUSTUS / "dense_Tesla_K80.csv.gz")
    records = list(stream)
    assert len(records) == stream.rows_read == stream.records == 25_000
    assert stream.skipped == Counter()
    assert {r.hardware_id for r in records} == {"k80"}
    assert {r.source for r in records} == {"justus2018"}
    assert {r.op_kind for r in records} == {"gemm"}
    assert {r.precision for r in records} == {"fp32"}
    assert {(r.pass_, r.optimizer == "none") for r in records} == {("forward", True), ("train_step", False)}
    assert [r.context["source_row"] for r in records] == list(range(25_000))
    first = records[0]
    assert first.repetitions == 5 and first.time_ms_median > 0 and first.time_ms_std is not None
    assert (first.context["framework"], first.context["framework_version"]) == ("TensorFlow", "1.x")
    assert (first.software_stack, first.granularity) == ("tf1-session", "layer")
    assert first.context["device_name"] == "Tesla K80"
    assert first.context["source_file"] == "dense_Tesla_K80.csv.gz"
    assert first.measured_at is not None and first.measured_at.year == 2018
    assert first.config["layer"]["op"] == "linear"


def test_justus_conv_config_rebuilds_the_layer() -> None:
    records = list(iter_justus(JUSTUS / "conv_Tesla_P100.csv.gz", limit=300))
    assert len(records) == 300
    assert {r.hardware_id for r in records} == {"p100"}
    exact = 0
    for r in records:
        c = r.config
        graph = import_json({"input_shape": c["input_shape"], "layers": [c["layer"]]}, batch_size=r.batch_size)
        (layer,) = graph.layers
        assert layer.inputs[0].shape == (r.batch_size, *c["input_shape"])
        assert layer.outputs[0].shape[1] == c["layer"]["out_channels"]
        exact += list(layer.outputs[0].shape[2:]) == c["output_hw"]
    assert exact >= 0.9 * len(records)  # only stride-1 'same' with an even kernel is off by one


def test_tf_same_padding() -> None:
    assert tf_same_padding(32, 3, 1) == (1, 1)
    assert tf_same_padding(32, 4, 1) == (1, 2)  # the extra pixel goes after
    assert tf_same_padding(302, 3, 4) == (0, 1)
    assert tf_same_padding(5, 1, 2) == (0, 0)


def test_deepbench_conv_three_passes_per_training_row() -> None:
    stream = iter_deepbench_conv(DEEPBENCH / "deepbench_conv.csv")
    records = list(stream)
    by_row: dict[int, set[str]] = {}
    for r in records:
        by_row.setdefault(r.context["source_row"], set()).add(r.pass_)
        assert r.op_kind == "conv" and r.time_ms_median > 0
    train_rows = {row for row, passes in by_row.items() if passes != {"forward"}}
    assert train_rows and all(
        by_row[row] == {"forward", "backward_input", "backward_weight"} for row in train_rows
    )
    train = [r for r in records if r.context["mode"] == "train"]
    assert len(train) == 3 * len({r.context["source_row"] for r in train})
    inference = [r for r in records if r.context["mode"] == "inference"]
    assert inference and {r.pass_ for r in inference} == {"forward"}
    assert {r.precision for r in inference} == {"int8"}
    assert {r.hardware_id for r in records} == {"p100", "gtx-1080-ti", "titan-xp"}
    assert {r.precision for r in records if r.hardware_id == "p100"} == {"fp32", "fp16"}
    assert all("hardware_note" in r.context for r in records if r.hardware_id == "p100")
    r = train[0]
    graph = import_json({"input_shape": r.config["input_shape"], "layers": [r.config["layer"]]},
                        batch_size=r.batch_size)
    assert graph.layers[0].inputs[0].shape == (r.batch_size, *r.config["input_shape"])


def test_deepbench_unmapped_devices_are_counted_not_dropped() -> None:
    stream = iter_deepbench_conv(DEEPBENCH / "deepbench_conv.csv")
    records = list(stream)
    devices = {device for device, _reason in stream.skipped}
    assert {"NV_TitanX", "NV_TitanX_Pascal", "NV_M40", "AMD_MI25", "IA_KNL7250", "Raspberry_Pi_3"} <= devices
    assert {reason for _device, reason in stream.skipped} == {importers.SKIP_NOT_IN_CATALOG}
    # every expected measurement is either a record or a counted skip: 94 training rows x 3 passes
    assert stream.skipped[("NV_M40", importers.SKIP_NOT_IN_CATALOG)] == 94 * 3
    mapped_rows = {r.context["source_row"] for r in records}
    assert stream.rows_read == 1277 and len(mapped_rows) < stream.rows_read


def test_deepbench_gemm_rnn_allreduce() -> None:
    gemm = iter_deepbench_gemm(DEEPBENCH / "deepbench_gemm.csv")
    g = list(gemm)
    assert gemm.rows_read == len(g) + sum(gemm.skipped.values()) == 1864
    assert {r.config["layer"]["op"] for r in g} == {"matmul"}
    assert {type(r.config["layer"]["a_trans"]) for r in g} == {bool}
    assert {r.hardware_id for r in g} == {"p100", "gtx-1080-ti", "titan-xp"}

    rnn = list(iter_deepbench_rnn(DEEPBENCH / "deepbench_rnn.csv"))
    assert {r.config["layer"]["op"] for r in rnn} == {"lstm", "gru", "rnn"}
    assert {r.op_kind for r in rnn} == {"recurrent"}
    # RNNs of the int8 inference sheet are fp32 (DeepBench README)
    assert {r.precision for r in rnn if r.context["mode"] == "inference"} == {"fp32"}
    assert {"forward", "backward", "backward_input", "backward_weight"} == {r.pass_ for r in rnn}
    r = rnn[0]
    graph = import_json({"input_shape": r.config["input_shape"], "layers": [r.config["layer"]]},
                        batch_size=r.batch_size)
    assert graph.layers[0].outputs[0].shape[-1] == r.config["layer"]["hidden_size"]

    allreduce = list(iter_deepbench_allreduce(DEEPBENCH / "deepbench_allreduce.csv"))
    assert allreduce and {r.op_kind for r in allreduce} == {"allreduce"}
    assert all(r.config["layer"]["size_bytes"] == 4 * r.config["layer"]["size_floats"] for r in allreduce)


def test_mapped_ids_are_catalog_entries() -> None:
    catalog = load_catalog()
    assert set(importers.DEEPBENCH_HARDWARE_IDS.values()) <= set(catalog)
    assert set(importers.JUSTUS_GPU_IDS.values()) <= set(catalog)
    assert not set(importers.DEEPBENCH_NOT_IN_CATALOG) & set(importers.DEEPBENCH_HARDWARE_IDS)


def _write_gz(path: Path, text: str) -> Path:
    with gzip.open(path, "wt", newline="") as fh:
        fh.write(text)
    return path


HEADER = "batch_size,in_features,out_features,gpu,optimizer,precision_bits,time_ms_max,time_ms_median,time_ms_min,"
HEADER += "time_ms_std,source_file,activation,pass\n"


def test_justus_skips_are_counted(tmp_path: Path) -> None:
    rows = [
        "4,10,20,Tesla K80,none,32,1.0,0.5,0.4,0.01,x/benchmark_dense__20180907.pkl,relu,forward",
        "4,10,20,Tesla K80,sgd,32,1.0,,0.4,0.01,x.pkl,relu,train_step",
        "4,10,20,Tesla K80,sgd,32,1.0,-1,0.4,0.01,x.pkl,relu,train_step",
        "4,10,20,Quadro Z,none,32,1.0,0.5,0.4,0.01,x.pkl,relu,forward",
    ]
    stream = iter_justus(_write_gz(tmp_path / "dense_Mixed.csv.gz", HEADER + "\n".join(rows) + "\n"))
    assert len(list(stream)) == 1
    assert stream.rows_read == 4
    assert stream.skipped == Counter({
        ("Tesla K80", "missing_time"): 1, ("Tesla K80", "non_positive_time"): 1, ("Quadro Z", "unknown_device"): 1,
    })


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("batch_size,in_features\n1,2\n", "missing columns"),
        (HEADER + "four,10,20,Tesla K80,none,32,1.0,0.5,0.4,0.01,x.pkl,relu,forward\n", "line 2.*batch_size"),
        (HEADER + "4,10,20,Tesla K80,none,32,1.0,fast,0.4,0.01,x.pkl,relu,forward\n", "not a time"),
        (HEADER + "4,10,20,Tesla K80,none\n", "expected 13 fields"),
    ],
)
def test_justus_malformed_file_raises(tmp_path: Path, body: str, match: str) -> None:
    stream = iter_justus(_write_gz(tmp_path / "dense_Bad.csv.gz", body))
    with pytest.raises(ImportFormatError, match=match):
        list(stream)


def test_corrupt_gzip_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "dense_Bad.csv.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage" * 10)
    with pytest.raises(ImportFormatError, match="dense_Bad.csv.gz"):
        list(iter_justus(bad))
    with pytest.raises(FileNotFoundError):
        iter_justus(tmp_path / "dense_None.csv.gz")
    with pytest.raises(ImportFormatError, match="conv_"):
        iter_justus(tmp_path / "weird.csv.gz")


def test_deepbench_precision_labels() -> None:
    assert importers.deepbench_precision("Float", family="gemm") == ("fp32", None)
    assert importers.deepbench_precision("16 bit inputs, 32 bit multiplication, 32 bit addition",
                                         family="conv")[0] == "fp16"  # type: ignore[index]
    assert importers.deepbench_precision("bfloat-ish", family="gemm") is None
